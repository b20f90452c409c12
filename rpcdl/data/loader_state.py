"""What an :class:`~rpcdl.RPCDataloader` state holds, and the checks a state passes before it is loaded.

A state is the position in an epoch (``epoch``, ``yielded_prefix``: batches
``0 .. yielded_prefix - 1`` were yielded, ``yielded_extra``: batches yielded
beyond them, ``generator_state``: the sampler's random generator at the start of
the epoch) and what determines the epoch's batches (:data:`SHAPE_FIELDS`). A
position only means something in a loader that makes the same batches: a state
is refused by a loader whose shape differs. States written before the shape was
recorded still load (their missing fields are not checked).
"""

from __future__ import annotations

from typing import Any

import torch

from ..checks import check_int

#: The fields of a state that determine the batch sequence of an epoch.
SHAPE_FIELDS = ("batches", "batch_size", "drop_last", "sampler", "batch_sampler", "in_order")
POSITION_FIELDS = ("epoch", "yielded_prefix", "yielded_extra")


def loader_shape(loader: Any) -> dict[str, Any]:
    """The fields of :data:`SHAPE_FIELDS` for ``loader`` (``batches`` is ``None`` for a sampler without length)."""
    try:
        batches: int | None = len(loader)
    except TypeError:
        batches = None
    batch_sampler = loader.batch_sampler
    return {
        "batches": batches,
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "sampler": type(loader.sampler).__qualname__,
        "batch_sampler": type(batch_sampler).__qualname__ if batch_sampler is not None else None,
        "in_order": loader.in_order,
    }


def check_state(state: Any, shape: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of ``state`` after checking that it is a valid position for a loader of ``shape``.

    Raises:
        TypeError: ``state`` is not a dict, or a field has the wrong type.
        ValueError: a field is missing or out of range, or the state was saved
            by a loader that makes different batches (each differing field named
            with both values).
    """
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
    differences = [
        f"{name}: the state has {state[name]!r}, this loader has {shape[name]!r}"
        for name in SHAPE_FIELDS
        if name in state and state[name] != shape[name]
    ]
    if differences:
        raise ValueError(
            "this state was saved by a loader that makes different batches; resuming would skip or repeat "
            f"samples. Differences: {'; '.join(differences)}. Load it into a loader built with the same "
            "batch_size, drop_last, sampler and in_order over a dataset of the same length"
        )
    _check_counter(state, "epoch")
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
    generator_state = state.get("generator_state")
    if generator_state is not None and not (
        isinstance(generator_state, torch.Tensor) and generator_state.dtype == torch.uint8
    ):
        raise TypeError(
            "generator_state must be None or the uint8 tensor of torch.Generator.get_state(), "
            f"got {type(generator_state).__name__}"
        )
    return dict(state)


def _check_counter(state: dict[str, Any], name: str) -> int:
    return check_int(state[name], name, minimum=0, wrong_type=TypeError)
