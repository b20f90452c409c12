"""Resume anywhere: an epoch's global order, split among any number of ranks, and positions in it.

torch's ``DistributedSampler`` lays an epoch out as one global order (a random
permutation of the dataset's indices drawn from ``seed + epoch``, or the indices
in turn), padded with its first positions to a multiple of the world size ``W``
(or cut to one with ``drop_last``), and gives rank ``r`` the positions
``r, r + W, r + 2W, ...``. Once every rank has yielded ``k`` batches of ``B``
samples, positions ``0 .. k*W*B - 1`` of the order are consumed, whatever ``W``.

An :class:`Origin` is where an epoch resumed on another cluster shape starts:
the positions consumed before it (every position below ``consumed``, and those
in ``consumed_extra``) and the batches counted before it (``first_batch``). The
positions left are laid out as ``DistributedSampler`` lays out a whole epoch
(:func:`layout_positions`): so a whole epoch (:data:`WHOLE_EPOCH`) is exactly
``DistributedSampler``'s, and a resumed epoch split again among the same ranks
continues exactly where it stopped.

Threading: the functions are pure. An :class:`ElasticDistributedSampler`'s
origin, epoch and count of samples yielded are guarded by its lock: a loader
sets the origin (on the user's thread, or as an epoch begins under its book's
lock), the thread iterating it counts, any thread may ask its length.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DistributedSampler

__all__ = [
    "ORDER_FIELDS",
    "WHOLE_EPOCH",
    "ElasticDistributedSampler",
    "Origin",
    "advance",
    "batch_positions",
    "layout_positions",
    "remaining_count",
]

#: The fields of a layout that decide an epoch's global order (a state whose layout differs in one is refused).
ORDER_FIELDS = ("length", "shuffle", "seed")


@dataclasses.dataclass(frozen=True, slots=True)
class Origin:
    """Where an epoch's layout starts (see the module).

    Attributes:
        consumed: every position of the global order below it was consumed before.
        consumed_extra: positions above ``consumed`` consumed before, sorted.
        first_batch: the number given to the first batch of the layout (the
            batches counted before it, on the ranks that took them).
    """

    consumed: int = 0
    consumed_extra: tuple[int, ...] = ()
    first_batch: int = 0

    def as_state(self) -> dict[str, Any]:
        """The origin as plain data (a state's ``origin`` field)."""
        return {"consumed": self.consumed, "consumed_extra": list(self.consumed_extra), "first_batch": self.first_batch}

    @classmethod
    def from_state(cls, value: Any, length: int) -> Origin:
        """The origin a state's ``origin`` field describes, for an order of ``length`` positions.

        Raises:
            TypeError: ``value`` is not a dict of integers (and a list of them).
            ValueError: a field is missing or out of range.
        """
        if not isinstance(value, dict) or not {"consumed", "consumed_extra", "first_batch"} <= value.keys():
            raise TypeError(
                f"a state's origin must be a dict with consumed, consumed_extra and first_batch, got {value!r:.100}"
            )
        consumed, extra, first = value["consumed"], value["consumed_extra"], value["first_batch"]
        check_position(consumed, extra, length, "origin")
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise TypeError(f"origin.first_batch must be a non-negative integer, got {first!r:.100}")
        return cls(consumed, tuple(sorted(extra)), first)


#: The origin of an epoch that starts at its beginning.
WHOLE_EPOCH = Origin()


def check_position(consumed: Any, extra: Any, length: int, name: str) -> None:
    """Raise unless ``consumed`` (an integer in ``0..length``) and ``extra`` (distinct positions above it,
    below ``length``) describe positions consumed in an order of ``length`` positions."""
    if isinstance(consumed, bool) or not isinstance(consumed, int):
        raise TypeError(f"{name}.consumed must be an integer, got {consumed!r:.100}")
    if not 0 <= consumed <= length:
        raise ValueError(f"{name}.consumed={consumed} is out of range: the epoch's order has {length} positions")
    if not isinstance(extra, (list, tuple)) or any(isinstance(p, bool) or not isinstance(p, int) for p in extra):
        raise TypeError(f"{name}.consumed_extra must be a list of positions (integers), got {extra!r:.100}")
    if len(set(extra)) != len(extra) or any(not consumed < p < length for p in extra):
        raise ValueError(
            f"{name}.consumed_extra must list distinct positions above consumed={consumed} and below {length}, "
            f"got {sorted(extra)!r:.100}"
        )


def remaining_count(length: int, origin: Origin) -> int:
    """How many positions of an order of ``length`` are left after ``origin``."""
    return length - origin.consumed - len(origin.consumed_extra)


def layout_positions(length: int, origin: Origin, world_size: int, drop_last: bool) -> list[int]:
    """The positions left after ``origin``, laid out for ``world_size`` ranks (rank ``r`` takes ``[r::world_size]``).

    Padded with the order's first positions (already consumed, or repeated) to a
    multiple of ``world_size``, or cut to one with ``drop_last``: for
    :data:`WHOLE_EPOCH`, exactly ``DistributedSampler``'s layout.

    Example::

        >>> layout_positions(5, WHOLE_EPOCH, 2, drop_last=False)
        [0, 1, 2, 3, 4, 0]
        >>> layout_positions(5, Origin(2, (3,)), 2, drop_last=False)
        [2, 4]
    """
    skipped = set(origin.consumed_extra)
    positions = [p for p in range(origin.consumed, length) if p not in skipped]
    if drop_last:
        return positions[: len(positions) - len(positions) % world_size]
    padding = -len(positions) % world_size
    if padding and length:
        positions += (list(range(length)) * -(-padding // length))[:padding]
    return positions


def batch_positions(share: Sequence[int], batch_size: int, batch: int) -> Sequence[int]:
    """The positions of batch ``batch`` (counted from the layout's first) of a rank's ``share``."""
    return share[batch * batch_size : (batch + 1) * batch_size]


def share_batches(share_length: int, batch_size: int, drop_last: bool) -> int:
    """How many batches a rank's share of ``share_length`` positions makes."""
    return share_length // batch_size if drop_last else -(-share_length // batch_size)


def advance(origin: Origin, taken: Iterable[int]) -> tuple[int, tuple[int, ...]]:
    """``(consumed, consumed_extra)`` once the positions ``taken`` are consumed after ``origin``'s.

    Example::

        >>> advance(Origin(2, (5,)), [2, 3])
        (4, (5,))
    """
    done = set(origin.consumed_extra)
    done.update(taken)
    consumed = origin.consumed
    while consumed in done:
        done.discard(consumed)
        consumed += 1
    return consumed, tuple(sorted(p for p in done if p > consumed))


def lockstep_consumed(
    length: int,
    origin: Origin,
    world_size: int,
    drop_last: bool,
    samples: int,
    extra: Iterable[int] = (),
) -> tuple[int, tuple[int, ...]]:
    """The global position once every rank has taken the first ``samples`` of its share after ``origin``
    (and the positions ``extra`` besides): ``(consumed, consumed_extra)``."""
    taken_extra = list(extra)
    if not origin.consumed_extra and not taken_extra:  # the common case, without building the layout
        cut = remaining_count(length, origin)
        if drop_last:
            cut -= cut % world_size
        return min(origin.consumed + world_size * samples, origin.consumed + cut), ()
    positions = layout_positions(length, origin, world_size, drop_last)
    return advance(origin, [*positions[: world_size * samples], *taken_extra])


# ---------------------------------------------------------------------------- the sampler


class ElasticDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` whose epoch can resume from a global position taken on another world size.

    A whole epoch is exactly ``DistributedSampler``'s (the same order, padding
    and shares, for the same ``seed``). An epoch resumed from an
    :class:`~rpcdl.data.elastic.Origin` (:meth:`set_origin`) lays the positions left out among this sampler's
    ``num_replicas`` ranks the same way, so every sample not consumed before is
    taken once. :func:`rpcdl.distributed.distributed_loader` and
    ``RPCDataModule`` build their loaders on it; their states hold the global
    position. Its own :meth:`state_dict` (a ``torchdata.nodes.SamplerWrapper``
    saves it) holds the same.

    Args:
        dataset, num_replicas, rank, shuffle, seed, drop_last: as ``DistributedSampler``'s.

    Example::

        >>> sampler = ElasticDistributedSampler(range(10), num_replicas=2, rank=1, shuffle=False)
        >>> list(sampler)
        [1, 3, 5, 7, 9]
        >>> sampler.set_origin(Origin(consumed=4))
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

    def layout(self) -> dict[str, Any]:
        """What decides the order and its split: ``length``, ``shuffle``, ``seed``, ``world_size``, ``rank``,
        ``drop_last``."""
        return {
            "length": len(self.dataset),
            "shuffle": self.shuffle,
            "seed": self.seed,
            "world_size": self.num_replicas,
            "rank": self.rank,
            "drop_last": self.drop_last,
        }

    @property
    def origin(self) -> Origin:
        """Where the epoch this sampler iterates next (or now) starts."""
        with self._lock:
            return self._origin

    def set_origin(self, origin: Origin) -> None:
        """Make the epoch start at ``origin`` (:data:`~rpcdl.data.elastic.WHOLE_EPOCH`: at its beginning)."""
        if origin.consumed > len(self.dataset):
            raise ValueError(f"origin {origin} is beyond the {len(self.dataset)} samples of the dataset")
        with self._lock:
            self._origin, self._skip = origin, 0

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; another epoch than the one set starts at its beginning."""
        with self._lock:
            if epoch != self.epoch:
                self._origin, self._skip = WHOLE_EPOCH, 0
            self.epoch = epoch

    def share_length(self, origin: Origin) -> int:
        """How many samples this rank takes in an epoch starting at ``origin``."""
        left = remaining_count(len(self.dataset), origin)
        if self.drop_last:
            return left // self.num_replicas
        return -(-left // self.num_replicas)

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
        rank has yielded as many samples as this one (as data-parallel ranks do).
        """
        with self._lock:
            origin, epoch, yielded = self._origin, self.epoch, self._yielded
        layout = self.layout()
        consumed, extra = lockstep_consumed(layout["length"], origin, self.num_replicas, self.drop_last, yielded)
        return {
            "epoch": epoch,
            "origin": origin.as_state(),
            "yielded": yielded,
            "layout": layout,
            "consumed": consumed,
            "consumed_extra": list(extra),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`, taken by any rank of any world size over the same order.

        Raises:
            TypeError, ValueError: ``state`` is not such a state, or was taken over
                another order (the message names each differing field).
        """
        if not isinstance(state, dict) or not {"epoch", "origin", "yielded", "layout"} <= state.keys():
            raise TypeError(f"not an ElasticDistributedSampler state: {state!r:.200}")
        layout = self.layout()
        refuse_other_order(state["layout"], layout, "sampler")
        length = layout["length"]
        origin = Origin.from_state(state["origin"], length)
        epoch, yielded = state["epoch"], state["yielded"]
        for name, value in (("epoch", epoch), ("yielded", yielded)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TypeError(f"{name} must be a non-negative integer, got {value!r:.100}")
        same = all(state["layout"].get(name) == layout[name] for name in ("world_size", "rank", "drop_last"))
        if same:
            if yielded > self.share_length(origin):
                raise ValueError(f"yielded={yielded} is beyond this rank's share of the epoch")
            skip = yielded
        else:
            old = state["layout"]
            consumed, extra = lockstep_consumed(length, origin, old["world_size"], old["drop_last"], yielded)
            origin, skip = Origin(consumed, extra, 0), 0
        with self._lock:
            self.epoch, self._origin, self._skip = epoch, origin, skip


def refuse_other_order(saved: Any, layout: dict[str, Any], what: str) -> None:
    """Raise ``ValueError`` naming each field of :data:`ORDER_FIELDS` where the ``saved`` layout differs.

    Raises:
        TypeError: ``saved`` is not a layout (a dict with the fields of :meth:`ElasticDistributedSampler.layout`).
    """
    needed = {*ORDER_FIELDS, "world_size", "rank", "drop_last"}
    if not isinstance(saved, dict) or not needed <= saved.keys():
        raise TypeError(f"a state's layout must be a dict with {sorted(needed)}, got {saved!r:.200}")
    differences = [
        f"{name}: the state has {saved[name]!r}, this {what} has {layout[name]!r}"
        for name in ORDER_FIELDS
        if saved[name] != layout[name]
    ]
    if differences:
        raise ValueError(
            "this state was taken over another order of the samples; resuming would skip or repeat samples. "
            f"Differences: {'; '.join(differences)}. Build the sampler with the same dataset (length), shuffle "
            "and seed, or start the epoch again (load no state, or set_epoch to the state's epoch)"
        )
