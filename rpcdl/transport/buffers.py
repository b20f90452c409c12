"""Memory for large received buffers, reused once nothing uses it.

A client receives each large out-of-band buffer (a batch, say) into memory
that becomes the tensor handed to the caller. Taken from the allocator, that
memory stays with the process after the tensor goes (the allocator keeps its
high-water mark, which grows with every batch received on a thread other
than the one freeing them), and fresh memory costs a page fault per page.
Here each buffer is its own private mapping, in 2 MiB huge pages where the
kernel allows them (one page fault per 2 MiB, not per 4 KiB). When the last
array (and tensor) using it goes, it returns to a free list with its pages
still mapped, so the next buffer of that size is received without page
faults; beyond that list it is unmapped.

A new mapping is made only when the free list is empty, so the memory mapped
for a size (in use plus free) never exceeds the most buffers of that size in
use at once: a loader's prefetch window and the batches its caller holds. The
free list is long enough to carry a window across an epoch's end, when the
last batches are dropped before the next epoch's arrive (with two free
buffers, one batch in five of a 24-batch epoch was received into fresh pages).

Threading: any thread takes buffers; the free lists are guarded by the pool's
lock. A buffer comes back from the finalizer of its array, which runs on
whatever thread drops the last reference, at any allocation, possibly inside
:meth:`BufferPool.take` holding that lock: so the finalizer only appends the
mapping to a deque (an atomic append, no lock), and the next :meth:`~BufferPool.take`
moves what is there to the free lists under the lock.
"""

from __future__ import annotations

import collections
import mmap
import threading
import weakref

import numpy as np

from .._lifecycle import in_forked_child

MIN_BYTES = 1 << 20  #: buffers this large come from the pool
FREE_PER_SIZE = 8  #: free buffers kept for each size, at most


class BufferPool:
    """Hands out writable uint8 arrays of private mappings; takes them back when unused.

    Args:
        free_per_size: how many unused buffers of one size to keep mapped.
    """

    def __init__(self, free_per_size: int = FREE_PER_SIZE):
        self.free_per_size = free_per_size
        self._free: dict[int, list[mmap.mmap]] = {}  # under _lock; the last one given back is taken first
        self._lock = threading.Lock()
        self._returned: collections.deque[mmap.mmap] = collections.deque()  # appended by finalizers, no lock

    def take(self, size: int) -> np.ndarray:
        """A writable ``uint8`` array of ``size`` bytes."""
        with self._lock:
            self._collect_returned()
            free = self._free.get(size)
            memory = free.pop() if free else None
        if memory is None:
            memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            _ask_for_huge_pages(memory)
        array = np.frombuffer(memory, dtype=np.uint8)
        weakref.finalize(array, self._returned.append, memory)
        return array

    def free_buffers(self, size: int | None = None) -> int:
        """How many unused buffers the pool keeps (of ``size`` bytes, or in all)."""
        with self._lock:
            self._collect_returned()
            if size is not None:
                return len(self._free.get(size, ()))
            return sum(len(free) for free in self._free.values())

    def _collect_returned(self) -> None:
        """Move the buffers whose arrays are gone to the free lists (the caller holds the lock)."""
        while self._returned:
            memory = self._returned.popleft()
            free = self._free.setdefault(len(memory), [])
            if len(free) < self.free_per_size:
                free.append(memory)
            # otherwise dropped here: unmapped, nothing uses it any more


def _ask_for_huge_pages(memory: mmap.mmap) -> None:
    # A fresh buffer takes a page fault per page: one per 2 MiB in huge pages, not one per 4 KiB.
    if _HUGE_PAGES is not None:
        try:
            memory.madvise(_HUGE_PAGES)
        except OSError:  # not supported by this kernel or its settings
            pass


_HUGE_PAGES = getattr(mmap, "MADV_HUGEPAGE", None)
_pool = BufferPool()


def take(size: int) -> np.ndarray:
    """A writable, page-aligned ``uint8`` array of ``size`` bytes from this process's pool."""
    return _pool.take(size)


def for_receiving(size: int) -> np.ndarray:
    """A writable ``uint8`` array of ``size`` bytes to receive a buffer into: from the pool from ``MIN_BYTES``,
    else a new one (numpy's, which costs a tenth of a tensor's and its view)."""
    return _pool.take(size) if size >= MIN_BYTES else np.empty(size, np.uint8)


def _after_fork_in_child() -> None:
    global _pool
    _pool = BufferPool()


in_forked_child(_after_fork_in_child)
