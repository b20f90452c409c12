"""The bench: scenarios measured round after round on every system."""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .mapper import scenario_mapper
from .report import Figure, percentile
from .rss import RssSampler, touch_pages
from .systems import LoaderSpec, System
from .workloads import (
    IMAGE_BATCH,
    IMAGE_BATCH_BYTES,
    IO_BATCH,
    IO_DELAY,
    MEMORY_EPOCHS,
    PIPELINE_WINDOW,
    PREFETCH,
    SLOWDOWN,
    SMALL_BATCH,
    SMALL_FEATURES,
    STRAGGLER_BATCH,
    STRAGGLER_DELAY,
    WARMUP_EPOCHS,
    ImageDataset,
    SleepDataset,
    SmallDataset,
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
    mapper_items: int = 20000
    io_workers: tuple[int, ...] = (1, 2, 4, 8)
    #: the small scenario's rounds repeat whole epochs for this long at least: one epoch is 60-300 ms, short
    #: enough for the machine's moment-to-moment speed to decide a round
    small_round_seconds: float = 0.5

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            rounds=1,
            latency_calls=20,
            pipelined_calls=40,
            small_batches=6,
            image_batches=2,
            straggler_batches=4,
            io_batches_per_worker=2,
            memory_batches=2,
            io_workers=(1, 2),
            mapper_items=200,
            small_round_seconds=0.0,
        )


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
            from ...local import local_workers

            self._local_context = local_workers(count)
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
            from ...rpc.client import shutdown

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
            "mapper": rounds * len(self.capable("mapper")),
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
        """A loader for ``spec`` from each system that loads, after warm-up epochs.

        Two each: over the first epochs a process still touches the pages of its
        heap for batch-sized allocations for the first time (image batches: the
        workers' page faults stop in the third epoch of 24 batches).
        """
        loaders = {}
        for system in self.capable("loader"):
            if not self._ensure_started(system):
                continue
            try:
                loader = system.loader(spec)
                for _ in range(WARMUP_EPOCHS):
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


def _epoch_rate(loader: Iterable, at_least: float = 0.0) -> tuple[int, float]:
    """Iterate one epoch, and more whole epochs until ``at_least`` seconds have passed; return (batches, seconds)."""
    started = time.perf_counter()
    count = 0
    while True:
        for _ in loader:
            count += 1
        seconds = time.perf_counter() - started
        if seconds >= at_least:
            return count, seconds


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
            p50.add(system.name, percentile(times, 0.5) * 1e6)
            p99.add(system.name, percentile(times, 0.99) * 1e6)
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


def _loader_scenario(
    bench: Bench, scenario: str, spec: LoaderSpec, figure: Figure, scale: float, at_least: float
) -> None:
    loaders = bench.open_loaders(spec, scenario)
    try:
        for _ in range(bench.sizes.rounds):
            for name, (_, loader) in loaders.items():
                batches, seconds = _epoch_rate(loader, at_least)
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
    _loader_scenario(bench, "small", spec, figure, 1.0, bench.sizes.small_round_seconds)


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
            with RssSampler() as sampler:
                start = sampler.rss()
                peaks = []
                for _ in range(MEMORY_EPOCHS):
                    sampler.reset()
                    for batch in loader:
                        touch_pages(batch)
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
    "mapper": scenario_mapper,
}
