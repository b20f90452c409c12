"""Load-balancing distributed samplers (bagua's API): every replica gets the same total complexity.

Samples of variable cost (sequence lengths, image sizes) make replicas of a
data-parallel job wait for the slowest. These samplers sort the samples by a
measure of their cost, cut the sorted list into chunks of ``num_replicas``
samples and give each replica one sample of every chunk, so the replicas'
total costs differ by at most the cost of one sample. Users import them from
:mod:`rpcdl.samplers`.

Threading: as torch's samplers, a sampler is set (``set_epoch``) and iterated
by the threads of the training loop; an :class:`~rpcdl.RPCDataloader` tells it
the epoch and starts its iteration under its epochs' lock, and may ask its
length from any thread. The batch sampler's batches of the current epoch,
built once per epoch, are guarded by its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from ..checks import check_int, check_number
from ..rpc.client import rpc_sync
from .dataset import RPCDataset
from .ranks import rank_and_world_size


def _complexities_of(dataset: Any, complexity_fn: Callable[[Any], Any]) -> list[Any]:
    """Runs where the dataset lives: the complexity of every sample."""
    return [complexity_fn(dataset[index]) for index in range(len(dataset))]


def _compute_complexities(dataset: Dataset, complexity_fn: Callable[[Any], Any]) -> list[float]:
    if isinstance(dataset, RPCDataset):
        # One call to a worker holding the dataset instead of one per sample.
        for address, rref in zip(dataset.workers, dataset.rrefs, strict=True):
            if rref is not None:
                values = rpc_sync(address, _complexities_of, (rref, complexity_fn), timeout=dataset.timeout)
                break
        else:
            raise RuntimeError("no worker holds this RPCDataset: cannot compute its samples' complexities")
    else:
        values = _complexities_of(dataset, complexity_fn)
    checked = []
    for index, value in enumerate(values):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"complexity_fn must return a number, got {value!r} for sample {index}")
        checked.append(value)
    return checked


class LoadBalancingDistributedSampler(Sampler[int]):
    """Restricts loading to this replica's share of the dataset, balancing the complexity across replicas.

    Like :class:`~torch.utils.data.DistributedSampler`, each of the
    ``num_replicas`` processes gets an exclusive share (padded to equal length
    with repeated samples unless ``drop_last``). Within an epoch the shares are
    chosen so that their total complexity differs by at most one sample's
    complexity (at ``random_level=0``). ``complexity_fn`` is evaluated once per
    sample when the sampler is built (the dataset is assumed constant in size);
    for an :class:`~rpcdl.RPCDataset` that happens on a worker, in one call.

    Args:
        dataset: the dataset to sample from.
        complexity_fn: a sample to a number measuring its computational cost.
        num_replicas: number of processes; defaults to the ``torch.distributed``
            world size (1 without a process group).
        rank: this process's rank; defaults to the ``torch.distributed`` rank (0).
        shuffle: shuffle the order (and, with ``random_level``, the grouping)
            every epoch. With ``False`` a replica sees its samples by increasing complexity.
        seed: shuffling seed, identical on every replica.
        drop_last: drop samples so that the dataset divides evenly (when
            shuffling, a different random set each epoch), instead of padding.
        random_level: from 0 (best balance) to 1 (noise as large as the range
            of complexities added before grouping); used when ``shuffle``.

    Example::

        >>> dataset = torch.utils.data.TensorDataset(torch.randn(n, 2), torch.randperm(n))  # doctest: +SKIP
        >>> sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=lambda x: x[1])  # doctest: +SKIP
        >>> loader = rpcdl.RPCDataloader(remote_dataset, sampler=sampler, batch_size=32)  # doctest: +SKIP
        >>> for epoch in range(n_epochs):  # doctest: +SKIP
        ...     sampler.set_epoch(epoch)
        ...     train(loader)
    """

    def __init__(
        self,
        dataset: Dataset,
        complexity_fn: Callable[[Any], Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        random_level: float = 0,
    ):
        if not callable(complexity_fn):
            raise TypeError(f"complexity_fn must be a callable from a sample to a number, got {complexity_fn!r}")
        check_number(random_level, "random_level", minimum=0, maximum=1)
        check_int(seed, "seed", wrong_type=TypeError)
        self.rank, self.num_replicas = rank_and_world_size(rank, num_replicas)
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.random_level = float(random_level)
        self.epoch = 0
        self.complexities = _compute_complexities(dataset, complexity_fn)
        size = len(self.complexities)
        if self.drop_last and size % self.num_replicas:
            self.num_samples = size // self.num_replicas
        else:
            self.num_samples = -(-size // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        spread = max(self.complexities, default=0) - min(self.complexities, default=0)
        self.noise_range = spread * self.random_level

    def shares(self) -> list[list[int]]:
        """Every replica's indices for the current epoch, in the order each replica reads them."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        size = len(self.complexities)
        order = torch.randperm(size, generator=generator).tolist() if self.shuffle else list(range(size))
        if self.drop_last:
            order = order[: self.total_size]
        elif order:
            padding = self.total_size - size
            order += (order * (-(-padding // size)))[:padding]
        keys = [float(self.complexities[index]) for index in order]
        if self.shuffle and self.noise_range > 0:
            noise = torch.rand(len(order), generator=generator, dtype=torch.float64) * self.noise_range
            keys = [key + extra for key, extra in zip(keys, noise.tolist(), strict=True)]
        ranked = [order[i] for i in sorted(range(len(order)), key=keys.__getitem__)]
        replicas = self.num_replicas
        chunks = [ranked[start : start + replicas] for start in range(0, len(ranked), replicas)]
        chunk_order = torch.randperm(len(chunks), generator=generator).tolist() if self.shuffle else range(len(chunks))
        return [[chunks[c][r] for c in chunk_order] for r in range(replicas)]

    def __iter__(self) -> Iterator[int]:
        indices = self.shares()[self.rank]
        assert len(indices) == self.num_samples
        return iter(indices)

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch: with ``shuffle``, each epoch has its own order, the same on every replica."""
        self.epoch = check_int(epoch, "epoch", wrong_type=TypeError)


class LoadBalancingDistributedBatchSampler(Sampler[list[int]]):
    """Groups a :class:`LoadBalancingDistributedSampler`'s indices into variable-sized batches.

    ``batch_fn`` turns a replica's list of indices into a list of batches (say,
    as many samples as fit a token budget). Replicas may then have different
    numbers of batches: with ``drop_last`` every replica keeps as many as the
    one with fewest, otherwise every replica is padded (with its own first
    batches again) to as many as the one with most, so all take the same
    number of steps.

    Args:
        sampler: the load-balancing sampler to draw indices from.
        batch_fn: ``batch_fn(indices: list[int]) -> list[list[int]]``.
        drop_last: drop batches beyond the smallest count instead of padding.

    Example::

        >>> sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=complexity_fn)  # doctest: +SKIP
        >>> batch_sampler = LoadBalancingDistributedBatchSampler(sampler, batch_fn=batch_fn)  # doctest: +SKIP
        >>> loader = rpcdl.RPCDataloader(remote_dataset, batch_sampler=batch_sampler)  # doctest: +SKIP
        >>> for epoch in range(n_epochs):  # doctest: +SKIP
        ...     batch_sampler.set_epoch(epoch)
        ...     train(loader)
    """

    def __init__(
        self,
        sampler: LoadBalancingDistributedSampler,
        batch_fn: Callable[[list[int]], list[list[int]]],
        drop_last: bool = False,
    ):
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise TypeError(f"sampler must be a LoadBalancingDistributedSampler, got {type(sampler).__name__}")
        if not callable(batch_fn):
            raise TypeError(
                f"batch_fn must be a callable from a list of indices to a list of batches, got {batch_fn!r}"
            )
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = bool(drop_last)
        self.num_replicas = sampler.num_replicas
        self.rank = sampler.rank
        self._lock = threading.Lock()  # guards the batches built, and their epoch
        self._epoch_built: int | None = None
        self._batches: list[list[int]] = []

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def epoch(self) -> int:
        """The epoch of the underlying sampler."""
        return self.sampler.epoch

    def _build(self) -> list[list[int]]:
        with self._lock:
            return self._build_locked()

    def _build_locked(self) -> list[list[int]]:
        if self._epoch_built == self.sampler.epoch:
            return self._batches
        per_replica = []
        for rank, indices in enumerate(self.sampler.shares()):
            batches = [list(batch) for batch in self.batch_fn(list(indices))]
            if indices and not batches:
                raise ValueError(f"batch_fn returned no batches for replica {rank}'s {len(indices)} indices")
            per_replica.append(batches)
        counts = [len(batches) for batches in per_replica]
        target = min(counts) if self.drop_last else max(counts)
        mine = per_replica[self.rank]
        if len(mine) >= target or not mine:
            mine = mine[:target]
        else:
            mine = mine + (mine * (-(-(target - len(mine)) // len(mine))))[: target - len(mine)]
        self._batches, self._epoch_built = mine, self.sampler.epoch
        return mine

    def __iter__(self) -> Iterator[list[int]]:
        return iter(list(self._build()))

    def __len__(self) -> int:
        return len(self._build())

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the underlying sampler (see :meth:`LoadBalancingDistributedSampler.set_epoch`)."""
        self.sampler.set_epoch(epoch)
