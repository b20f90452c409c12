"""RPCDataloader and RPCDataset behave as torch's DataLoader where they stand in for it (issue 14).

Concurrent iterators, ``__getitems__``, checkpoint validation, timeouts, attributes
fixed after construction, torch-only arguments, iterable datasets, the build timeout.
"""

from __future__ import annotations

import gc
import signal
import threading
import time
import weakref

import helpers
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, StackDataset, Subset

import rpcdl
from rpcdl.data.scheduler import NoWorkersLeft
from rpcdl.errors import RPCDLError, WorkerTimeout


def as_lists(batches) -> list:
    return [batch.tolist() for batch in batches]


# ---------------------------------------------------------------------------- concurrent iterators


@pytest.mark.timeout(60)
def test_zip_of_a_loader_with_itself_gives_every_pair_as_torch_does(two_workers):
    local = helpers.RangeDataset(22)
    theirs = DataLoader(local, batch_size=4)
    ours = rpcdl.RPCDataloader(rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 22), batch_size=4)
    expected = [(a.tolist(), b.tolist()) for a, b in zip(theirs, theirs, strict=True)]
    got = [(a.tolist(), b.tolist()) for a, b in zip(ours, ours, strict=True)]
    assert len(got) == len(expected) == len(ours) == 6
    assert got == expected


@pytest.mark.timeout(60)
def test_a_look_at_one_batch_inside_the_loop_leaves_the_epoch_whole(two_workers):
    local = helpers.RangeDataset(40)
    ours = rpcdl.RPCDataloader(rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 40), batch_size=4, shuffle=True)
    theirs = DataLoader(local, batch_size=4, shuffle=True)
    results = {}
    for name, loader in (("torch", theirs), ("rpcdl", ours)):
        seen, peeked = [], []
        for i, batch in enumerate(loader):
            seen.extend(batch.tolist())
            if i in (1, 5):
                peeked.append(next(iter(loader)).tolist())  # a common habit: look at a batch
        results[name] = (sorted(seen), len(peeked), all(len(p) == 4 for p in peeked))
    assert results["rpcdl"] == results["torch"] == (list(range(40)), 2, True)


@pytest.mark.timeout(60)
def test_state_dict_follows_the_iterator_that_yielded_last(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 24)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4)
    first = iter(loader)
    second = iter(loader)
    next(first)
    next(second)
    next(second)
    assert loader.state_dict()["yielded_prefix"] == 2
    next(first)
    next(first)
    next(first)
    assert loader.state_dict()["yielded_prefix"] == 4
    assert as_lists(first) == [[16, 17, 18, 19], [20, 21, 22, 23]]
    assert as_lists(second) == [[8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23]]


def _in_flight(loader: rpcdl.RPCDataloader) -> int:
    return sum(entry["in_flight"] for entry in loader.worker_windows().values())


@pytest.mark.timeout(60)
def test_a_dropped_iterator_cancels_what_it_has_in_flight(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 400, 0.002)
    loader = rpcdl.RPCDataloader(dataset, batch_size=2, prefetch_factor=4, max_batches_per_call=1)
    for i, _ in enumerate(loader):
        if i == 3:
            next(iter(loader))  # dropped at once, its window in flight
    assert _in_flight(loader) == 0  # no gc.collect(): its calls were let go as the pool was looked at
    assert sorted(i for batch in loader for i in batch.tolist()) == list(range(400))


@pytest.mark.timeout(60)
def test_abandoned_epochs_are_freed_by_reference_counting_alone(two_workers):
    """Without the cyclic collector, an epoch left by ``break`` or peeked at with ``next(iter(loader))`` is freed
    as it is dropped, and the pool's count of calls in flight is back to 0 at its next look: nothing is left to
    a finalizer running on another thread."""
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 400, 0.001)
    loader = rpcdl.RPCDataloader(dataset, batch_size=2, prefetch_factor=4, max_batches_per_call=1)
    next(iter(loader))  # connections and workers warm
    gc.collect()
    gc.disable()
    try:
        for _ in range(5):
            iterator = iter(loader)
            for i, _ in enumerate(iterator):
                if i == 2:
                    break
            dropped = weakref.ref(iterator)
            del iterator
            assert dropped() is None
            assert _in_flight(loader) == 0
        peeked = iter(loader)
        assert next(peeked).tolist() == [0, 1]
        dropped = weakref.ref(peeked)
        del peeked
        assert dropped() is None and _in_flight(loader) == 0
        iterator = iter(loader)
        for batch in iterator:
            next(iter(loader))  # peeks inside the loop, each dropped at once
            if batch.tolist() == [10, 11]:
                break
        dropped = weakref.ref(iterator)
        del iterator, batch
        assert dropped() is None and _in_flight(loader) == 0
    finally:
        gc.enable()
    assert sorted(i for batch in loader for i in batch.tolist()) == list(range(400))


@pytest.mark.timeout(60)
def test_a_second_thread_in_an_epoch_is_refused_and_a_close_from_another_thread_ends_it(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 40, 0.5)  # a batch of 4 takes 2 s
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, max_batches_per_call=1)
    iterator = iter(loader)
    outcome: list = []

    def advance() -> None:
        try:
            outcome.append(next(iterator))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=advance, name="test-advance")
    thread.start()
    deadline = time.monotonic() + 10
    while sum(entry["in_flight"] for entry in loader.worker_windows().values()) == 0:
        assert time.monotonic() < deadline, "the epoch did not start"
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="already being advanced by another thread"):
        next(iterator)
    loader.close()  # from this thread, while the other waits for its first batch
    thread.join(10)
    assert not thread.is_alive() and isinstance(outcome[0], StopIteration)
    assert sum(entry["in_flight"] for entry in loader.worker_windows().values()) == 0  # its calls let go at once
    with pytest.raises(StopIteration):
        next(iterator)


@pytest.mark.timeout(90)
def test_two_open_iterators_survive_a_worker_killed_mid_epoch(spawn_workers):
    workers = spawn_workers(3)
    dataset = rpcdl.RPCDataset(workers, helpers.RangeDataset, 120, 0.004)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, timeout=20)
    first, second = [], []
    for i, (a, b) in enumerate(zip(loader, loader, strict=True)):
        first.extend(a.tolist())
        second.extend(b.tolist())
        if i == 5:
            workers.kill(1, signal.SIGKILL)
    assert first == second == list(range(120))
    assert loader.worker_states()[workers[1]] != "active"


# ---------------------------------------------------------------------------- __getitems__


class BatchedReadDataset(Dataset):
    """Sample ``i`` is ``(i, 0)`` read alone and ``(i, 1)`` read through ``__getitems__``."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        return torch.tensor(index), torch.tensor(0)

    def __getitems__(self, indices: list[int]):
        return [(torch.tensor(i), torch.tensor(1)) for i in indices]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", [dict(batch_size=3), dict(batch_size=None), dict(batch_sampler=[[4, 1], [0]])])
def test_getitems_is_used_exactly_when_torch_uses_it(two_workers, options):
    theirs = [[t.tolist() for t in batch] for batch in DataLoader(BatchedReadDataset(10), **options)]
    ours = rpcdl.RPCDataloader(rpcdl.RPCDataset(two_workers, BatchedReadDataset, 10), **options)
    assert [[t.tolist() for t in batch] for batch in ours] == theirs


def make_subset():
    return Subset(helpers.RangeDataset(30), [29, 3, 7, 11, 0, 5, 8])


def make_stack():
    return StackDataset(a=helpers.RangeDataset(9), b=BatchedReadDataset(9))


@pytest.mark.timeout(60)
def test_subset_and_stack_dataset_give_torchs_batches(two_workers):
    for factory in (make_subset, make_stack):
        theirs = list(DataLoader(factory(), batch_size=3))
        ours = list(rpcdl.RPCDataloader(rpcdl.RPCDataset(two_workers, factory), batch_size=3))
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            if isinstance(b, dict):
                assert a.keys() == b.keys() and torch.equal(a["a"], b["a"])
                assert all(torch.equal(x, y) for x, y in zip(a["b"], b["b"], strict=True))
            else:
                assert torch.equal(a, b)


# ---------------------------------------------------------------------------- checkpoints


@pytest.fixture
def range_dataset(two_workers):
    return rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 40)


@pytest.mark.timeout(60)
def test_a_state_from_another_batch_size_is_refused_naming_what_differs(range_dataset):
    small = rpcdl.RPCDataloader(range_dataset, batch_size=2)
    iterator = iter(small)
    for _ in range(6):
        next(iterator)
    state = small.state_dict()
    big = rpcdl.RPCDataloader(range_dataset, batch_size=4)
    with pytest.raises(ValueError, match="different batches") as info:
        big.load_state_dict(state)
    message = str(info.value)
    assert "batch_size: the state has 2, this loader has 4" in message
    assert "batches: the state has 20, this loader has 10" in message
    for other in (
        dict(batch_size=2, drop_last=True),
        dict(batch_size=2, shuffle=True),
        dict(batch_size=2, in_order=False),
    ):
        with pytest.raises(ValueError, match="different batches"):
            rpcdl.RPCDataloader(range_dataset, **other).load_state_dict(state)
    same = rpcdl.RPCDataloader(range_dataset, batch_size=2)
    same.load_state_dict(state)
    assert sorted(i for batch in same for i in batch.tolist()) == list(range(12, 40))


@pytest.mark.timeout(60)
def test_a_position_loads_into_a_loader_of_the_same_shape(range_dataset):
    loader = rpcdl.RPCDataloader(range_dataset, batch_size=4)
    position = {"epoch": 3, "yielded_prefix": 2, "yielded_extra": [4], "generator_state": None}
    loader.load_state_dict({**loader.state_dict(), **position})
    assert sorted(i for batch in loader for i in batch.tolist()) == sorted(set(range(8, 40)) - {16, 17, 18, 19})
    assert loader.epoch == 3


GONE = object()  # a field left out of the state


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("change", "words"),
    [
        (dict(version=GONE), "has version None, this rpcdl reads version 1"),
        (dict(version=2), "has version 2, this rpcdl reads version 1"),
        (dict(batches=GONE, batch_size=GONE, sampler=GONE), "missing ['batches', 'batch_size', 'sampler']"),
    ],
    ids=["no-version", "another-version", "no-shape"],
)
def test_a_state_of_another_format_is_refused_saying_so(range_dataset, change, words):
    """Only the format this rpcdl writes loads: a state without its shape loaded anywhere, skipping samples."""
    loader = rpcdl.RPCDataloader(range_dataset, batch_size=4)
    taken = iter(loader)
    next(taken)
    state = {name: value for name, value in {**loader.state_dict(), **change}.items() if value is not GONE}
    taken.close()
    with pytest.raises(ValueError) as info:
        rpcdl.RPCDataloader(range_dataset, batch_size=4).load_state_dict(state)
    assert words in str(info.value)


def valid_state(**changes):
    state = {"epoch": 1, "yielded_prefix": 2, "yielded_extra": [5], "generator_state": None}
    return {**state, **changes}


def with_shape(loader, state):
    """``state``'s fields over those of a state of ``loader`` that say what its batches are."""
    if not isinstance(state, dict):
        return state
    position = ("epoch", "yielded_prefix", "yielded_extra", "generator_state")
    return {**{k: v for k, v in loader.state_dict().items() if k not in position}, **state}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "state, error, words",
    [
        (None, TypeError, "must be the dict returned by RPCDataloader.state_dict()"),
        ([1, 2], TypeError, "must be the dict returned by RPCDataloader.state_dict()"),
        ({"epoch": 0}, ValueError, "missing ['yielded_prefix', 'yielded_extra']"),
        (valid_state(epoch="1"), TypeError, "epoch must be a non-negative integer"),
        (valid_state(epoch=-1), ValueError, "epoch must be a non-negative integer"),
        (valid_state(yielded_prefix=2.0), TypeError, "yielded_prefix must be a non-negative integer"),
        (valid_state(yielded_prefix=-3), ValueError, "yielded_prefix must be a non-negative integer"),
        (valid_state(yielded_prefix=11), ValueError, "yielded_prefix=11 is out of range"),
        (valid_state(yielded_extra=5), TypeError, "yielded_extra must be a list"),
        (valid_state(yielded_extra=[5, "6"]), TypeError, "yielded_extra must be a list"),
        (valid_state(yielded_extra=[5, 5]), ValueError, "yielded_extra lists a batch more than once"),
        (valid_state(yielded_extra=[10]), ValueError, "yielded_extra holds batch numbers out of range"),
        (valid_state(yielded_extra=[1]), ValueError, "yielded_extra holds batch numbers out of range"),
        (valid_state(generator_state=[1, 2]), TypeError, "generator_state must be None"),
        (valid_state(generator_state=torch.zeros(3)), TypeError, "generator_state must be None"),
    ],
)
def test_garbage_states_are_refused_naming_the_field(range_dataset, state, error, words):
    loader = rpcdl.RPCDataloader(range_dataset, batch_size=4)
    with pytest.raises(error) as info:
        loader.load_state_dict(with_shape(loader, state))
    assert words in str(info.value)
    assert len(list(loader)) == 10  # and nothing of it was kept


# ---------------------------------------------------------------------------- timeouts


@pytest.mark.timeout(60)
def test_timeout_zero_means_no_timeout_and_a_negative_one_gets_torchs_error(range_dataset):
    loader = rpcdl.RPCDataloader(range_dataset, batch_size=8, timeout=0)
    assert loader.timeout == DataLoader(helpers.RangeDataset(4), timeout=0).timeout == 0
    assert len([batch for batch in loader]) == 5
    with pytest.raises(ValueError) as theirs:
        DataLoader(helpers.RangeDataset(4), timeout=-1)
    with pytest.raises(ValueError) as ours:
        rpcdl.RPCDataloader(range_dataset, timeout=-1)
    assert str(ours.value) == str(theirs.value) == "timeout option should be non-negative"


def test_timeout_errors_are_runtime_errors():
    for error in (WorkerTimeout, NoWorkersLeft):
        assert issubclass(error, RuntimeError) and issubclass(error, RPCDLError)
    assert issubclass(WorkerTimeout, TimeoutError)  # still an infrastructure failure (rpcdl.errors.is_transient)


@pytest.mark.timeout(60)
def test_a_batch_that_times_out_raises_a_runtime_error(embedded_worker):
    worker = embedded_worker()
    dataset = rpcdl.RPCDataset([worker.address], helpers.RangeDataset, 2, 1.5)
    loader = rpcdl.RPCDataloader(dataset, batch_size=1, timeout=0.3)
    with pytest.raises(RuntimeError, match="raise the timeout") as info:
        next(iter(loader))
    assert isinstance(info.value, WorkerTimeout)


class SlowAtOneIndex(helpers.RangeDataset):
    """Sample ``slow_index`` takes ``seconds``; the others none."""

    def __init__(self, n: int, slow_index: int, seconds: float):
        super().__init__(n)
        self.slow_index, self.seconds = slow_index, seconds

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.slow_index:
            time.sleep(self.seconds)
        return torch.tensor(index)


@pytest.mark.timeout(60)
def test_a_batch_slower_than_the_timeout_fails_alone_and_every_other_batch_comes_once(embedded_worker):
    workers = [embedded_worker().address for _ in range(2)]
    dataset = rpcdl.RPCDataset(workers, SlowAtOneIndex, 200, 11, 2.0)
    # the batch is lost, the epoch goes on, as with torch's worker errors
    batches, failures = helpers.values_and_errors(rpcdl.RPCDataloader(dataset, timeout=0.3), WorkerTimeout)
    seen = [batch.item() for batch in batches]
    assert len(failures) == 1 and "timed out on 2 workers" in "".join(failures[0].__notes__)
    assert seen == [i for i in range(200) if i != 11]  # in order, none lost, none twice


# ---------------------------------------------------------------------------- attributes and arguments


@pytest.mark.timeout(60)
def test_setting_sampling_attributes_after_construction_raises_as_in_torch(range_dataset):
    theirs = DataLoader(helpers.RangeDataset(40), batch_size=4)
    ours = rpcdl.RPCDataloader(range_dataset, batch_size=4)
    values = dict(batch_size=8, batch_sampler=[[0]], sampler=RandomSampler(range(40)), drop_last=True, dataset=None)
    for name, value in {**values, "persistent_workers": True}.items():
        with pytest.raises(ValueError) as torch_error:
            setattr(theirs, name, value)
        with pytest.raises(ValueError) as our_error:
            setattr(ours, name, value)
        assert str(our_error.value) == str(torch_error.value).replace("DataLoader", "RPCDataloader")
        assert str(our_error.value) == f"{name} attribute should not be set after RPCDataloader is initialized"
    ours.set_epoch(3)
    ours.collate_fn = ours.collate_fn  # not one of torch's fixed attributes
    assert len(list(ours)) == 10 and ours.epoch == 3


@pytest.mark.timeout(60)
def test_torch_only_arguments_say_what_replaces_them(range_dataset):
    with pytest.raises(TypeError, match=r"num_workers=.*RPCDataset.*--parallel"):
        rpcdl.RPCDataloader(range_dataset, batch_size=4, num_workers=4)
    with pytest.raises(TypeError, match=r"worker_init_fn=.*seed="):
        rpcdl.RPCDataloader(range_dataset, worker_init_fn=print)
    with pytest.raises(TypeError, match="persistent_workers="):
        rpcdl.RPCDataloader(range_dataset, persistent_workers=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'batchsize'"):
        rpcdl.RPCDataloader(range_dataset, batchsize=4)


# ---------------------------------------------------------------------------- RPCDataset


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


def make_stream():
    return Stream()


@pytest.mark.timeout(60)
def test_an_iterable_dataset_points_to_the_iterable_tools(two_workers):
    with pytest.raises(TypeError, match=r"Stream is an IterableDataset.*RPCMapper.*rpc_map"):
        rpcdl.RPCDataset(two_workers, Stream)
    with pytest.raises(TypeError, match=r"make_stream\(\.\.\.\) is an IterableDataset.*RPCMapper.*rpc_map"):
        rpcdl.RPCDataset(two_workers, make_stream)


class SlowToBuild(helpers.RangeDataset):
    def __init__(self, n: int, build_seconds: float = 0.0, **options):
        time.sleep(build_seconds)
        super().__init__(n)
        self.options = options


@pytest.mark.timeout(60)
def test_rpcdataset_build_timeout_is_its_own_keyword_and_its_error_says_how_to_allow_more(embedded_worker):
    worker = embedded_worker()
    dataset = rpcdl.RPCDataset([worker.address], SlowToBuild, 6, 0.0, rpcdl_timeout=5, colour="red")
    assert dataset.timeout == 5 and len(dataset) == 6
    assert rpcdl.RPCDataset([worker.address], SlowToBuild, 6, rpcdl_timeout=0).timeout > 1e6  # no limit
    with pytest.raises(ValueError, match="rpcdl_timeout option should be non-negative"):
        rpcdl.RPCDataset([worker.address], SlowToBuild, 6, rpcdl_timeout=-1)
    with pytest.raises(WorkerTimeout) as info:
        rpcdl.RPCDataset([worker.address], SlowToBuild, 6, 1.0, rpcdl_timeout=0.2)
    message = str(info.value)
    assert worker.address in message and "rpcdl_timeout=0.2s" in message and "still building" in message
    assert "rpcdl.RPCDataset(workers, SlowToBuild, ..., rpcdl_timeout=SECONDS)" in message
