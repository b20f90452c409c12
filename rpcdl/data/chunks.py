"""Work sent in chunks: one call runs a list of items on a worker.

One call per item costs a round trip and the call's own overhead per item,
about 100 us of CPU on each side, which dominates when an item is cheap: a
map of a trivial function, a batch of a few small rows. The loader and the
remote map therefore send items in chunks whose size adapts to their cost:

- a chunk starts at one item and grows (at most doubling per answer) while
  the work a chunk carries is below :data:`TARGET_CHUNK_SECONDS` and, when a
  byte target is set, its answer below that target, up to a bound of items;
  it shrinks at once when items get slower or larger;
- filling a chunk never waits for a slow source: pulling stops after an
  item that took longer than :data:`FILL_SECONDS` to come (the next one
  would likely be as slow), or once the chunk took that long.

:func:`run_chunk` runs on the worker. When an item raises it still runs the
others, then raises :class:`~rpcdl.errors.ChunkFailed` with the values and the errors in
place, so the worker counts the call as failed (it is not retried) and the
client raises each error at its item's position
(:class:`rpcdl.data.chunked_pass.ChunkedPass`).

Threading: a :class:`ChunkReader` belongs to the thread advancing its pass. A
:class:`ChunkSizer` is shared by the passes of a loader or remote map, which
several threads may advance at once, and set by the user's thread
(``max_batches_per_call``): its lock guards every access to its size and bound.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ..errors import ChunkFailed
from ..serialization.pickling import dump_exception
from ..serialization.stacked import StackedSamples

__all__ = ["ChunkReader", "ChunkSizer", "ReaderState", "answer_bytes", "run_chunk"]

#: Seconds of work (measured on the worker) a chunk aims at, enough to make a call's overhead small.
TARGET_CHUNK_SECONDS = 0.002
#: Seconds spent pulling items for one chunk after its first item, before the chunk goes as it is.
FILL_SECONDS = 0.001


def answer_bytes(value: Any, depth: int = 3) -> int:
    """The bytes of the tensors, arrays and strings in ``value`` (looking ``depth`` containers deep).

    An estimate of an answer's size that costs a microsecond or two, not a pickling.

    Example::

        >>> answer_bytes({"image": torch.zeros(3, 4), "label": 1})
        48
    """
    kind = type(value)
    if kind is torch.Tensor:
        return value.numel() * value.element_size()
    if kind is StackedSamples:
        return sum(answer_bytes(sample) for sample in value.samples)
    if kind is np.ndarray:
        return value.nbytes
    if kind is bytes or kind is bytearray or kind is str:
        return len(value)
    if depth > 0:
        if kind is list or kind is tuple:
            return sum(answer_bytes(item, depth - 1) for item in value)
        if kind is dict:
            return sum(answer_bytes(item, depth - 1) for item in value.values())
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0


def run_chunk(fn: Callable[[Any], Any], items: list[Any]) -> tuple[list[Any], float, int]:
    """Apply ``fn`` to each item, on a worker: the values, the seconds it took and their size in bytes.

    Raises:
        ChunkFailed: ``fn`` raised for one item or more (the others are run all the same).

    Example::

        >>> run_chunk(abs, [-1, 2])[0]
        [1, 2]
    """
    started = time.perf_counter()
    values: list[Any] = []
    errors: dict[int, bytes] = {}
    for index, item in enumerate(items):
        try:
            values.append(fn(item))
        except Exception as exc:
            values.append(None)
            errors[index] = dump_exception(exc)
    seconds = time.perf_counter() - started
    nbytes = sum(map(answer_bytes, values))
    if errors:
        raise ChunkFailed(values, errors, seconds, nbytes)
    return values, seconds, nbytes


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
        size = self._sizer.size
        started = time.perf_counter()
        try:
            while len(chunk) < size:
                pulled_at = time.perf_counter()
                chunk.append(next(self._items))
                now = time.perf_counter()
                if now - pulled_at > FILL_SECONDS or now - started > FILL_SECONDS:
                    break  # the source is slow: the next item might not come soon either
        except StopIteration:
            self.state = ReaderState.ENDED
            if not chunk:
                raise
        except Exception as exc:
            self.state, self._error = ReaderState.FAILED, exc
            if not chunk:
                raise StopIteration from None
        return chunk
