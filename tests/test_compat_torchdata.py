"""torchdata's ParallelMapper and rpcdl's RPCMapper side by side: the same cases, the same outcomes.

Each case runs on both nodes (and the DataPipe form ``rpc_map`` beside torch's
``map`` where it applies): the items, the errors (type, message, position)
and the states saved and restored at every step over several epochs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from torch.utils.data.datapipes.iter import IterableWrapper
from torchdata.nodes import BaseNode, Loader, Mapper, ParallelMapper

from rpcdl.integrations.torchdata import RPCMapper

pytestmark = pytest.mark.timeout(90)

SOURCE_BREAKS_AT = 4  # the fifth item of epoch 0 of a ShuffledRange(12): items are pulled ahead of it
FN_BREAKS_AT = 3


class ShuffledRange(BaseNode[int]):
    """``0..n-1`` in an order that depends on the epoch only; raises at item ``breaks_at`` when given."""

    def __init__(self, n: int, breaks_at: int | None = None):
        super().__init__()
        self.n, self.breaks_at = n, breaks_at
        self.epoch = -1

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.epoch, self.position = initial_state["epoch"], initial_state["position"]
        else:
            self.epoch, self.position = self.epoch + 1, 0
        self.order = order_of_epoch(self.n, self.epoch)

    def next(self) -> int:
        if self.position >= self.n:
            raise StopIteration
        item = self.order[self.position]
        self.position += 1
        if item == self.breaks_at:
            raise ValueError(f"the source broke at item {item}")
        return item

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}


def order_of_epoch(n: int, epoch: int) -> list[int]:
    """The order of a :class:`ShuffledRange` of ``n`` items (``n`` prime to 7) in ``epoch``."""
    return sorted(range(n), key=lambda i: (i * 7 + epoch * 3) % n)


def affine(x: int) -> int:
    return 3 * x + 1


def fn_breaks(x: int) -> int:
    if x == FN_BREAKS_AT:
        raise KeyError(f"fn broke at item {x}")
    return 3 * x + 1


def source_breaks(x: int) -> int:
    if x == SOURCE_BREAKS_AT:
        raise ValueError(f"the source broke at item {x}")
    return x


MESSAGES = {ValueError: f"the source broke at item {SOURCE_BREAKS_AT}", KeyError: f"fn broke at item {FN_BREAKS_AT}"}


def outcome_of_error(exc: Exception) -> tuple[str, str]:
    """An error as a comparable outcome: its type, and its original message (both nodes add context)."""
    message = MESSAGES[type(exc)]
    assert message in str(exc), f"{type(exc).__name__} without its message: {exc}"
    return type(exc).__name__, message


def drain(iterator: Any, limit: int = 1000) -> list[Any]:
    """Every outcome of ``iterator`` up to StopIteration, an error in its place going on after it."""
    outcomes = []
    for _ in range(limit):
        try:
            outcomes.append(next(iterator))
        except StopIteration:
            return outcomes
        except (ValueError, KeyError) as exc:
            outcomes.append(outcome_of_error(exc))
    raise AssertionError(f"no end after {limit} outcomes")


def parallel_mapper(source: BaseNode, fn: Callable, snapshot_frequency: int = 1) -> BaseNode:
    return ParallelMapper(source, fn, num_workers=2, snapshot_frequency=snapshot_frequency)


def both(workers: list[str]) -> dict[str, Callable[..., BaseNode]]:
    """Node factories ``(source, fn, snapshot_frequency)`` of torchdata and of rpcdl."""

    def rpc_mapper(source: BaseNode, fn: Callable, snapshot_frequency: int = 1) -> BaseNode:
        return RPCMapper(source, workers, fn, prefetch_factor=3, snapshot_frequency=snapshot_frequency)

    return {"ParallelMapper": parallel_mapper, "RPCMapper": rpc_mapper}


# ---------------------------------------------------------------------------- errors


def test_a_source_error_comes_in_its_place_after_the_items_pulled_before_it(two_workers):
    position = order_of_epoch(12, 0).index(SOURCE_BREAKS_AT)
    expected = [affine(i) for i in order_of_epoch(12, 0)[:position]]
    for name, make in both(two_workers).items():
        node = make(ShuffledRange(12, breaks_at=SOURCE_BREAKS_AT), affine)
        node.reset()
        outcomes = []
        while True:
            try:
                outcomes.append(next(node))
            except ValueError as exc:
                outcomes.append(outcome_of_error(exc))
                break
        assert outcomes == [*expected, ("ValueError", MESSAGES[ValueError])], name
        state = node.state_dict()
        resumed = make(ShuffledRange(12, breaks_at=SOURCE_BREAKS_AT), affine)
        resumed.reset(state)  # the state stands before the failed pull: resuming raises it again
        with pytest.raises(ValueError, match=MESSAGES[ValueError]):
            next(resumed)


def test_after_a_source_error_rpc_mapper_goes_on_as_mapper_does(two_workers):
    """ParallelMapper blocks on the next call after a source error; Mapper and RPCMapper go on."""
    local = Mapper(ShuffledRange(12, breaks_at=SOURCE_BREAKS_AT), affine)
    remote = RPCMapper(ShuffledRange(12, breaks_at=SOURCE_BREAKS_AT), two_workers, affine, prefetch_factor=3)
    local.reset()
    remote.reset()
    outcomes = drain(remote)
    assert outcomes == drain(local)
    assert len(outcomes) == 12 and outcomes[4] == ("ValueError", MESSAGES[ValueError])


def test_a_state_taken_after_going_on_past_a_source_error_resumes_exactly(two_workers):
    for snapshot_frequency in (1, 3, 0):
        make = both(two_workers)["RPCMapper"]
        uninterrupted = drain(_started(make(ShuffledRange(12, SOURCE_BREAKS_AT), affine, snapshot_frequency)))
        error_at = uninterrupted.index(("ValueError", MESSAGES[ValueError]))
        for k in range(error_at + 2, len(uninterrupted) + 1):  # states taken once next() went past the error
            node = _started(make(ShuffledRange(12, SOURCE_BREAKS_AT), affine, snapshot_frequency))
            taken = list(itertools.islice(_outcomes(node), k))
            assert taken == uninterrupted[:k]
            resumed = make(ShuffledRange(12, SOURCE_BREAKS_AT), affine, snapshot_frequency)
            resumed.reset(node.state_dict())
            assert drain(resumed) == uninterrupted[k:], (snapshot_frequency, k)


def test_fn_errors_come_in_the_same_place_with_the_same_type_and_message(two_workers):
    results = {}
    for name, make in both(two_workers).items():
        results[name] = drain(_started(make(ShuffledRange(12), fn_breaks)))
    assert results["RPCMapper"] == results["ParallelMapper"]
    assert results["RPCMapper"].count(("KeyError", MESSAGES[KeyError])) == 1
    assert len(results["RPCMapper"]) == 12


def test_rpc_map_raises_source_and_fn_errors_where_map_does(two_workers):
    import rpcdl.integrations.torchdata  # noqa: F401  (registers rpc_map)

    def outcomes(pipe: Any) -> list[Any]:
        return drain(iter(pipe))

    source = IterableWrapper(range(10)).map(source_breaks)
    assert outcomes(source.rpc_map(two_workers, affine, prefetch_factor=3)) == outcomes(source.map(affine))
    assert outcomes(source.rpc_map(two_workers, affine))[-1] == ("ValueError", MESSAGES[ValueError])
    plain = IterableWrapper(range(10))
    assert outcomes(plain.rpc_map(two_workers, fn_breaks)) == outcomes(plain.map(fn_breaks))


# ---------------------------------------------------------------------------- state at every step


@pytest.mark.parametrize("snapshot_frequency", [1, 3, 0])
@pytest.mark.parametrize("fn", [affine, fn_breaks], ids=["clean", "fn-error"])
def test_state_saved_and_restored_at_every_step_over_three_epochs(two_workers, snapshot_frequency, fn):
    """A Loader's state after each step, loaded into a fresh pipeline: what follows is what ParallelMapper
    gives (an error handed out last comes again), and without errors exactly what was not yielded yet."""
    epochs, n = 3, 6
    runs = {}
    for name, make in both(two_workers).items():
        frequency = snapshot_frequency
        if name == "ParallelMapper" and fn is fn_breaks:
            frequency = 1  # with others it maps the items it skips on resume, and raises their errors there

        def loader(make: Callable[..., BaseNode] = make, frequency: int = frequency) -> Loader:
            return Loader(make(ShuffledRange(n), fn, frequency), restart_on_stop_iteration=False)

        first = loader()
        uninterrupted = [drain(iter(first)) for _ in range(epochs)]
        assert [len(epoch) for epoch in uninterrupted] == [n] * epochs
        flat = list(itertools.chain.from_iterable(uninterrupted))
        resumed_at_each_step = []
        for k in range(len(flat) + 1):
            first = loader()
            assert _take(first, k) == flat[:k], (name, k)
            second = loader()
            second.load_state_dict(first.state_dict())
            epoch = (k - 1) // n if k else 0  # the epoch the state belongs to
            rest = [drain(iter(second)) for _ in range(epochs - epoch)]
            resumed_at_each_step.append(rest)
            if fn is affine:  # the rest of the epoch in progress, then the next epochs
                assert rest == [flat[k : (epoch + 1) * n], *uninterrupted[epoch + 1 :]], (name, k)
        runs[name] = (uninterrupted, resumed_at_each_step)
    assert runs["RPCMapper"] == runs["ParallelMapper"]


def test_snapshot_frequency_zero_is_accepted_and_negative_is_refused(two_workers):
    ParallelMapper(ShuffledRange(3), affine, num_workers=1, snapshot_frequency=0)
    RPCMapper(ShuffledRange(3), two_workers, affine, snapshot_frequency=0)
    with pytest.raises(ValueError, match="snapshot_frequency must be a non-negative integer"):
        RPCMapper(ShuffledRange(3), two_workers, affine, snapshot_frequency=-1)


# ---------------------------------------------------------------------------- helpers


def _started(node: BaseNode) -> BaseNode:
    node.reset()
    return node


def _outcomes(node: BaseNode):
    while True:
        try:
            yield next(node)
        except StopIteration:
            return
        except (ValueError, KeyError) as exc:
            yield outcome_of_error(exc)


def _take(loader: Loader, count: int) -> list[Any]:
    """The first ``count`` outcomes of ``loader`` over as many epochs as it takes."""
    taken: list[Any] = []
    while len(taken) < count:
        iterator = iter(loader)
        for outcome in _outcomes(iterator):
            taken.append(outcome)
            if len(taken) == count:
                break
    return taken
