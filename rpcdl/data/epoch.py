"""One epoch of an :class:`~rpcdl.RPCDataloader`: its batches, in order, with its position kept.

An epoch is a :class:`~rpcdl.data.chunked_pass.ChunkedPass` over the
sampler's batches: each call fetches a chunk of consecutive batches on a
worker, as many as take about 4 ms there and answer at most
:data:`TARGET_CHUNK_BYTES`, up to the loader's ``max_batches_per_call``. Small
batches then cost one call per chunk instead of one per batch; a batch of a
few hundred KB or more, or a slow one, still has its own call. Each batch
keeps its own seed and its own error, and the position counts batches
yielded, so a resumed epoch starts at the first batch not yielded, wherever
its chunk began.

An :class:`EpochIterator` starts its epoch at its first ``next()``: it asks its
:class:`EpochOpener` (the loader) for an :class:`EpochPlan`, everything the
epoch needs, fixed then. Nothing it builds refers back to it or to its loader
(the calls are made by an :class:`EpochCall`, which holds only what a call
needs), so an epoch dropped mid-way (a ``break``) is freed by reference
counting at once, and its pool lets go of its calls at its next step.

Threading: an epoch is advanced by one thread at a time; another thread
entering ``next()`` meanwhile gets a ``RuntimeError``
(:class:`~rpcdl.data.guard.EntryGuard`). Its stage (not started, running,
finished) belongs to that thread. :meth:`EpochIterator.close` may come from any
thread: it sets an event the advancing thread reads at its next step, and
closes the running epoch's pass, which the advancing thread publishes under
the iterator's lock as it starts. Its position belongs to its loader's
:class:`~rpcdl.data.epoch_book.EpochBook`. The time its ``next()`` last
returned is the advancing thread's; what it measures goes to the loader's
:class:`~rpcdl.data.flow.DataFlow`, under the flow's lock.

Each ``next()`` is timed: the seconds spent in it are data wait, those since
the previous one returned are the consumer's work (see
:mod:`rpcdl.data.flow`). An epoch that runs to its end, long enough to mean
something (:data:`WAIT_WARNING_MIN_SECONDS`, :data:`WAIT_WARNING_MIN_BATCHES`),
and waited more than :data:`WAIT_WARNING_FRACTION` of its time says so in one
warning on :data:`WAIT_LOGGER`, with the workers that would keep it fed (none
estimated from a loop that does no work) and those that served it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import threading
from collections.abc import Callable, Iterator
from time import perf_counter
from typing import Any, Protocol

import torch

from ..errors import is_transient
from ..rpc.client import rpc_async
from ..rpc.rref import RRefNotFound, remote_id
from ..seeding import derive_seed, set_random_seeds
from .chunked_pass import ChunkedPass, ChunkedPassState, ChunkSizer, ServedCounts
from .dataset import RPCDataset
from .epoch_book import EpochBook, Position
from .flow import DataFlow, FlowFigures, FlowSnapshot
from .guard import EntryGuard
from .records import Task
from .scheduler import NoWorkersLeft
from .worker_pool import WorkerPool

__all__ = [
    "NO_WORK_STEP_SECONDS",
    "TARGET_CHUNK_BYTES",
    "WAIT_LOGGER",
    "WAIT_WARNING_FRACTION",
    "WAIT_WARNING_MIN_BATCHES",
    "WAIT_WARNING_MIN_SECONDS",
    "EpochCall",
    "EpochIterator",
    "EpochOpener",
    "EpochPlan",
]

#: The logger of the epochs' data-wait warnings (a child of ``rpcdl.dataloader``): raise its level to silence them.
WAIT_LOGGER = logging.getLogger("rpcdl.dataloader.wait")

#: The size of the answer a chunk of batches aims at, in bytes. Enough batches to make a call's overhead
#: small, few enough that the batches in flight stay a few MB and that a chunk crosses a slow link quickly.
TARGET_CHUNK_BYTES = 512 * 1024

#: An epoch whose consumer waited for data more than this fraction of its time logs a warning as it ends.
WAIT_WARNING_FRACTION = 0.05

#: Seconds of wait and work an epoch needs before it logs a data-wait warning; in a shorter one, its first
#: batches, always waited for, would make most of the wait.
WAIT_WARNING_MIN_SECONDS = 10.0

#: Batches an epoch needs before it logs a data-wait warning, for the same reason.
WAIT_WARNING_MIN_BATCHES = 100

#: Seconds between two ``next()`` calls under which a training loop is taken to do no work; no count of
#: workers is extrapolated from such a loop.
NO_WORK_STEP_SECONDS = 0.0005


class EpochCall:
    """Sends a chunk of an epoch's batches to a worker (a pass's :data:`~rpcdl.data.scheduler.Call`).

    It holds what a call needs and nothing else: no reference to the epoch's
    iterator or loader, so none of them lives in a cycle.

    Args:
        dataset: the remote dataset.
        seed: the loader's seed (``None``: batches are not seeded).
        epoch: the epoch.
        fetch: the worker function (``rpcdl.data.fetch.fetch_batches_at`` or ``fetch_samples_at``).
        collate_fn: sent with each call; ``None`` is torch's default.
        pin_memory: receive the batches into pinned memory.
        timeout: seconds a call may take (0: no limit).
    """

    __slots__ = ("collate_fn", "dataset", "epoch", "fetch", "pin_memory", "seed", "timeout")

    def __init__(
        self,
        dataset: RPCDataset,
        seed: int | None,
        epoch: int,
        fetch: Callable[..., Any],
        collate_fn: Callable | None,
        pin_memory: bool,
        timeout: float,
    ):
        self.dataset, self.seed, self.epoch, self.fetch = dataset, seed, epoch, fetch
        self.collate_fn, self.pin_memory, self.timeout = collate_fn, pin_memory, timeout

    def __call__(self, task: Task, address: str) -> torch.futures.Future:
        rref = self.dataset.rref(address)
        if rref is None:
            raise RRefNotFound(f"the dataset is not built on worker {address}")
        if self.seed is None:
            args: tuple = (remote_id(rref), [(indices, None) for _, indices in task.payload], self.collate_fn)
        else:  # each batch's seed is derived on the worker, from its number: not on the thread iterating
            chunk = [(indices, seq) for seq, indices in task.payload]
            args = (remote_id(rref), chunk, self.collate_fn, (self.seed, self.epoch))
        return rpc_async(address, self.fetch, args, pin_memory=self.pin_memory, timeout=self.timeout)


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    """Everything an epoch needs, fixed as it begins (built by its loader).

    Attributes:
        position: where it starts (a resumed epoch skips the batches yielded),
            kept up to date in ``book``.
        batches: the sampler's (or batch sampler's) iterator, started: each item is a batch's indices.
        call: sends a chunk of batches to a worker.
        pool, sizer, served: the loader's workers, chunk sizer and counts.
        in_order: yield batches in sampler order.
        book: the loader's epochs.
        reseed_timeout: seconds each worker has to be reseeded at the start
            (when ``call.seed`` is set).
        flow: the loader's data flow, told how long each ``next()`` waited.
    """

    position: Position
    batches: Iterator[Any]
    call: EpochCall
    pool: WorkerPool
    sizer: ChunkSizer
    served: ServedCounts
    in_order: bool
    book: EpochBook
    reseed_timeout: float
    flow: DataFlow


class EpochOpener(Protocol):
    """Begins an epoch when its iterator is first advanced (its loader's side of the iterator)."""

    def open(self) -> EpochPlan:
        """Choose the epoch, tell the samplers, and return the plan."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class _NotStarted:
    opener: EpochOpener


@dataclasses.dataclass(frozen=True, slots=True)
class _Running:
    plan: EpochPlan
    batches: ChunkedPass
    flow_at_start: FlowSnapshot
    served_at_start: dict[str, int]  #: the loader's counts of batches per worker as the epoch began


@dataclasses.dataclass(frozen=True, slots=True)
class _Finished:
    pass


_FINISHED = _Finished()


class EpochIterator(Iterator[Any]):
    """One epoch, started by the first ``next()`` (see the module).

    Args:
        opener: begins the epoch.
    """

    def __init__(self, opener: EpochOpener):
        self._entry = EntryGuard("this epoch")
        self._stage: _NotStarted | _Running | _Finished = _NotStarted(opener)  # the advancing thread's
        self._closing = threading.Event()  # set by close(), from any thread
        self._lock = threading.Lock()  # guards _closable: the epoch running, published for close()
        self._closable: _Running | _Finished = _FINISHED
        self._returned_at = 0.0  # when next() last returned, while running (the advancing thread's)

    def __next__(self) -> Any:
        if not self._entry.try_enter():
            raise self._entry.busy()
        entered = perf_counter()
        try:
            stage = self._stage
            if type(stage) is not _Running:
                if type(stage) is _Finished or self._closing.is_set():
                    self._stage = _FINISHED
                    raise StopIteration
                stage = self._start(stage.opener)
                worked = 0.0  # the time before an epoch's first batch is not the consumer's work on it
            else:
                worked = entered - self._returned_at
            try:
                item = next(stage.batches)
            except (StopIteration, NoWorkersLeft) as exc:
                self._count(stage, entered, worked, batches=0)
                self._end(stage, complete=isinstance(exc, StopIteration))
                raise
            except Exception:
                self._count(stage, entered, worked, batches=0)
                if stage.batches.state is ChunkedPassState.SOURCE_FAILED:  # the sampler raised, after its batches
                    self._end(stage)
                raise
            self._returned_at = now = perf_counter()  # _count, inline: this is every batch's path
            plan = stage.plan
            plan.flow.yielded(now - entered, worked)
            seq, indices = item.payload
            plan.book.yielded(plan.position, seq)
            if item.error is not None:
                raise self._annotate(item.error, plan.position.epoch, seq, indices, item.worker)
            return item.value
        finally:
            self._entry.leave()

    def close(self) -> None:
        """Stop the epoch; answers still in flight are dropped when they arrive.

        Any thread may close it: its calls are let go at once, and the thread
        advancing it, if another, stops at its next step.
        """
        self._closing.set()
        with self._lock:
            running, self._closable = self._closable, _FINISHED
        if type(running) is _Running:
            running.batches.close()
            running.plan.book.finished(running.plan.position)
        if self._entry.try_enter():  # no thread advances it: let its batches go now
            try:
                self._stage = _FINISHED
            finally:
                self._entry.leave()

    def _start(self, opener: EpochOpener) -> _Running:
        try:
            plan = opener.open()
        except BaseException:
            self._stage = _FINISHED
            raise
        try:
            position = plan.position
            skip = position.start_extra
            # A resumed epoch's sampler starts at its origin: its first batch has the origin's number.
            first = position.origin.first_batch
            numbered = enumerate(plan.batches, first)
            if position.start_prefix != first:
                numbered = itertools.islice(numbered, position.start_prefix - first, None)
            batched = ((seq, indices) for seq, indices in numbered if seq not in skip) if skip else numbered
            if plan.call.seed is not None:
                _reseed(plan)
            running = _Running(
                plan,
                ChunkedPass(plan.pool, batched, plan.call, plan.sizer, plan.served, in_order=plan.in_order),
                plan.flow.snapshot(),
                plan.served.snapshot(),
            )
        except BaseException:
            self._stage = _FINISHED
            plan.book.finished(plan.position)
            raise
        self._stage = running
        with self._lock:
            self._closable = running
        if self._closing.is_set():  # closed meanwhile, perhaps before it could see this epoch: its next() ends
            running.batches.close()
        return running

    def _count(self, stage: _Running, entered: float, worked: float, batches: int) -> None:
        """Tell the loader's flow how long this ``next()`` waited, and how long the consumer worked before it."""
        self._returned_at = now = perf_counter()
        stage.plan.flow.yielded(now - entered, worked, batches)

    def _end(self, stage: _Running, complete: bool = False) -> None:
        self._stage = _FINISHED
        with self._lock:
            self._closable = _FINISHED
        stage.plan.book.finished(stage.plan.position)
        if complete:
            _warn_if_waited(stage)

    @staticmethod
    def _annotate(exc: BaseException, epoch: int, seq: int, indices: Any, worker: str) -> BaseException:
        if isinstance(indices, (list, tuple)) and len(indices) > 16:
            shown = f"{list(indices[:16])} ... ({len(indices)} in all)"
        else:
            shown = repr(indices)
        exc.add_note(f"while loading batch {seq} of epoch {epoch} (indices {shown}) on worker {worker}")
        return exc


def _warn_if_waited(stage: _Running) -> None:
    """Log one warning if the epoch's consumer waited for data more than :data:`WAIT_WARNING_FRACTION` of it.

    Only for an epoch long enough to mean something (:data:`WAIT_WARNING_MIN_SECONDS` and
    :data:`WAIT_WARNING_MIN_BATCHES`); the workers it names are those that served the epoch.
    """
    figures = stage.plan.flow.snapshot().since(stage.flow_at_start)
    served = served_workers(stage.served_at_start, stage.plan.served.snapshot())
    message = wait_warning(figures, served, stage.plan.position.epoch)
    if message:
        WAIT_LOGGER.warning("%s", message)


def served_workers(before: dict[str, int], after: dict[str, int]) -> int:
    """How many workers delivered batches between two snapshots of a loader's counts.

    Example::

        >>> served_workers({"a:1": 4}, {"a:1": 9, "b:2": 0, "c:3": 2})
        2
    """
    return sum(count > before.get(worker, 0) for worker, count in after.items())


def wait_warning(figures: FlowFigures, workers: int, epoch: int) -> str:
    """The data-wait warning of an epoch, or ``""`` when there is none to give.

    None for an epoch that waited :data:`WAIT_WARNING_FRACTION` of its time or less, lasted less than
    :data:`WAIT_WARNING_MIN_SECONDS` or yielded fewer than :data:`WAIT_WARNING_MIN_BATCHES` batches. A loop
    whose step is under :data:`NO_WORK_STEP_SECONDS` gets no estimate of the workers it needs: any
    number would be an extrapolation from nothing.

    Args:
        figures: the epoch's data flow.
        workers: the workers that served it.
        epoch: its number.

    Returns:
        the warning's text, or ``""``.

    Example::

        >>> epoch = FlowFigures(batches=500, wait_seconds=8.0, work_seconds=4.0, worker_seconds=60.0,
        ...                     worker_batches=500)
        >>> wait_warning(epoch, 2, 3)[:63]
        'the training loop waited for data 67% of epoch 3 (8.0 s of 12.0'
        >>> "about 15 workers of the measured speed" in wait_warning(epoch, 2, 3)
        True
        >>> toy = FlowFigures(batches=10, wait_seconds=0.04, work_seconds=0.0, worker_seconds=0.1, worker_batches=10)
        >>> wait_warning(toy, 1, 0)
        ''
    """
    seconds = figures.wait_seconds + figures.work_seconds
    if (
        figures.data_wait_fraction <= WAIT_WARNING_FRACTION
        or seconds < WAIT_WARNING_MIN_SECONDS
        or figures.batches < WAIT_WARNING_MIN_BATCHES
    ):
        return ""
    step = figures.work_seconds / figures.batches
    needed = figures.workers_needed
    if step < NO_WORK_STEP_SECONDS:
        advice = (
            f"its step takes {step * 1e3:.2f} ms, too little to estimate the workers that would keep it fed "
            "(measure with the real training step)"
        )
    elif math.isfinite(needed):
        advice = f"about {math.ceil(needed)} workers of the measured speed would keep it fed"
    else:
        advice = "no worker delivered a measured batch, so no estimate of the workers needed"
    return (
        f"the training loop waited for data {100 * figures.data_wait_fraction:.0f}% of epoch {epoch} "
        f"({figures.wait_seconds:.1f} s of {seconds:.1f} s, {figures.batches} batches): {advice} "
        f"(served by {workers} worker{'' if workers == 1 else 's'}; see rpcdl_workers_needed)"
    )


def _reseed(plan: EpochPlan) -> None:
    """Seed every active worker's random generators from ``(seed, epoch)`` and its index."""
    base = derive_seed(plan.call.seed, plan.call.epoch)
    futures = [
        rpc_async(address, set_random_seeds, (base, index), timeout=plan.reseed_timeout)
        for index, address in plan.pool.active()
    ]
    for future in futures:
        try:
            future.wait()
        except Exception as exc:
            if not is_transient(exc):
                raise
