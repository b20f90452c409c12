"""rpcdl.integrations.torchdata on real worker processes: RPCMapper, rpc_map, RPCIterableDataset."""

from __future__ import annotations

import pickle
import time

import helpers
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, get_worker_info
from torch.utils.data.datapipes.iter import IterableWrapper
from torchdata.nodes import Batcher, Loader, Mapper, SamplerWrapper

import rpcdl
from rpcdl.errors import is_transient, remote_origin
from rpcdl.integrations.torchdata import RPCIterableDataset, RPCMapper, RPCMapperIterDataPipe


def affine(x: int) -> int:
    return 3 * x + 1


def slow_affine(x: int) -> int:
    time.sleep(0.01)
    return 3 * x + 1


def fails_on_five(x: int) -> int:
    if x == 5:
        raise ValueError("item 5 is broken")
    return x


def with_loader_worker(value):
    return value, get_worker_info().id


def shuffled_source(n: int) -> SamplerWrapper:
    """A node of indices in a shuffled order that depends on the epoch only."""
    return SamplerWrapper(DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=7))


def epochs(loader: Loader, count: int) -> list[list]:
    return [list(loader) for _ in range(count)]


# ---------------------------------------------------------------------------- RPCMapper


def test_rpc_mapper_gives_the_batches_of_a_local_mapper(two_workers):
    remote = Loader(Batcher(RPCMapper(shuffled_source(61), two_workers, affine), 8, drop_last=False))
    local = Loader(Batcher(Mapper(shuffled_source(61), affine), 8, drop_last=False))
    remote_epochs, local_epochs = epochs(remote, 2), epochs(local, 2)
    assert remote_epochs == local_epochs
    assert remote_epochs[0] != remote_epochs[1]  # the sampler reshuffled: epochs went through the node
    assert sorted(x for batch in remote_epochs[0] for x in batch) == [affine(i) for i in range(61)]


@pytest.mark.parametrize("snapshot_frequency", [1, 3])
def test_rpc_mapper_state_dict_resumes_at_the_next_batch(two_workers, snapshot_frequency):
    def pipeline(fn, mapper=RPCMapper):
        source = shuffled_source(50)
        if mapper is Mapper:
            return Loader(Batcher(Mapper(source, fn), 4, drop_last=False))
        node = RPCMapper(source, two_workers, fn, prefetch_factor=3, snapshot_frequency=snapshot_frequency)
        return Loader(Batcher(node, 4, drop_last=False))

    expected, next_epoch = epochs(pipeline(affine, Mapper), 2)
    for k in (0, 1, 5, len(expected) - 1):
        first = pipeline(affine)
        iterator = iter(first)
        taken = [next(iterator) for _ in range(k)]
        state = first.state_dict()  # items are in flight and pulled ahead here
        assert taken == expected[:k]
        resumed = pipeline(affine)
        resumed.load_state_dict(state)
        assert list(resumed) == expected[k:], f"resuming after {k} batches"
        assert list(resumed) == next_epoch  # then the next epoch, complete


def test_rpc_mapper_raises_user_errors_once_with_the_remote_traceback(two_workers):
    _, failed_before = helpers.worker_calls(two_workers)
    node = RPCMapper(SamplerWrapper(range(10)), two_workers, fails_on_five)
    results, errors = helpers.values_and_errors(node, ValueError)
    assert results == [0, 1, 2, 3, 4, 6, 7, 8, 9]  # the pipeline goes on after the failed item
    [error] = errors
    assert "item 5 is broken" in str(error)
    assert remote_origin(error) in two_workers and not is_transient(error)
    assert "fails_on_five" in error.remote_traceback
    assert helpers.worker_calls(two_workers)[1] == failed_before + 1  # not retried


def test_rpc_mapper_loses_and_repeats_nothing_when_a_worker_is_killed(two_workers, spawn_workers):
    killable = spawn_workers(1)
    steady, victim = two_workers[0], killable[0]
    for address in (steady, victim):  # warm: a cold first call would lose every race to the other worker
        rpcdl.rpc_sync(address, slow_affine, (0,))
    node = RPCMapper(SamplerWrapper(range(160)), [steady, victim], slow_affine, prefetch_factor=2, timeout=30)
    seen, served_before_restart = [], None
    for index, batch in enumerate(Loader(Batcher(node, 4, drop_last=False))):
        seen.extend(batch)
        if index == 5:
            assert node.items_served[victim] > 0  # it was taking items
            killable.kill(0)  # SIGKILL, with calls in flight
        elif index == 10:
            assert node.worker_states()[victim] != "active"
            served_before_restart = node.items_served[victim]
            assert killable.restart(0) == victim  # same address: the background probe finds it again
    assert seen == [affine(i) for i in range(160)]
    assert node.worker_states()[victim] == "active"
    assert node.items_served[victim] > served_before_restart  # it rejoined within the pass
    assert sum(node.items_served.values()) == 160


def test_rpc_mapper_raises_an_item_that_times_out_on_every_worker(two_workers):
    node = RPCMapper(SamplerWrapper(range(3)), two_workers, lambda x: time.sleep(0.8 if x == 0 else 0), timeout=0.25)
    with pytest.raises(rpcdl.WorkerTimeout) as caught:
        next(node)
    assert any("timed out on 2 workers" in note for note in caught.value.__notes__)
    assert list(node) == [None, None]  # the other items come through
    deadline = time.monotonic() + 10  # the workers finish the calls left running before the next test
    while any(rpcdl.stats(worker)["calls_in_flight"] for worker in two_workers):
        assert time.monotonic() < deadline, "the timed-out calls still run on the workers after 10 s"
        time.sleep(0.02)


def test_rpc_mapper_rejects_bad_arguments(two_workers):
    source = SamplerWrapper(range(3))
    with pytest.raises(TypeError, match="BaseNode"):
        RPCMapper(range(3), two_workers, affine)
    with pytest.raises(TypeError, match="host:port"):
        RPCMapper(source, "127.0.0.1:1", affine)
    with pytest.raises(ValueError, match="HOST:PORT"):
        RPCMapper(source, ["nowhere"], affine)
    with pytest.raises(TypeError, match="fn must be callable"):
        RPCMapper(source, two_workers, 3)
    with pytest.raises(ValueError, match="prefetch_factor"):
        RPCMapper(source, two_workers, affine, prefetch_factor=0)
    with pytest.raises(ValueError, match="timeout"):
        RPCMapper(source, two_workers, affine, timeout=-1)
    with pytest.raises(ValueError, match="snapshot_frequency"):
        RPCMapper(source, two_workers, affine, snapshot_frequency=-1)
    with pytest.raises(ValueError, match="not an RPCMapper state"):
        RPCMapper(source, two_workers, affine).reset({"source": {}})


# ---------------------------------------------------------------------------- rpc_map


def test_rpc_map_yields_every_item_once_across_dataloader_workers(two_workers):
    mapped = IterableWrapper(range(100)).shuffle().sharding_filter().rpc_map(two_workers, lambda x: x * 10)
    assert sorted(mapped) == [x * 10 for x in range(100)]  # used here first: the forked workers reconnect
    loader = DataLoader(mapped.map(with_loader_worker).batch(32), batch_size=None, num_workers=2)
    items = [pair for batch in loader for pair in batch]
    assert sorted(value for value, _ in items) == [x * 10 for x in range(100)]
    assert {worker for _, worker in items} == {0, 1}  # both DataLoader workers mapped their share


def test_rpc_map_in_process_keeps_order_and_length(two_workers):
    pipe = IterableWrapper(range(20)).rpc_map(two_workers, lambda x: x + 0.5)
    assert isinstance(pipe, RPCMapperIterDataPipe)
    assert len(pipe) == 20
    assert list(pipe) == [x + 0.5 for x in range(20)]
    assert list(pipe) == [x + 0.5 for x in range(20)]  # a second pass


def test_rpc_map_pickles_with_a_lambda(two_workers):
    offset = 7
    pipe = IterableWrapper(range(10)).rpc_map(two_workers, lambda x: x + offset)
    assert list(pipe) == list(range(7, 17))  # its connections are not pickled along
    copy = pickle.loads(pickle.dumps(pipe))  # what a spawned DataLoader worker receives
    assert list(copy) == list(range(7, 17))


# ---------------------------------------------------------------------------- RPCIterableDataset


def test_rpc_iterable_dataset_yields_each_sample_once_under_a_dataloader(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 50)
    iterable = RPCIterableDataset(dataset, batch_size=4, shuffle=True, seed=3)
    loader = DataLoader(iterable, batch_size=None, num_workers=2)
    batches = [batch.tolist() for batch in loader]
    assert sorted(i for batch in batches for i in batch) == list(range(50))
    assert len(batches) == len(iterable) == 13
    assert batches == [batch.tolist() for batch in iterable]  # the DataLoader keeps the batch order
    iterable.set_epoch(1)
    next_epoch = [batch.tolist() for batch in loader]
    assert next_epoch != batches
    assert sorted(i for batch in next_epoch for i in batch) == list(range(50))


@pytest.mark.parametrize("drop_last", [False, True])
def test_rpc_iterable_dataset_splits_samples_across_ranks(two_workers, drop_last):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 23)
    shares = []
    for rank in range(3):
        iterable = RPCIterableDataset(dataset, batch_size=3, shuffle=True, drop_last=drop_last, rank=rank, world_size=3)
        batches = [batch.tolist() for batch in iterable]
        assert len(batches) == len(iterable)
        shares.append([i for batch in batches for i in batch])
    everything = [i for share in shares for i in share]
    assert len(everything) == len(set(everything))  # no sample twice, across ranks
    if drop_last:
        assert [len(share) for share in shares] == [6, 6, 6]  # 7 each, cut to full batches of 3
    else:
        assert sorted(everything) == list(range(23))


def test_rpc_iterable_dataset_rejects_bad_arguments(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 5)
    with pytest.raises(TypeError, match="RPCDataset"):
        RPCIterableDataset(list(range(5)))
    with pytest.raises(ValueError, match="batch_size"):
        RPCIterableDataset(dataset, batch_size=0)
    with pytest.raises(ValueError, match="rank"):
        RPCIterableDataset(dataset, rank=2, world_size=2)
    with pytest.raises(ValueError, match="epoch"):
        RPCIterableDataset(dataset).set_epoch(-1)
    assert torch.equal(next(iter(RPCIterableDataset(dataset, batch_size=5))), torch.arange(5))
