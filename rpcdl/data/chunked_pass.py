"""A pass whose calls each run a chunk of items, handed out one item at a time.

The engine of the loader's epochs and of the remote maps: a
:class:`~rpcdl.data.scheduler.Dispatch` whose tasks are chunks (see
:mod:`rpcdl.data.chunks`), each run by one call, so scheduling, failover and
revival are the pool's and a chunk is retried whole. A pass hands out one
:class:`ChunkedItem` per item, in the order of its chunks.

A chunk that fails as a whole for a reason other than a worker failure (its
answer cannot be pickled or breaks a message limit, it timed out on every
worker) is run again item by item, so that the error comes at the item that
causes it and the other items of the chunk come through.

An exception raised by the source is held back until every item pulled before
it has been handed out, then raised in its place in the stream, as torchdata's
``Mapper`` and ``ParallelMapper`` do.

Threading: a :class:`ChunkedPass` belongs to the thread advancing it, one at
a time: its owner admits that thread (an epoch, a mapper: their
:class:`~rpcdl.data.guard.EntryGuard` refuses a second one; a DataPipe's
generator refuses it as any generator does), and its passes refuse a second
thread too. Any thread may close it: its lock guards the pass re-running a
failed chunk, which the closing thread closes, and an event tells the thread
advancing it to stop. A :class:`ServedCounts` is shared by the passes of a
loader or remote map: its lock guards every access; it tells its
:class:`~rpcdl.data.flow.DataFlow` after letting that lock go.
"""

from __future__ import annotations

import collections
import enum
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from ..errors import ChunkFailed
from ..serialization.pickling import load_exception
from .chunks import ChunkReader, ChunkSizer
from .flow import DataFlow
from .records import Task
from .scheduler import Call, Dispatch
from .worker_pool import WorkerPool

__all__ = ["ChunkedItem", "ChunkedPass", "ChunkedPassState", "ServedCounts"]


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
        self._handed_out = 0
        self._closing = threading.Event()  # set by close(), from any thread
        self._lock = threading.Lock()  # guards _split: the advancing thread sets it, close() closes it
        self._split: Dispatch | None = None  # a failed chunk, run again item by item
        self.state = ChunkedPassState.RUNNING

    def __next__(self) -> ChunkedItem:
        if self.state is not ChunkedPassState.RUNNING:
            raise StopIteration
        while True:
            if self._closing.is_set():  # closed, by this thread or another
                self._end()
                raise StopIteration
            if self._ready:
                self._handed_out += 1
                return self._ready.popleft()
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
            self._sizer.observe(len(chunk), seconds, nbytes)
            self._served.add(worker, len(chunk), seconds, nbytes)
            for index, (item, value) in enumerate(zip(chunk, values, strict=True)):
                report = errors.get(index)
                failure = None if report is None else load_exception(report, worker)
                self._ready.append(ChunkedItem(self._handed_out + len(self._ready), item, value, failure, worker))
        elif len(chunk) == 1:
            self._ready.append(ChunkedItem(self._handed_out + len(self._ready), chunk[0], None, error, worker))
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
