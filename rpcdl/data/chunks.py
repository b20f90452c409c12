"""What a worker runs for one chunk of items, and the estimate of an answer's size.

A chunk is a list of items one call runs (see :mod:`rpcdl.data.chunked_pass`,
which sizes the chunks and hands their items out). :func:`run_chunk` runs on
the worker. When an item raises it still runs the others, then raises
:class:`~rpcdl.errors.ChunkFailed` with the values and the errors in place, so
the worker counts the call as failed (it is not retried) and the client raises
each error at its item's position (:class:`rpcdl.data.chunked_pass.ChunkedPass`).

Threading: plain functions, no state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import ChunkFailed
from ..serialization.pickling import dump_exception
from ..serialization.stacked import StackedSamples

__all__ = ["answer_bytes", "run_chunk"]

#: Types that hold no buffer worth counting: no need to ask whether they are a tensor (torch's
#: ``isinstance`` check goes through a Python ``__instancecheck__``, a cost per item of a cheap map).
_NO_BUFFER = frozenset({int, float, bool, complex, type(None)})


def answer_bytes(value: Any, depth: int = 3) -> int:
    """The bytes of the tensors, arrays and strings in ``value`` (looking ``depth`` containers deep).

    An estimate of an answer's size that costs a microsecond or two, not a pickling.

    Example::

        >>> answer_bytes({"image": torch.zeros(3, 4), "label": 1})
        48
    """
    kind = type(value)
    if kind in _NO_BUFFER:
        return 0
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
