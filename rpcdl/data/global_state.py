"""The global position in a loader's state: resume a distributed epoch on any world size and batch size.

A loader over an :class:`~rpcdl.data.elastic.ElasticDistributedSampler` (made
by :func:`rpcdl.distributed.distributed_loader`, or by ``RPCDataModule``) adds to
its state the sampler's ``layout`` (the order's ``length``, ``shuffle`` and
``seed``, the ``world_size``, ``rank`` and ``drop_last`` it was split with), the
``origin`` of the epoch's layout, and the global position: ``consumed`` (every
position of the epoch's global order below it is consumed) and
``consumed_extra`` (positions consumed above it). The global position assumes
that every rank yielded the batches this rank yielded, as data-parallel ranks
do with ``in_order=True``. With ``in_order=False`` each rank's out-of-order
batches are its own: :func:`~rpcdl.distributed.merge_states` joins the ranks' states into one that
any world size resumes.

Loading (:func:`check_loader_state`): a state taken by the same rank, world size
and batches resumes exactly where that rank stopped; any other state resumes
from its global position: the positions left are split among the new ranks
(:mod:`rpcdl.data.elastic`), each once. A state over another order (dataset
length, ``shuffle``, ``seed``) is refused, unless it is at the start of an epoch
(a checkpoint saved at an epoch's end): then it only names the epoch.

Threading: pure functions, called by the loader's user thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .elastic import (
    WHOLE_EPOCH,
    ElasticDistributedSampler,
    Origin,
    advance,
    check_position,
    layout_positions,
    lockstep_consumed,
    refuse_other_order,
    share_batches,
)
from .loader_state import SHAPE_FIELDS, check_state

__all__ = ["check_loader_state", "epoch_batches", "global_fields", "merge_states", "next_epoch_state"]

#: The shape fields that may differ between a state and a loader resuming it from its global position.
_SPLIT_FIELDS = ("batches", "batch_size", "drop_last", "in_order")


def epoch_batches(sampler: ElasticDistributedSampler, origin: Origin, batch_size: int | None, drop_last: bool) -> int:
    """The batches numbered in an epoch of a loader over ``sampler`` starting at ``origin`` (the batches
    counted before it included)."""
    share = sampler.share_length(origin)
    return origin.first_batch + share_batches(share, batch_size or 1, drop_last and batch_size is not None)


def global_fields(
    sampler: ElasticDistributedSampler, position: dict[str, Any], batch_size: int | None, drop_last: bool
) -> dict[str, Any]:
    """A state's ``layout``, ``origin`` (plain data), ``consumed`` and ``consumed_extra`` for ``position``
    (the book's position fields)."""
    origin: Origin = position["origin"]
    layout = sampler.layout()
    world_size, length = layout["world_size"], layout["length"]
    size = batch_size or 1
    first = origin.first_batch
    share = sampler.share_length(origin)
    samples = min((position["yielded_prefix"] - first) * size, share)
    extra: list[int] = []
    if position["yielded_extra"]:
        positions = layout_positions(length, origin, world_size, layout["drop_last"])
        for seq in position["yielded_extra"]:
            batch = seq - first
            extra += positions[world_size * batch * size : world_size * min((batch + 1) * size, share)]
    consumed, consumed_extra = lockstep_consumed(length, origin, world_size, layout["drop_last"], samples, extra)
    return {"layout": layout, "origin": origin.as_state(), "consumed": consumed, "consumed_extra": list(consumed_extra)}


def next_epoch_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` moved to the start of the epoch after its own (a trainer that ends epochs early).

    Example::

        >>> next_epoch_state({"epoch": 2, "yielded_prefix": 5, "yielded_extra": []})["epoch"]
        3
    """
    moved = {**state, "epoch": state["epoch"] + 1, "yielded_prefix": 0, "yielded_extra": []}
    if "origin" in state:
        moved.update(origin=WHOLE_EPOCH.as_state(), consumed=0, consumed_extra=[])
    return moved


def check_loader_state(
    state: Any, shape: dict[str, Any], sampler: ElasticDistributedSampler, batch_size: int | None, drop_last: bool
) -> dict[str, Any]:
    """The position fields (for the loader's book) that resume ``state`` in a loader of ``shape`` over ``sampler``.

    Raises:
        TypeError: ``state`` is not a loader state, or a field has the wrong type.
        ValueError: a field is out of range; the state was taken over another
            order (dataset length, shuffle, seed, sampler, generator: each
            difference named); or it holds batches yielded out of order by one
            rank of several and is loaded on another rank or world size (merge
            the ranks' states first).
    """
    if not isinstance(state, dict) or "layout" not in state:
        # A state taken before the layout was recorded: torch's DistributedSampler then, the same shape now.
        legacy = isinstance(state, dict) and state.get("sampler") == "DistributedSampler"
        checked = check_state(state, {**shape, "sampler": "DistributedSampler"} if legacy else shape)
        return {**checked, "origin": WHOLE_EPOCH}
    layout = sampler.layout()
    saved = state["layout"]
    if _at_epoch_start(state):
        # Nothing of the epoch consumed: the state names an epoch, which any order starts whole.
        checked = check_state(state, {**shape, **{name: state.get(name, shape[name]) for name in _SPLIT_FIELDS}})
        return {**checked, "generator_state": None, "origin": WHOLE_EPOCH}
    refuse_other_order(saved, layout, "loader")
    length = layout["length"]
    origin = Origin.from_state(state.get("origin"), length)
    same_split = all(saved[name] == layout[name] for name in ("world_size", "rank", "drop_last")) and all(
        state.get(name) == shape[name] for name in ("batch_size", "drop_last", "in_order")
    )
    if same_split:
        checked = check_state(state, {**shape, "batches": epoch_batches(sampler, origin, batch_size, drop_last)})
        if checked["yielded_prefix"] < origin.first_batch:
            raise ValueError(
                f"yielded_prefix={checked['yielded_prefix']} is below the epoch's first batch {origin.first_batch}"
            )
        return {**checked, "origin": origin}
    # Another rank, world size or batch size: resume from the global position.
    checked = check_state(state, {**shape, **{name: state.get(name, shape[name]) for name in _SPLIT_FIELDS}})
    if checked["yielded_extra"] and saved["rank"] is not None:
        raise ValueError(
            f"this state was taken by rank {saved['rank']} of {saved['world_size']} with batches yielded out of "
            f"order (in_order=False: {checked['yielded_extra'][:8]} beyond the first {checked['yielded_prefix']}); "
            "it cannot tell which batches the other ranks yielded. Load each rank's own state on the same world "
            "size and batch size, or join all ranks' states with rpcdl.distributed.merge_states(states) and load "
            "the result on any world size"
        )
    consumed, extra = state.get("consumed"), state.get("consumed_extra")
    check_position(consumed, extra, length, "state")
    first = checked["yielded_prefix"]
    return {
        "epoch": checked["epoch"],
        "yielded_prefix": first,
        "yielded_extra": [],
        "generator_state": None,
        "origin": Origin(consumed, tuple(sorted(extra)), first),
    }


def _at_epoch_start(state: dict[str, Any]) -> bool:
    """Whether ``state`` is at the start of its epoch (nothing consumed, nothing yielded)."""
    return (
        state.get("yielded_prefix") == 0
        and state.get("yielded_extra") == []
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
    first_state = states[0]
    world_size = first_state["layout"]["world_size"]
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
    layout = first_state["layout"]
    length = layout["length"]
    origin = Origin.from_state(first_state["origin"], length)
    positions = layout_positions(length, origin, world_size, layout["drop_last"])
    size = first_state.get("batch_size") or 1
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
        "layout": {**layout, "rank": None},
        "yielded_prefix": origin.first_batch + max(counts),
        "yielded_extra": [],
        "consumed": consumed,
        "consumed_extra": list(extra),
    }
