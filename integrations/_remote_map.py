"""Map items through a function on remote workers, results in source order.

The engine of :class:`~rpcdl.integrations.torchdata.RPCMapper` and of the
``rpc_map`` DataPipe: a :class:`rpcdl.data.scheduler.WorkerPool` whose calls
each map a chunk of items (:class:`rpcdl.data.chunked_pass.ChunkedPass`, the
loader's engine too), so scheduling, failover, revival and the handling of a
failed chunk are the loader's.

Threading: a :class:`RemoteMap` runs no thread; its passes are advanced by the
threads that iterate them, one thread per pass at a time (see
:mod:`rpcdl.data.scheduler`). What its passes share has its own owner: the
pool's lock guards the workers' records (:mod:`rpcdl.data.worker_pool`), the chunk
sizer and the served counts have their own locks; its settings do not change.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from rpcdl import rpc_async
from rpcdl.checks import check_positive_int, check_timeout
from rpcdl.data.chunked_pass import ChunkedItem, ChunkedPass, ChunkSizer, ServedCounts
from rpcdl.data.chunks import run_chunk
from rpcdl.data.records import Task
from rpcdl.data.sources import Fleet, WorkerSource, start_timeout, worker_source
from rpcdl.data.worker_pool import WorkerPool

#: The default bound of items in one chunk.
DEFAULT_MAX_CHUNK_SIZE = 256


def check_fn(fn: Any) -> None:
    """Validate the function sent to the workers."""
    if not callable(fn):
        raise TypeError(f"fn must be callable (it is sent to the workers), got {type(fn).__name__}: {fn!r}")


def workers_or_source(workers: Any) -> list[str] | WorkerSource:
    """A remote map's ``workers``: a list of addresses (checked), or a worker source (a file, ``dns://``,
    ``redis://``, an object with ``addresses()``: see :mod:`rpcdl.data.sources`)."""
    source = worker_source(workers)
    return source.addresses() if not getattr(source, "changing", True) else source


def listed(workers: list[str] | WorkerSource) -> list[str]:
    """The addresses ``workers`` lists now (for counters before the first pass)."""
    return list(workers) if isinstance(workers, list) else []


def check_options(prefetch_factor: Any, timeout: Any, max_chunk_size: Any = 1) -> None:
    """Validate the in-flight bound, the timeout and the chunk bound of a remote map or loader."""
    check_positive_int(prefetch_factor, "prefetch_factor", "calls in flight per worker")
    check_timeout(timeout)
    check_positive_int(max_chunk_size, "max_chunk_size", "items mapped by one call (1: one call per item)")


class MapCall:
    """Sends a chunk of ``(item, tag)`` pairs to a worker to map the items through ``fn`` (a pass's call).

    Args:
        fn: the function applied to each item.
        pin_memory: receive results into pinned memory.
        timeout: seconds a call may take.
    """

    __slots__ = ("fn", "pin_memory", "timeout")

    def __init__(self, fn: Callable, *, pin_memory: bool, timeout: float):
        self.fn, self.pin_memory, self.timeout = fn, pin_memory, timeout

    def __call__(self, task: Task, address: str) -> torch.futures.Future:
        items = [item for item, _ in task.payload]
        return rpc_async(address, run_chunk, (self.fn, items), pin_memory=self.pin_memory, timeout=self.timeout)


class RemoteMap:
    """``fn`` on a pool of workers, their health and the chunk size kept across passes over sources.

    Args:
        workers: worker addresses, or a worker source (waited for as it begins, up to
            :func:`~rpcdl.data.sources.start_timeout`).
        fn: the function applied to each item, on a worker (sent with each call).
        prefetch_factor: calls (chunks) in flight per worker.
        timeout: seconds a call (a chunk) may take before it goes to another
            worker; also how long to wait for a worker when none is left.
        pin_memory: receive results into pinned memory when CUDA is available.
        max_chunk_size: the most items one call maps.
    """

    def __init__(
        self,
        workers: Sequence[str] | WorkerSource,
        fn: Callable,
        *,
        prefetch_factor: int,
        timeout: float,
        pin_memory: bool,
        max_chunk_size: int,
    ):
        self.fn = fn
        self.timeout = float(timeout)
        self.pin_memory = pin_memory
        self.pid = os.getpid()
        fleet = Fleet(workers)
        membership = fleet.wait_for_workers(start_timeout()) if fleet.changing else fleet.membership()
        self.pool = WorkerPool(fleet, prefetch_factor=prefetch_factor, timeout=timeout)
        self.sizer = ChunkSizer(max_chunk_size, self.timeout)
        self.items_served = ServedCounts(membership.addresses)
        self._call = MapCall(fn, pin_memory=pin_memory, timeout=self.timeout)

    def start(self, items: Iterator[tuple[Any, Any]]) -> ChunkedPass:
        """Begin a pass over ``(item, tag)`` pairs; iterate it for the mapped items, in order."""
        return ChunkedPass(self.pool, items, self._call, self.sizer, self.items_served)

    def result(self, mapped: ChunkedItem) -> Any:
        """The value of a mapped item, or its error raised with a note naming the item and worker."""
        if mapped.error is not None:
            name = getattr(self.fn, "__qualname__", None) or type(self.fn).__name__
            mapped.error.add_note(f"while mapping item {mapped.seq} with {name} on worker {mapped.worker}")
            raise mapped.error
        return mapped.value
