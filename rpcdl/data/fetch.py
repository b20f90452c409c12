"""What runs on a worker for each batch of an :class:`~rpcdl.RPCDataloader`: torch's fetchers, remotely.

As ``torch.utils.data._utils.fetch._MapDatasetFetcher``: a batch goes through
the dataset's ``__getitems__`` when it defines one, else sample by sample, then
through ``collate_fn``. torch's ``default_collate`` stacks tensors straight into
the connection's shared segment when it has one (see :mod:`rpcdl.transport.shm`);
over a socket, large tensors are not stacked here at all: they are sent as
their stack from the samples' own memory
(:class:`~rpcdl.serialization.stacked.StackedSamples`), and the trainer receives one tensor.

A loader's call fetches a chunk of batches (:func:`fetch_batches_at`, or
samples: :func:`fetch_samples_at`; see :mod:`rpcdl.data.chunks`). It names its
dataset by the id of its RRef and torch's default collate or convert function by
``None``: what does not change within an epoch costs the pickler nothing per batch.
A seeded loader sends its seed and epoch once per call and each batch's number:
the worker derives each batch's seed (:func:`~rpcdl.seeding.derive_seed`, some
microseconds each), not the trainer's thread that iterates the loader.

Threading: these functions run on a worker, on the threads that execute its
calls (several at once with ``--parallel``); they keep no state between calls.
The segment a batch is stacked into is the calling thread's own
(:mod:`rpcdl.transport.context`); the module's collate table is built once, at import.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch.utils.data._utils.collate import (
    collate,
    collate_tensor_fn,
    default_collate,
    default_collate_fn_map,
    default_convert,
)

from ..rpc.rref import resolve_here
from ..seeding import derive_seed, set_random_seeds
from ..serialization.stacked import StackedSamples
from ..server.counters import count_batches
from ..transport import shm
from ..transport.context import SEGMENT, thread_context
from .chunks import run_chunk

_shape_and_dtype = operator.attrgetter("shape", "dtype")


def _stack_in_segment(batch: Sequence[torch.Tensor], *, collate_fn_map: dict | None = None) -> torch.Tensor:
    first = batch[0]
    plain = first.layout == torch.strided and first.device.type == "cpu" and not first.requires_grad
    # A batch smaller than a span never goes in the segment: no need to ask for one.
    big = plain and not first.is_nested and len(batch) * first.numel() * first.element_size() >= shm.MIN_SPAN_BYTES
    if big and len(set(map(_shape_and_dtype, batch))) == 1:
        context = thread_context.value
        over_socket = context[SEGMENT] is None and context[0] is not None  # a worker's call, answered on the socket
        if over_socket and all(type(sample) is torch.Tensor for sample in batch):  # a subclass stacks to its type
            return StackedSamples(batch)
        out = shm.empty((len(batch), *first.shape), first.dtype)
        if out is not None:
            return torch.stack(list(batch), 0, out=out)
    return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


_collate_in_segment = partial(collate, collate_fn_map={**default_collate_fn_map, torch.Tensor: _stack_in_segment})


def fetch_batch(dataset: Any, indices: Sequence[Any], collate_fn: Callable, seed: int | None) -> Any:
    """Load the samples at ``indices`` and collate them; seed the random generators first when ``seed`` is set."""
    if seed is not None:
        set_random_seeds(seed, 0)
    # As torch's _MapDatasetFetcher: a dataset's own batched read when it defines one.
    getitems = getattr(dataset, "__getitems__", None)
    samples = getitems(indices) if getitems else [dataset[i] for i in indices]
    batch = _collated(samples, collate_fn)
    count_batches()  # the worker's batches/s (rpcdl status --watch)
    return batch


def _collated(samples: Any, collate_fn: Callable) -> Any:
    if collate_fn is not default_collate:
        return collate_fn(samples)
    if type(samples) is list and samples and type(samples[0]) is torch.Tensor:  # default_collate's own dispatch
        return _stack_in_segment(samples)
    return _collate_in_segment(samples)


def fetch_sample(dataset: Any, index: Any, convert_fn: Callable, seed: int | None) -> Any:
    """Load one sample (a loader without batches) and convert it; seed first when ``seed`` is set."""
    if seed is not None:
        set_random_seeds(seed, 0)
    return convert_fn(dataset[index])


def _no_seed(number: int | None) -> None:
    return None


def _seeds(epoch_seed: tuple[int, int] | None) -> Callable[[int | None], int | None]:
    """The seed of a batch from its number: ``derive_seed(seed, epoch, number)``, or ``None`` unseeded."""
    if epoch_seed is None:
        return _no_seed
    seed, epoch = epoch_seed
    return partial(derive_seed, seed, epoch)


def fetch_batches_at(
    dataset_id: int,
    batches: list[tuple[Sequence[Any], int | None]],
    collate_fn: Callable | None,
    epoch_seed: tuple[int, int] | None = None,
) -> tuple[list[Any], float, int]:
    """:func:`fetch_batch` for each ``(indices, number)`` of a chunk, on the dataset the caller's RRef
    ``dataset_id`` names (see :func:`rpcdl.rpc.rref.remote_id`); ``collate_fn=None`` is torch's
    ``default_collate``. With ``epoch_seed=(seed, epoch)``, each batch is seeded first from
    ``derive_seed(seed, epoch, number)``; without, the numbers are not used. Returns and raises as
    :func:`~rpcdl.data.chunks.run_chunk`: the batches, the seconds they took and their size, or
    :class:`~rpcdl.errors.ChunkFailed` when some raised."""
    dataset = resolve_here(dataset_id)
    collate = default_collate if collate_fn is None else collate_fn
    seed_of = _seeds(epoch_seed)
    return run_chunk(lambda batch: fetch_batch(dataset, batch[0], collate, seed_of(batch[1])), batches)


def fetch_samples_at(
    dataset_id: int,
    samples: list[tuple[Any, int | None]],
    convert_fn: Callable | None,
    epoch_seed: tuple[int, int] | None = None,
) -> tuple[list[Any], float, int]:
    """:func:`fetch_sample` for each ``(index, number)`` of a chunk, as :func:`fetch_batches_at`
    (``convert_fn=None`` is torch's ``default_convert``)."""
    dataset = resolve_here(dataset_id)
    convert = default_convert if convert_fn is None else convert_fn
    seed_of = _seeds(epoch_seed)
    return run_chunk(lambda sample: fetch_sample(dataset, sample[0], convert, seed_of(sample[1])), samples)
