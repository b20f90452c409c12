"""The loader's extension points for subclasses: ``requested_epoch`` and ``epoch_batch_limit``, on real workers.

A trainer's loader (the Lightning integration's) overrides them; these tests
use a plain subclass over real worker processes.
"""

from __future__ import annotations

import helpers
import pytest
import torch
from torch.utils.data import DistributedSampler

import rpcdl


def indices_of(batches) -> list[int]:
    return [int(i) for batch in batches for i in torch.as_tensor(batch).reshape(-1)]


class FollowingLoader(rpcdl.RPCDataloader):
    """A loader whose epochs and epoch length an outside loop decides, as a trainer's does."""

    def __init__(self, *args, epoch=None, limit=float("inf"), **kwargs):
        super().__init__(*args, **kwargs)
        self.outside_epoch = epoch
        self.outside_limit = limit

    def requested_epoch(self):
        return self.outside_epoch

    def epoch_batch_limit(self):
        return self.outside_limit


@pytest.fixture
def range_dataset(two_workers):
    return rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 40)


def shuffled(epoch: int) -> list[int]:
    reference = DistributedSampler(range(40), num_replicas=2, rank=1, shuffle=True, seed=5)
    reference.set_epoch(epoch)
    return list(reference)


def test_the_epoch_a_subclass_requests_is_the_one_each_iteration_runs(range_dataset):
    sampler = DistributedSampler(range(40), num_replicas=2, rank=1, shuffle=True, seed=5)
    loader = FollowingLoader(range_dataset, batch_size=4, sampler=sampler, epoch=6)
    assert indices_of(loader) == shuffled(6) and loader.epoch == 6
    assert indices_of(loader) == shuffled(6)  # the outside loop did not move: the same epoch again
    loader.set_epoch(2)
    assert indices_of(loader) == shuffled(6)  # the subclass's epoch comes before set_epoch
    loader.outside_epoch = 9
    assert indices_of(loader) == shuffled(9) and loader.epoch == 9
    loader.outside_epoch = None  # the loader's own rules again: the epoch after the last
    assert indices_of(loader) == shuffled(10) and loader.epoch == 10


def test_a_position_at_the_subclass_batch_limit_is_the_start_of_the_next_epoch(range_dataset):
    loader = FollowingLoader(range_dataset, batch_size=4, limit=3)
    iterator = iter(loader)
    assert indices_of(next(iterator) for _ in range(3)) == list(range(12))
    state = loader.state_dict()
    assert (state["epoch"], state["yielded_prefix"]) == (1, 0)
    resumed = rpcdl.RPCDataloader(range_dataset, batch_size=4)
    resumed.load_state_dict(state)
    assert indices_of(resumed) == list(range(40)) and resumed.epoch == 1

    loader.outside_limit = float("inf")  # the default: a position within the epoch
    state = loader.state_dict()
    assert (state["epoch"], state["yielded_prefix"]) == (0, 3)
    resumed.load_state_dict(state)
    assert indices_of(resumed) == list(range(12, 40))


@pytest.mark.parametrize(
    "hook, value, error, words",
    [
        ("epoch", "1", TypeError, "FollowingLoader.requested_epoch() must be"),
        ("epoch", -1, ValueError, "FollowingLoader.requested_epoch() must be a non-negative integer"),
        ("epoch", True, TypeError, "requested_epoch()"),
        ("limit", -2, ValueError, "FollowingLoader.epoch_batch_limit() must be a non-negative number"),
        ("limit", float("nan"), ValueError, "epoch_batch_limit()"),
        ("limit", None, ValueError, "epoch_batch_limit()"),
    ],
)
def test_a_hook_returning_what_it_may_not_is_named_in_the_error(range_dataset, hook, value, error, words):
    loader = FollowingLoader(range_dataset, batch_size=4, **{hook: value})
    with pytest.raises(error) as info:
        next(iter(loader)) if hook == "epoch" else loader.state_dict()
    assert words in str(info.value)
