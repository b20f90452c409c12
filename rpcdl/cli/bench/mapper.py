"""The ``mapper`` scenario: items per second of a trivial function mapped over the workers, in order.

rpcdl's :class:`~rpcdl.integrations.torchdata.RPCMapper` against torchdata's
``ParallelMapper(method="process", num_workers=N)`` with as many local
processes, in the same run. Each system maps one endless source (so no
epoch restarts a process pool); a round times ``mapper_items`` more items.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from .report import Figure
from .systems import System


class MapperBench(Protocol):
    """What the scenario needs of :class:`rpcdl.cli.bench.scenarios.Bench`."""

    sizes: Any
    notes: list[str]
    worker_count: int

    def capable(self, capability: str) -> list[System]: ...

    def figure(self, scenario: str, metric: str, unit: str, better: str, note: str = "") -> Figure: ...

    def step(self, label: str) -> None: ...

    def _ensure_started(self, system: System) -> bool: ...


def _take(iterator: Any, count: int) -> float:
    """Seconds to take ``count`` items from ``iterator``."""
    started = time.perf_counter()
    for _ in range(count):
        next(iterator)
    return time.perf_counter() - started


def scenario_mapper(bench: MapperBench) -> None:
    """A trivial function mapped over the workers: items per second."""
    n = bench.worker_count
    figure = bench.figure("mapper", "items/s", "items/s", "higher", f"x + 1 mapped in order, {n} workers")
    count = bench.sizes.mapper_items
    mappers: dict[str, tuple[System, Any]] = {}
    try:
        for system in bench.capable("mapper"):
            if not bench._ensure_started(system):
                continue
            try:
                mapper = system.mapper(n)
                _take(mapper, max(count // 2, 50))  # processes and connections up, chunk sizes grown
            except Exception as exc:
                bench.notes.append(f"{system.name} could not run mapper: {type(exc).__name__}: {exc}")
                continue
            mappers[system.name] = (system, mapper)
        for _ in range(bench.sizes.rounds):
            for name, (_, mapper) in mappers.items():
                figure.add(name, count / _take(mapper, count))
                bench.step(f"mapper: {name}")
    finally:
        for system, mapper in mappers.values():
            system.release_mapper(mapper)
