"""The same cases on torch's DataLoader and on RPCDataloader, side by side.

Each test runs one case on both sides and compares what a training loop sees:
the batches, the lengths, the exceptions (type and message) and the
checkpoints (torchdata's ``StatefulDataLoader`` stands in for torch there).
"""

from __future__ import annotations

import pickle

import compat_datasets as cd
import helpers
import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

import rpcdl

pytestmark = pytest.mark.timeout(60)


class Side:
    """Builds a loader over a dataset made by ``factory(*args)``: in this process (torch) or on workers (rpcdl)."""

    def __init__(self, name: str, workers: list[str]):
        self.name = name
        self.workers = workers

    def loader(self, factory, *args, torch_loader=DataLoader, **options):
        if self.name == "torch":
            return torch_loader(factory(*args), **options)
        return rpcdl.RPCDataloader(rpcdl.RPCDataset(self.workers, factory, *args), **options)

    def __repr__(self) -> str:
        return self.name


def both(workers: list[str]) -> tuple[Side, Side]:
    return Side("torch", workers), Side("rpcdl", workers)


def assert_same(ours, theirs, where: str = "batch") -> None:
    """Equal values of equal types, all the way down."""
    assert type(ours) is type(theirs), f"{where}: {type(ours).__name__} != {type(theirs).__name__}"
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, where
        assert torch.equal(ours, theirs), where
    elif isinstance(theirs, np.ndarray):
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), where
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), where
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, where


def run_both(workers, factory, *args, fresh_options=dict, **options):
    """One epoch on each side; ``fresh_options()`` makes the stateful options (samplers) anew for each."""
    torch_side, rpcdl_side = both(workers)
    theirs_loader = torch_side.loader(factory, *args, **options, **fresh_options())
    ours_loader = rpcdl_side.loader(factory, *args, **options, **fresh_options())
    theirs, ours = list(theirs_loader), list(ours_loader)
    assert len(ours_loader) == len(theirs_loader) == len(theirs)
    assert_same(ours, theirs, "epoch")
    return ours


def fixed_sampler(n: int, shuffle: bool):
    if shuffle:
        return RandomSampler(range(n), generator=torch.Generator().manual_seed(7))
    return SequentialSampler(range(n))


# ---------------------------------------------------------------------------- results


@pytest.mark.parametrize("batch_size", [1, 4, None])
@pytest.mark.parametrize("drop_last", [False, True])
def test_structured_samples_collate_alike(two_workers, batch_size, drop_last):
    if batch_size is None and drop_last:
        pytest.skip("rejected by both: see test_argument_errors_alike")
    run_both(two_workers, cd.StructuredDataset, 11, batch_size=batch_size, drop_last=drop_last)


@pytest.mark.parametrize("shuffle", [False, True])
def test_batch_sampler_and_custom_collate_alike(two_workers, shuffle):
    def fresh_options():
        return dict(batch_sampler=BatchSampler(fixed_sampler(23, shuffle), 5, drop_last=False))

    run_both(two_workers, helpers.RangeDataset, 23, fresh_options=fresh_options, collate_fn=cd.identity_collate)


@pytest.mark.parametrize("batch_size", [3, None])
def test_getitems_is_used_exactly_when_torch_uses_it(two_workers, batch_size):
    """torch reads a batch through ``__getitems__`` when the dataset has it, and only when auto-batching."""
    got = run_both(two_workers, cd.BatchedReadDataset, 10, batch_size=batch_size)
    marks = [bool(flag) for batch in got for flag in (batch[1] if batch_size else [batch[1]])]
    assert all(marks) if batch_size else not any(marks)


@pytest.mark.parametrize("factory,args", [(cd.subset_of_range, (30, [5, 1, 29, 7, 3])), (cd.stack_of_ranges, (9,))])
def test_subset_and_stack_dataset_alike(two_workers, factory, args):
    run_both(two_workers, factory, *args, batch_size=2)


@pytest.mark.parametrize("seeded", ["generator", "global seed"])
def test_shuffle_order_and_random_streams_are_torchs(two_workers, seeded):
    """The same seed gives torch's order, epoch after epoch, and leaves torch's random stream where torch does."""
    results = {}
    for side in both(two_workers):
        torch.manual_seed(11)
        generator = torch.Generator().manual_seed(3) if seeded == "generator" else None
        loader = side.loader(helpers.RangeDataset, 14, batch_size=4, shuffle=True, generator=generator)
        epochs = [[batch.tolist() for batch in loader] for _ in range(3)]
        results[side.name] = (epochs, torch.rand(2).tolist())
    assert results["rpcdl"] == results["torch"]


# ---------------------------------------------------------------------------- several iterators


def test_two_iterators_at_once_each_see_a_whole_epoch(two_workers):
    torch_side, rpcdl_side = both(two_workers)
    results = {}
    for side in (torch_side, rpcdl_side):
        loader = side.loader(helpers.RangeDataset, 12, batch_size=3)
        results[side.name] = [(a.tolist(), b.tolist()) for a, b in zip(loader, loader, strict=True)]
    assert len(results["torch"]) == 4
    assert results["rpcdl"] == results["torch"]


def test_a_peek_with_a_second_iterator_leaves_the_epoch_whole(two_workers):
    torch_side, rpcdl_side = both(two_workers)
    results = {}
    for side in (torch_side, rpcdl_side):
        loader = side.loader(helpers.RangeDataset, 12, batch_size=3)
        seen = []
        for step, batch in enumerate(loader):
            if step == 1:
                assert next(iter(loader)).tolist() == [0, 1, 2]  # a look at a batch, as training loops do
            seen.append(batch.tolist())
        results[side.name] = seen
    assert results["rpcdl"] == results["torch"] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


# ---------------------------------------------------------------------------- errors


def first_error(loader) -> tuple[BaseException, int]:
    yielded = 0
    with pytest.raises(Exception) as caught:
        for _ in loader:
            yielded += 1
    return caught.value, yielded


@pytest.mark.parametrize(
    "factory,args,options",
    [
        (cd.FailingAt, (10, 6), dict(batch_size=2)),
        (cd.FailingAt, (10, 0), dict(batch_size=None)),
        (helpers.RangeDataset, (6,), dict(batch_size=2, collate_fn=cd.failing_collate)),
    ],
    ids=["dataset", "dataset-unbatched", "collate"],
)
def test_user_errors_raise_alike(two_workers, factory, args, options):
    torch_side, rpcdl_side = both(two_workers)
    theirs, theirs_yielded = first_error(torch_side.loader(factory, *args, **options))
    ours, ours_yielded = first_error(rpcdl_side.loader(factory, *args, **options))
    assert type(ours) is type(theirs)
    assert str(theirs) in str(ours)
    assert ours_yielded == theirs_yielded


def constructor_error(make) -> BaseException:
    with pytest.raises(Exception) as caught:
        make()
    return caught.value


@pytest.mark.parametrize(
    "options",
    [
        dict(batch_size=0),
        dict(batch_size=-2),
        dict(timeout=-1),
        dict(sampler=SequentialSampler(range(8)), shuffle=True),
        dict(batch_sampler=BatchSampler(SequentialSampler(range(8)), 2, False), batch_size=3),
        dict(batch_sampler=BatchSampler(SequentialSampler(range(8)), 2, False), shuffle=True),
        dict(batch_sampler=BatchSampler(SequentialSampler(range(8)), 2, False), drop_last=True),
        dict(batch_size=None, drop_last=True),
    ],
)
def test_argument_errors_alike(two_workers, options):
    torch_side, rpcdl_side = both(two_workers)
    theirs = constructor_error(lambda: torch_side.loader(helpers.RangeDataset, 8, **options))
    ours = constructor_error(lambda: rpcdl_side.loader(helpers.RangeDataset, 8, **options))
    assert type(ours) is type(theirs)
    assert str(ours) == str(theirs)


@pytest.mark.parametrize("attribute", ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset"])
def test_setting_sampling_attributes_after_construction_is_refused_alike(two_workers, attribute):
    torch_side, rpcdl_side = both(two_workers)
    messages = {}
    for side in (torch_side, rpcdl_side):
        loader = side.loader(helpers.RangeDataset, 8, batch_size=2)
        with pytest.raises(ValueError) as caught:
            setattr(loader, attribute, getattr(loader, attribute))
        messages[side.name] = str(caught.value).replace(type(loader).__name__, "LOADER")
    assert messages["rpcdl"] == messages["torch"]


def test_timeout_zero_means_no_timeout_as_in_torch(two_workers):
    run_both(two_workers, helpers.RangeDataset, 6, batch_size=2, timeout=0)


def test_a_timed_out_batch_is_a_runtime_error_on_both_sides(spawn_workers):
    workers = spawn_workers(1)
    # a batch takes 3 s, 6x the timeout; both sides wait for the batch running to end as they stop their workers
    torch_loader = DataLoader(cd.SlowDataset(4, 1.5), batch_size=2, num_workers=1, timeout=0.5)
    rpcdl_loader = Side("rpcdl", workers).loader(cd.SlowDataset, 4, 1.5, batch_size=2, timeout=0.5)
    for loader in (torch_loader, rpcdl_loader):
        with pytest.raises(RuntimeError):
            next(iter(loader))


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_at_every_step_like_stateful_dataloader(two_workers, shuffle):
    """A state taken after k batches of an epoch, loaded into a new loader, gives the rest of that epoch."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    n, batch_size = 14, 3
    resumed_epochs = {}
    for side in both(two_workers):

        def make(side=side):
            generator = torch.Generator().manual_seed(3)
            return side.loader(
                helpers.RangeDataset, n, batch_size=batch_size, shuffle=shuffle, generator=generator,
                torch_loader=StatefulDataLoader,
            )  # fmt: skip

        for epoch in range(2):
            reference = make()
            for _ in range(epoch + 1):
                whole = [b.tolist() for b in reference]
            assert sorted(i for b in whole for i in b) == list(range(n)), f"{side}: epoch {epoch}"
            for k in range(len(whole)):
                partial = make()
                for _ in range(epoch):
                    list(partial)
                iterator = iter(partial)
                taken = [next(iterator).tolist() for _ in range(k)]
                state = pickle.loads(pickle.dumps(partial.state_dict()))
                resumed = make()
                resumed.load_state_dict(state)
                rest = [b.tolist() for b in resumed]
                assert taken + rest == whole, f"{side}: epoch {epoch}, resumed after {k} batches"
            resumed_epochs[side.name, epoch] = whole
    if not shuffle:
        assert resumed_epochs["rpcdl", 0] == resumed_epochs["torch", 0]
