"""``rpcdl bench``: rpcdl side by side with what users would pick instead, in one run.

Every scenario measures each system in turn, round after round (interleaved,
so a burst of load on the machine hits them all alike), and reports medians
and the ratio of rpcdl's median to each other system's. The systems here are
rpcdl, torch's DataLoader (as many local processes as rpcdl has workers) and
a raw loopback socket; ``benchmarks/compare.py`` adds rpcdataloader and
torch.distributed.rpc through ``main()``'s ``extra_systems``.

Scenarios (two workers unless said):

- ``latency``: no-op call round trips to one worker, p50 and p99;
- ``pipelined``: no-op calls per second to one worker, 64 in flight;
- ``small``: batches of 32 x float32[128] per second;
- ``image``: MB/s of batches of 64 x uint8[3, 224, 224];
- ``straggler``: one worker 10x slower than the others, against the same run
  with the fast workers only;
- ``io``: a dataset sleeping 5 ms per item, with 1, 2, 4 and 8 workers;
- ``memory``: the client's peak RSS in each of 10 epochs of image batches.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .cli_args import positive_int, silent_worker, worker_address
from .local import child_environment, stop_process

HELP = "measure rpcdl side by side with torch's DataLoader and a raw loopback socket"
DESCRIPTION = (
    "Run benchmark scenarios against local worker processes (--local N, the default being 2) or running "
    "workers (--workers HOST:PORT ...), each figure beside torch's DataLoader with as many local processes "
    "and a raw loopback socket where meaningful, interleaved over several rounds. Prints a table of medians "
    "and ratios (rpcdl / other); --json and --plot save them. Speeds depend on the machine and its load: "
    "compare ratios from one run, not figures from different runs."
)

SCENARIOS = ("latency", "pipelined", "small", "memory", "image", "straggler", "io")  # memory before image: a cold start
RPCDL = "rpcdl"
TORCH = "torch DataLoader"
SOCKET = "socket"

SMALL_BATCH = 32
SMALL_FEATURES = 128
IMAGE_BATCH = 64
IMAGE_SHAPE = (3, 224, 224)
IMAGE_BATCH_BYTES = IMAGE_BATCH * IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * IMAGE_SHAPE[2]
IO_DELAY = 0.005
IO_BATCH = 4
STRAGGLER_DELAY = 0.002
STRAGGLER_BATCH = 4
SLOWDOWN = 10.0
PREFETCH = 2
PIPELINE_WINDOW = 64
MEMORY_EPOCHS = 10


# ---------------------------------------------------------------------------- run on workers


def _noop() -> None:
    """The no-op call of the latency scenarios."""


_slowdown = 1.0  # per process: how much slower SleepDataset is here


def set_slowdown(factor: float) -> None:
    """Make :class:`SleepDataset` ``factor`` times slower in this process (the straggler)."""
    global _slowdown
    _slowdown = float(factor)


class SmallDataset:
    """Rows of float32[features]; batches of them are a few KB."""

    def __init__(self, length: int, features: int = SMALL_FEATURES):
        import torch

        self.rows = torch.randn(length, features)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        return self.rows[index]


class ImageDataset:
    """uint8[3, 224, 224] images (a few distinct ones, repeated): batches are MB."""

    def __init__(self, length: int, distinct: int = 8):
        import torch

        self.length = length
        self.images = torch.randint(0, 256, (distinct, *IMAGE_SHAPE), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.images[index % len(self.images)]


class SleepDataset:
    """Sleeps ``delay`` seconds per item (times this process's slowdown): I/O-bound loading."""

    def __init__(self, length: int, delay: float):
        self.length = length
        self.delay = delay

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        time.sleep(self.delay * _slowdown)
        return index


def _slow_torch_worker(slow_index: int | None, worker_id: int) -> None:
    """``worker_init_fn`` of torch's DataLoader: slow down one of its worker processes."""
    if worker_id == slow_index:
        set_slowdown(SLOWDOWN)


# ---------------------------------------------------------------------------- raw socket peer


def socket_server() -> None:
    """A raw loopback peer for the socket baseline: echoes frames, or streams them on request.

    A request is a kind byte and two u64: ``E`` (echo the ``size`` bytes that
    follow), ``S`` (send ``count`` frames of ``size`` bytes). Each answer is a
    u64 length and the bytes. Prints its port, serves one connection, exits.
    """
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    connection, _ = listener.accept()
    listener.close()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = connection.makefile("rb", buffering=1 << 16)
    payload = memoryview(bytearray(0))
    while True:
        request = reader.read(17)
        if len(request) < 17:
            return
        kind, size, count = _REQUEST.unpack(request)
        if kind == b"E":
            connection.sendall(_LENGTH.pack(size) + reader.read(size))
        else:
            if payload.nbytes != size:
                payload = memoryview(bytearray(os.urandom(16)) * (size // 16) + bytearray(size % 16))
            for _ in range(count):
                connection.sendall(_LENGTH.pack(size))
                connection.sendall(payload)


_REQUEST = struct.Struct("!cQQ")
_LENGTH = struct.Struct("!Q")


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        received = sock.recv_into(view)
        if not received:
            raise ConnectionError("the socket peer closed the connection")
        view = view[received:]


# ---------------------------------------------------------------------------- systems


@dataclass
class LoaderSpec:
    """A data loading run: the dataset (built where the system loads), batches, workers."""

    dataset: Callable[..., Any]
    args: tuple
    batch_size: int
    workers: int
    slow_worker: int | None = None  # index of the worker made SLOWDOWN times slower


class System:
    """Something measured side by side. Subclasses implement the capabilities they have.

    Capabilities: ``call()`` (one no-op round trip, blocking), ``calls(count,
    window)`` (``count`` no-op calls with ``window`` in flight), ``stream(size,
    count)`` (receive ``count`` messages of ``size`` bytes) and ``loader(spec)``
    (an iterable whose iterations are epochs). A system lacking one is left out
    of the scenarios that need it.
    """

    name = "system"

    def start(self, bench: Bench) -> None:
        """Prepare (start processes); called once before the first scenario that uses it."""

    def stop(self) -> None:
        """Free what :meth:`start` and the loaders took."""

    def release_loader(self, loader: Any) -> None:
        """Free one loader made by :meth:`loader` (its worker processes or remote datasets)."""


class RpcdlSystem(System):
    name = RPCDL

    def __init__(self) -> None:
        self.bench: Bench | None = None

    def start(self, bench: Bench) -> None:
        self.bench = bench

    def call(self) -> None:
        from .client import rpc_sync

        rpc_sync(self.bench.worker_addresses(1)[0], _noop)

    def calls(self, count: int, window: int) -> None:
        from .client import rpc_async

        address = self.bench.worker_addresses(1)[0]
        in_flight: collections.deque = collections.deque()
        for _ in range(count):
            if len(in_flight) >= window:
                in_flight.popleft().wait()
            in_flight.append(rpc_async(address, _noop))
        for future in in_flight:
            future.wait()

    def loader(self, spec: LoaderSpec) -> Any:
        from .client import rpc_sync
        from .dataloader import RPCDataloader
        from .dataset import RPCDataset

        addresses = self.bench.worker_addresses(spec.workers)
        for index, address in enumerate(addresses):
            rpc_sync(address, set_slowdown, (SLOWDOWN if index == spec.slow_worker else 1.0,))
        dataset = RPCDataset(addresses, spec.dataset, *spec.args)
        return RPCDataloader(dataset, batch_size=spec.batch_size, prefetch_factor=PREFETCH)

    def release_loader(self, loader: Any) -> None:
        from .client import rpc_sync

        for address in loader.workers:
            rpc_sync(address, set_slowdown, (1.0,))
        loader.dataset.release()


class TorchLoaderSystem(System):
    """torch.utils.data.DataLoader with as many worker processes as rpcdl has workers."""

    name = TORCH

    def loader(self, spec: LoaderSpec) -> Any:
        import functools
        import warnings

        from torch.utils.data import DataLoader

        # more worker processes than CPUs is the point of the io scenario: no warning about it
        warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
        return DataLoader(
            spec.dataset(*spec.args), batch_size=spec.batch_size, num_workers=spec.workers,
            persistent_workers=True, prefetch_factor=PREFETCH,
            worker_init_fn=functools.partial(_slow_torch_worker, spec.slow_worker),
        )  # fmt: skip

    def release_loader(self, loader: Any) -> None:
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()
            loader._iterator = None


class SocketSystem(System):
    """A raw loopback TCP connection to a minimal Python peer: the transport's ceiling."""

    name = SOCKET
    message = 64  # bytes per echo, about an rpcdl no-op call

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.sock: socket.socket | None = None

    def start(self, bench: Bench) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from rpcdl.bench import socket_server; socket_server()"],
            stdout=subprocess.PIPE, text=True, env=child_environment(),
        )  # fmt: skip
        port = int(self.process.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._echo = _REQUEST.pack(b"E", self.message, 0) + bytes(self.message)
        self._answer = memoryview(bytearray(_LENGTH.size + self.message))

    def stop(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self.process is not None:
            stop_process(self.process)

    def call(self) -> None:
        self.sock.sendall(self._echo)
        _recv_exact_into(self.sock, self._answer)

    def calls(self, count: int, window: int) -> None:
        while count > 0:
            batch = min(window, count)
            self.sock.sendall(self._echo * batch)
            for _ in range(batch):
                _recv_exact_into(self.sock, self._answer)
            count -= batch

    def stream(self, size: int, count: int) -> None:
        header = memoryview(bytearray(_LENGTH.size))
        target = memoryview(bytearray(size))
        self.sock.sendall(_REQUEST.pack(b"S", size, count))
        for _ in range(count):
            _recv_exact_into(self.sock, header)
            _recv_exact_into(self.sock, target)


# ---------------------------------------------------------------------------- figures


@dataclass
class Figure:
    """One measured quantity for every system that could measure it."""

    scenario: str
    metric: str
    unit: str
    better: str  # "higher" or "lower"
    samples: dict[str, list[float]] = field(default_factory=dict)
    note: str = ""

    def add(self, system: str, value: float) -> None:
        self.samples.setdefault(system, []).append(float(value))

    def median(self, system: str) -> float | None:
        values = self.samples.get(system)
        return statistics.median(values) if values else None

    def ratio(self, system: str, reference: str = RPCDL) -> float | None:
        """``reference``'s median over ``system``'s."""
        mine, theirs = self.median(reference), self.median(system)
        if mine is None or not theirs:
            return None
        return mine / theirs

    def as_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "metric": self.metric,
            "unit": self.unit,
            "better": self.better,
            "note": self.note,
            "systems": {
                name: {"median": self.median(name), "min": min(values), "max": max(values), "samples": values}
                for name, values in self.samples.items()
            },
            "ratios": {name: self.ratio(name) for name in self.samples if name != RPCDL},
        }


@dataclass(frozen=True)
class Target:
    """A goal on a figure: rpcdl's median over ``against``'s (or rpcdl's own when ``against`` is None)."""

    label: str
    scenario: str
    metric: str
    against: str | None
    op: str  # "<=" or ">="
    threshold: float

    def value(self, figures: Sequence[Figure]) -> float | None:
        for figure in figures:
            if figure.scenario == self.scenario and figure.metric == self.metric:
                return figure.median(RPCDL) if self.against is None else figure.ratio(self.against)
        return None

    def met(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return value <= self.threshold if self.op == "<=" else value >= self.threshold


RPCDATALOADER = "rpcdataloader"
TORCH_RPC = "torch.distributed.rpc"

TARGETS = (
    Target("no-op rpc_sync p50 latency vs rpcdataloader", "latency", "p50", RPCDATALOADER, "<=", 0.25),
    Target("no-op rpc_sync p50 latency vs torch.distributed.rpc", "latency", "p50", TORCH_RPC, "<=", 1.0),
    Target("pipelined calls/s vs rpcdataloader", "pipelined", "calls/s", RPCDATALOADER, ">=", 5.0),
    Target("small batches/s vs rpcdataloader", "small", "batches/s", RPCDATALOADER, ">=", 2.0),
    Target("small batches/s vs torch DataLoader", "small", "batches/s", TORCH, ">=", 2.0),
    Target("image MB/s vs rpcdataloader", "image", "MB/s", RPCDATALOADER, ">=", 1.5),
    Target("image MB/s vs raw loopback socket", "image", "MB/s", SOCKET, ">=", 0.6),
    Target("straggler: throughput kept vs fast workers only", "straggler", "kept", None, ">=", 0.8),
    Target("I/O-bound: 8 workers vs 1 worker", "io", "speedup x8", None, ">=", 7.0),
    Target("client peak memory / (prefetch window + 2 batches)", "memory", "peak / bound", None, "<=", 1.0),
    Target("client peak memory growth, epochs 2-5 -> 6-10, in batches", "memory", "growth (batches)", None, "<=", 1.0),
)


# ---------------------------------------------------------------------------- progress


class Progress:
    """A progress bar on standard error: tqdm when installed, else a plain one."""

    def __init__(self, total: int, enabled: bool = True):
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=self.total, unit="step", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_description(label)
            self._bar.update(1)
            return
        width = 30
        filled = int(width * self.done / self.total)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label:<40}")
        sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            sys.stderr.write("\n")


# ---------------------------------------------------------------------------- the bench


@dataclass
class Sizes:
    """How much work each scenario does per round."""

    rounds: int = 5
    latency_calls: int = 1000
    pipelined_calls: int = 3000
    small_batches: int = 300
    image_batches: int = 24
    straggler_batches: int = 48
    io_batches_per_worker: int = 12
    memory_batches: int = 12
    io_workers: tuple[int, ...] = (1, 2, 4, 8)

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            rounds=1, latency_calls=20, pipelined_calls=40, small_batches=6, image_batches=2,
            straggler_batches=4, io_batches_per_worker=2, memory_batches=2, io_workers=(1, 2),
        )  # fmt: skip


class Bench:
    """Runs scenarios over a set of systems and collects :class:`Figure` s.

    Args:
        systems: what to measure; the first must be rpcdl's.
        workers: running rpcdl workers to use, or ``None`` to start local ones.
        local: how many local workers the scenarios use when ``workers`` is None.
        sizes: work per round.
        progress: show a progress bar.
    """

    def __init__(
        self,
        systems: Sequence[System],
        workers: Sequence[str] | None = None,
        local: int = 2,
        sizes: Sizes | None = None,
        progress: bool = True,
    ):
        self.systems = list(systems)
        self.given_workers = list(workers) if workers else None
        self.local = local
        self.sizes = sizes or Sizes()
        self.show_progress = progress
        self.figures: list[Figure] = []
        self.notes: list[str] = []
        self._local_workers: Any = None
        self._local_context: Any = None
        self._started: set[str] = set()
        self.progress: Progress | None = None

    @property
    def worker_count(self) -> int:
        """Workers in the scenarios that say "2 workers unless said"."""
        return len(self.given_workers) if self.given_workers else self.local

    def worker_addresses(self, count: int) -> list[str]:
        """The first ``count`` rpcdl workers, starting local ones if needed."""
        if self.given_workers is not None:
            if count > len(self.given_workers):
                raise ValueError(f"this scenario needs {count} workers, --workers gave {len(self.given_workers)}")
            return self.given_workers[:count]
        if self._local_workers is None:
            from .local import local_workers

            self._local_context = local_workers(count, extra_args=("--log-level", "WARNING"))
            self._local_workers = self._local_context.__enter__()
        elif len(self._local_workers) < count:
            self._local_workers.start(count - len(self._local_workers))
        return list(self._local_workers[:count])

    def capable(self, capability: str) -> list[System]:
        return [system for system in self.systems if callable(getattr(system, capability, None))]

    def _ensure_started(self, system: System) -> bool:
        if system.name in self._started:
            return True
        try:
            system.start(self)
        except Exception as exc:
            self.notes.append(f"{system.name} could not start: {exc}")
            self.systems.remove(system)
            return False
        self._started.add(system.name)
        return True

    def close(self) -> None:
        for system in self.systems:
            if system.name in self._started:
                with contextlib.suppress(Exception):
                    system.stop()
        if self._local_context is not None:
            from .client import shutdown

            shutdown()
            self._local_context.__exit__(None, None, None)
            self._local_context = self._local_workers = None

    def steps(self, scenario: str) -> int:
        """How many progress steps ``scenario`` takes."""
        rounds = self.sizes.rounds
        loaders = len(self.capable("loader"))
        return {
            "latency": rounds * len(self.capable("call")),
            "pipelined": rounds * len(self.capable("calls")),
            "small": rounds * loaders,
            "image": rounds * (loaders + len(self.capable("stream"))),
            "straggler": rounds * loaders * 2,
            "io": rounds * loaders * len(self.io_counts()),
            "memory": loaders,
        }[scenario]

    def io_counts(self) -> list[int]:
        counts = list(self.sizes.io_workers)
        if self.given_workers is not None:
            counts = [k for k in counts if k <= len(self.given_workers)]
        return counts

    def run(self, scenarios: Sequence[str]) -> list[Figure]:
        """Run ``scenarios`` in order; return every figure measured."""
        self.progress = Progress(sum(self.steps(name) for name in scenarios), self.show_progress)
        try:
            for name in scenarios:
                _SCENARIO_FUNCTIONS[name](self)
        finally:
            self.progress.close()
        return self.figures

    def step(self, label: str) -> None:
        if self.progress is not None:
            self.progress.step(label)

    def figure(self, scenario: str, metric: str, unit: str, better: str, note: str = "") -> Figure:
        figure = Figure(scenario, metric, unit, better, note=note)
        self.figures.append(figure)
        return figure

    # ------------------------------------------------------------------ helpers for scenarios

    def open_loaders(self, spec: LoaderSpec, label: str) -> dict[str, Any]:
        """A loader for ``spec`` from each system that loads, after one warm-up epoch each."""
        loaders = {}
        for system in self.capable("loader"):
            if not self._ensure_started(system):
                continue
            try:
                loader = system.loader(spec)
                for _ in loader:
                    pass
            except Exception as exc:
                self.notes.append(f"{system.name} could not run {label}: {type(exc).__name__}: {exc}")
                continue
            loaders[system.name] = (system, loader)
        return loaders

    def close_loaders(self, loaders: dict[str, Any]) -> None:
        for system, loader in loaders.values():
            with contextlib.suppress(Exception):
                system.release_loader(loader)


def _epoch_rate(loader: Iterable) -> tuple[int, float]:
    """Iterate one epoch; return (batches, seconds)."""
    started = time.perf_counter()
    count = 0
    for _ in loader:
        count += 1
    return count, time.perf_counter() - started


def _percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


# ---------------------------------------------------------------------------- scenarios


def scenario_latency(bench: Bench) -> None:
    """No-op calls to one worker, one at a time: p50 and p99 round trips."""
    p50 = bench.figure("latency", "p50", "us", "lower", "no-op call round trip to one worker")
    p99 = bench.figure("latency", "p99", "us", "lower", "no-op call round trip to one worker")
    systems = [s for s in bench.capable("call") if bench._ensure_started(s)]
    for system in systems:
        for _ in range(max(10, bench.sizes.latency_calls // 10)):
            system.call()  # connections opened, code paths warm
    for _ in range(bench.sizes.rounds):
        for system in systems:
            times = []
            for _ in range(bench.sizes.latency_calls):
                started = time.perf_counter()
                system.call()
                times.append(time.perf_counter() - started)
            p50.add(system.name, _percentile(times, 0.5) * 1e6)
            p99.add(system.name, _percentile(times, 0.99) * 1e6)
            bench.step(f"latency: {system.name}")


def scenario_pipelined(bench: Bench) -> None:
    """No-op calls to one worker with PIPELINE_WINDOW in flight: calls per second."""
    figure = bench.figure(
        "pipelined", "calls/s", "calls/s", "higher", f"no-op calls to one worker, {PIPELINE_WINDOW} in flight"
    )
    systems = [s for s in bench.capable("calls") if bench._ensure_started(s)]
    count = bench.sizes.pipelined_calls
    for system in systems:
        system.calls(min(count, 200), PIPELINE_WINDOW)
    for _ in range(bench.sizes.rounds):
        for system in systems:
            started = time.perf_counter()
            system.calls(count, PIPELINE_WINDOW)
            figure.add(system.name, count / (time.perf_counter() - started))
            bench.step(f"pipelined: {system.name}")


def _loader_scenario(bench: Bench, scenario: str, spec: LoaderSpec, figure: Figure, scale: float) -> None:
    loaders = bench.open_loaders(spec, scenario)
    try:
        for _ in range(bench.sizes.rounds):
            for name, (_, loader) in loaders.items():
                batches, seconds = _epoch_rate(loader)
                figure.add(name, batches * scale / seconds)
                bench.step(f"{scenario}: {name}")
    finally:
        bench.close_loaders(loaders)


def scenario_small(bench: Bench) -> None:
    """Batches of 32 x float32[128]: batches per second, all workers."""
    n = bench.worker_count
    figure = bench.figure(
        "small", "batches/s", "batches/s", "higher", f"{SMALL_BATCH} x float32[{SMALL_FEATURES}], {n} workers"
    )
    spec = LoaderSpec(SmallDataset, (bench.sizes.small_batches * SMALL_BATCH,), SMALL_BATCH, n)
    _loader_scenario(bench, "small", spec, figure, 1.0)


def scenario_image(bench: Bench) -> None:
    """Batches of 64 x uint8[3, 224, 224]: MB/s, all workers; the socket streams the same bytes."""
    n = bench.worker_count
    note = f"{IMAGE_BATCH} x uint8[3,224,224] ({IMAGE_BATCH_BYTES / 1e6:.1f} MB), {n} workers"
    figure = bench.figure("image", "MB/s", "MB/s", "higher", note)
    spec = LoaderSpec(ImageDataset, (bench.sizes.image_batches * IMAGE_BATCH,), IMAGE_BATCH, n)
    streams = [s for s in bench.capable("stream") if bench._ensure_started(s)]
    loaders = bench.open_loaders(spec, "image")
    megabytes = IMAGE_BATCH_BYTES / 1e6
    try:
        for system in streams:
            system.stream(IMAGE_BATCH_BYTES, 2)
        for _ in range(bench.sizes.rounds):
            for name, (_, loader) in loaders.items():
                batches, seconds = _epoch_rate(loader)
                figure.add(name, batches * megabytes / seconds)
                bench.step(f"image: {name}")
            for system in streams:
                started = time.perf_counter()
                system.stream(IMAGE_BATCH_BYTES, bench.sizes.image_batches)
                figure.add(system.name, bench.sizes.image_batches * megabytes / (time.perf_counter() - started))
                bench.step(f"image: {system.name}")
    finally:
        bench.close_loaders(loaders)


def scenario_straggler(bench: Bench) -> None:
    """One worker 10x slower than the others, against the same run with the fast workers only."""
    n = bench.worker_count
    if n < 2:
        bench.notes.append("straggler needs at least 2 workers: skipped")
        return
    args = (bench.sizes.straggler_batches * STRAGGLER_BATCH, STRAGGLER_DELAY)
    note = f"{n} workers, the last {SLOWDOWN:g}x slower; {STRAGGLER_DELAY * 1e3:g} ms/item, batch {STRAGGLER_BATCH}"
    mixed = bench.figure("straggler", "batches/s with straggler", "batches/s", "higher", note)
    fast = bench.figure("straggler", "batches/s fast only", "batches/s", "higher", f"the {n - 1} fast workers only")
    kept = bench.figure("straggler", "kept", "x", "higher", "with straggler / fast only (1.0: no loss)")
    with_slow = bench.open_loaders(LoaderSpec(SleepDataset, args, STRAGGLER_BATCH, n, slow_worker=n - 1), "straggler")
    fast_only = bench.open_loaders(LoaderSpec(SleepDataset, args, STRAGGLER_BATCH, n - 1), "straggler")
    try:
        for _ in range(bench.sizes.rounds):
            for name in with_slow.keys() & fast_only.keys():
                batches, seconds = _epoch_rate(with_slow[name][1])
                slow_rate = batches / seconds
                bench.step(f"straggler: {name}")
                batches, seconds = _epoch_rate(fast_only[name][1])
                fast_rate = batches / seconds
                bench.step(f"straggler: {name}")
                mixed.add(name, slow_rate)
                fast.add(name, fast_rate)
                kept.add(name, slow_rate / fast_rate)
    finally:
        bench.close_loaders(with_slow)
        bench.close_loaders(fast_only)


def scenario_io(bench: Bench) -> None:
    """A dataset sleeping 5 ms per item: batches per second with 1, 2, 4 and 8 workers, and the speedup."""
    counts = bench.io_counts()
    if not counts:
        bench.notes.append("io: no worker count fits the workers given: skipped")
        return
    rates = {k: bench.figure("io", f"batches/s x{k}", "batches/s", "higher", f"{k} workers") for k in counts}
    length = bench.sizes.io_batches_per_worker * max(counts) * IO_BATCH
    for k in counts:
        loaders = bench.open_loaders(LoaderSpec(SleepDataset, (length, IO_DELAY), IO_BATCH, k), f"io x{k}")
        try:
            for _ in range(bench.sizes.rounds):
                for name, (_, loader) in loaders.items():
                    batches, seconds = _epoch_rate(loader)
                    rates[k].add(name, batches / seconds)
                    bench.step(f"io x{k}: {name}")
        finally:
            bench.close_loaders(loaders)
    base = counts[0]
    for k in counts[1:]:
        speedup = bench.figure("io", f"speedup x{k}", "x", "higher", f"{k} workers / {base} worker")
        for name, values in rates[k].samples.items():
            one = rates[base].median(name)
            if one:
                speedup.add(name, statistics.median(values) / one)


class _RssSampler:
    """Samples this process's resident memory from a thread; keeps the peak since the last reset."""

    def __init__(self, period: float = 0.002):
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._run, name="rpcdl-bench-rss", daemon=True)

    def rss(self) -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, self.rss())

    def reset(self) -> int:
        self.peak = current = self.rss()
        return current

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _touch(batch: Any) -> None:
    """Read one byte per page of a batch, as a training step would read it all (maps shared memory in)."""
    tensor = batch[0] if isinstance(batch, (list, tuple)) else batch
    flat = tensor.reshape(-1)
    flat[:: 4096 // flat.element_size()].sum()


def scenario_memory(bench: Bench) -> None:
    """The client's peak RSS in each of 10 epochs of image batches, above its RSS before the first.

    The bound: the prefetch window (``PREFETCH`` batches per worker, in flight
    or ready), the batch the training loop holds, and one batch's worth for
    everything else the process allocates.
    """
    if not os.path.exists("/proc/self/statm"):
        bench.notes.append("memory: needs /proc (Linux): skipped")
        return
    n = bench.worker_count
    window = PREFETCH * n
    epochs = [
        bench.figure("memory", f"epoch {e} peak", "MB", "lower", "peak RSS above the start")
        for e in range(1, MEMORY_EPOCHS + 1)
    ]
    note = f"max over epochs 2-10 of the peak / {IMAGE_BATCH_BYTES / 1e6:.1f} MB"
    peak_batches = bench.figure("memory", "peak (batches)", "batches", "lower", note)
    bound_note = f"bound: window ({PREFETCH} x {n} workers) + the loop's batch + 1 for the rest = {window + 2} batches"
    bounded = bench.figure("memory", "peak / bound", "x", "lower", bound_note)
    growth = bench.figure(
        "memory", "growth (batches)", "batches", "lower", "max peak of epochs 6-10 - max peak of epochs 2-5"
    )
    spec = LoaderSpec(ImageDataset, (bench.sizes.memory_batches * IMAGE_BATCH,), IMAGE_BATCH, n)
    for system in bench.capable("loader"):
        if not bench._ensure_started(system):
            continue
        loader = None
        try:
            loader = system.loader(spec)
            gc.collect()
            with _RssSampler() as sampler:
                start = sampler.rss()
                peaks = []
                for _ in range(MEMORY_EPOCHS):
                    sampler.reset()
                    for batch in loader:
                        _touch(batch)
                        del batch
                    peaks.append(max(sampler.peak, sampler.rss()) - start)
        except Exception as exc:
            bench.notes.append(f"{system.name} could not run memory: {type(exc).__name__}: {exc}")
            continue
        finally:
            if loader is not None:
                with contextlib.suppress(Exception):
                    system.release_loader(loader)
        for figure, peak in zip(epochs, peaks, strict=True):
            figure.add(system.name, peak / 1e6)
        peak_batches.add(system.name, max(peaks[1:]) / IMAGE_BATCH_BYTES)
        bounded.add(system.name, max(peaks[1:]) / IMAGE_BATCH_BYTES / (window + 2))
        growth.add(system.name, (max(peaks[5:]) - max(peaks[1:5])) / IMAGE_BATCH_BYTES)
        bench.step(f"memory: {system.name}")


_SCENARIO_FUNCTIONS: dict[str, Callable[[Bench], None]] = {
    "latency": scenario_latency,
    "pipelined": scenario_pipelined,
    "small": scenario_small,
    "image": scenario_image,
    "straggler": scenario_straggler,
    "io": scenario_io,
    "memory": scenario_memory,
}


# ---------------------------------------------------------------------------- report


def machine_info() -> dict[str, Any]:
    """The machine and its load, for the report."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    with contextlib.suppress(OSError):
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as handle:
        models = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
        if models:
            info["processor"] = models[0]
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as handle:
        info["memory_gb"] = round(int(handle.readline().split()[1]) / 1e6, 1)
    return info


def _format_value(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def format_table(figures: Sequence[Figure], systems: Sequence[str]) -> str:
    """A text table: one row per figure, each system's median, and rpcdl's ratio to each other system."""
    others = [name for name in systems if name != RPCDL]
    headers = ["scenario", "metric", "unit", *systems, *(f"{RPCDL}/{name}" for name in others)]
    rows = []
    for figure in figures:
        if not figure.samples:
            continue
        cells = [figure.scenario, figure.metric, f"{figure.unit} ({figure.better})"]
        cells += [_format_value(figure.median(name)) for name in systems]
        cells += [_format_ratio(figure.ratio(name)) for name in others]
        rows.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def _format_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def evaluate_targets(figures: Sequence[Figure]) -> list[dict[str, Any]]:
    """Where each of :data:`TARGETS` stands in ``figures``."""
    results = []
    for target in TARGETS:
        value = target.value(figures)
        results.append(
            {
                "target": target.label,
                "goal": f"{target.op} {target.threshold:g}",
                "value": value,
                "met": target.met(value),
            }
        )
    return results


def format_targets(results: Sequence[dict[str, Any]]) -> str:
    lines = []
    for result in results:
        status = {True: "met", False: "MISSED", None: "not measured"}[result["met"]]
        value = "-" if result["value"] is None else f"{result['value']:.2f}"
        lines.append(f"  {status:<12} {result['target']}: {value} (goal {result['goal']})")
    return "\n".join(lines)


def plot(figures: Sequence[Figure], systems: Sequence[str], path: str) -> None:
    """Draw each figure's medians (bars, with min-max whiskers) per system into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [f for f in figures if f.samples and not f.metric.startswith("epoch ")]
    columns = 4
    rows = max(1, -(-len(shown) // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, figure in zip(axes.flat, shown, strict=False):
        names = [name for name in systems if name in figure.samples]
        medians = [figure.median(name) for name in names]
        low = [m - min(figure.samples[n]) for m, n in zip(medians, names, strict=True)]
        high = [max(figure.samples[n]) - m for m, n in zip(medians, names, strict=True)]
        axis.bar(range(len(names)), medians, yerr=[low, high], capsize=3,
                 color=[colors[systems.index(n) % len(colors)] for n in names])  # fmt: skip
        axis.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=7)
        axis.set_title(f"{figure.scenario}: {figure.metric}", fontsize=9)
        axis.set_ylabel(f"{figure.unit} ({figure.better} is better)", fontsize=7)
    for axis in list(axes.flat)[len(shown) :]:
        axis.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``rpcdl bench``."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--workers", nargs="+", type=worker_address, metavar="HOST:PORT",
        help="benchmark these running workers (rpcdl worker); the local baselines use as many processes",
    )  # fmt: skip
    where.add_argument(
        "--local", type=positive_int, metavar="N",
        help="start N local worker processes (default: 2; the io scenario starts up to 8)",
    )  # fmt: skip
    parser.add_argument(
        "--scenario", nargs="+", choices=SCENARIOS, default=list(SCENARIOS), metavar="NAME",
        help=f"scenarios to run, in order (default: all): {', '.join(SCENARIOS)}",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=positive_int, metavar="R",
        help="interleaved rounds per scenario; figures are medians over them (default: 5, 1 with --quick)",
    )  # fmt: skip
    parser.add_argument(
        "--io-workers", type=positive_int, nargs="+", metavar="K",
        help="worker counts of the io scenario (default: 1 2 4 8; 1 2 with --quick)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that everything runs, in seconds")
    parser.add_argument("--json", metavar="FILE", help="write the figures, the machine and the targets to FILE")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the figures into FILE.png (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace, extra_systems: Sequence[System] = ()) -> int:
    """Run ``rpcdl bench`` with parsed arguments; return the exit code."""
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.rounds:
        sizes.rounds = args.rounds
    if args.io_workers:
        sizes.io_workers = tuple(sorted(set(args.io_workers)))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("rpcdl bench: --plot needs matplotlib: pip install 'rpcdl[bench]'", file=sys.stderr)
            return 2
    local = args.local or 2
    problem = silent_worker(args.workers, timeout=10.0) if args.workers else None
    if problem:
        print(f"rpcdl bench: {problem}", file=sys.stderr)
        return 2
    systems: list[System] = [RpcdlSystem(), TorchLoaderSystem(), SocketSystem(), *extra_systems]
    names = [system.name for system in systems]
    machine = machine_info()
    bench = Bench(systems, workers=args.workers, local=local, sizes=sizes, progress=not args.no_progress)
    started = time.time()
    try:
        figures = bench.run(args.scenario)
    finally:
        bench.close()
    machine["load_average_after"] = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    targets = evaluate_targets(figures)
    workers = f"{len(args.workers)} given" if args.workers else f"{local} local"
    print(f"rpcdl bench: {workers} workers, {sizes.rounds} rounds, medians; ratios are rpcdl's median / the other's")
    print(
        f"machine: {machine['cpus']} CPUs, {machine['processor']}, {machine['platform']}; "
        f"load average {machine.get('load_average')} before, {machine.get('load_average_after')} after"
    )
    print()
    print(format_table(figures, names))
    print()
    print("targets:")
    print(format_targets(targets))
    for note in bench.notes:
        print(f"note: {note}")
    if args.json:
        document = {
            "command": getattr(args, "command_line", None) or " ".join(["rpcdl", *sys.argv[1:]]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "seconds": round(time.time() - started, 1),
            "machine": machine,
            "workers": args.workers or {"local": local},
            "rounds": sizes.rounds,
            "systems": names,
            "figures": [figure.as_dict() for figure in figures],
            "targets": targets,
            "notes": bench.notes,
        }
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=2)
    if args.plot:
        plot(figures, names, args.plot)
    return 0


def main(argv: Sequence[str] | None = None, extra_systems: Sequence[System] = ()) -> int:
    """``rpcdl bench`` as a function, with more systems to compare (benchmarks/compare.py)."""
    parser = argparse.ArgumentParser(prog="rpcdl bench", description=DESCRIPTION)
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.command_line = " ".join([os.path.basename(sys.argv[0]), *argv])
    return run(args, extra_systems)
