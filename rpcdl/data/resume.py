"""Resume: the one format of a loader's and a sampler's state, written and read here alone.

Design. A state is a versioned dict (:data:`STATE_VERSION`) of plain data
(but ``generator_state``, a tensor), so a checkpoint holds it as it is. Every
decision about a state lives in this module; the loader, the sampler and the
integrations only call it:

- writing: :func:`write_loader_state` (what ``RPCDataloader.state_dict``
  returns) and :func:`write_sampler_state` (``ElasticDistributedSampler``'s);
- reading: :func:`read_loader_state` and :func:`read_sampler_state` check a
  state (a clear ``TypeError`` or ``ValueError`` naming the field, or each
  difference with both values) and compute, once, where the epoch resumes: a
  :class:`LoaderPosition` (the book of the loader's epochs keeps it and hands
  the sampler its origin once, as the epoch begins) or a
  :class:`SamplerStart`;
- :func:`merge_states`: the ranks' states of one step, joined into one.

One position format: what a rank yielded of its epoch is a :class:`Yielded`,
items ``0 .. prefix - 1`` and ``extra`` beyond, counted from the epoch's
:class:`Origin`, each item a batch of the loader (or a sample of the sampler).
The loader's state writes it as ``yielded_prefix`` and ``yielded_extra`` (batch
numbers, counted on from the batches before the origin), the sampler's as
``yielded`` (samples). The global position, ``consumed`` and
``consumed_extra``, is derived from it in one function,
:func:`consumed_in_lockstep`.

What a state holds. Every loader state: ``version``, the position
(``epoch``, ``yielded_prefix``, ``yielded_extra``, ``generator_state``: the
sampler's random generator at the start of the epoch) and what determines the
epoch's batches (:data:`SHAPE_FIELDS`); a position only means something in a
loader that makes the same batches, so a loader whose shape differs refuses
it. A loader over an ``ElasticDistributedSampler`` (made by
:func:`rpcdl.distributed.distributed_loader`, or by ``RPCDataModule``) adds
the global position: the sampler's ``layout`` (:class:`Layout`), the
``origin`` of the epoch's layout, ``consumed`` and ``consumed_extra``.

The global position. torch's ``DistributedSampler`` lays an epoch out as one
global order (a permutation drawn from ``seed + epoch``, or the indices in
turn), padded with its first positions to a multiple of the world size ``W``
(or cut to one with ``drop_last``), and gives rank ``r`` the positions ``r, r +
W, r + 2W, ...``. Once every rank has yielded ``k`` batches of ``B`` samples,
positions ``0 .. k*W*B - 1`` are consumed, whatever ``W``: the global position
assumes every rank yielded what this one did (data-parallel ranks do, with
``in_order=True``). An :class:`Origin` is where an epoch resumed on another
shape starts: the positions consumed before it and the batches counted before
it; the positions left are laid out as ``DistributedSampler`` lays out a whole
epoch (:func:`layout_positions`), so a whole epoch (:data:`WHOLE_EPOCH`) is
``DistributedSampler``'s.

Reading a distributed loader's state: one taken by the same rank, world size,
batch size and ``drop_last`` resumes exactly where that rank stopped; any
other resumes from its global position, the positions left split among the
new ranks, each once. A state over another order (dataset length,
``shuffle``, ``seed``) is refused, unless it is at the start of an epoch (a
checkpoint saved at an epoch's end): it then only names the epoch. A rank's
state with batches yielded out of order resumes on that rank alone;
:func:`merge_states` joins every rank's into one that resumes anywhere. Only
the format this module writes is read (:data:`STATE_VERSION`).

Threading: pure functions and frozen values; the callers own what they pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from ..checks import check_int

__all__ = [
    "ORDER_FIELDS",
    "POSITION_FIELDS",
    "SEED_SOURCES",
    "SHAPE_FIELDS",
    "STATE_VERSION",
    "WHOLE_EPOCH",
    "Layout",
    "LoaderPosition",
    "Origin",
    "SamplerStart",
    "Shaped",
    "Yielded",
    "advance",
    "consumed_in_lockstep",
    "epoch_batches",
    "layout_positions",
    "loader_shape",
    "merge_states",
    "read_loader_state",
    "read_sampler_state",
    "refuse_other_order",
    "share_length",
    "write_loader_state",
    "write_sampler_state",
]

#: The version of the state format written and read here (a state's ``version``).
STATE_VERSION = 1

#: The fields of a loader state that determine the batch sequence of an epoch.
SHAPE_FIELDS = ("batches", "batch_size", "drop_last", "sampler", "batch_sampler", "in_order", "seed_source")

#: The fields of a loader state that say where its epoch is.
POSITION_FIELDS = ("epoch", "yielded_prefix", "yielded_extra")

#: The fields a distributed loader's state adds: the global position.
GLOBAL_FIELDS = ("layout", "origin", "consumed", "consumed_extra")

#: The fields of a layout that decide an epoch's global order (a state whose layout differs in one is refused).
ORDER_FIELDS = ("length", "shuffle", "seed")

#: Where a loader's random order comes from (a state's ``seed_source``): the sampler's own generator
#: (the loader's ``generator=``, or a ``RandomSampler(generator=...)``); a generator drawn from torch's
#: global one at each epoch (a ``RandomSampler`` without one); or the sampler alone (no random order
#: drawn by the loader: a sequential sampler, or one seeded by its own ``seed``, as ``DistributedSampler``).
SEED_SOURCES = ("generator", "global", "sampler")

#: The shape fields that may differ between a state and a distributed loader resuming it from its global position.
_SPLIT_FIELDS = ("batches", "batch_size", "drop_last", "in_order")

#: The samplers whose split among ranks is by complexity (their names, as a shape holds them).
_LOAD_BALANCING = ("LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler")

#: The fields of a sampler state.
_SAMPLER_FIELDS = ("version", "epoch", "origin", "yielded", "layout")


# ---------------------------------------------------------------------------- positions in an epoch's order


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
        _check_global_position(consumed, extra, length, "origin")
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise TypeError(f"origin.first_batch must be a non-negative integer, got {first!r:.100}")
        return cls(consumed, tuple(sorted(extra)), first)


#: The origin of an epoch that starts at its beginning.
WHOLE_EPOCH = Origin()


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """What decides an epoch's global order and its split among ranks (an ``ElasticDistributedSampler``'s).

    Attributes:
        length: the dataset's length.
        shuffle, seed: the order is a permutation drawn from ``seed + epoch``, or the indices in turn.
        world_size: the ranks it is split among.
        rank: the rank whose share it is; ``None`` in a state merged from every rank's.
        drop_last: the order is cut to a multiple of ``world_size`` instead of padded.
    """

    length: int
    shuffle: bool
    seed: int
    world_size: int
    rank: int | None
    drop_last: bool

    def as_state(self) -> dict[str, Any]:
        """The layout as plain data (a state's ``layout`` field)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, value: Any) -> Layout:
        """The layout a state's ``layout`` field describes.

        Raises:
            TypeError: ``value`` is not a dict with the fields of a layout.
        """
        names = [field.name for field in dataclasses.fields(cls)]
        if not isinstance(value, dict) or not set(names) <= value.keys():
            raise TypeError(f"a state's layout must be a dict with {sorted(names)}, got {value!r:.200}")
        length, world_size = value["length"], value["world_size"]
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise TypeError(f"layout.length must be a non-negative integer, got {length!r:.100}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise TypeError(f"layout.world_size must be a positive integer, got {world_size!r:.100}")
        return cls(**{name: value[name] for name in names})


def _check_global_position(consumed: Any, extra: Any, length: int, name: str) -> None:
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


def layout_positions(length: int, origin: Origin, world_size: int, drop_last: bool) -> list[int]:
    """The positions left after ``origin``, laid out for ``world_size`` ranks (rank ``r`` takes ``[r::world_size]``).

    Padded with the order's first positions (already consumed, or repeated) to a
    multiple of ``world_size``, or cut to one with ``drop_last``: for
    :data:`WHOLE_EPOCH`, exactly ``DistributedSampler``'s layout.

    Args:
        length: the positions of the order.
        origin: what was consumed before.
        world_size: the ranks.
        drop_last: cut instead of pad.

    Returns:
        the positions, rank ``r``'s at ``r, r + world_size, ...``.

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


def share_length(layout: Layout, origin: Origin) -> int:
    """How many samples a rank of ``layout`` takes in an epoch starting at ``origin``.

    Example::

        >>> share_length(Layout(10, False, 0, 3, 0, drop_last=False), Origin(4))
        2
    """
    left = layout.length - origin.consumed - len(origin.consumed_extra)
    if layout.drop_last:
        return left // layout.world_size
    return -(-left // layout.world_size)


def epoch_batches(layout: Layout, origin: Origin, batch_size: int | None, drop_last: bool) -> int:
    """The batches numbered in an epoch of a loader over a sampler of ``layout`` starting at ``origin``: the
    batches counted before the origin, then the rank's share in batches of ``batch_size`` (``None``: single
    samples).

    Example::

        >>> epoch_batches(Layout(50, True, 0, 4, 0, drop_last=False), Origin(16, (), 2), 3, drop_last=False)
        5
    """
    share = share_length(layout, origin)
    size = batch_size or 1
    batches = share // size if drop_last and batch_size is not None else -(-share // size)
    return origin.first_batch + batches


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


@dataclasses.dataclass(frozen=True, slots=True)
class Yielded:
    """What one rank yielded of its epoch since the origin: items ``0 .. prefix - 1`` and those of ``extra``
    (each above ``prefix``); an item is a batch of a loader, or a sample of a sampler."""

    prefix: int
    extra: tuple[int, ...] = ()


def consumed_in_lockstep(
    layout: Layout, origin: Origin, yielded: Yielded, item_size: int
) -> tuple[int, tuple[int, ...]]:
    """The global position ``(consumed, consumed_extra)`` once every rank of ``layout`` has yielded what
    ``yielded`` says (items of ``item_size`` samples of its share) after ``origin``, as data-parallel ranks do.

    Example::

        >>> consumed_in_lockstep(Layout(50, True, 0, 4, 0, False), WHOLE_EPOCH, Yielded(5), item_size=1)
        (20, ())
    """
    world_size, share = layout.world_size, share_length(layout, origin)
    samples = min(yielded.prefix * item_size, share)
    if not origin.consumed_extra and not yielded.extra:  # the common case, without building the layout
        cut = layout.length - origin.consumed
        if layout.drop_last:
            cut -= cut % world_size
        return min(origin.consumed + world_size * samples, origin.consumed + cut), ()
    positions = layout_positions(layout.length, origin, world_size, layout.drop_last)
    taken = positions[: world_size * samples]
    for item in yielded.extra:
        taken += positions[world_size * item * item_size : world_size * min((item + 1) * item_size, share)]
    return advance(origin, taken)


def refuse_other_order(saved: Layout, layout: Layout, what: str) -> None:
    """Raise ``ValueError`` naming each field of :data:`ORDER_FIELDS` where the ``saved`` layout differs from
    ``layout`` (that of the ``what`` loading it: ``"loader"`` or ``"sampler"``)."""
    differences = [
        f"{name}: the state has {getattr(saved, name)!r}, this {what} has {getattr(layout, name)!r}"
        for name in ORDER_FIELDS
        if getattr(saved, name) != getattr(layout, name)
    ]
    if differences:
        raise ValueError(
            "this state was taken over another order of the samples; resuming would skip or repeat samples. "
            f"Differences: {'; '.join(differences)}. Build the sampler with the same dataset (length), shuffle "
            "and seed, or start the epoch again (load no state, or set_epoch to the state's epoch)"
        )


# ---------------------------------------------------------------------------- a loader's state


class Shaped(Protocol):
    """What a loader's shape is read from (an :class:`~rpcdl.RPCDataloader`)."""

    batch_size: int | None
    drop_last: bool
    sampler: Any
    batch_sampler: Any
    in_order: bool


def loader_shape(loader: Shaped, batches: int | None, seed_source: str) -> dict[str, Any]:
    """The fields of :data:`SHAPE_FIELDS` for ``loader``, with its ``batches`` in an epoch (``None`` for a
    sampler without length) and its ``seed_source`` (one of :data:`SEED_SOURCES`)."""
    batch_sampler = loader.batch_sampler
    return {
        "batches": batches,
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "sampler": _sampler_name(loader.sampler),
        "batch_sampler": _sampler_name(batch_sampler) if batch_sampler is not None else None,
        "in_order": loader.in_order,
        "seed_source": seed_source,
    }


def _sampler_name(sampler: Any) -> str:
    """How a shape names ``sampler``: its class, and for a load-balancing one the world size it splits for
    (its split is by complexity, so a state resumes only on that world size, even where the number of
    batches per rank happens to be the same on another)."""
    name = type(sampler).__qualname__
    if name in _LOAD_BALANCING:
        return f"{name}(num_replicas={sampler.num_replicas})"
    return name


@dataclasses.dataclass(frozen=True, slots=True)
class LoaderPosition:
    """Where a loader's epoch is (or resumes): the position fields of a state, ``origin`` as an :class:`Origin`.

    Attributes:
        epoch: the epoch.
        yielded_prefix: batches numbered below it were yielded (numbers start at ``origin.first_batch``).
        yielded_extra: batches above it yielded (out of order), sorted.
        generator_state: the sampler's random generator at the start of the epoch (``None``: none to restore).
        origin: where the epoch's layout starts (:data:`WHOLE_EPOCH` but in a distributed loader's resumed epoch).
    """

    epoch: int
    yielded_prefix: int = 0
    yielded_extra: tuple[int, ...] = ()
    generator_state: torch.Tensor | None = None
    origin: Origin = WHOLE_EPOCH

    def yielded(self) -> Yielded:
        """The batches yielded, counted from the origin (the one position format)."""
        first = self.origin.first_batch
        return Yielded(self.yielded_prefix - first, tuple(seq - first for seq in self.yielded_extra))


def write_loader_state(
    shape: dict[str, Any],
    position: LoaderPosition,
    layout: Layout | None,
    batch_size: int | None,
    drop_last: bool,
) -> dict[str, Any]:
    """The state of a loader of ``shape`` at ``position`` (what ``RPCDataloader.state_dict`` returns).

    Args:
        shape: the loader's :func:`loader_shape`.
        position: where its epoch is.
        layout: its ``ElasticDistributedSampler``'s layout: the state then holds the global position too;
            ``None`` for other samplers.
        batch_size, drop_last: the loader's.

    Returns:
        the state: plain data, but ``generator_state``.

    Example::

        >>> shape = {"batches": 10, "batch_size": 4, "drop_last": False, "sampler": "SequentialSampler",
        ...          "batch_sampler": "BatchSampler", "in_order": True, "seed_source": "sampler"}
        >>> write_loader_state(shape, LoaderPosition(0, 3), None, 4, False)["yielded_prefix"]
        3
    """
    fields = {
        "version": STATE_VERSION,
        **shape,
        "epoch": position.epoch,
        "yielded_prefix": position.yielded_prefix,
        "yielded_extra": list(position.yielded_extra),
        "generator_state": position.generator_state,
    }
    if layout is None:
        return fields
    origin = position.origin
    consumed, extra = consumed_in_lockstep(layout, origin, position.yielded(), batch_size or 1)
    return {
        **fields,
        # The batches of the position's epoch (the next epoch's may differ from the one just done).
        "batches": epoch_batches(layout, origin, batch_size, drop_last),
        "layout": layout.as_state(),
        "origin": origin.as_state(),
        "consumed": consumed,
        "consumed_extra": list(extra),
    }


def read_loader_state(state: Any, loader: Shaped, seed_source: str, layout: Layout | None) -> LoaderPosition:
    """Check ``state`` for ``loader`` and say where its epoch resumes.

    Args:
        state: what a loader's ``state_dict()`` returned (perhaps through a checkpoint).
        loader: the loader loading it (its shape is compared with the state's).
        seed_source: where its random order comes from (one of :data:`SEED_SOURCES`).
        layout: its ``ElasticDistributedSampler``'s layout; ``None`` for other samplers.

    Returns:
        the position the next epoch continues; its ``origin`` is for the sampler.

    Raises:
        TypeError: ``state`` is not a dict, or a field has the wrong type.
        ValueError: a field is missing or out of range; the state is of another version; it was saved by a
            loader that makes different batches, or over another order (each difference named with both
            values); or it holds batches yielded out of order by one rank of several and is loaded on another
            rank or world size (merge the ranks' states first).

    Example::

        >>> state = loader.state_dict()  # doctest: +SKIP
        >>> read_loader_state(state, loader, "sampler", None).epoch  # doctest: +SKIP
        0
    """
    batch_size, drop_last = loader.batch_size, loader.drop_last
    shape = loader_shape(loader, _whole_epoch_batches(loader, layout), seed_source)
    _check_format(state)
    if layout is None:
        return _same_batches(state, shape, WHOLE_EPOCH)
    if _at_epoch_start(state):
        # Nothing of the epoch consumed: the state names an epoch, which any order starts whole.
        checked = _same_batches(state, {**shape, **{name: state[name] for name in _SPLIT_FIELDS}}, WHOLE_EPOCH)
        return LoaderPosition(checked.epoch)
    _refuse_other_batches(state, {**shape, **{name: state[name] for name in _SPLIT_FIELDS}})
    missing = [name for name in GLOBAL_FIELDS if name not in state]
    if missing:
        raise ValueError(
            f"not a distributed loader's state: missing {missing}; load what the state_dict() of a loader made by "
            "rpcdl.distributed.distributed_loader (or RPCDataModule) returned"
        )
    saved = Layout.from_state(state["layout"])
    refuse_other_order(saved, layout, "loader")
    origin = Origin.from_state(state["origin"], layout.length)
    same_split = (saved.world_size, saved.rank, saved.drop_last) == (
        layout.world_size,
        layout.rank,
        layout.drop_last,
    ) and all(state[name] == shape[name] for name in ("batch_size", "drop_last", "in_order"))
    if same_split:
        position = _same_batches(
            state, {**shape, "batches": epoch_batches(layout, origin, batch_size, drop_last)}, origin
        )
        if position.yielded_prefix < origin.first_batch:
            raise ValueError(
                f"yielded_prefix={position.yielded_prefix} is below the epoch's first batch {origin.first_batch}"
            )
        return position
    # Another rank, world size or batch size: resume from the global position.
    checked = _same_batches(state, {**shape, **{name: state[name] for name in _SPLIT_FIELDS}}, WHOLE_EPOCH)
    if checked.yielded_extra and saved.rank is not None:
        raise ValueError(
            f"this state was taken by rank {saved.rank} of {saved.world_size} with batches yielded out of "
            f"order (in_order=False: {list(checked.yielded_extra[:8])} beyond the first {checked.yielded_prefix}); "
            "it cannot tell which batches the other ranks yielded. Load each rank's own state on the same world "
            "size and batch size, or join all ranks' states with rpcdl.distributed.merge_states(states) and load "
            "the result on any world size"
        )
    consumed, extra = state["consumed"], state["consumed_extra"]
    _check_global_position(consumed, extra, layout.length, "state")
    first = checked.yielded_prefix
    return LoaderPosition(checked.epoch, first, (), None, Origin(consumed, tuple(sorted(extra)), first))


def _whole_epoch_batches(loader: Shaped, layout: Layout | None) -> int | None:
    """The batches of a whole epoch of ``loader`` (``None``: its sampler has no length)."""
    if layout is not None:
        return epoch_batches(layout, WHOLE_EPOCH, loader.batch_size, loader.drop_last)
    try:
        return len(loader.batch_sampler if loader.batch_sampler is not None else loader.sampler)
    except TypeError:
        return None


def _check_format(state: Any) -> None:
    """Raise unless ``state`` is a dict with the fields of this version's loader states."""
    if not isinstance(state, dict):
        raise TypeError(
            f"an RPCDataloader state must be the dict returned by RPCDataloader.state_dict(), "
            f"got {type(state).__name__}: {state!r:.100}"
        )
    missing = [name for name in POSITION_FIELDS if name not in state]
    if missing:
        raise ValueError(
            f"not an RPCDataloader state: missing {missing}; load what RPCDataloader.state_dict() returned"
        )
    _check_version(state, "RPCDataloader")
    missing = [name for name in (*SHAPE_FIELDS, "generator_state") if name not in state]
    if missing:
        raise ValueError(
            f"not an RPCDataloader state: missing {missing}; load what RPCDataloader.state_dict() returned"
        )


def _check_version(state: dict[str, Any], what: str) -> None:
    version = state.get("version")
    if version != STATE_VERSION:
        raise ValueError(
            f"this {what} state has version {version!r}, this rpcdl reads version {STATE_VERSION}: load a state "
            f"that {what}.state_dict() of this rpcdl returned, or start the epoch again (load no state)"
        )


def _refuse_other_batches(state: dict[str, Any], shape: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming each field of :data:`SHAPE_FIELDS` where ``state`` and ``shape`` differ."""
    differences = [
        f"{name}: the state has {state[name]!r}, this loader has {shape[name]!r}"
        for name in SHAPE_FIELDS
        if state[name] != shape[name]
    ]
    if not differences:
        return
    hint = ""
    balancing = [name for name in (shape["sampler"], shape["batch_sampler"]) if name]
    if any(name.startswith(_LOAD_BALANCING) for name in balancing) and any(
        name.startswith(("batches", "sampler", "batch_sampler")) for name in differences
    ):
        hint = (
            " (a load-balancing sampler's state resumes only on the world size it was taken on: the "
            "sampler splits an epoch among ranks by complexity, groups of num_replicas samples sorted by "
            "cost, not by DistributedSampler's layout, which is the one a state taken on W ranks is split "
            "again from; a different number of batches per rank means another world size, or another "
            "dataset, batch_fn or drop_last. Resume on the same world size, or start the epoch again)"
        )
    elif any(name.startswith("seed_source") for name in differences):
        hint = (
            " (seed_source: the random order came from the loader's generator= in one loader and from "
            "torch's global generator in the other; build both the same way)"
        )
    raise ValueError(
        "this state was saved by a loader that makes different batches; resuming would skip or repeat "
        f"samples. Differences: {'; '.join(differences)}{hint}. Load it into a loader built with the same "
        "batch_size, drop_last, sampler, generator and in_order over a dataset of the same length, or "
        "start the epoch again (load no state: the next iteration is a whole epoch). Loaders made by "
        "rpcdl.distributed.distributed_loader (and RPCDataModule) resume on another world size or batch size"
    )


def _same_batches(state: dict[str, Any], shape: dict[str, Any], origin: Origin) -> LoaderPosition:
    """The position of ``state`` (checked) in a loader of ``shape`` that makes the same batches, from ``origin``."""
    _refuse_other_batches(state, shape)
    epoch = _check_counter(state, "epoch")
    prefix = _check_counter(state, "yielded_prefix")
    batches = shape["batches"]
    if batches is not None and prefix > batches:
        raise ValueError(f"yielded_prefix={prefix} is out of range: an epoch of this loader has {batches} batches")
    extra = state["yielded_extra"]
    if not isinstance(extra, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in extra):
        raise TypeError(f"yielded_extra must be a list of batch numbers (integers), got {extra!r:.100}")
    if len(set(extra)) != len(extra):
        raise ValueError(f"yielded_extra lists a batch more than once: {sorted(extra)!r:.100}")
    upper = batches if batches is not None else float("inf")
    outside = [i for i in extra if not prefix < i < upper]
    if outside:
        limit = f" and below {batches}" if batches is not None else ""
        raise ValueError(
            f"yielded_extra holds batch numbers out of range {outside!r:.100}: each must be above "
            f"yielded_prefix={prefix}{limit}"
        )
    generator_state = state["generator_state"]
    if generator_state is not None and not (
        isinstance(generator_state, torch.Tensor) and generator_state.dtype == torch.uint8
    ):
        raise TypeError(
            "generator_state must be None or the uint8 tensor of torch.Generator.get_state(), "
            f"got {type(generator_state).__name__}"
        )
    return LoaderPosition(epoch, prefix, tuple(sorted(extra)), generator_state, origin)


def _check_counter(state: dict[str, Any], name: str) -> int:
    return check_int(state[name], name, minimum=0, wrong_type=TypeError)


def _at_epoch_start(state: dict[str, Any]) -> bool:
    """Whether ``state`` is at the start of its epoch (nothing consumed, nothing yielded)."""
    return (
        state["yielded_prefix"] == 0
        and state["yielded_extra"] == []
        and state.get("consumed") == 0
        and state.get("consumed_extra") == []
    )


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Join the states of every rank of a distributed loader, taken at one step, into one global state.

    Each rank's state already tells the global position when the ranks yielded
    the same batches (``in_order=True``: the batches in order). With
    ``in_order=False`` each rank yielded its own batches out of order; the
    joined state counts every rank's, and resumes on any world size, every
    sample not yielded once.

    Args:
        states: ``state_dict()`` of each rank's loader (made by
            :func:`rpcdl.distributed.distributed_loader`), one per rank, in any order.

    Returns:
        a state any such loader loads, on any world size and batch size.

    Raises:
        ValueError: the states are not one per rank of one world size, or were
            taken at different epochs or over different orders or shapes.

    Example::

        >>> states = [loader.state_dict() for loader in rank_loaders]  # doctest: +SKIP
        >>> new_loader.load_state_dict(merge_states(states))  # doctest: +SKIP
    """
    if not states or not all(isinstance(state, dict) and "layout" in state for state in states):
        raise ValueError("merge_states needs the state_dict() of every rank's distributed_loader, one per rank")
    for state in states:
        _check_format(state)
    first_state = states[0]
    layout = Layout.from_state(first_state["layout"])
    world_size = layout.world_size
    ranks = sorted(state["layout"]["rank"] for state in states)
    if ranks != list(range(world_size)):
        raise ValueError(f"merge_states needs one state per rank of {world_size}: got ranks {ranks}")
    same = ("epoch", "origin", *SHAPE_FIELDS)
    for state in states:
        differing = [name for name in same if state.get(name) != first_state.get(name)]
        layout_differs = {**state["layout"], "rank": 0} != {**first_state["layout"], "rank": 0}
        if differing or layout_differs:
            raise ValueError(
                f"the states of rank {state['layout']['rank']} and rank {first_state['layout']['rank']} differ in "
                f"{differing + (['layout'] if layout_differs else [])}: take every rank's state at the same step"
            )
    origin = Origin.from_state(first_state["origin"], layout.length)
    positions = layout_positions(layout.length, origin, world_size, layout.drop_last)
    size = first_state["batch_size"] or 1
    taken: list[int] = []
    counts = []
    for state in states:
        share = positions[state["layout"]["rank"] :: world_size]
        yielded = [*range(origin.first_batch, state["yielded_prefix"]), *state["yielded_extra"]]
        for seq in yielded:
            batch = seq - origin.first_batch
            taken += share[batch * size : (batch + 1) * size]
        counts.append(len(yielded))
    consumed, extra = advance(origin, taken)
    return {
        **first_state,
        "layout": {**first_state["layout"], "rank": None},
        "yielded_prefix": origin.first_batch + max(counts),
        "yielded_extra": [],
        "consumed": consumed,
        "consumed_extra": list(extra),
    }


# ---------------------------------------------------------------------------- a sampler's state


@dataclasses.dataclass(frozen=True, slots=True)
class SamplerStart:
    """Where an ``ElasticDistributedSampler`` resumes: its ``epoch`` laid out from ``origin``, the first
    ``skip`` samples of its share already taken."""

    epoch: int
    origin: Origin
    skip: int


def write_sampler_state(epoch: int, origin: Origin, yielded: int, layout: Layout) -> dict[str, Any]:
    """An ``ElasticDistributedSampler``'s state: its ``epoch`` from ``origin``, ``yielded`` samples of its share
    taken, its ``layout``, and the global position (every rank counted as having taken as many).

    Example::

        >>> write_sampler_state(0, WHOLE_EPOCH, 5, Layout(50, True, 11, 4, 2, False))["consumed"]
        20
    """
    consumed, extra = consumed_in_lockstep(layout, origin, Yielded(yielded), item_size=1)
    return {
        "version": STATE_VERSION,
        "epoch": epoch,
        "origin": origin.as_state(),
        "yielded": yielded,
        "layout": layout.as_state(),
        "consumed": consumed,
        "consumed_extra": list(extra),
    }


def read_sampler_state(state: Any, layout: Layout) -> SamplerStart:
    """Check an ``ElasticDistributedSampler`` state for a sampler of ``layout``; where that sampler resumes.

    Raises:
        TypeError: ``state`` is not such a state, or a field has the wrong type.
        ValueError: the state is of another version, was taken over another order (the message names each
            differing field), or a field is out of range.

    Example::

        >>> layout = Layout(50, True, 11, 3, 0, False)
        >>> state = write_sampler_state(0, WHOLE_EPOCH, 5, Layout(50, True, 11, 4, 2, False))
        >>> read_sampler_state(state, layout)
        SamplerStart(epoch=0, origin=Origin(consumed=20, consumed_extra=(), first_batch=0), skip=0)
    """
    if not isinstance(state, dict) or not set(_SAMPLER_FIELDS) <= state.keys():
        raise TypeError(
            f"not an ElasticDistributedSampler state (a dict with {list(_SAMPLER_FIELDS)}): {state!r:.200}; load "
            "what ElasticDistributedSampler.state_dict() returned"
        )
    _check_version(state, "ElasticDistributedSampler")
    saved = Layout.from_state(state["layout"])
    refuse_other_order(saved, layout, "sampler")
    origin = Origin.from_state(state["origin"], layout.length)
    epoch, yielded = state["epoch"], state["yielded"]
    for name, value in (("epoch", epoch), ("yielded", yielded)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"{name} must be a non-negative integer, got {value!r:.100}")
    if (saved.world_size, saved.rank, saved.drop_last) == (layout.world_size, layout.rank, layout.drop_last):
        if yielded > share_length(layout, origin):
            raise ValueError(f"yielded={yielded} is beyond this rank's share of the epoch")
        return SamplerStart(epoch, origin, yielded)
    consumed, extra = consumed_in_lockstep(saved, origin, Yielded(yielded), item_size=1)
    return SamplerStart(epoch, Origin(consumed, extra, 0), 0)
