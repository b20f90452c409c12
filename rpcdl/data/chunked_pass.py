"""A pass over a source of items, sent in chunks, handed out one item at a time: what a pass does with chunks.

Why a layer of its own: a call costs a round trip and about 100 us of CPU on
each side, which dominates when an item is cheap (a map of a trivial function,
a batch of a few small rows). This module owns everything about the chunks of
a pass and nothing about workers: how many items a chunk carries
(:class:`ChunkSizer`), how they are pulled from the source
(:class:`ChunkReader`), how a chunk's answer is handed out item by item with
each item's own error, and what happens to a chunk that fails as a whole
(:class:`ChunkedPass`). Sending the chunks, failover and revival are the
:class:`~rpcdl.data.scheduler.Dispatch`'s it runs on, so a chunk is retried
whole. It is the engine of the loader's epochs and of the remote maps; what a
worker runs for a chunk is :func:`rpcdl.data.chunks.run_chunk`.

The size of a chunk adapts to the cost of its items:

- a chunk starts at one item and grows (at most doubling per answer) while
  the work a chunk carries is below :data:`TARGET_CHUNK_SECONDS` and, when a
  byte target is set, its answer below that target, up to a bound of items;
  it shrinks at once when items get slower or larger;
- filling a chunk never waits for a slow source: pulling stops after an
  item that took longer than :data:`FILL_SECONDS` to come (the next one
  would likely be as slow), or once filling the chunk took
  :data:`TARGET_CHUNK_SECONDS`, as long as the chunk aims to take on a
  worker (a source that costs some microseconds per item, such as a
  torchdata node asked for its state after each, still fills chunks that
  make a call's overhead small).

A chunk that fails as a whole for a reason other than a worker failure (its
answer cannot be pickled or breaks a message limit, it timed out on every
worker) is run again item by item, in a pass of its own on the same pool, so
that the error comes at the item that causes it and the other items of the
chunk come through; every item is handed out once.

An exception raised by the source is held back until every item pulled before
it has been handed out, then raised in its place in the stream, as torchdata's
``Mapper`` and ``ParallelMapper`` do.

Threading: a :class:`ChunkedPass` and its :class:`ChunkReader` belong to the
thread advancing it, one at a time: its owner admits that thread (an epoch, a
mapper: their :class:`~rpcdl.data.guard.EntryGuard` refuses a second one; a
DataPipe's generator refuses it as any generator does), and its passes refuse
a second thread too. Any thread may close it: its lock guards the pass
re-running a failed chunk, which the closing thread closes, and an event tells
the thread advancing it to stop. A :class:`ChunkSizer` is shared by the passes
of a loader or remote map, which several threads may advance at once, and set
by the user's thread (``max_batches_per_call``): its lock guards every access
to its size and bound. A :class:`ServedCounts` is shared by the passes of a
loader or remote map: its lock guards every access; it tells its
:class:`~rpcdl.data.flow.DataFlow` after letting that lock go.
"""

from __future__ import annotations

import collections
import enum
import itertools
import threading
from collections.abc import Iterable, Iterator
from time import perf_counter
from typing import Any

from ..errors import ChunkFailed
from ..serialization.pickling import load_exception
from .flow import DataFlow
from .records import Task
from .scheduler import Call, Dispatch
from .worker_pool import WorkerPool

__all__ = [
    "FILL_SECONDS",
    "TARGET_CHUNK_SECONDS",
    "ChunkReader",
    "ChunkSizer",
    "ChunkedItem",
    "ChunkedPass",
    "ChunkedPassState",
    "ReaderState",
    "ServedCounts",
]

#: Seconds of work (measured on the worker) a chunk aims at, enough to make a call's overhead small.
TARGET_CHUNK_SECONDS = 0.004
#: Seconds an item may take to come from the source before its chunk goes as it is (the source is slow).
FILL_SECONDS = 0.001


class ChunkSizer:
    """The number of items the next chunk may carry (see the module).

    Args:
        max_chunk_size: the most items in one chunk.
        timeout: the timeout of one call: a chunk aims at a small part of it too.
        target_bytes: the size of an answer a chunk aims at (``None``: any).
    """

    def __init__(self, max_chunk_size: int, timeout: float, target_bytes: int | None = None):
        self.target_seconds = min(TARGET_CHUNK_SECONDS, timeout / 20) if timeout > 0 else TARGET_CHUNK_SECONDS
        self.target_bytes = target_bytes
        self._lock = threading.Lock()
        self._max_chunk_size = max_chunk_size
        self._size = 1

    @property
    def size(self) -> int:
        """The items the next chunk may carry."""
        with self._lock:
            return self._size

    @property
    def max_chunk_size(self) -> int:
        """The most items in one chunk; a new bound applies to the next chunk."""
        with self._lock:
            return self._max_chunk_size

    @max_chunk_size.setter
    def max_chunk_size(self, value: int) -> None:
        with self._lock:
            self._max_chunk_size = value
            self._size = min(self._size, value)

    def observe(self, items: int, seconds: float, nbytes: int = 0) -> None:
        """Learn from a chunk of ``items`` items that took ``seconds`` on its worker and answered ``nbytes``."""
        with self._lock:
            wanted = self._max_chunk_size
            if seconds > 0:
                wanted = min(wanted, int(self.target_seconds * items / seconds))
            if self.target_bytes is not None and nbytes > 0:
                wanted = min(wanted, self.target_bytes * items // nbytes)
            if wanted > self._size and items < self._size:
                return  # a short chunk (the source was slow or ended) says nothing about a larger one
            self._size = max(1, min(wanted, 2 * self._size, self._max_chunk_size))

    def restart(self) -> None:
        """Go back to chunks of one item (a chunk failed as a whole)."""
        with self._lock:
            self._size = 1


class ReaderState(enum.Enum):
    """Where a :class:`ChunkReader` is."""

    READING = "reading"  #: pulling items from its source
    FAILED = "failed"  #: the source raised; its error waits to be taken by :meth:`ChunkReader.take_error`
    ENDED = "ended"  #: the source ended, or its error was taken


class ChunkReader(Iterator[list[Any]]):
    """The chunks of a pass: lists of items pulled from ``items``, as many as ``sizer`` allows.

    An exception the source raises ends the chunks (after the chunk holding the
    items pulled before it) and is kept until :meth:`take_error`.
    """

    def __init__(self, items: Iterator[Any], sizer: ChunkSizer):
        self._items = items
        self._sizer = sizer
        self.state = ReaderState.READING
        self._error: Exception | None = None  # while FAILED

    def take_error(self) -> Exception | None:
        """The exception the source raised, once (``None`` if it raised none)."""
        if self.state is not ReaderState.FAILED:
            return None
        error, self._error = self._error, None
        self.state = ReaderState.ENDED
        return error

    def __next__(self) -> list[Any]:
        if self.state is not ReaderState.READING:
            raise StopIteration
        chunk: list[Any] = []
        append, items = chunk.append, self._items
        previous = perf_counter()  # when the item pulled last came (one clock read per item)
        filled_by = previous + TARGET_CHUNK_SECONDS
        try:
            for _ in range(self._sizer.size):
                append(next(items))
                now = perf_counter()
                if now - previous > FILL_SECONDS or now > filled_by:
                    break  # the source is slow: the next item might not come soon either
                previous = now
        except StopIteration:
            self.state = ReaderState.ENDED
            if not chunk:
                raise
        except Exception as exc:
            self.state, self._error = ReaderState.FAILED, exc
            if not chunk:
                raise StopIteration from None
        return chunk


class ChunkedItem:
    """One item of a pass, run: its ``payload`` (the item pulled), ``value`` or ``error``, and ``worker``."""

    __slots__ = ("error", "payload", "seq", "value", "worker")

    def __init__(self, seq: int, payload: Any, value: Any, error: BaseException | None, worker: str):
        self.seq, self.payload, self.value, self.error, self.worker = seq, payload, value, error, worker


class ServedCounts:
    """How many items each worker ran (and a pass accepted), counted by the passes of a loader or remote map.

    Args:
        workers: the addresses counted from the start (at 0).
        flow: told of each chunk's items, seconds and bytes too (a loader's :class:`~rpcdl.data.flow.DataFlow`).

    Example::

        >>> served = ServedCounts(["a:1"])
        >>> served.add("a:1", 3)
        >>> served.snapshot()
        {'a:1': 3}
    """

    def __init__(self, workers: Iterable[str], flow: DataFlow | None = None):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(workers, 0)
        self._flow = flow

    def add(self, worker: str, items: int, seconds: float = 0.0, nbytes: int = 0) -> None:
        """Count ``items`` more for ``worker``, which spent ``seconds`` making them, answered in ``nbytes``."""
        with self._lock:
            self._counts[worker] = self._counts.get(worker, 0) + items
        if self._flow is not None:
            self._flow.served(items, seconds, nbytes)

    def snapshot(self) -> dict[str, int]:
        """The counts now, a copy."""
        with self._lock:
            return dict(self._counts)


class ChunkedPassState(enum.Enum):
    """Where a :class:`ChunkedPass` is."""

    RUNNING = "running"  #: handing out items
    SOURCE_FAILED = "source failed"  #: its last ``next()`` raised the source's exception; nothing more comes
    FINISHED = "finished"  #: every item was handed out
    CLOSED = "closed"  #: closed before its end


class ChunkedPass(Iterator[ChunkedItem]):
    """One pass over ``items``: chunks sent by ``pool`` through ``call``, handed out item by item.

    Args:
        pool: the workers.
        items: the source.
        call: sends a task whose payload is a chunk (a list of items) and returns
            its future; the call answers ``(values, seconds, nbytes)`` or raises
            :class:`~rpcdl.errors.ChunkFailed` (see :func:`~rpcdl.data.chunks.run_chunk`).
        sizer: the size of the chunks; it learns from their answers.
        served: the items each worker ran, counted up as chunks come back.
        in_order: hand out chunks in source order (else as they complete).

    Attributes:
        state: a :class:`ChunkedPassState`.
    """

    def __init__(
        self,
        pool: WorkerPool,
        items: Iterator[Any],
        call: Call,
        sizer: ChunkSizer,
        served: ServedCounts,
        *,
        in_order: bool = True,
    ):
        self._pool = pool
        self._call = call
        self._sizer = sizer
        self._served = served
        self._in_order = in_order
        self._reader = ChunkReader(items, sizer)
        self._dispatch = Dispatch(pool, self._reader, call, in_order=in_order)
        self._ready: collections.deque[ChunkedItem] = collections.deque()
        self._queued = 0  # the items queued to hand out so far: the number of the next one
        self._closing = threading.Event()  # set by close(), from any thread
        self._lock = threading.Lock()  # guards _split: the advancing thread sets it, close() closes it
        self._split: Dispatch | None = None  # a failed chunk, run again item by item
        self.state = ChunkedPassState.RUNNING

    def __next__(self) -> ChunkedItem:
        ready = self._ready
        if ready and self.state is ChunkedPassState.RUNNING and not self._closing.is_set():
            return ready.popleft()  # most items: one of a chunk already here
        if self.state is not ChunkedPassState.RUNNING:
            raise StopIteration
        while True:
            if self._closing.is_set():  # closed, by this thread or another
                self._end()
                raise StopIteration
            if ready:
                return ready.popleft()
            if not self._expand_next():
                break
        if self._closing.is_set():  # its passes ended because it was closed
            self._end()
            raise StopIteration
        error = self._reader.take_error()
        if error is None:
            self.state = ChunkedPassState.FINISHED
            raise StopIteration
        self.state = ChunkedPassState.SOURCE_FAILED
        raise error

    def _expand_next(self) -> bool:
        """Queue the items of the next chunk done; ``False`` when no chunk is left."""
        with self._lock:
            split = self._split
        if split is not None:
            try:
                self._expand(next(split))
            except StopIteration:
                with self._lock:
                    self._split = None
            return True
        try:
            task = next(self._dispatch)
        except StopIteration:
            return False
        self._expand(task)
        return True

    def _expand(self, task: Task) -> None:
        """Queue the items of a finished chunk, or run them again one by one if it failed as a whole."""
        chunk, worker, error = task.payload, task.worker, task.error
        if error is None or isinstance(error, ChunkFailed):
            if error is None:
                values, seconds, nbytes = task.value
                errors: dict[int, bytes] = {}
            else:
                values, seconds, nbytes, errors = error.values, error.seconds, error.nbytes, error.errors
            items = len(chunk)
            if len(values) != items:
                raise ValueError(f"a chunk of {items} items was answered with {len(values)} values by {worker}")
            self._sizer.observe(items, seconds, nbytes)
            self._served.add(worker, items, seconds, nbytes)
            failures = [None] * items
            for index, report in errors.items():
                failures[index] = load_exception(report, worker)
            first, self._queued = self._queued, self._queued + items
            numbers = range(first, self._queued)
            self._ready.extend(map(ChunkedItem, numbers, chunk, values, failures, itertools.repeat(worker)))
        elif len(chunk) == 1:
            self._ready.append(ChunkedItem(self._queued, chunk[0], None, error, worker))
            self._queued += 1
        else:
            self._sizer.restart()
            split = Dispatch(self._pool, iter([[item] for item in chunk]), self._call, in_order=self._in_order)
            with self._lock:
                self._split = split  # closed by close() from now on, or at the next step if it was closed before

    def close(self) -> None:
        """End the pass; answers still in flight are dropped when they arrive.

        Any thread may close it: its calls are let go at once, and the thread
        advancing it, if another, stops at its next step.
        """
        self._closing.set()
        with self._lock:
            split = self._split
        if split is not None:
            split.close()
        self._dispatch.close()  # it wakes the thread advancing it, if that one waits

    def _end(self) -> None:
        with self._lock:
            split, self._split = self._split, None
        if split is not None:
            split.close()
        self._dispatch.close()
        self._ready.clear()
        self.state = ChunkedPassState.CLOSED
