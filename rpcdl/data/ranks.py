"""Helpers for data-parallel training: split workers and data across ranks (public as :mod:`rpcdl.distributed`).

Threading: plain functions; they keep no state (the rank and world size come
from the arguments or from torch.distributed's initialized group).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch.distributed as dist
from torch.utils.data import RandomSampler

from ..address import check_workers
from ..checks import check_int, check_positive_int
from .dataloader import RPCDataloader
from .elastic import ElasticDistributedSampler
from .resume import merge_states
from .shares import rank_share

__all__ = ["distributed_loader", "merge_states", "rank_and_world_size", "shard_workers"]


def rank_and_world_size(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: those given, else the initialized torch.distributed group's, else ``(0, 1)``."""
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    check_positive_int(world_size, "world_size")
    check_int(rank, "rank", minimum=0, maximum=world_size - 1, meaning=f"one of the {world_size} ranks")
    return rank, world_size


def shard_workers(
    workers: Sequence[str], rank: int | None = None, world_size: int | None = None, *, changing: bool = False
) -> list[str]:
    """The workers rank ``rank`` of ``world_size`` uses.

    With ``changing=False`` (the default, for a fixed list), ``workers[rank::world_size]``; with fewer workers
    than ranks, ranks share them (rank ``r`` uses worker ``r % len(workers)``) and a warning says so.

    With ``changing=True`` (for a list that changes, such as a worker source's), the rank's share of a balanced
    assignment (:func:`rpcdl.data.shares.assignment`) that a join or a leave disturbs little: every rank gets
    ``floor(W/R)`` or ``ceil(W/R)`` of the ``W`` workers (with fewer workers than ranks: one each, and no
    worker serves more than ``ceil(R/W)`` ranks). It depends only on the set of addresses and ``world_size``,
    not on their order, so every rank computes the same assignment without talking. This is the share a
    :class:`~rpcdl.data.sources.Fleet` over a changing source prefers.

    ``rank`` and ``world_size`` default to those of the initialized ``torch.distributed`` group, else 0 and 1.

    Args:
        workers: the workers' ``HOST:PORT`` addresses.
        rank, world_size: this rank and the number of ranks.
        changing: whether the list changes while the job runs (then the balanced assignment).

    Returns:
        this rank's workers, in the order of ``workers``.

    Raises:
        TypeError, ValueError: ``workers`` is not a list of addresses, or ``rank`` is not one of the ranks.

    Example::

        >>> shard_workers(["a:1", "b:1", "c:1", "d:1"], rank=1, world_size=2)
        ['b:1', 'd:1']
        >>> workers = [f"10.0.0.{i}:6543" for i in range(10)]
        >>> sorted(len(shard_workers(workers, rank, 4, changing=True)) for rank in range(4))
        [2, 2, 3, 3]
    """
    workers = check_workers(workers)
    rank, world_size = rank_and_world_size(rank, world_size)
    if not isinstance(changing, bool):
        raise TypeError(f"changing must be True or False (whether the list of workers changes), got {changing!r}")
    if changing:
        return list(rank_share(workers, rank, world_size))
    if len(workers) < world_size:
        warnings.warn(
            f"{len(workers)} workers for {world_size} ranks: ranks share workers; start at least one per rank",
            stacklevel=2,
        )
        return [workers[rank % len(workers)]]
    return list(workers[rank::world_size])


def distributed_loader(
    loader: RPCDataloader,
    world_size: int | None = None,
    rank: int | None = None,
    shuffle: bool | None = None,
    *,
    seed: int = 0,
    drop_last: bool | None = None,
) -> RPCDataloader:
    """A copy of ``loader`` that reads only this rank's share of the dataset.

    The copy draws indices from an
    :class:`~rpcdl.data.elastic.ElasticDistributedSampler`, a
    :class:`~torch.utils.data.DistributedSampler` (every rank sees a disjoint
    shard, padded to equal length unless ``drop_last``) whose epochs resume on
    another cluster shape, and keeps the other settings of ``loader``. Like
    aitoolbox's ``DDPHandler.build_loader_sampler`` for rpcdl loaders.

    Its ``state_dict()`` holds the global position in the epoch (the samples
    consumed in the epoch's global order, counting every rank as having
    yielded the batches this one did, as data-parallel ranks do), with the
    world size and batch size it was taken with. ``load_state_dict`` accepts
    the state of any rank of any world size and batch size over the same
    dataset, ``shuffle`` and ``seed``: the samples of the epoch not consumed
    yet are split among the new ranks, each once (padded, or cut with
    ``drop_last``, as ``DistributedSampler`` does). The state of a rank that
    yielded batches out of order (``in_order=False``) resumes on that rank of
    the same world size; :func:`merge_states` joins every rank's into one that
    resumes anywhere. Give ``rank`` and ``world_size`` to build every rank's
    loader in one process (no process group needed).

    Args:
        loader: the single-process loader.
        world_size, rank: default to the initialized ``torch.distributed`` group's.
        shuffle: shuffle the shard; defaults to whether ``loader`` shuffles.
        seed: seed of the sampler's shuffling, the same on every rank.
        drop_last: defaults to ``loader.drop_last``.

    Returns:
        the new loader; its sampler is ``new_loader.sampler`` (call ``set_epoch``
        on the loader or the sampler each epoch).

    Example::

        >>> train = distributed_loader(RPCDataloader(dataset, batch_size=32, shuffle=True))  # doctest: +SKIP
    """
    if not isinstance(loader, RPCDataloader):
        raise TypeError(f"loader must be an RPCDataloader, got {type(loader).__name__}")
    if loader.batch_size is None and loader.batch_sampler is not None:
        raise ValueError("distributed_loader needs a loader built with batch_size, not with a custom batch_sampler")
    rank, world_size = rank_and_world_size(rank, world_size)
    if shuffle is None:
        shuffle = isinstance(loader.sampler, RandomSampler)
    drop_last = loader.drop_last if drop_last is None else drop_last
    sampler = ElasticDistributedSampler(
        loader.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    return RPCDataloader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        prefetch_factor=loader.prefetch_factor,
        max_batches_per_call=loader.max_batches_per_call,
        in_order=loader.in_order,
        seed=loader.seed,
    )
