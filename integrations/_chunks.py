"""Items mapped in chunks: one call maps a list of items on a worker.

One call per item costs a round trip and the call's own overhead per item,
which dominates when the function is cheap. A remote map therefore sends
items in chunks whose size adapts to the function's cost:

- a chunk starts at one item and grows (at most doubling per answer) while
  the work a chunk carries is below :data:`TARGET_CHUNK_SECONDS`, up to
  ``max_chunk_size`` items; it shrinks at once when items get slower;
- filling a chunk never waits for a slow source: pulling stops after an
  item that took longer than :data:`FILL_SECONDS` to come (the next one
  would likely be as slow), or once the chunk took that long.

:func:`map_chunk` runs on the worker. When ``fn`` raises for some items it
still maps the others, then raises :class:`ChunkFailed` with the values and
the errors in place, so the worker counts the call as failed (it is not
retried) and the client raises each error at its item's position.

Threading: a :class:`ChunkReader` and a :class:`ChunkSizer` belong to the
thread that advances their pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from rpcdl.serialization.pickling import dump_exception

#: Seconds of work (measured on the worker) a chunk aims at: enough to make a call's overhead small.
TARGET_CHUNK_SECONDS = 0.002
#: Seconds spent pulling items for one chunk after its first item, before the chunk goes as it is.
FILL_SECONDS = 0.001
#: The default bound of items in one chunk.
DEFAULT_MAX_CHUNK_SIZE = 256


class ChunkFailed(Exception):
    """``fn`` raised for some items of a chunk: every item's value (``None`` where it failed) and the errors.

    Args:
        values: one per item of the chunk.
        errors: index in the chunk -> the error's report (:func:`rpcdl.serialization.pickling.dump_exception`).
        seconds: how long the chunk took on the worker.
    """

    def __init__(self, values: list[Any], errors: dict[int, bytes], seconds: float):
        super().__init__(f"fn raised for {len(errors)} of the {len(values)} items of a chunk")
        self.values, self.errors, self.seconds = values, errors, seconds

    def __reduce__(self):
        return ChunkFailed, (self.values, self.errors, self.seconds)


def map_chunk(fn: Callable[[Any], Any], items: list[Any]) -> tuple[list[Any], float]:
    """Apply ``fn`` to each item, on a worker: the values and the seconds it took.

    Raises:
        ChunkFailed: ``fn`` raised for one item or more (the others are mapped all the same).
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
    if errors:
        raise ChunkFailed(values, errors, seconds)
    return values, seconds


class ChunkSizer:
    """The number of items the next chunk may carry (see the module).

    Args:
        max_chunk_size: the most items in one chunk.
        timeout: the timeout of one call: a chunk aims at a small part of it too.
    """

    def __init__(self, max_chunk_size: int, timeout: float):
        self.max_chunk_size = max_chunk_size
        self.target_seconds = min(TARGET_CHUNK_SECONDS, timeout / 20) if timeout > 0 else TARGET_CHUNK_SECONDS
        self.size = 1

    def observe(self, items: int, seconds: float) -> None:
        """Learn from a chunk of ``items`` items that took ``seconds`` on its worker."""
        per_item = seconds / items
        wanted = self.max_chunk_size if per_item <= 0 else int(self.target_seconds / per_item)
        if wanted > self.size and items < self.size:
            return  # a short chunk (the source was slow or ended) says nothing about a larger one
        self.size = max(1, min(wanted, 2 * self.size, self.max_chunk_size))

    def restart(self) -> None:
        """Go back to chunks of one item (a chunk failed as a whole)."""
        self.size = 1


class ChunkReader(Iterator[list[tuple[Any, Any]]]):
    """The chunks of a pass: lists of ``(item, tag)`` pairs pulled from ``items``.

    An exception the source raises ends the chunks (after the chunk holding the
    items pulled before it) and is kept in ``error``.
    """

    def __init__(self, items: Iterator[tuple[Any, Any]], sizer: ChunkSizer):
        self._items = items
        self._sizer = sizer
        self.error: Exception | None = None

    def __next__(self) -> list[tuple[Any, Any]]:
        if self.error is not None:
            raise StopIteration
        chunk: list[tuple[Any, Any]] = []
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
            if not chunk:
                raise
        except Exception as exc:
            self.error = exc
            if not chunk:
                raise StopIteration from None
        return chunk
