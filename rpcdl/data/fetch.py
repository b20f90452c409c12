"""What runs on a worker for each batch of an :class:`~rpcdl.RPCDataloader`: torch's fetchers, remotely.

As ``torch.utils.data._utils.fetch._MapDatasetFetcher``: a batch goes through
the dataset's ``__getitems__`` when it defines one, else sample by sample, then
through ``collate_fn``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..seeding import set_random_seeds


def fetch_batch(dataset: Any, indices: Sequence[Any], collate_fn: Callable, seed: int | None) -> Any:
    """Load the samples at ``indices`` and collate them; seed the random generators first when ``seed`` is set."""
    if seed is not None:
        set_random_seeds(seed, 0)
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
