"""Map items through a function on remote workers, results in source order.

The engine of :class:`~rpcdl.integrations.torchdata.RPCMapper` and of the
``rpc_map`` DataPipe: a :class:`rpcdl.data.scheduler.WorkerPool` whose tasks are
chunks of items (see :mod:`rpcdl.integrations._chunks`), each mapped by one
call, so scheduling, failover and revival are the loader's and a chunk is
retried whole. A pass hands out one :class:`MappedItem` per item, in order.

A chunk that fails as a whole for a reason other than a worker failure (its
answer cannot be pickled or breaks a message limit, it timed out on every
worker) is mapped again item by item, so that the error comes at the item
that causes it and the other items of the chunk come through.

An exception raised by the source is held back until every item pulled before
it has been handed out, then raised in its place in the stream, as torchdata's
``Mapper`` and ``ParallelMapper`` do.

Threading: a pass belongs to the thread that advances it (see :mod:`rpcdl.data.scheduler`).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from rpcdl import rpc_async
from rpcdl.checks import check_positive_int, check_timeout
from rpcdl.data.scheduler import Dispatch, Task, WorkerPool, WorkerSlot
from rpcdl.serialization.pickling import load_exception

from ._chunks import ChunkFailed, ChunkReader, ChunkSizer, map_chunk


def check_fn(fn: Any) -> None:
    """Validate the function sent to the workers."""
    if not callable(fn):
        raise TypeError(f"fn must be callable (it is sent to the workers), got {type(fn).__name__}: {fn!r}")


def check_options(prefetch_factor: Any, timeout: Any, max_chunk_size: Any = 1) -> None:
    """Validate the in-flight bound, the timeout and the chunk bound of a remote map or loader."""
    check_positive_int(prefetch_factor, "prefetch_factor", "calls in flight per worker")
    check_timeout(timeout)
    check_positive_int(max_chunk_size, "max_chunk_size", "items mapped by one call (1: one call per item)")


class RemoteMap:
    """``fn`` on a pool of workers, their health and the chunk size kept across passes over sources.

    Args:
        workers: worker addresses.
        fn: the function applied to each item, on a worker (sent with each call).
        prefetch_factor: calls (chunks) in flight per worker.
        timeout: seconds a call (a chunk) may take before it goes to another
            worker; also how long to wait for a worker when none is left.
        pin_memory: receive results into pinned memory when CUDA is available.
        max_chunk_size: the most items one call maps.
    """

    def __init__(
        self, workers: Sequence[str], fn: Callable, *, prefetch_factor: int, timeout: float, pin_memory: bool,
        max_chunk_size: int,
    ):  # fmt: skip
        self.fn = fn
        self.timeout = float(timeout)
        self.pin_memory = pin_memory
        self.pid = os.getpid()
        self.pool = WorkerPool(workers, prefetch_factor=prefetch_factor, timeout=timeout)
        self.sizer = ChunkSizer(max_chunk_size, self.timeout)
        self.items_served = dict.fromkeys(workers, 0)

    def start(self, items: Iterator[tuple[Any, Any]]) -> RemotePass:
        """Begin a pass over ``(item, tag)`` pairs; iterate it for the mapped items, in order."""
        reader = ChunkReader(items, self.sizer)
        return RemotePass(self, self.pool.start(reader, self._call), reader)

    def _call(self, task: Task, slot: WorkerSlot) -> torch.futures.Future:
        items = [item for item, _ in task.payload]
        return rpc_async(slot.address, map_chunk, (self.fn, items), pin_memory=self.pin_memory, timeout=self.timeout)

    def result(self, mapped: MappedItem) -> Any:
        """The value of a mapped item, or its error raised with a note naming the item and worker."""
        if mapped.error is not None:
            name = getattr(self.fn, "__qualname__", None) or type(self.fn).__name__
            mapped.error.add_note(f"while mapping item {mapped.seq} with {name} on worker {mapped.worker}")
            raise mapped.error
        return mapped.value


class MappedItem:
    """One item of a pass, mapped: its ``(item, tag)`` ``payload``, ``value`` or ``error``, and ``worker``."""

    __slots__ = ("error", "payload", "seq", "value", "worker")

    def __init__(self, seq: int, payload: tuple[Any, Any], value: Any, error: BaseException | None, worker: str):
        self.seq, self.payload, self.value, self.error, self.worker = seq, payload, value, error, worker


class RemotePass(Iterator[MappedItem]):
    """One pass over a source: mapped items in order, then the source's exception if it raised one.

    Attributes:
        source_failed: the last ``next()`` raised the source's exception (a
            new pass may go on with the source's following items).
    """

    def __init__(self, remote_map: RemoteMap, dispatch: Dispatch, reader: ChunkReader):
        self._map = remote_map
        self._dispatch = dispatch
        self._reader = reader
        self._split: Dispatch | None = None  # a failed chunk, mapped again item by item
        self._ready: collections.deque[MappedItem] = collections.deque()
        self._handed_out = 0
        self.source_failed = False

    def __next__(self) -> MappedItem:
        while not self._ready:
            if self._split is not None:
                try:
                    self._expand(next(self._split))
                except StopIteration:
                    self._split = None
                continue
            try:
                task = next(self._dispatch)
            except StopIteration:
                break
            self._expand(task)
        if self._ready:
            self._handed_out += 1
            return self._ready.popleft()
        error, self._reader.error = self._reader.error, None
        if error is None:
            raise StopIteration
        self.source_failed = True
        raise error

    def _expand(self, task: Task) -> None:
        """Queue the items of a finished chunk, or map them again one by one if it failed as a whole."""
        chunk, worker = task.payload, task.worker
        error = task.error
        if error is None or isinstance(error, ChunkFailed):
            values, seconds = (error.values, error.seconds) if error is not None else task.value
            errors = error.errors if error is not None else {}
            self._map.sizer.observe(len(chunk), seconds)
            self._map.items_served[worker] = self._map.items_served.get(worker, 0) + len(chunk)
            for index, (pair, value) in enumerate(zip(chunk, values, strict=True)):
                report = errors.get(index)
                failure = None if report is None else load_exception(report, worker)
                self._ready.append(MappedItem(self._handed_out + len(self._ready), pair, value, failure, worker))
        elif len(chunk) == 1:
            self._ready.append(MappedItem(self._handed_out + len(self._ready), chunk[0], None, error, worker))
        else:
            self._map.sizer.restart()
            self._split = self._map.pool.start(iter([[pair] for pair in chunk]), self._map._call)

    def close(self) -> None:
        """End the pass; answers still in flight are dropped when they arrive."""
        if self._split is not None:
            self._split.close()
            self._split = None
        self._ready.clear()
        self._dispatch.close()
