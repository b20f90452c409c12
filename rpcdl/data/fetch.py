"""What runs on a worker for each batch of an :class:`~rpcdl.RPCDataloader`: torch's fetchers, remotely.

As ``torch.utils.data._utils.fetch._MapDatasetFetcher``: a batch goes through
the dataset's ``__getitems__`` when it defines one, else sample by sample, then
through ``collate_fn``. torch's ``default_collate`` stacks tensors straight into
the connection's shared segment when it has one (see :mod:`rpcdl.transport.shm`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate, default_collate_fn_map

from ..seeding import set_random_seeds
from ..transport import shm


def _stack_in_segment(batch: Sequence[torch.Tensor], *, collate_fn_map: dict | None = None) -> torch.Tensor:
    first = batch[0]
    plain = first.layout == torch.strided and first.device.type == "cpu" and not first.requires_grad
    if plain and all(t.shape == first.shape and t.dtype == first.dtype for t in batch):
        out = shm.empty((len(batch), *first.shape), first.dtype)
        if out is not None:
            return torch.stack(list(batch), 0, out=out)
    return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


_collate_in_segment = partial(collate, collate_fn_map={**default_collate_fn_map, torch.Tensor: _stack_in_segment})


def fetch_batch(dataset: Any, indices: Sequence[Any], collate_fn: Callable, seed: int | None) -> Any:
    """Load the samples at ``indices`` and collate them; seed the random generators first when ``seed`` is set."""
    if seed is not None:
        set_random_seeds(seed, 0)
    if collate_fn is default_collate:
        collate_fn = _collate_in_segment
    # As torch's _MapDatasetFetcher: a dataset's own batched read when it defines one.
    getitems = getattr(dataset, "__getitems__", None)
    if getitems:
        return collate_fn(getitems(indices))
    return collate_fn([dataset[i] for i in indices])


def fetch_sample(dataset: Any, index: Any, convert_fn: Callable, seed: int | None) -> Any:
    """Load one sample (a loader without batches) and convert it; seed first when ``seed`` is set."""
    if seed is not None:
        set_random_seeds(seed, 0)
    return convert_fn(dataset[index])
