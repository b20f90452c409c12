"""Map items through a function on remote workers, results in source order.

The engine of :class:`~rpcdl.integrations.torchdata.RPCMapper` and of the
``rpc_map`` DataPipe: a :class:`rpcdl.scheduler.WorkerPool` whose tasks are
``fn(item)`` calls, so scheduling, failover and revival are the loader's.

An exception raised by the source is held back until every item pulled before
it has been handed out, then raised in its place in the stream, as torchdata's
``Mapper`` and ``ParallelMapper`` do.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from rpcdl import rpc_async
from rpcdl.checks import check_positive_int, check_timeout
from rpcdl.scheduler import Dispatch, Task, WorkerPool, WorkerSlot


def check_fn(fn: Any) -> None:
    """Validate the function sent to the workers."""
    if not callable(fn):
        raise TypeError(f"fn must be callable (it is sent to the workers), got {type(fn).__name__}: {fn!r}")


def check_options(prefetch_factor: Any, timeout: Any) -> None:
    """Validate the in-flight bound and the timeout of a remote map or loader."""
    check_positive_int(prefetch_factor, "prefetch_factor", "calls in flight per worker")
    check_timeout(timeout)


class RemoteMap:
    """``fn`` on a pool of workers, their health kept across passes over sources.

    Args:
        workers: worker addresses.
        fn: the function applied to each item, on a worker (sent with each call).
        prefetch_factor: calls in flight per worker.
        timeout: seconds a call may take before its item goes to another
            worker; also how long to wait for a worker when none is left.
        pin_memory: receive results into pinned memory when CUDA is available.
    """

    def __init__(self, workers: Sequence[str], fn: Callable, *, prefetch_factor: int, timeout: float, pin_memory: bool):
        self.fn = fn
        self.timeout = float(timeout)
        self.pin_memory = pin_memory
        self.pid = os.getpid()
        self.pool = WorkerPool(workers, prefetch_factor=prefetch_factor, timeout=timeout)

    def start(self, items: Iterator[tuple[Any, Any]]) -> RemotePass:
        """Begin a pass over ``(item, tag)`` pairs; iterate it for finished tasks, in order."""
        reader = _SourceReader(items)
        return RemotePass(self.pool.start(reader, self._call), reader)

    def _call(self, task: Task, slot: WorkerSlot) -> torch.futures.Future:
        item, _ = task.payload
        return rpc_async(slot.address, self.fn, (item,), pin_memory=self.pin_memory, timeout=self.timeout)

    def result(self, task: Task) -> Any:
        """The value of a finished task, or its error raised with a note naming the item and worker."""
        if task.error is not None:
            name = getattr(self.fn, "__qualname__", None) or type(self.fn).__name__
            task.error.add_note(f"while mapping item {task.seq} with {name} on worker {task.worker}")
            raise task.error
        return task.value


class _SourceReader(Iterator[tuple[Any, Any]]):
    """The items of a pass; an exception the source raises ends them and is kept in ``error``."""

    def __init__(self, items: Iterator[tuple[Any, Any]]):
        self._items = items
        self.error: Exception | None = None

    def __next__(self) -> tuple[Any, Any]:
        if self.error is not None:
            raise StopIteration
        try:
            return next(self._items)
        except StopIteration:
            raise
        except Exception as exc:
            self.error = exc
            raise StopIteration from None


class RemotePass(Iterator[Task]):
    """One pass over a source: finished tasks in order, then the source's exception if it raised one.

    Attributes:
        source_failed: the last ``next()`` raised the source's exception (a
            new pass may go on with the source's following items).
    """

    def __init__(self, dispatch: Dispatch, reader: _SourceReader):
        self._dispatch = dispatch
        self._reader = reader
        self.source_failed = False

    def __next__(self) -> Task:
        try:
            return next(self._dispatch)
        except StopIteration:
            pass
        error, self._reader.error = self._reader.error, None
        if error is None:
            raise StopIteration
        self.source_failed = True
        raise error

    def close(self) -> None:
        """End the pass; answers still in flight are dropped when they arrive."""
        self._dispatch.close()
