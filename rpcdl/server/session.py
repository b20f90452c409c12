"""The worker's side of one client connection: two service threads take turns reading it.

Threading: each connection has ``_SERVICE_THREADS`` service threads; one at a
time holds the read turn and reads a frame, hands it to the worker
(:meth:`rpcdl.server.worker.Worker._dispatch`), and runs the call itself when the
worker gives it a slot. Answers are sent under the connection's send lock, by
whichever thread ran the call; that thread compresses its answer's large buffers
first, outside the lock, when the connection's :class:`~rpcdl.transport.compression.Compressor` says so,
or copies them into the connection's shared segment (:mod:`rpcdl.transport.shm`) when it has one.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import torch

from ..errors import ConnectionLost, ProtocolError
from ..rpc.rref import StoreView
from ..transport.compression import Compressor
from ..transport.control import decode_span_release
from ..transport.shm import WorkerSegment
from ..transport.wire import COMPRESSED, Frame, FrameReader, Kind, send_frame

log = logging.getLogger("rpcdl.worker")

_SERVICE_THREADS = 2


class Counters:
    """A worker's counters, changed under one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls_served = 0
        self.calls_failed = 0
        self.calls_rejected = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.busy_seconds = 0.0
        self.clients = 0
        self.connections_total = 0
        self.connections_refused = 0
        self.outstanding = 0

    def add(self, **deltas: float) -> None:
        """Add each of ``deltas`` to the counter of that name."""
        with self.lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)


class ClientConnection:
    """The worker's side of one client connection."""

    def __init__(
        self,
        worker: Any,
        sock: socket.socket,
        peer: str,
        compressor: Compressor | None = None,
        segment: WorkerSegment | None = None,
    ):
        self.worker = worker
        self.segment = segment
        self.sock = sock
        self.peer = peer
        self.compressor = compressor or Compressor("off")
        self.store_view = StoreView(worker._store, self, worker.timeout)
        self.reader = FrameReader(sock, worker.limits, stall_timeout=worker.timeout)
        self.idle_threads = _SERVICE_THREADS  # guarded by the worker's scheduler lock
        self.closed = False
        self._read_turn = threading.Lock()
        self._send_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._counted = 0
        self._threads = [
            threading.Thread(target=self._serve, name=f"rpcdl-service-{peer}", daemon=True)
            for _ in range(_SERVICE_THREADS)
        ]

    def start(self) -> None:
        """Start the service threads."""
        for thread in self._threads:
            thread.start()

    def send(self, frame: Frame, answers_call: bool = False) -> None:
        """Send ``frame`` (counting its call as done if it ``answers_call``); a connection
        that cannot take it is closed."""
        sent = 0
        try:
            in_segment = frame.kind == Kind.RESULT and self.segment is not None and self.segment.place(frame)
            if frame.kind == Kind.RESULT and frame.buffers and not self.closed and not in_segment:
                frame.buffers, frame.decoded_sizes = self.compressor.prepare(frame.buffers)
                frame.flags |= COMPRESSED if frame.decoded_sizes else 0
            if not self.closed:
                with self._send_lock:
                    started = time.perf_counter()
                    sent = send_frame(self.sock, frame)
                    self.compressor.sent(sent, time.perf_counter() - started)
        except OSError as exc:
            log.warning("could not answer client %s: %s", self.peer, exc or type(exc).__name__)
            self.close()
        finally:
            self.worker._counters.add(bytes_out=sent, outstanding=-int(answers_call))

    def answer(self, frame: Frame) -> None:
        """Send the answer to a call and count the call as done."""
        self.send(frame, answers_call=True)

    def close(self) -> None:
        """Close the connection (once) and have the worker forget it and the RRefs it held."""
        with self._close_lock:  # not the send lock: a send may block for the whole timeout
            if self.closed:
                return
            self.closed = True
        shutdown_socket(self.sock)
        if self.segment is not None:
            self.segment.close()
        self.worker._forget(self)

    def release_spans(self, payload: bytes | bytearray | memoryview) -> None:
        """Free the spans of the shared segment a ``SEGMENT_RELEASE`` frame names.

        Raises:
            ProtocolError: this connection has no segment, or a span is not in use.
        """
        if self.segment is None:
            raise ProtocolError("the client released spans of a shared segment this connection does not have")
        self.segment.release(decode_span_release(payload))

    def transport_state(self) -> dict[str, Any]:
        """How answers cross this connection: ``"shm"`` or ``"socket"``, and the segment's counters."""
        if self.segment is None:
            return {"transport": "socket"}
        return {"transport": "shm", "shared_memory": self.segment.state()}

    def _serve(self) -> None:
        worker = self.worker
        while not self.closed:
            with self._read_turn:
                if self.closed:
                    return
                try:
                    frame = self.reader.read_frame(allocate_buffer)
                except ConnectionLost:
                    log.debug("client %s disconnected", self.peer)
                    self.close()
                    return
                except (OSError, ProtocolError) as exc:
                    if not self.closed:
                        log.warning("closed connection from %s: %s", self.peer, exc or type(exc).__name__)
                    self.close()
                    return
                if frame is None:
                    continue
                bytes_in, self._counted = self.reader.bytes_read - self._counted, self.reader.bytes_read
                try:
                    run_here = worker._dispatch(self, frame, bytes_in)
                except ProtocolError as exc:
                    log.warning("closed connection from %s: %s", self.peer, exc)
                    self.close()
                    return
            if run_here:
                worker._run(self, frame, from_service_thread=True)


def shutdown_socket(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways (waking a thread blocked on it) and close it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def allocate_buffer(call_id: int, size: int) -> Any:
    """Memory for an out-of-band buffer of a call received: a numpy view of a new uint8 tensor."""
    return torch.empty(size, dtype=torch.uint8).numpy()
