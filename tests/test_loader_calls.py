"""The loader's batch call: the dataset named by its RRef id, torch's defaults by ``None``, the policy in one pass.

The calls run on real workers (the ``two_workers`` fixture); the policy and the
collate helpers are pure functions, checked against reference versions written
here the plain way.
"""

from __future__ import annotations

import random

import helpers
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import collate_tensor_fn, default_collate, default_convert

import rpcdl
from rpcdl.data import fetch
from rpcdl.data.records import Attempt, WorkerSlot, WorkerState
from rpcdl.data.scheduling_policy import SLOW_FACTOR, SchedulingPolicy, active, any_active
from rpcdl.errors import RRefNotFound
from rpcdl.rpc.rref import RRef, remote_id, resolve_here

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------- remote ids


def test_local_rref_has_no_remote_id():
    with pytest.raises(ValueError, match="local RRef has no remote id"):
        remote_id(RRef(3))


def test_resolve_here_outside_a_worker_says_so():
    with pytest.raises(RRefNotFound, match="not an rpcdl worker"):
        resolve_here(0x1234)


def test_remote_id_names_the_object_on_its_owner(two_workers):
    rref = rpcdl.remote(two_workers[0], torch.arange, (4,))
    uid = remote_id(rref)
    assert uid == rref._handle.uid
    got = rpcdl.rpc_sync(two_workers[0], resolve_here, (uid,))
    assert torch.equal(got, torch.arange(4))


def test_unknown_remote_id_is_rref_not_found_on_the_worker(two_workers):
    with pytest.raises(RRefNotFound, match="holds no object for RRef"):
        rpcdl.rpc_sync(two_workers[0], resolve_here, (0x5,))


def test_fetch_at_defaults_on_a_worker(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 10)
    uid = remote_id(dataset.rref(two_workers[1]))
    (batch, other), _, nbytes = rpcdl.rpc_sync(
        two_workers[1], fetch.fetch_batches_at, (uid, [([3, 4, 5], None), ([9], None)], None)
    )
    assert torch.equal(batch, torch.tensor([3, 4, 5])) and torch.equal(other, torch.tensor([9]))
    assert nbytes == 4 * 8  # the size of the chunk's batches, for the loader's chunk sizer
    (sample,), _, _ = rpcdl.rpc_sync(two_workers[1], fetch.fetch_samples_at, (uid, [(7, None)], None))
    assert torch.equal(sample, torch.tensor(7))
    (as_list,), _, _ = rpcdl.rpc_sync(two_workers[1], fetch.fetch_batches_at, (uid, [([1, 2], None)], default_convert))
    assert isinstance(as_list, list) and [int(t) for t in as_list] == [1, 2]


@pytest.mark.parametrize("batch_size", [3, None])
def test_explicit_convert_or_collate_is_not_taken_for_the_default(two_workers, batch_size):
    """``None`` stands for the default of the loader's kind only: ``default_convert`` given to a batching
    loader (``default_collate`` to one without batches) is sent as it is."""
    other = default_convert if batch_size is not None else default_collate
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 7)
    if batch_size is None:  # default_collate of one 0-d sample fails, in torch as here
        with pytest.raises(IndexError) as theirs_failed:
            list(DataLoader(helpers.RangeDataset(7), batch_size=None, collate_fn=other))
        with pytest.raises(IndexError) as ours_failed:
            list(rpcdl.RPCDataloader(dataset, batch_size=None, collate_fn=other))
        assert str(theirs_failed.value) in str(ours_failed.value)
        return
    ours = list(rpcdl.RPCDataloader(dataset, batch_size=batch_size, collate_fn=other))
    theirs = list(DataLoader(helpers.RangeDataset(7), batch_size=batch_size, collate_fn=other))
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert type(a) is type(b)
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))


# ---------------------------------------------------------------------------- collate


@pytest.mark.parametrize(
    "batch",
    [
        [torch.ones(4), torch.zeros(4)],
        [torch.ones(2, dtype=torch.float32), torch.ones(2, dtype=torch.float64)],  # promoted, as torch does
        [torch.arange(3) for _ in range(32)],
    ],
)
def test_stack_in_segment_outside_a_call_is_torch_stack(batch):
    ours = fetch._stack_in_segment(batch)
    theirs = collate_tensor_fn(batch)
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_fetch_batch_default_collate_of_tuples_and_getitems():
    class Pairs:
        def __getitem__(self, index):
            return torch.tensor(index), index * 2

    pairs = fetch.fetch_batch(Pairs(), [1, 2], default_collate, None)
    assert torch.equal(pairs[0], torch.tensor([1, 2])) and torch.equal(pairs[1], torch.tensor([2, 4]))

    class Batched:
        def __getitems__(self, indices):
            return [torch.tensor(i) for i in indices]

    assert torch.equal(fetch.fetch_batch(Batched(), [5, 6], default_collate, None), torch.tensor([5, 6]))
    with pytest.raises(IndexError):
        fetch.fetch_batch(Batched(), [], default_collate, None)  # as torch's default_collate of nothing


# ---------------------------------------------------------------------------- the policy in one pass


def _reference_pick(policy, slots, now, exclude=None):
    """The policy's choice written the plain way (lists and min), to check the one-pass version against."""
    candidates = [slot for slot in active(slots) if slot is not exclude]
    if not candidates:
        return None
    default = policy.default_service_time(slots)
    best_possible = min(slot.expected_done(default) for slot in candidates)
    free = [slot for slot in candidates if len(slot.in_flight) < policy.window(slot)]
    if not free:
        return None
    chosen = min(free, key=lambda slot: (slot.expected_done(default), len(slot.in_flight), slot.index))
    if chosen.expected_done(default) > SLOW_FACTOR * best_possible and not policy.due_for_trial(chosen, now):
        return None
    return chosen


def _random_slots(rng: random.Random, policy: SchedulingPolicy) -> list[WorkerSlot]:
    slots = []
    for index in range(rng.randint(1, 5)):
        slot = WorkerSlot(f"127.0.0.1:{index + 1}", index)
        slot.state = rng.choice([WorkerState.ACTIVE] * 3 + [WorkerState.DOWN, WorkerState.PROBING])
        slot.service_time = rng.choice([None, 0.001, 0.002, 0.01, 0.05])
        slot.window = rng.choice([None, 0, 1, 2, 3, 5, 8, 20])
        slot.last_done = rng.uniform(0.0, 1.0)
        slot.last_sent = rng.uniform(0.0, 1.0)
        for _ in range(rng.randint(0, 6)):
            slot.in_flight.add(Attempt(0, index, 1, 0.0, torch.futures.Future()))
        slots.append(slot)
    return slots


def test_one_pass_policy_decides_as_the_plain_version():
    rng = random.Random(15)
    for _ in range(3000):
        policy = SchedulingPolicy(prefetch_factor=rng.randint(1, 4), timeout=5.0, max_window=rng.choice([None, 3, 6]))
        slots = _random_slots(rng, policy)
        now = rng.uniform(0.0, 1.2)
        exclude = rng.choice([None, *slots])
        assert policy.pick(slots, now, exclude) is _reference_pick(policy, slots, now, exclude)
        windows = [policy.window(slot) for slot in active(slots)]
        assert policy.pass_window(slots) == (sum(windows) or policy.prefetch_factor)
        for slot in slots:
            least = min(max(policy.prefetch_factor, 3), policy.max_window)  # one runs, one waits, one on its way
            clamped = min(max(slot.window or least, least), policy.max_window)
            expected = 1 if slot.service_time is None else clamped
            assert policy.window(slot) == expected
        times = [slot.service_time for slot in slots if slot.service_time is not None]
        assert policy.default_service_time(slots) == (min(times) if times else 1.0)
        assert any_active(slots) == bool(active(slots))
