"""RPCDataloader fetches small batches in chunks: one call, many batches, every per-batch semantic kept."""

from __future__ import annotations

import random
import signal
import threading

import helpers
import pytest
import torch
from torch.utils.data import DataLoader

import rpcdl
from rpcdl.data.epoch import TARGET_CHUNK_BYTES

pytestmark = pytest.mark.timeout(90)


class RandomRows(helpers.RangeDataset):
    """Sample ``i`` is ``[i, a random draw]``: shows which seed the worker had when it loaded it."""

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index), random.random()])


class LockAt(helpers.RangeDataset):
    """Sample ``bad`` is a lock, which no answer can carry; the others are their index."""

    def __init__(self, n: int, bad: int):
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, index: int):
        return threading.Lock() if index == self.bad else index


def test_small_batches_come_in_far_fewer_calls_than_batches_and_equal_torchs(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 4000)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    before = helpers.worker_calls(two_workers)[0]
    ours = list(loader)
    calls = helpers.worker_calls(two_workers)[0] - before
    theirs = list(
        DataLoader(helpers.RangeDataset(4000), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    )
    assert [b.tolist() for b in ours] == [b.tolist() for b in theirs]
    assert calls < len(ours) / 4, f"{calls} calls for {len(ours)} batches"
    assert sum(loader.batches_served.values()) == len(ours)  # batches, not calls


def test_chunks_as_they_complete_give_every_batch_once(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 3000)
    loader = rpcdl.RPCDataloader(dataset, batch_size=3, in_order=False)
    for _ in range(2):
        batches = [b.tolist() for b in loader]
        assert sorted(batches) == [[i, i + 1, i + 2] for i in range(0, 3000, 3)]


def test_max_batches_per_call_one_fetches_each_batch_in_its_own_call(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 60)
    loader = rpcdl.RPCDataloader(dataset, batch_size=2, max_batches_per_call=1)
    before = helpers.worker_calls(two_workers)[0]
    assert [b.tolist() for b in loader] == [[i, i + 1] for i in range(0, 60, 2)]
    assert helpers.worker_calls(two_workers)[0] - before >= 30  # more when a late call got a copy elsewhere
    for wrong in (0, 2.5, True):
        with pytest.raises(ValueError, match="max_batches_per_call must be a positive integer"):
            rpcdl.RPCDataloader(dataset, batch_size=2, max_batches_per_call=wrong)
    chunked = rpcdl.RPCDataloader(dataset, batch_size=2)
    list(chunked)
    chunked.max_batches_per_call = 1  # between epochs, as torch's loaders take a new setting
    before = helpers.worker_calls(two_workers)[0]
    assert len(list(chunked)) == 30 and helpers.worker_calls(two_workers)[0] - before >= 30
    with pytest.raises(ValueError, match="max_batches_per_call must be a positive integer"):
        chunked.max_batches_per_call = -1


def test_large_batches_go_one_per_call(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.ArrayDataset, 96, TARGET_CHUNK_BYTES // 4)  # batches that large
    loader = rpcdl.RPCDataloader(dataset, batch_size=4)
    before = helpers.worker_calls(two_workers)[0]
    assert [int(b[0, 0]) for b in loader] == list(range(0, 96, 4))
    assert helpers.worker_calls(two_workers)[0] - before >= 24


def test_a_seeded_batch_gets_its_own_seed_inside_a_chunk(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, RandomRows, 400)
    chunked = [b.tolist() for b in rpcdl.RPCDataloader(dataset, batch_size=2, seed=5)]
    single = [b.tolist() for b in rpcdl.RPCDataloader(dataset, batch_size=2, seed=5, max_batches_per_call=1)]
    assert chunked == single
    assert len({row[1] for batch in chunked for row in batch}) == 400


def test_a_batch_that_cannot_be_sent_fails_alone_and_its_chunk_comes_through(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, LockAt, 300, 150)
    loader = rpcdl.RPCDataloader(dataset, batch_size=None, collate_fn=lambda sample: sample)
    seen, failures = helpers.values_and_errors(loader)
    assert seen == [i for i in range(300) if i != 150]  # in order, none lost, none twice
    assert len(failures) == 1 and "batch 150 " in "\n".join(failures[0].__notes__)


def test_a_state_taken_inside_a_chunk_resumes_at_the_next_batch(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 2000)
    loader = rpcdl.RPCDataloader(dataset, batch_size=2, shuffle=True)
    iterator = iter(loader)
    for _ in range(3):  # the chunks have grown: batches are fetched 16 a call
        next(iterator)
    list(iterator)
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(37)]
    state = loader.state_dict()
    rest = [b.tolist() for b in iterator]
    resumed = rpcdl.RPCDataloader(dataset, batch_size=2, shuffle=True)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest
    assert sorted(i for b in head + rest for i in b) == list(range(2000))


class BrokenAfter:
    """A batch sampler whose iteration raises after ``count`` batches of two."""

    def __init__(self, count: int):
        self.count = count

    def __iter__(self):
        for start in range(0, 2 * self.count, 2):
            yield [start, start + 1]
        raise KeyError("the sampler broke")


def test_a_sampler_error_comes_after_the_batches_it_gave_as_with_torch_in_process(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 100)
    ours = helpers.values_and_errors(rpcdl.RPCDataloader(dataset, batch_sampler=BrokenAfter(20)))
    theirs = helpers.values_and_errors(DataLoader(helpers.RangeDataset(100), batch_sampler=BrokenAfter(20)))
    assert [b.tolist() for b in ours[0]] == [b.tolist() for b in theirs[0]] == [[i, i + 1] for i in range(0, 40, 2)]
    assert [repr(e) for e in ours[1]] == [repr(e) for e in theirs[1]] == [repr(KeyError("the sampler broke"))]


def test_a_worker_killed_with_chunks_in_flight_changes_no_batch(spawn_workers):
    workers = spawn_workers(3)
    dataset = rpcdl.RPCDataset(workers, RandomRows, 4000)
    loader = rpcdl.RPCDataloader(dataset, batch_size=2, seed=9, timeout=20)
    expected = [b.tolist() for b in loader]  # an epoch: the chunks have grown
    assert loader.worker_windows()[workers[1]]["in_flight"] == 0
    loader.set_epoch(0)
    seen = []
    for step, batch in enumerate(loader):
        seen.append(batch.tolist())
        if step == 300:
            workers.kill(1, signal.SIGKILL)
    assert seen == expected  # every batch once, in order, loaded with its own seed wherever it went
    assert loader.worker_states()[workers[1]] != "active"
