"""Floors and peers beyond the raw socket: a minimal framed-pickle RPC and torchdata's ParallelMapper.

- :class:`FramedPickleSystem`: the least an RPC over pickle can cost in
  Python. Each call is a frame (a u64 length and a pickle of ``(call id,
  function, args)``); a server with one thread reads a frame, runs the
  function and writes the answer frame; on the client, the caller writes its
  frame and one reader thread (``rpcdl-bench-floor-reader``) reads the answers
  and completes the callers' waits. rpcdl's latency and pipelined figures are
  judged against it.
- :class:`ParallelMapperSystem`: ``torchdata.nodes.ParallelMapper(method="process",
  num_workers=N)``, local processes, for the ``mapper`` scenario.
"""

from __future__ import annotations

import itertools
import pickle
import socket
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

from ...local import stop_process
from .systems import Bench, Releasable, System, start_peer
from .workloads import FRAMED, LENGTH, PARALLEL_MAPPER, accept_one, increment, noop

# ---------------------------------------------------------------------------- framed-pickle RPC


def framed_pickle_server(host: str = "127.0.0.1") -> None:
    """The server of the framed-pickle RPC floor, one thread: prints its port, serves one connection, exits."""
    connection, reader = accept_one(host)
    while True:
        header = reader.read(LENGTH.size)
        if len(header) < LENGTH.size:
            return
        call_id, function, args = pickle.loads(reader.read(LENGTH.unpack(header)[0]))
        answer = pickle.dumps((call_id, function(*args)), protocol=pickle.HIGHEST_PROTOCOL)
        connection.sendall(LENGTH.pack(len(answer)) + answer)


class _Pending:
    """A call waiting for its answer: ``wait()`` returns once the reader thread ``complete()`` d it."""

    __slots__ = ("_done", "value")

    def __init__(self) -> None:
        self._done = threading.Lock()
        self._done.acquire()
        self.value: Any = None

    def complete(self, value: Any) -> None:
        self.value = value
        self._done.release()

    def wait(self) -> Any:
        self._done.acquire()
        return self.value


class FramedPickleSystem(System):
    """A minimal framed-pickle RPC: the floor of an RPC in Python (see the module)."""

    name = FRAMED

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def start(self, bench: Bench) -> None:
        self.process, self.sock = start_peer("rpcdl.cli.bench.floors", "framed_pickle_server")
        self._reader = threading.Thread(target=self._read_answers, name="rpcdl-bench-floor-reader", daemon=True)
        self._reader.start()

    def stop(self) -> None:
        if self.sock is not None:
            self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self.process is not None:
            stop_process(self.process)

    def _read_answers(self) -> None:
        stream = self.sock.makefile("rb", buffering=1 << 16)  # one recv brings many answers
        try:
            while True:
                header = stream.read(LENGTH.size)
                if len(header) < LENGTH.size:
                    return
                call_id, value = pickle.loads(stream.read(LENGTH.unpack(header)[0]))
                self._pending.pop(call_id).complete(value)
        except (OSError, ValueError):
            return  # stop() closed the socket

    def _send(self, function: Any, args: tuple = ()) -> _Pending:
        call_id = next(self._ids)
        pending = self._pending[call_id] = _Pending()
        frame = pickle.dumps((call_id, function, args), protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.sock.sendall(LENGTH.pack(len(frame)) + frame)
        return pending

    def call(self) -> None:
        self._send(noop).wait()

    def calls(self, count: int, window: int) -> None:
        in_flight: list[_Pending] = []
        for _ in range(count):
            if len(in_flight) >= window:
                in_flight.pop(0).wait()
            in_flight.append(self._send(noop))
        for pending in in_flight:
            pending.wait()


# ---------------------------------------------------------------------------- torchdata's ParallelMapper


class ParallelMapperSystem(System):
    """``torchdata.nodes.ParallelMapper(method="process", num_workers=N)`` over an endless source."""

    name = PARALLEL_MAPPER

    def mapper(self, workers: int) -> Iterator[int]:
        """``increment`` over 0, 1, 2, ... in ``workers`` local processes, in order."""
        from torchdata.nodes import IterableWrapper, ParallelMapper

        node = ParallelMapper(IterableWrapper(itertools.count()), increment, num_workers=workers, method="process")
        node.reset()
        return Releasable(node)

    def release_mapper(self, mapper: Any) -> None:
        mapper.release()
