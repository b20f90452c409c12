"""LoadBalancingDistributedSampler and LoadBalancingDistributedBatchSampler."""

from __future__ import annotations

import collections

import pytest
import torch
from helpers import RangeDataset
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler, TensorDataset

import rpcdl
from rpcdl.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler


def complexity_dataset(complexities: list[int]) -> TensorDataset:
    return TensorDataset(torch.arange(len(complexities)), torch.tensor(complexities))


def second(sample):
    return sample[1]


def all_shares(dataset, replicas: int, epoch: int = 0, **options) -> list[list[int]]:
    shares = []
    for rank in range(replicas):
        sampler = LoadBalancingDistributedSampler(dataset, second, num_replicas=replicas, rank=rank, **options)
        sampler.set_epoch(epoch)
        shares.append(list(sampler))
    return shares


def torch_shares(dataset, replicas: int, epoch: int = 0, **options) -> list[list[int]]:
    shares = []
    for rank in range(replicas):
        sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, **options)
        sampler.set_epoch(epoch)
        shares.append(list(sampler))
    return shares


@settings(max_examples=60, deadline=None)
@given(
    complexities=st.lists(st.integers(0, 1000), min_size=1, max_size=60),
    replicas=st.integers(1, 7),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 5),
)
def test_shares_match_distributed_sampler_and_balance_the_complexity(
    complexities, replicas, shuffle, drop_last, seed, epoch
):
    dataset = complexity_dataset(complexities)
    options = {"shuffle": shuffle, "drop_last": drop_last, "seed": seed}
    shares = all_shares(dataset, replicas, epoch, **options)
    reference = torch_shares(dataset, replicas, epoch, **options)

    # Same length and the same multiset of indices as DistributedSampler: padding (or dropping) alike.
    assert [len(share) for share in shares] == [len(share) for share in reference]
    assert collections.Counter(i for share in shares for i in share) == collections.Counter(
        i for share in reference for i in share
    )
    if len(complexities) % replicas == 0:
        flat = [i for share in shares for i in share]
        assert sorted(flat) == list(range(len(complexities)))  # every index on exactly one replica

    # Totals within one sample's complexity of each other.
    totals = [sum(complexities[i] for i in share) for share in shares]
    assert max(totals) - min(totals) <= max(complexities)


def test_shuffle_changes_the_order_each_epoch_and_repeats_it_for_the_same_seed_and_epoch():
    dataset = complexity_dataset(list(torch.randint(0, 100, (64,)).tolist()))
    epoch0, epoch1 = all_shares(dataset, 4, 0), all_shares(dataset, 4, 1)
    assert all(a != b for a, b in zip(epoch0, epoch1, strict=True))
    assert all_shares(dataset, 4, 1) == epoch1
    assert all_shares(dataset, 4, 1, seed=7) != epoch1


def test_without_shuffle_the_order_is_fixed_and_by_increasing_complexity():
    complexities = [5, 1, 9, 3, 7, 2, 8, 6]
    dataset = complexity_dataset(complexities)
    shares = all_shares(dataset, 2, 0, shuffle=False)
    assert shares == all_shares(dataset, 2, 3, shuffle=False)
    for share in shares:
        assert [complexities[i] for i in share] == sorted(complexities[i] for i in share)


def test_random_level_loosens_the_grouping_but_keeps_the_partition():
    complexities = list(range(0, 400, 5))
    dataset = complexity_dataset(complexities)
    balanced = all_shares(dataset, 4, 0)
    loose = all_shares(dataset, 4, 0, random_level=1.0)
    assert sorted(i for share in loose for i in share) == list(range(len(complexities)))
    assert [set(s) for s in loose] != [set(s) for s in balanced]
    spread = lambda shares: max(map(sum, shares)) - min(map(sum, shares))  # noqa: E731
    as_costs = lambda shares: [[complexities[i] for i in s] for s in shares]  # noqa: E731
    assert spread(as_costs(balanced)) <= max(complexities) < spread(as_costs(loose))


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"complexity_fn": 3}, TypeError, "complexity_fn must be a callable"),
        ({"random_level": 1.5}, ValueError, "random_level"),
        ({"num_replicas": 2, "rank": 2}, ValueError, "rank must be an integer in"),
        ({"num_replicas": 0}, ValueError, "world_size"),
        ({"complexity_fn": lambda sample: "big"}, TypeError, "must return a number"),
        ({"seed": 1.5}, TypeError, "seed"),
    ],
)
def test_sampler_arguments_are_validated(kwargs, error, words):
    options = {"complexity_fn": second, "num_replicas": 2, "rank": 0, **kwargs}
    with pytest.raises(error, match=words):
        LoadBalancingDistributedSampler(complexity_dataset([1, 2, 3]), **options)


def budget_batches(budget: int, complexities: list[int]):
    def batch_fn(indices: list[int]) -> list[list[int]]:
        batches, current, used = [], [], 0
        for index in indices:
            if current and used + complexities[index] > budget:
                batches.append(current)
                current, used = [], 0
            current.append(index)
            used += complexities[index]
        return [*batches, current] if current else batches

    return batch_fn


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sampler_gives_every_replica_the_same_number_of_batches(drop_last):
    complexities = [int(c) for c in torch.randint(1, 50, (101,), generator=torch.Generator().manual_seed(3))]
    dataset = complexity_dataset(complexities)
    batch_fn = budget_batches(120, complexities)
    per_rank = []
    for rank in range(3):
        sampler = LoadBalancingDistributedSampler(dataset, second, num_replicas=3, rank=rank)
        batch_sampler = LoadBalancingDistributedBatchSampler(sampler, batch_fn, drop_last=drop_last)
        batches = list(batch_sampler)
        assert len(batches) == len(batch_sampler)
        unbatched = batch_fn(list(sampler))
        if drop_last:
            assert batches == unbatched[: len(batches)]
        else:
            assert batches[: len(unbatched)] == unbatched
            assert all(extra in unbatched for extra in batches[len(unbatched) :])  # padded with its own batches
        per_rank.append(batches)
    counts = [len(batches) for batches in per_rank]
    assert len(set(counts)) == 1
    natural = [len(batch_fn(b)) for b in all_shares(dataset, 3)]
    assert counts[0] == (min(natural) if drop_last else max(natural))


def test_batch_sampler_set_epoch_reshuffles():
    complexities = list(range(40))
    dataset = complexity_dataset(complexities)
    sampler = LoadBalancingDistributedSampler(dataset, second, num_replicas=2, rank=1)
    batch_sampler = LoadBalancingDistributedBatchSampler(sampler, budget_batches(60, complexities))
    first = list(batch_sampler)
    batch_sampler.set_epoch(1)
    assert sampler.epoch == batch_sampler.epoch == 1 and list(batch_sampler) != first
    batch_sampler.set_epoch(0)
    assert list(batch_sampler) == first
    with pytest.raises(TypeError, match="LoadBalancingDistributedSampler"):
        LoadBalancingDistributedBatchSampler(DistributedSampler(dataset, 2, 0), budget_batches(60, complexities))


def test_samplers_drive_an_rpc_dataloader(two_workers):
    n = 30
    dataset = rpcdl.RPCDataset(two_workers, RangeDataset, n)
    complexity = lambda sample: int(sample) % 7  # noqa: E731  (runs on a worker, in one call)
    samplers = [
        LoadBalancingDistributedSampler(dataset, complexity, num_replicas=2, rank=rank, seed=5) for rank in range(2)
    ]
    assert samplers[0].complexities == [i % 7 for i in range(n)]
    loaders = [rpcdl.RPCDataloader(dataset, sampler=sampler, batch_size=4) for sampler in samplers]
    epochs = []
    for _ in range(2):  # each iteration is an epoch: the loader calls set_epoch
        shares = [torch.cat(list(loader)).tolist() for loader in loaders]
        assert shares == [list(sampler) for sampler in samplers]
        assert sorted(shares[0] + shares[1]) == list(range(n))
        epochs.append(shares)
    assert epochs[0] != epochs[1] and samplers[0].epoch == 1

    batch_sampler = LoadBalancingDistributedBatchSampler(samplers[1], lambda indices: [indices[:5], indices[5:]])
    loader = rpcdl.RPCDataloader(dataset, batch_sampler=batch_sampler)
    batches = [batch.tolist() for batch in loader]
    assert batches == list(batch_sampler) and [len(b) for b in batches] == [5, 10]


def identity(sample):
    return int(sample)


def test_a_state_on_another_world_size_says_why_it_cannot_resume(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, RangeDataset, 48)

    def loader_on(replicas: int) -> rpcdl.RPCDataloader:
        sampler = LoadBalancingDistributedSampler(dataset, identity, num_replicas=replicas, rank=0)
        return rpcdl.RPCDataloader(dataset, sampler=sampler, batch_size=4)

    taken = loader_on(2)
    epoch = iter(taken)
    next(epoch), next(epoch)
    state = taken.state_dict()
    epoch.close()
    loader_on(2).load_state_dict(state)  # the same world size resumes
    with pytest.raises(ValueError, match="resumes only on the world size it was taken on"):
        loader_on(3).load_state_dict(state)
    dataset.release()


def test_a_state_on_another_world_size_is_refused_even_with_as_many_batches(two_workers):
    """47 samples in batches of 4: 3 batches per rank on 4 ranks and on 5, yet other samples."""
    dataset = rpcdl.RPCDataset(two_workers, RangeDataset, 47)

    def loader_on(replicas: int) -> rpcdl.RPCDataloader:
        sampler = LoadBalancingDistributedSampler(dataset, identity, num_replicas=replicas, rank=0)
        return rpcdl.RPCDataloader(dataset, sampler=sampler, batch_size=4)

    taken = loader_on(4)
    assert len(taken) == len(loader_on(5)) == 3
    epoch = iter(taken)
    next(epoch)
    state = taken.state_dict()
    epoch.close()
    with pytest.raises(ValueError, match="resumes only on the world size it was taken on"):
        loader_on(5).load_state_dict(state)
    dataset.release()
