"""RPCMapper and rpc_map send items in chunks: one call maps many items, every per-item semantic kept."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import helpers
import pytest
from torch.utils.data.datapipes.iter import IterableWrapper
from torchdata.nodes import Batcher, Loader, SamplerWrapper
from torchdata.nodes import IterableWrapper as NodeIterable

import rpcdl
from rpcdl.integrations.torchdata import RPCMapper

COUNT = 3000


def affine(x: int) -> int:
    return 3 * x + 1


def fails_on_2000(x: int) -> int:
    if x == 2000:
        raise ValueError("item 2000 is broken")
    return x


def lock_for_2000(x: int):
    return threading.Lock() if x == 2000 else x


def outcomes(node: RPCMapper) -> list:
    """Every value, and every exception raised in its place, until the node ends."""
    seen = []
    while True:
        try:
            seen.append(next(node))
        except StopIteration:
            return seen
        except Exception as exc:
            seen.append(exc)


@pytest.mark.timeout(60)
def test_a_cheap_function_is_mapped_in_far_fewer_calls_than_items(two_workers):
    served_before, _ = helpers.worker_calls(two_workers)
    node = RPCMapper(SamplerWrapper(range(COUNT)), two_workers, affine)
    assert list(node) == [affine(i) for i in range(COUNT)]
    calls = helpers.worker_calls(two_workers)[0] - served_before
    assert calls < COUNT / 10, f"{calls} calls for {COUNT} items"
    assert sum(node.items_served.values()) == COUNT  # items, not calls


@pytest.mark.timeout(60)
def test_rpc_map_maps_in_chunks_too(two_workers):
    served_before, _ = helpers.worker_calls(two_workers)
    assert list(IterableWrapper(range(COUNT)).rpc_map(two_workers, affine)) == [affine(i) for i in range(COUNT)]
    assert helpers.worker_calls(two_workers)[0] - served_before < COUNT / 10


@pytest.mark.timeout(60)
def test_max_chunk_size_one_maps_each_item_in_its_own_call(two_workers):
    served_before, _ = helpers.worker_calls(two_workers)
    node = RPCMapper(SamplerWrapper(range(50)), two_workers, affine, max_chunk_size=1)
    assert list(node) == [affine(i) for i in range(50)]
    assert helpers.worker_calls(two_workers)[0] - served_before >= 50  # more when a late call got a copy elsewhere
    with pytest.raises(ValueError, match="max_chunk_size must be a positive integer"):
        RPCMapper(SamplerWrapper(range(3)), two_workers, affine, max_chunk_size=0)
    with pytest.raises(ValueError, match="max_chunk_size"):
        IterableWrapper(range(3)).rpc_map(two_workers, affine, max_chunk_size=2.5)


@pytest.mark.timeout(60)
def test_an_fn_error_inside_a_chunk_comes_at_its_item_and_the_chunk_goes_on(two_workers):
    _, failed_before = helpers.worker_calls(two_workers)
    seen = outcomes(RPCMapper(SamplerWrapper(range(COUNT)), two_workers, fails_on_2000))
    [position] = [i for i, value in enumerate(seen) if isinstance(value, Exception)]
    assert position == 2000 and isinstance(seen[2000], ValueError) and "item 2000 is broken" in str(seen[2000])
    assert "fails_on_2000" in seen[2000].remote_traceback
    assert any("while mapping item 2000" in note for note in seen[2000].__notes__)
    assert seen[:2000] + seen[2001:] == [i for i in range(COUNT) if i != 2000]
    assert helpers.worker_calls(two_workers)[1] - failed_before == 1  # one chunk failed, and it was not retried


@pytest.mark.timeout(60)
def test_a_result_that_cannot_be_pickled_fails_its_item_only(two_workers):
    seen = outcomes(RPCMapper(SamplerWrapper(range(COUNT)), two_workers, lock_for_2000))
    [position] = [i for i, value in enumerate(seen) if isinstance(value, Exception)]
    assert position == 2000 and "lock" in str(seen[2000])
    assert seen[:2000] + seen[2001:] == [i for i in range(COUNT) if i != 2000]


def _slow_items(count: int, pause: float) -> Iterator[int]:
    for i in range(count):
        time.sleep(pause)
        yield i


@pytest.mark.timeout(60)
def test_a_slow_source_is_not_waited_for_to_fill_a_chunk(two_workers):
    """A cheap function wants large chunks; items that come every 20 ms go as they come."""
    warm = RPCMapper(SamplerWrapper(range(COUNT)), two_workers, affine)
    list(warm)  # the chunk size grew
    served_before, _ = helpers.worker_calls(two_workers)
    warm.source = NodeIterable(_slow_items(12, 0.02))
    warm.reset()
    assert list(warm) == [affine(i) for i in range(12)]
    calls = helpers.worker_calls(two_workers)[0] - served_before
    assert calls >= 12  # one call per item (and a copy of a late one maybe)


@pytest.mark.timeout(120)
def test_state_resumes_exactly_inside_large_chunks(two_workers):
    def pipeline() -> Loader:
        return Loader(Batcher(RPCMapper(SamplerWrapper(range(COUNT)), two_workers, affine), 7, drop_last=False))

    expected = [affine(i) for i in range(COUNT)]
    for batches in (1, 150, 300):
        first = pipeline()
        iterator = iter(first)
        taken = [x for _ in range(batches) for x in next(iterator)]
        state = first.state_dict()  # chunks of up to 256 items are in flight and pulled ahead here
        resumed = pipeline()
        resumed.load_state_dict(state)
        assert taken + [x for batch in resumed for x in batch] == expected, f"resuming after {batches} batches"


def sleeps_on_1500(x: int) -> int:
    if x == 1500:
        time.sleep(1.5)
    return x


@pytest.mark.timeout(90)
def test_a_chunk_that_times_out_on_every_worker_fails_its_slow_item_only(spawn_workers):
    workers = spawn_workers(2)
    seen = outcomes(RPCMapper(SamplerWrapper(range(2000)), workers, sleeps_on_1500, timeout=0.5))
    [position] = [i for i, value in enumerate(seen) if isinstance(value, Exception)]
    assert position == 1500 and isinstance(seen[1500], rpcdl.WorkerTimeout)
    assert seen[:1500] + seen[1501:] == [i for i in range(2000) if i != 1500]
