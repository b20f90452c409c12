"""rpcdl.distributed: shard_workers and distributed_loader, on real workers and a real process group."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from helpers import RangeDataset
from torch.utils.data import DistributedSampler

import rpcdl
from rpcdl.distributed import distributed_loader, shard_workers
from rpcdl.samplers import LoadBalancingDistributedSampler

WORKERS = ["10.0.0.1:6543", "10.0.0.2:6543", "10.0.0.3:6543", "10.0.0.4:6543", "10.0.0.5:6543"]


def test_shard_workers_slices_by_rank():
    shards = [shard_workers(WORKERS, rank, 2) for rank in range(2)]
    assert shards == [WORKERS[0::2], WORKERS[1::2]]
    assert [shard_workers(WORKERS, rank, 5) for rank in range(5)] == [[w] for w in WORKERS]


def test_shard_workers_shares_with_a_warning_when_workers_are_fewer_than_ranks():
    with pytest.warns(UserWarning, match="2 workers for 3 ranks"):
        shards = [shard_workers(WORKERS[:2], rank, 3) for rank in range(3)]
    assert shards == [[WORKERS[0]], [WORKERS[1]], [WORKERS[0]]]


@pytest.mark.parametrize(
    ("workers", "rank", "world_size", "error", "words"),
    [
        ([], 0, 1, TypeError, "non-empty list"),
        ("10.0.0.1:6543", 0, 1, TypeError, "non-empty list"),
        (["10.0.0.1"], 0, 1, ValueError, "malformed worker address"),
        (WORKERS, 2, 2, ValueError, "rank must be an integer in"),
        (WORKERS, 0, 0, ValueError, "world_size must be a positive integer"),
    ],
)
def test_shard_workers_validates(workers, rank, world_size, error, words):
    with pytest.raises(error, match=words):
        shard_workers(workers, rank, world_size)


def indices_of(loader) -> list[int]:
    return torch.cat(list(loader)).tolist()


@pytest.fixture(scope="module")
def range_dataset(two_workers):
    return rpcdl.RPCDataset(two_workers, RangeDataset, 30)


def test_distributed_loader_world_size_3_gives_disjoint_shards_covering_the_data(range_dataset):
    loader = rpcdl.RPCDataloader(
        range_dataset, batch_size=4, shuffle=True, prefetch_factor=3, max_batches_per_call=5, seed=11
    )
    shards = [distributed_loader(loader, world_size=3, rank=rank) for rank in range(3)]
    for shard in shards:
        assert isinstance(shard.sampler, DistributedSampler) and shard.sampler.shuffle  # follows the loader
        assert (shard.batch_size, shard.prefetch_factor, shard.max_batches_per_call, shard.seed) == (4, 3, 5, 11)
        assert shard.collate_fn is loader.collate_fn
        assert len(shard) == 3  # 10 samples in batches of 4
    epochs = []
    for _ in range(2):
        parts = [indices_of(shard) for shard in shards]
        assert [len(part) for part in parts] == [10, 10, 10]
        assert sorted(parts[0] + parts[1] + parts[2]) == list(range(30))  # disjoint and covering
        epochs.append(parts)
    assert epochs[0] != epochs[1]  # each iteration is a new epoch with its own order

    ordered = [indices_of(distributed_loader(loader, 3, rank, shuffle=False)) for rank in range(3)]
    assert ordered == [list(range(rank, 30, 3)) for rank in range(3)]


@pytest.mark.parametrize("drop_last", [False, True])
def test_uneven_data_is_padded_or_dropped_like_distributed_sampler(two_workers, drop_last):
    dataset = rpcdl.RPCDataset(two_workers, RangeDataset, 31)
    loader = rpcdl.RPCDataloader(dataset, batch_size=5, shuffle=True)
    parts = [indices_of(distributed_loader(loader, 3, rank, drop_last=drop_last)) for rank in range(3)]
    flat = parts[0] + parts[1] + parts[2]
    if drop_last:
        assert [len(part) for part in parts] == [10, 10, 10] and len(set(flat)) == 30
    else:
        assert [len(part) for part in parts] == [11, 11, 11] and set(flat) == set(range(31))
        assert len(flat) - len(set(flat)) == 2  # the padding repeats two indices


def test_distributed_loader_validates(range_dataset):
    with pytest.raises(TypeError, match="RPCDataloader"):
        distributed_loader(torch.utils.data.DataLoader(range(4)), 2, 0)
    batch_sampler = torch.utils.data.BatchSampler(range(30), 4, False)
    with pytest.raises(ValueError, match="batch_sampler"):
        distributed_loader(rpcdl.RPCDataloader(range_dataset, batch_sampler=batch_sampler), 2, 0)
    with pytest.raises(ValueError, match="rank must be an integer in"):
        distributed_loader(rpcdl.RPCDataloader(range_dataset), 3, 3)


_PEER = textwrap.dedent(
    """
    import sys, torch.distributed as dist
    dist.init_process_group("gloo", init_method=sys.argv[1], rank=1, world_size=2)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_ranks_come_from_the_initialized_process_group(range_dataset, tmp_path, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    init_method = f"file://{tmp_path / 'rendezvous'}"
    peer = subprocess.Popen([sys.executable, "-c", _PEER, init_method], env={**os.environ})
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=2)
        try:
            loader = distributed_loader(rpcdl.RPCDataloader(range_dataset, batch_size=4))
            assert (loader.sampler.num_replicas, loader.sampler.rank) == (2, 0)
            assert indices_of(loader) == list(range(0, 30, 2))
            assert shard_workers(WORKERS) == WORKERS[0::2]
            sampler = LoadBalancingDistributedSampler(range_dataset, complexity_fn=int)
            assert (sampler.num_replicas, sampler.rank) == (2, 0)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        assert peer.wait(timeout=60) == 0
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
