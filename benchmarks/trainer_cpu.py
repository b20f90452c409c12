"""The trainer's CPU per GB of image batches: what receiving them costs the training process.

Issue 26, item 8. Batches of 64 x uint8[3, 224, 224] (9.6 MB, the image
scenario of ``rpcdl bench``) reach a trainer process four ways:

- ``socket``: a raw loopback socket, ``recv_into`` one reused buffer, from a peer
  process streaming the same bytes (length-prefixed): the floor;
- ``torch``: ``torch.utils.data.DataLoader(num_workers=2)``, the main process
  (batches collated in its worker processes, handed over in shared memory);
- ``rpcdl-tcp``: ``rpcdl.RPCDataloader`` over two local workers with
  ``RPCDL_SHM_BYTES=0``: the path batches from other hosts take;
- ``rpcdl-shm``: the same over shared memory (the default on one host);
- ``frames`` (not run unless named): rpcdl's transport alone, no call, no
  loader: a peer process streams answer frames of the same batch
  (``rpcdl.transport.wire.encode_frame``), received here by the package's
  :class:`~rpcdl.transport.frame_protocol.FrameProtocol` fed from a blocking
  ``recv_into`` (``tests/blocking_wire.py``) into the buffer pool and
  unpickled into a tensor, on one thread. The receive path's own floor;
- ``frames-loop`` (not run unless named): the same frames received as a
  trainer's answers are, on rpcdl's event loop (``rpcdl-loop``): a
  :class:`~rpcdl.transport.socket_stream.SocketStream` feeding the
  :class:`~rpcdl.transport.frame_protocol.FrameProtocol`, each whole frame
  handed to the trainer's thread through a queue and unpickled there. The
  transport's share of ``rpcdl-tcp``, without calls or a loader.

Each system runs in a trainer process of its own, set up once and warmed up
(two epochs); the rounds then take the systems in turn, their order rotating,
and each round measures one epoch of ``--batches`` batches in that process:
its user + system CPU seconds (``resource.getrusage(RUSAGE_SELF)``: every
thread of the trainer process, none of its workers'), its minor page faults,
its wall time, and the load average of the minute as the epoch ends. The
batches are dropped unread, as a trainer that hands them to a GPU copy would
leave their reading to the copy. Printed: each round's CPU per GB and its ratio
to the socket's in the same round, and the medians, each with the load beside
it (the machine may be shared)::

    python benchmarks/trainer_cpu.py --rounds 3 [--batches 48] [--json FILE]

``--profile SYSTEM`` runs ``py-spy record`` (``--profiler perf``: ``perf record
-e cpu-clock -g``, where the kernel allows it) on that system's trainer during
its rounds, into ``--profile-out`` (py-spy: a speedscope file for a ``.json``
name, else a flame graph). py-spy counts threads blocked in a system call as
busy; perf counts only time on a CPU, the kernel's included.

Not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))  # blocking_wire: the raw reader

import harness

SYSTEMS = ("socket", "torch", "rpcdl-tcp", "rpcdl-shm", "frames", "frames-loop")
BATCH = 64
BATCH_BYTES = BATCH * 3 * 224 * 224
WARMUP_EPOCHS = 2


# ---------------------------------------------------------------------------- one trainer process


def _socket_epochs(batches: int) -> Any:
    from rpcdl.cli.bench.systems import start_peer
    from rpcdl.cli.bench.workloads import IMAGE_BATCH_BYTES, LENGTH, REQUEST, recv_exact_into

    _, sock = start_peer("rpcdl.cli.bench.workloads", "socket_server")
    header = memoryview(bytearray(LENGTH.size))
    target = memoryview(bytearray(IMAGE_BATCH_BYTES))

    def epoch() -> int:
        sock.sendall(REQUEST.pack(b"S", IMAGE_BATCH_BYTES, batches))
        for _ in range(batches):
            recv_exact_into(sock, header)
            recv_exact_into(sock, target)
        return batches * IMAGE_BATCH_BYTES

    return epoch


def frame_peer() -> None:
    """Stream answer frames of one image batch: ``count`` (a u64 read from the socket) at a time; prints its port."""
    import socket
    import struct

    import torch
    from blocking_wire import send_pieces

    from rpcdl.cli.bench.workloads import IMAGE_SHAPE, accept_one
    from rpcdl.serialization.pickling import dumps_answer
    from rpcdl.transport.wire import Frame, Kind, encode_frame

    connection, reader = accept_one("127.0.0.1")
    batch = torch.randint(0, 256, (BATCH, *IMAGE_SHAPE), dtype=torch.uint8)
    payload, buffers = dumps_answer(batch)
    pieces = encode_frame(Frame(Kind.RESULT, 1, 0, payload, buffers))
    while request := reader.read(8):
        for _ in range(struct.unpack("!Q", request)[0]):
            send_pieces(connection, pieces)
    connection.shutdown(socket.SHUT_RDWR)


def _frame_epochs(batches: int) -> Any:
    import struct

    from blocking_wire import FrameReader, io_stream

    from rpcdl.cli.bench.systems import start_peer
    from rpcdl.serialization.pickling import loads
    from rpcdl.transport import buffers
    from rpcdl.transport.wire import Limits

    _, sock = start_peer("trainer_cpu", "frame_peer")
    reader = FrameReader(io_stream(sock, receive=0.1, send=10.0), Limits(), stall_timeout=10.0)

    def allocate(call_id: int, size: int) -> Any:
        return buffers.for_receiving(size)

    def epoch() -> int:
        sock.sendall(struct.pack("!Q", batches))
        received = 0
        while received < batches * BATCH_BYTES:
            frame = reader.read_frame(allocate)
            if frame is not None:
                received += loads(frame.payload, frame.buffers).nbytes
        return received

    return epoch


def _loop_epochs(batches: int) -> Any:
    import queue
    import struct

    from rpcdl.cli.bench.systems import start_peer
    from rpcdl.serialization.pickling import loads
    from rpcdl.transport import buffers
    from rpcdl.transport.event_loop import run_coroutine
    from rpcdl.transport.frame_protocol import FrameProtocol
    from rpcdl.transport.socket_stream import SocketStream
    from rpcdl.transport.wire import Frame, Limits

    _, sock = start_peer("trainer_cpu", "frame_peer")
    arrived: queue.SimpleQueue[Frame | Exception] = queue.SimpleQueue()

    class Sink:  # on the loop, as a connection is
        def frame_received(self, frame: Frame) -> None:
            arrived.put(frame)

        def receiving_failed(self, error: Exception) -> None:
            arrived.put(error)

        def stream_ended(self, error: Exception | None) -> None:
            arrived.put(error or ConnectionError("the frame peer closed the connection"))

    def allocate(call_id: int, size: int) -> Any:
        return buffers.for_receiving(size)

    async def attach() -> SocketStream:
        return SocketStream(sock, FrameProtocol(Sink(), Limits(), allocate=allocate))

    stream = run_coroutine(attach(), timeout=30)

    def epoch() -> int:
        stream.write(struct.pack("!Q", batches))
        received = 0
        for _ in range(batches):
            frame = arrived.get(timeout=60)
            if isinstance(frame, Exception):
                raise frame
            received += loads(frame.payload, frame.buffers).nbytes
        return received

    return epoch


def _torch_epochs(batches: int) -> Any:
    from torch.utils.data import DataLoader

    from rpcdl.cli.bench.workloads import ImageDataset

    loader = DataLoader(
        ImageDataset(batches * BATCH), batch_size=BATCH, num_workers=2, persistent_workers=True, prefetch_factor=2
    )
    return lambda: _drain(loader)


def _rpcdl_epochs(batches: int) -> Any:
    import rpcdl
    from rpcdl.cli.bench.workloads import ImageDataset

    running = rpcdl.local_workers(2)
    workers = running.__enter__()  # stopped with this process
    _kept.append(running)  # its generator, collected, would stop them
    dataset = rpcdl.RPCDataset(workers, ImageDataset, batches * BATCH)
    loader = rpcdl.RPCDataloader(dataset, batch_size=BATCH, prefetch_factor=2)
    return lambda: _drain(loader)


_kept: list[Any] = []


def _drain(loader: Any) -> int:
    received = 0
    for batch in loader:
        received += batch.nbytes
    return received


def trainer(system: str, batches: int) -> None:
    """Set ``system`` up, warm it up, then measure one epoch per line read from stdin."""
    if system == "rpcdl-tcp":
        os.environ["RPCDL_SHM_BYTES"] = "0"  # this trainer and its workers
    systems = {"socket": _socket_epochs, "torch": _torch_epochs, "frames": _frame_epochs, "frames-loop": _loop_epochs}
    epoch = systems.get(system, _rpcdl_epochs)(batches)
    for _ in range(WARMUP_EPOCHS):
        epoch()
    print(json.dumps({"ready": os.getpid()}), flush=True)
    while sys.stdin.readline():
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        received = epoch()
        wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        figures = {
            "bytes": received,
            "cpu": cpu,
            "user": after.ru_utime - before.ru_utime,
            "sys": after.ru_stime - before.ru_stime,
            "wall": wall,
            "minflt_per_batch": (after.ru_minflt - before.ru_minflt) / batches,
        }
        print(json.dumps(figures), flush=True)


# ---------------------------------------------------------------------------- the driver


def driver(args: argparse.Namespace) -> None:
    python = {system: sys.executable for system in args.systems}
    if args.baseline:  # the same rpcdl systems run by another interpreter (its own rpcdl): before and after
        for system in [system for system in args.systems if system.startswith(("rpcdl", "frames"))]:
            python[f"{system} (baseline)"] = args.baseline
        args.systems = list(python)
    with tempfile.TemporaryDirectory() as scratch:  # children import their interpreter's rpcdl, not this checkout's
        trainers = {
            name: subprocess.Popen(
                [
                    interpreter,
                    os.path.abspath(__file__),
                    "--trainer",
                    name.partition(" ")[0],
                    "--batches",
                    str(args.batches),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=scratch,
                env={key: value for key, value in os.environ.items() if key != "PYTHONPATH"},
            )
            for name, interpreter in python.items()
        }
        _measure(args, trainers)


def _measure(args: argparse.Namespace, trainers: dict[str, subprocess.Popen]) -> None:
    profiler = None
    try:
        pids = {system: json.loads(process.stdout.readline())["ready"] for system, process in trainers.items()}
        if args.profile:
            pid = str(pids[args.profile])
            if args.profiler == "perf":
                command = ["perf", "record", "-e", "cpu-clock", "-F", "2000", "-g", "-p", pid, "-o", args.profile_out]
            else:
                command = [
                    "py-spy",
                    "record",
                    "--pid",
                    pid,
                    "--output",
                    args.profile_out,
                    "--threads",
                    "--gil",
                    "--rate",
                    "1000",
                    "--format",
                    "speedscope" if args.profile_out.endswith(".json") else "flamegraph",
                ]
            profiler = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        print(f"load average before: {harness.load_average()}")

        def measure(system: str) -> dict[str, float]:
            process = trainers[system]
            process.stdin.write("go\n")
            process.stdin.flush()
            figures = json.loads(process.stdout.readline())
            figures["cpu_per_gb"] = figures["cpu"] / (figures["bytes"] / 1e9)
            figures["load"] = os.getloadavg()[0]  # the minute's, as this epoch ends
            return figures

        def show(index: int, measured: dict[str, dict[str, float]]) -> None:
            floor = measured.get("socket", {}).get("cpu_per_gb")
            print(f"round {index}:")
            for system in args.systems:
                figures = measured[system]
                ratio = f" = {figures['cpu_per_gb'] / floor:.2f}x socket" if floor else ""
                print(
                    f"  {system:22s} {figures['cpu_per_gb']:.3f} CPU s/GB{ratio} (user {figures['user']:.2f} s, "
                    f"sys {figures['sys']:.2f} s, {figures['minflt_per_batch']:.1f} page faults/batch, "
                    f"{figures['bytes'] / 1e6 / figures['wall']:.0f} MB/s; load {figures['load']:.1f})",
                    flush=True,
                )

        samples = harness.interleave(
            {system: (lambda system=system: measure(system)) for system in args.systems},
            args.rounds,
            rotate=True,
            after_round=show,
        )
        rounds = [{system: samples[system][index] for system in args.systems} for index in range(args.rounds)]
        print(f"load average after: {harness.load_average()}")
        print("medians over the rounds (ratio: median of the rounds' ratios to the socket):")
        for system in args.systems:
            per_gb = harness.median(measured[system]["cpu_per_gb"] for measured in rounds)
            ratios = [m[system]["cpu_per_gb"] / m["socket"]["cpu_per_gb"] for m in rounds if "socket" in m]
            ratio = f", {harness.median(ratios):.2f}x socket" if ratios else ""
            loads = [measured[system]["load"] for measured in rounds]
            print(f"  {system:22s} {per_gb:.3f} CPU s/GB{ratio} (load {min(loads):.1f}-{max(loads):.1f})")
        harness.save_json(args.json, {"rounds": rounds})
    finally:
        if profiler is not None:
            profiler.send_signal(2)  # SIGINT: py-spy writes its file
            profiler.wait(timeout=60)
        for process in trainers.values():
            process.stdin.close()
        for process in trainers.values():
            process.wait(timeout=60)
            process.stdout.close()


def main() -> None:
    parser = harness.parser(__doc__, rounds=3, json_file=True)
    parser.add_argument("--trainer", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS[:4]))
    parser.add_argument(
        "--baseline",
        metavar="PYTHON",
        help="also run the rpcdl systems with this interpreter (the rpcdl it imports): a before/after in one run",
    )
    parser.add_argument("--batches", type=int, default=48, help="batches per round (9.6 MB each)")
    parser.add_argument("--profile", help="py-spy record this system's trainer during the rounds")
    parser.add_argument("--profiler", choices=("py-spy", "perf"), default="py-spy")
    parser.add_argument("--profile-out", default="profile.svg", help="py-spy: .json for speedscope; perf: perf.data")
    args = parser.parse_args()
    if args.trainer:
        trainer(args.trainer, args.batches)
    else:
        driver(args)


if __name__ == "__main__":
    main()
