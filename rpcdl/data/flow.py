"""How fast a trainer takes batches and how fast its workers make them: data wait and the workers needed.

A :class:`DataFlow` counts, for one loader, what its epochs saw: the batches
yielded, the seconds the consuming thread spent blocked in ``next()`` (data
wait) and between two ``next()`` calls (its own work: the training step), and
the seconds the workers spent making the batches they delivered, with their
bytes. A loader's flow adds each count to the process's too
(:data:`PROCESS_FLOW`), which the Prometheus collector of
:mod:`rpcdl.metrics` reads when scraped: nothing here calls prometheus-client.

From two snapshots, a :class:`FlowFigures` tells the fraction of the time the
trainer waited, its batches per second, and how many workers of the measured
speed keep it fed: the worker-seconds its batches cost, over the seconds it
spent working on them (its pace if data were free).

The process also keeps the durations of its loaders' calls
(:data:`CALL_SECONDS`, bucket counts) and weak references to their worker
pools (:data:`LIVE_POOLS`), whose states the collector reads when scraped.

Threading: a flow's counters are guarded by its lock, for every read and
write; the threads advancing a loader's epochs write them, any thread reads a
snapshot. A flow takes its parent's lock after letting go of its own, never
both at once. :data:`PROCESS_FLOW` has no parent. :class:`CallSeconds` and
:class:`LivePools` each guard their fields with their own lock; no other lock
is taken while holding it (a pool's lock is taken after letting go).
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import weakref
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CALL_SECONDS",
    "LIVE_POOLS",
    "PROCESS_FLOW",
    "CallSeconds",
    "DataFlow",
    "FlowFigures",
    "FlowSnapshot",
    "LivePools",
]


@dataclasses.dataclass(frozen=True)
class FlowSnapshot:
    """A :class:`DataFlow`'s counters at one moment (all cumulative).

    Attributes:
        batches: batches yielded to the consumer.
        wait_seconds: seconds the consumer spent blocked in ``next()``.
        work_seconds: seconds the consumer spent between two ``next()`` calls of an epoch.
        worker_seconds: seconds the workers spent making the batches they delivered.
        worker_batches: batches the workers delivered.
        bytes_received: bytes of the answers that carried them.
    """

    batches: int = 0
    wait_seconds: float = 0.0
    work_seconds: float = 0.0
    worker_seconds: float = 0.0
    worker_batches: int = 0
    bytes_received: int = 0

    def since(self, earlier: FlowSnapshot) -> FlowFigures:
        """The figures of the interval from ``earlier`` to this snapshot.

        Example::

            >>> start = FlowSnapshot()
            >>> end = FlowSnapshot(batches=10, wait_seconds=1.0, work_seconds=1.0,
            ...                    worker_seconds=4.0, worker_batches=10)
            >>> figures = end.since(start)
            >>> figures.data_wait_fraction, figures.batches_per_second, figures.workers_needed
            (0.5, 5.0, 4.0)
        """
        return FlowFigures(
            batches=self.batches - earlier.batches,
            wait_seconds=self.wait_seconds - earlier.wait_seconds,
            work_seconds=self.work_seconds - earlier.work_seconds,
            worker_seconds=self.worker_seconds - earlier.worker_seconds,
            worker_batches=self.worker_batches - earlier.worker_batches,
        )


@dataclasses.dataclass(frozen=True)
class FlowFigures:
    """What a trainer's data flow was over an interval (see :meth:`FlowSnapshot.since`)."""

    batches: int
    wait_seconds: float
    work_seconds: float
    worker_seconds: float
    worker_batches: int

    @property
    def data_wait_fraction(self) -> float:
        """The fraction of the time the consumer spent waiting for batches (0 when nothing was timed)."""
        total = self.wait_seconds + self.work_seconds
        return self.wait_seconds / total if total > 0 else 0.0

    @property
    def batches_per_second(self) -> float:
        """Batches yielded per second, waits included (0 when nothing was timed)."""
        total = self.wait_seconds + self.work_seconds
        return self.batches / total if total > 0 else 0.0

    @property
    def workers_needed(self) -> float:
        """How many workers of the measured speed keep the consumer fed; ``nan`` before anything is measured.

        The consumer takes a batch every ``work_seconds / batches`` when it
        does not wait; one worker makes one every ``worker_seconds /
        worker_batches``. Their ratio is the number of workers (each running
        calls as it does now) that make batches as fast as they are taken.
        """
        if self.worker_batches <= 0 or self.batches <= 0:
            return float("nan")
        seconds_per_batch = self.worker_seconds / self.worker_batches
        if self.work_seconds <= 0:  # a consumer that does nothing else: no count of workers keeps up
            return float("inf") if seconds_per_batch > 0 else 0.0
        return seconds_per_batch * self.batches / self.work_seconds


class DataFlow:
    """The counters of a loader's data flow (see the module); each count goes to ``parent`` too.

    Args:
        parent: a flow that adds up several, such as :data:`PROCESS_FLOW`; ``None`` for none.

    Example::

        >>> flow = DataFlow()
        >>> flow.yielded(wait_seconds=0.25, work_seconds=0.75)
        >>> flow.served(batches=1, seconds=0.5, nbytes=1000)
        >>> flow.snapshot().since(FlowSnapshot()).workers_needed
        0.6666666666666666
    """

    def __init__(self, parent: DataFlow | None = None):
        self._parent = parent
        self._lock = threading.Lock()
        self._batches = 0
        self._wait_seconds = 0.0
        self._work_seconds = 0.0
        self._worker_seconds = 0.0
        self._worker_batches = 0
        self._bytes_received = 0

    def yielded(self, wait_seconds: float, work_seconds: float, batches: int = 1) -> None:
        """The consumer's ``next()`` returned ``batches`` after waiting ``wait_seconds`` in it, having worked
        ``work_seconds`` since its previous ``next()`` returned (0 for an epoch's first)."""
        flow: DataFlow | None = self
        while flow is not None:  # this flow, then its parents, one lock at a time
            with flow._lock:
                flow._batches += batches
                flow._wait_seconds += wait_seconds
                flow._work_seconds += work_seconds
            flow = flow._parent

    def served(self, batches: int, seconds: float, nbytes: int) -> None:
        """A worker delivered ``batches`` batches it spent ``seconds`` making, in an answer of ``nbytes``."""
        with self._lock:
            self._worker_batches += batches
            self._worker_seconds += seconds
            self._bytes_received += nbytes
        if self._parent is not None:
            self._parent.served(batches, seconds, nbytes)

    def snapshot(self) -> FlowSnapshot:
        """The counters now."""
        with self._lock:
            return FlowSnapshot(
                batches=self._batches,
                wait_seconds=self._wait_seconds,
                work_seconds=self._work_seconds,
                worker_seconds=self._worker_seconds,
                worker_batches=self._worker_batches,
                bytes_received=self._bytes_received,
            )


PROCESS_FLOW = DataFlow()
"""The data flow of every loader of this process, added up (what the trainer's metrics report)."""


class CallSeconds:
    """A histogram of call durations in plain counts: the upper bound of each bucket, the count below it.

    Args:
        bounds: the buckets' upper bounds, in seconds, increasing (the last, infinity, is implied).

    Example::

        >>> times = CallSeconds([0.01, 0.1])
        >>> times.observe(0.05)
        >>> times.snapshot()
        ([(0.01, 0), (0.1, 1), (inf, 1)], 0.05)
    """

    def __init__(self, bounds: Sequence[float]):
        self._bounds = [float(bound) for bound in bounds]
        self._lock = threading.Lock()
        self._counts = [0] * (len(self._bounds) + 1)  # per bucket, not cumulative
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        """Count a call that took ``seconds``."""
        bucket = bisect.bisect_left(self._bounds, seconds)
        with self._lock:
            self._counts[bucket] += 1
            self._sum += seconds

    def snapshot(self) -> tuple[list[tuple[float, int]], float]:
        """Each bucket's upper bound with the calls at or under it (cumulative, as Prometheus has them), and
        the sum of the durations."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip([*self._bounds, float("inf")], counts, strict=True):
            running += count
            cumulative.append((bound, running))
        return cumulative, total


CALL_SECONDS = CallSeconds([0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60])
"""How long the calls of this process's loaders took, from sent to answered."""


class LivePools:
    """Weak references to the worker pools of this process's loaders, to read their states when asked.

    The references have no callback: a pool garbage-collected is dropped from
    the list by the next reader, on its own thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: list[weakref.ref] = []

    def add(self, pool: Any) -> None:
        """Watch ``pool`` (a :class:`~rpcdl.data.worker_pool.WorkerPool`) while it lives."""
        with self._lock:
            self._pools = [ref for ref in self._pools if ref() is not None]
            self._pools.append(weakref.ref(pool))

    def windows(self) -> list[dict[str, dict[str, Any]]]:
        """For each pool alive, its :meth:`~rpcdl.data.worker_pool.WorkerPool.windows`."""
        with self._lock:
            self._pools = [ref for ref in self._pools if ref() is not None]
            refs = list(self._pools)
        pools = [pool for pool in (ref() for ref in refs) if pool is not None]
        return [pool.windows() for pool in pools]  # each takes its pool's lock, after this one is let go


LIVE_POOLS = LivePools()
"""The worker pools of this process's loaders."""
