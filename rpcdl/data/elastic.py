"""ElasticDistributedSampler: ``DistributedSampler``'s epochs, each laid out from an origin.

A whole epoch is exactly ``DistributedSampler``'s. An epoch can instead start
at an :class:`~rpcdl.data.resume.Origin` (the positions of the epoch's global
order consumed before, on another cluster shape): the positions left are laid
out the same way among this sampler's ranks. What a state holds and how it
is read is :mod:`rpcdl.data.resume`'s alone; this module keeps the sampler's
epoch, its origin and the samples it yielded.

Threading: the sampler's origin, epoch and count of samples yielded are
guarded by its lock: a loader tells it the epoch and its origin at once (as
an epoch begins, under the loader's book's lock), the user's thread may set
the epoch or load a state, the thread iterating it counts, any thread may ask
its length.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from .resume import (
    WHOLE_EPOCH,
    Layout,
    Origin,
    layout_positions,
    read_sampler_state,
    share_length,
    write_sampler_state,
)

__all__ = ["ElasticDistributedSampler"]


class ElasticDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` whose epoch can resume from a global position taken on another world size.

    A whole epoch is exactly ``DistributedSampler``'s (the same order, padding
    and shares, for the same ``seed``). An epoch begun at an
    :class:`~rpcdl.data.resume.Origin` (:meth:`begin_epoch`) lays the positions
    left out among this sampler's ``num_replicas`` ranks the same way, so every
    sample not consumed before is taken once.
    :func:`rpcdl.distributed.distributed_loader` and ``RPCDataModule`` build
    their loaders on it; their states hold the global position. Its own
    :meth:`state_dict` (a ``torchdata.nodes.SamplerWrapper`` saves it) holds
    the same.

    Args:
        dataset, num_replicas, rank, shuffle, seed, drop_last: as ``DistributedSampler``'s.

    Example::

        >>> sampler = ElasticDistributedSampler(range(10), num_replicas=2, rank=1, shuffle=False)
        >>> list(sampler)
        [1, 3, 5, 7, 9]
        >>> sampler.begin_epoch(0, Origin(consumed=4))
        >>> list(sampler)
        [5, 7, 9]
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self._lock = threading.Lock()  # guards _origin, _skip, _yielded and the epoch
        self._origin = WHOLE_EPOCH
        self._skip = 0  # samples of the share the next iteration skips (a state loaded by load_state_dict)
        self._yielded = 0  # samples of the share the iteration in progress has yielded (skipped ones included)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ layout

    def layout(self) -> Layout:
        """What decides the order and its split: the dataset's length, ``shuffle``, ``seed``, the world size,
        the rank and ``drop_last``."""
        return Layout(len(self.dataset), self.shuffle, self.seed, self.num_replicas, self.rank, self.drop_last)

    @property
    def origin(self) -> Origin:
        """Where the epoch this sampler iterates next (or now) starts."""
        with self._lock:
            return self._origin

    def begin_epoch(self, epoch: int, origin: Origin) -> None:
        """Make the next iteration epoch ``epoch``, starting at ``origin``
        (:data:`~rpcdl.data.resume.WHOLE_EPOCH`: at its beginning). A loader calls it as each epoch begins.

        Raises:
            ValueError: ``origin`` is beyond the dataset.
        """
        if origin.consumed > len(self.dataset):
            raise ValueError(f"origin {origin} is beyond the {len(self.dataset)} samples of the dataset")
        with self._lock:
            self.epoch, self._origin, self._skip = epoch, origin, 0

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; another epoch than the one set starts at its beginning."""
        with self._lock:
            if epoch != self.epoch:
                self._origin, self._skip = WHOLE_EPOCH, 0
            self.epoch = epoch

    def share_length(self, origin: Origin) -> int:
        """How many samples this rank takes in an epoch starting at ``origin``."""
        return share_length(self.layout(), origin)

    def share(self, origin: Origin) -> list[int]:
        """The positions of the global order this rank takes in an epoch starting at ``origin``."""
        positions = layout_positions(len(self.dataset), origin, self.num_replicas, self.drop_last)
        return positions[self.rank :: self.num_replicas]

    def order(self, epoch: int) -> list[int]:
        """The global order of epoch ``epoch``: dataset indices by position (``DistributedSampler``'s)."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            return torch.randperm(len(self.dataset), generator=generator).tolist()
        return list(range(len(self.dataset)))

    # ------------------------------------------------------------------ sampling

    def __iter__(self) -> Iterator[int]:
        with self._lock:
            origin, epoch, skip = self._origin, self.epoch, self._skip
            self._skip, self._yielded = 0, skip
        order = self.order(epoch)
        return self._count(order[position] for position in self.share(origin)[skip:])

    def _count(self, indices: Iterator[int]) -> Iterator[int]:
        for index in indices:
            with self._lock:
                self._yielded += 1
            yield index

    def __len__(self) -> int:
        return self.share_length(self.origin)

    # ------------------------------------------------------------------ its own state (torchdata)

    def state_dict(self) -> dict[str, Any]:
        """The epoch, its origin, the samples this rank yielded in it, and the layout: the global position.

        ``consumed`` and ``consumed_extra`` are the global position once every
        rank has yielded as many samples as this one (as data-parallel ranks do);
        :mod:`rpcdl.data.resume` writes the state.

        Returns:
            the state, plain data.

        Example::

            >>> sampler = ElasticDistributedSampler(range(10), num_replicas=2, rank=0, shuffle=False)
            >>> iterator = iter(sampler)
            >>> next(iterator), next(iterator)
            (0, 2)
            >>> sampler.state_dict()["consumed"]
            4
        """
        with self._lock:
            origin, epoch, yielded = self._origin, self.epoch, self._yielded
        return write_sampler_state(epoch, origin, yielded, self.layout())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`, taken by any rank of any world size over the same order.

        Args:
            state: what :meth:`state_dict` returned.

        Raises:
            TypeError, ValueError: ``state`` is not such a state, or was taken over
                another order (the message names each differing field).

        Example::

            >>> sampler.load_state_dict(other_rank_sampler.state_dict())  # doctest: +SKIP
        """
        start = read_sampler_state(state, self.layout())
        with self._lock:
            self.epoch, self._origin, self._skip = start.epoch, start.origin, start.skip
