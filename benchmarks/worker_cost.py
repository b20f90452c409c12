"""The worker's CPU per call, measured apart from any rpcdl client.

A raw client (a plain socket, the handshake, frames encoded once up front with
:func:`rpcdl.transport.wire.encode_frame` and
:func:`rpcdl.serialization.pickling.dumps`, answers read with the blocking
reader of ``tests/blocking_wire.py``) drives one worker process
(``python -m rpcdl worker --port 0``). The client does as little Python per
call as it can, so what moves between two runs is the worker. Scenarios:

- ``latency``: one no-op call at a time; the round trip's p50 and the worker's CPU per call.
- ``pipelined``: no-op calls with ``--window`` (64) in flight, sent in bursts as answers come back.
- ``small``: the loader's small batches: ``fetch_batch(dataset RRef, 32 indices, default_collate, None)``
  on a ``SmallDataset`` of float32[128] rows built on the worker, 2 in flight.
- ``image``: the loader's large batches, the same call on an ``ImageDataset`` (64 x uint8[3, 224, 224],
  9.6 MB per batch), 2 in flight, over the socket (no shared segment): what the worker spends to
  collate, pickle and write a large answer, and its minor page faults per batch.

The worker's CPU is the sum of its threads' time on a CPU (``/proc/PID/task/*/schedstat``,
nanoseconds), before and after each round. Rounds alternate between the
interpreters given with ``--python`` (each runs the ``rpcdl`` it imports outside
this checkout: the system python runs ``/work/main``'s, a venv its own), so one run
compares two versions of the worker::

    python benchmarks/worker_cost.py --python /root/.pyenv/versions/3.11.7/bin/python \\
        --python /work/venvs/NAME/bin/python --rounds 3

``--floor`` adds, for the no-op scenarios, the same client against a floor: a
one-thread loop in this script that takes the handshake, then reads a frame,
unpickles, calls, pickles and sends the answer, nothing else.

Not a test: it asserts nothing about speed; it prints medians over the rounds.
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torch.utils.data import default_collate

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))  # blocking_wire: the raw client

import harness
from blocking_wire import FrameReader, client_negotiate, io_stream, server_negotiate

from rpcdl.cli.bench.workloads import ImageDataset, SmallDataset, noop
from rpcdl.data.fetch import fetch_batch
from rpcdl.rpc.rref import resolve_here
from rpcdl.serialization.pickling import dumps
from rpcdl.transport.wire import Frame, Kind, Limits, encode_frame

_FLOOR = "floor"
_ROWS = 9600
_BATCH = 32
_IMAGES = 64 * 200
_IMAGE_BATCH = 64


class _DatasetOnWorker:
    """Pickles as an RRef sent back to its owner: the worker unpickles it as the object it holds."""

    def __init__(self, uid: int):
        self.uid = uid

    def __reduce__(self):
        return resolve_here, (self.uid,)


def _call_bytes(call_id: int, func: Any, args: tuple, ref: int = 0) -> bytes:
    payload, buffers = dumps((func, args, {}))
    assert not buffers
    return b"".join(bytes(piece) for piece in encode_frame(Frame(Kind.CALL, call_id, ref, payload)))


class RawClient:
    """One connection to a worker, speaking frames with nothing else around them."""

    def __init__(self, address: str, shared_memory: bool = True):
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(10)
        client_negotiate(sock, None, address, compression="off", shared_memory=shared_memory)
        self.sock = io_stream(sock, receive=None, send=None)
        self.reader = FrameReader(self.sock, Limits(), stall_timeout=10)

    def read(self) -> Frame:
        frame = self.reader.read_frame()
        if frame.kind is not Kind.RESULT:
            raise RuntimeError(f"the worker answered {frame.kind.name}: {bytes(frame.payload)[:200]!r}")
        return frame

    def close(self) -> None:
        self.sock.close()


def serve_floor() -> None:
    """The floor: one thread, one client at a time, a frame in, an answer out (no slots, no counters)."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"127.0.0.1:{listener.getsockname()[1]}", flush=True)
    head = struct.Struct("!BBHIQQQ")
    while True:
        sock, _ = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        server_negotiate(sock, None, "floor", "off", 0)
        sock.settimeout(None)
        buffer = bytearray(1 << 18)
        view, start, end = memoryview(buffer), 0, 0
        try:
            while True:
                while end - start < head.size:
                    if start == end:
                        start = end = 0
                    received = sock.recv_into(view[end:])
                    if not received:
                        raise EOFError
                    end += received
                _, _, _, _, call_id, _, size = head.unpack_from(buffer, start)
                start += head.size
                while end - start < size:
                    received = sock.recv_into(view[end:])
                    if not received:
                        raise EOFError
                    end += received
                func, args, kwargs = pickle.loads(view[start : start + size])
                start += size
                answer = pickle.dumps(func(*args, **kwargs), protocol=5)
                sock.sendall(head.pack(Kind.RESULT, 0, 0, 0, call_id, 0, len(answer)) + answer)
        except (EOFError, OSError):
            sock.close()


class WorkerProcess:
    """``python -m rpcdl worker --port 0`` run by ``python`` from a neutral folder (or the floor loop)."""

    def __init__(self, python: str):
        self.python = python
        self._folder = tempfile.TemporaryDirectory()
        command = [python, "-m", "rpcdl", "worker", "--port", "0", "--log-level", "WARNING"]
        if python == _FLOOR:
            command = [sys.executable, os.path.abspath(__file__), "--serve-floor"]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, cwd=self._folder.name, text=True)
        self.address = self.process.stdout.readline().strip()
        if not self.address:
            raise RuntimeError(f"{python} -m rpcdl worker did not start")
        self.pid = self.process.pid

    def cpu_seconds(self) -> float:
        total = 0
        for task in os.listdir(f"/proc/{self.pid}/task"):
            try:
                with open(f"/proc/{self.pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                pass
        return total / 1e9

    def minor_faults(self) -> int:
        """The worker process's minor page faults so far (every thread's)."""
        return int(harness.stat_fields(self.pid)[7])

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)
        self._folder.cleanup()


def latency(client: RawClient, worker: WorkerProcess, calls: int) -> dict[str, float]:
    frames = [_call_bytes(i + 1, noop, ()) for i in range(256)]
    sock, read = client.sock, client.read
    for frame in frames:
        sock.sendall(frame)
        read()
    times = []
    cpu = worker.cpu_seconds()
    for i in range(calls):
        started = time.perf_counter()
        sock.sendall(frames[i & 255])
        read()
        times.append(time.perf_counter() - started)
    cpu = worker.cpu_seconds() - cpu
    return {"worker_us_per_call": cpu / calls * 1e6, "p50_us": harness.median(times) * 1e6}


def _windowed(client: RawClient, worker: WorkerProcess, frames: list[bytes], calls: int, window: int) -> dict:
    sock, reader = client.sock, client.reader
    sent = received = 0
    cpu = worker.cpu_seconds()
    started = time.perf_counter()
    sock.sendall(b"".join(frames[i % len(frames)] for i in range(window)))
    sent = window
    while received < calls:
        client.read()
        received += 1
        more = 1
        while reader.holds_frame and received < calls:  # answers already here: read them, send as many
            client.read()
            received += 1
            more += 1
        more = min(more, calls - sent)
        if more > 0:
            sock.sendall(b"".join(frames[(sent + i) % len(frames)] for i in range(more)))
            sent += more
    elapsed = time.perf_counter() - started
    cpu = worker.cpu_seconds() - cpu
    return {"worker_us_per_call": cpu / calls * 1e6, "calls_per_s": calls / elapsed}


def pipelined(client: RawClient, worker: WorkerProcess, calls: int, window: int) -> dict[str, float]:
    frames = [_call_bytes(i + 1, noop, ()) for i in range(1024)]
    _windowed(client, worker, frames, 2 * window, window)
    return _windowed(client, worker, frames, calls, window)


def _batch_calls(client: RawClient, dataset_type: type, rows: int, batch: int, uid: int) -> list[bytes]:
    """Build ``dataset_type(rows)`` on the worker (its RRef ``uid``); return a ``fetch_batch`` call per batch."""
    client.sock.sendall(_call_bytes(1, dataset_type, (rows,), ref=uid))
    client.read()
    dataset = _DatasetOnWorker(uid)
    return [
        _call_bytes(i + 2, fetch_batch, (dataset, list(range(i * batch, (i + 1) * batch)), default_collate, None))
        for i in range(rows // batch)
    ]


def small(client: RawClient, worker: WorkerProcess, calls: int, window: int = 2) -> dict[str, float]:
    frames = _batch_calls(client, SmallDataset, _ROWS, _BATCH, 0x5EED)
    _windowed(client, worker, frames, len(frames), window)
    return _windowed(client, worker, frames, calls, window)


def image(client: RawClient, worker: WorkerProcess, calls: int, window: int = 2) -> dict[str, float]:
    frames = _batch_calls(client, ImageDataset, _IMAGES, _IMAGE_BATCH, 0x1AA6E)
    _windowed(client, worker, frames, len(frames), window)
    faults = worker.minor_faults()
    figures = _windowed(client, worker, frames, calls, window)
    figures = {"worker_us_per_batch": figures["worker_us_per_call"], "batches_per_s": figures["calls_per_s"]}
    figures["minor_faults_per_batch"] = (worker.minor_faults() - faults) / calls
    return figures


def run_round(python: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    worker = WorkerProcess(python)
    try:
        results = {}
        for scenario in args.scenario:
            if python == _FLOOR and scenario in ("small", "image"):
                continue  # the floor holds no RRefs
            client = RawClient(worker.address, shared_memory=scenario != "image")
            try:
                if scenario == "latency":
                    results[scenario] = latency(client, worker, args.calls)
                elif scenario == "pipelined":
                    results[scenario] = pipelined(client, worker, args.calls * 4, args.window)
                elif scenario == "image":
                    results[scenario] = image(client, worker, args.calls // 5)
                else:
                    results[scenario] = small(client, worker, args.calls)
            finally:
                client.close()
        return results
    finally:
        worker.stop()


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, rounds=3)
    parser.add_argument("--python", action="append", help="interpreter running the worker (repeat to compare)")
    parser.add_argument("--scenario", nargs="+", default=["latency", "pipelined", "small"])
    parser.add_argument(
        "--calls", type=int, default=5000, help="calls per round (pipelined: 4 times as many; image: a fifth)"
    )
    parser.add_argument("--window", type=int, default=64, help="pipelined calls in flight")
    parser.add_argument("--floor", action="store_true", help="also measure the floor loop (no-op scenarios)")
    parser.add_argument("--serve-floor", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_floor:
        serve_floor()
        return 0
    pythons = (args.python or [sys.executable]) + ([_FLOOR] if args.floor else [])

    def show(index: int, this_round: dict[str, dict[str, dict[str, float]]]) -> None:
        for python, scenarios in this_round.items():
            for scenario, figures in scenarios.items():
                shown = "  ".join(f"{k} {v:.1f}" for k, v in figures.items())
                print(f"round {index} {python}: {scenario:9s} {shown}", flush=True)

    samples = harness.interleave(
        {python: (lambda python=python: run_round(python, args)) for python in pythons}, args.rounds, after_round=show
    )
    print(f"\nmedians over rounds; {harness.describe_machine()}")
    for python, runs in samples.items():
        for scenario in runs[0]:
            figures = [run[scenario] for run in runs]
            shown = "  ".join(f"{k} {harness.median(f[k] for f in figures):.1f}" for k in figures[0])
            print(f"{scenario:9s} {shown}   [{python}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
