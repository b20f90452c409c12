"""What rpcdl's threading model costs by itself: a lone call's round trip against floors with fewer threads.

rpcdl's design (DESIGN.md) puts one event loop per process in charge of its
sockets: a caller never reads a socket (the client's loop thread receives the
answer and wakes the caller), and user code never runs on the loop (the
worker's loop hands a call to an executor thread). A lone call therefore
crosses two thread hand-offs per side that a blocking ping-pong does not.
This script measures, side by side and in turns:

- ``socket``: a raw loopback ping-pong of 64 bytes, blocking on both sides;
- ``framed pickle``: the minimal framed-pickle RPC of ``rpcdl bench`` (the
  caller writes, one reader thread wakes it; the server runs calls inline);
- ``loop floor``: rpcdl's thread structure and nothing else: the caller
  writes its pickled call and waits on a lock; the client's event loop
  (a ``BufferedProtocol``) receives the answer and releases it; the server's
  event loop hands each call through a lock to an executor thread, which
  unpickles and runs it and writes the pickled answer (both loops are
  uvloop's where it is installed, as rpcdl's are);
- ``rpcdl``: ``rpcdl.rpc_sync`` of a no-op to one local worker.

For each: the round trip's median and p99, and the CPU per call of the
client and server processes (every thread, from ``/proc``). Run it plain and
under ``taskset -c 0`` (one core: no wakeup crosses cores)::

    python benchmarks/loop_floor.py --rounds 5 [--calls 2000] [--json FILE]
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

import rpcdl
from rpcdl.cli.bench.floors import FramedPickleSystem
from rpcdl.cli.bench.systems import SocketSystem
from rpcdl.cli.bench.workloads import LENGTH, noop
from rpcdl.local import child_environment
from rpcdl.processes import stop_process


class _Frames(asyncio.BufferedProtocol):
    """Receives length-prefixed frames into one buffer and hands each to ``deliver`` (on the loop)."""

    def __init__(self, deliver: Callable[[bytes], None]) -> None:
        self._deliver = deliver
        self._buffer = bytearray(1 << 16)
        self._filled = 0

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._buffer)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        start = 0
        while self._filled - start >= LENGTH.size:
            (size,) = LENGTH.unpack_from(self._buffer, start)
            end = start + LENGTH.size + size
            if end > self._filled:
                break
            self._deliver(bytes(self._buffer[start + LENGTH.size : end]))
            start = end
        if start:
            self._buffer[: self._filled - start] = self._buffer[start : self._filled]
            self._filled -= start


def _new_loop() -> asyncio.AbstractEventLoop:
    """The kind of loop rpcdl runs: uvloop's where it is installed, else the standard library's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _run_loop(sock: socket.socket, deliver: Callable[[bytes], None], started: threading.Event) -> None:
    loop = _new_loop()

    async def serve() -> None:
        await loop.connect_accepted_socket(lambda: _Frames(deliver), sock)
        started.set()
        await loop.create_future()  # until the process exits

    loop.run_until_complete(serve())


def loop_floor_server() -> None:
    """The server of the loop floor: prints its port, serves one connection (a loop and an executor thread)."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    connection, _ = listener.accept()
    listener.close()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    writer = socket.socket(fileno=os.dup(connection.fileno()))  # the executor's, blocking: the loop's is not
    calls: list[bytes] = []
    parked = threading.Lock()
    parked.acquire()

    def deliver(frame: bytes) -> None:
        calls.append(frame)
        parked.release()

    def execute() -> None:
        while True:
            parked.acquire()
            call_id, function, args = pickle.loads(calls.pop(0))
            answer = pickle.dumps((call_id, function(*args)), protocol=pickle.HIGHEST_PROTOCOL)
            writer.sendall(LENGTH.pack(len(answer)) + answer)

    threading.Thread(target=execute, name="loop-floor-executor", daemon=True).start()
    _run_loop(connection, deliver, threading.Event())


class LoopFloor:
    """The client of the loop floor (see the module): its caller writes, its loop thread receives."""

    name = "loop floor"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True, env=child_environment()
        )
        port = int(self.process.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._writer = socket.socket(fileno=os.dup(self.sock.fileno()))
        self._waiting: dict[int, list] = {}
        self._ids = 0
        started = threading.Event()
        threading.Thread(
            target=_run_loop, args=(self.sock, self._answered, started), name="loop-floor-loop", daemon=True
        ).start()
        started.wait()
        self.pid = self.process.pid

    def _answered(self, frame: bytes) -> None:
        call_id, value = pickle.loads(frame)
        waiting = self._waiting.pop(call_id)
        waiting[1] = value
        waiting[0].release()

    def call(self) -> None:
        self._ids += 1
        done = threading.Lock()
        done.acquire()
        self._waiting[self._ids] = [done, None]
        frame = pickle.dumps((self._ids, noop, ()), protocol=pickle.HIGHEST_PROTOCOL)
        self._writer.sendall(LENGTH.pack(len(frame)) + frame)
        done.acquire()

    def stop(self) -> None:
        self._writer.close()
        stop_process(self.process)


class Peer:
    """One of ``rpcdl bench``'s systems (``socket``, ``framed pickle``): ``call()`` is one round trip."""

    def __init__(self, system: SocketSystem | FramedPickleSystem) -> None:
        self.system = system
        self.name = system.name

    def start(self) -> None:
        self.system.start(None)
        self.pid = self.system.process.pid
        self.call = self.system.call

    def stop(self) -> None:
        self.system.stop()


class Rpcdl:
    """``rpcdl.rpc_sync(worker, noop)`` to one local worker."""

    name = "rpcdl"

    def start(self) -> None:
        self._running = rpcdl.local_workers(1)
        workers = self._running.__enter__()
        (self._address,) = list(workers)
        self.pid = workers.processes[0].pid

    def call(self) -> None:
        rpcdl.rpc_sync(self._address, noop)

    def stop(self) -> None:
        self._running.__exit__(None, None, None)


def measure(system, calls: int) -> dict[str, float]:
    """``calls`` round trips: their median and p99 in us, and each side's CPU per call in us."""
    client, server = harness.process_cpu(os.getpid()), harness.process_cpu(system.pid)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        system.call()
        times.append(time.perf_counter() - started)
    client, server = harness.process_cpu(os.getpid()) - client, harness.process_cpu(system.pid) - server
    times.sort()
    return {
        "p50_us": times[len(times) // 2] * 1e6,
        "p99_us": times[int(len(times) * 0.99)] * 1e6,
        "client_cpu_us": client / calls * 1e6,
        "server_cpu_us": server / calls * 1e6,
        "load": (harness.load_average() or [0.0])[0],
    }


def main() -> None:
    args = _arguments()
    if args.serve:
        loop_floor_server()
        return
    systems = [Peer(SocketSystem()), Peer(FramedPickleSystem()), LoopFloor(), Rpcdl()]
    started = []
    try:
        for system in systems:
            system.start()
            started.append(system)
            for _ in range(args.calls // 4):
                system.call()  # warm up: connections, caches
        rounds = harness.interleave(
            {system.name: (lambda system=system: measure(system, args.calls)) for system in systems},
            args.rounds,
            rotate=True,
        )
    finally:
        for system in started:
            system.stop()
    print(harness.describe_machine())
    print(f"{args.rounds} rounds of {args.calls} lone calls; medians of the rounds; ratios to the socket's p50")
    print(
        f"{'system':18s} {'p50 us':>8s} {'p99 us':>8s} {'x socket':>9s} {'client CPU us':>14s} {'server CPU us':>14s}"
    )
    socket_p50 = harness.median(figures["p50_us"] for figures in rounds["socket"])
    summary = {}
    for name, figures in rounds.items():
        row = {key: harness.median(figure[key] for figure in figures) for key in figures[0]}
        summary[name] = row
        print(
            f"{name:18s} {row['p50_us']:8.0f} {row['p99_us']:8.0f} {row['p50_us'] / socket_p50:8.2f}x "
            f"{row['client_cpu_us']:14.0f} {row['server_cpu_us']:14.0f}"
        )
    loads = [figure["load"] for figures in rounds.values() for figure in figures]
    print(f"load average at the rounds' ends: {min(loads):.1f}-{max(loads):.1f}")
    harness.save_json(args.json, {"machine": harness.machine(), "rounds": rounds, "medians": summary})


def _arguments():
    made = harness.parser(__doc__, rounds=5, json_file=True)
    made.add_argument("--calls", type=harness.positive_int, default=2000, help="calls per round (default: %(default)s)")
    made.add_argument("--serve", action="store_true", help="run the loop floor's server (used by the script itself)")
    return made.parse_args()


if __name__ == "__main__":
    main()
