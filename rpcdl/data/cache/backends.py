"""The stores behind :mod:`rpcdl.data.cache.cached`: one LRU store per process, or Redis servers.

Each backend turns its own failures into :class:`StoreError` naming the server;
the cache decides what to do about them.

Threading: any thread may call a backend at any time (the caches of a worker
running several calls at once share the process's store). A
:class:`MemoryStore`'s lock guards every access to its entries, size and
capacity; the process's store is made once under ``_memory_lock``. A redis
backend's fields do not change after it is made, and redis-py's clients are
safe for concurrent use (each takes a connection from its pool per command).
"""

from __future__ import annotations

import collections
import logging
import threading
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from ...checks import check_positive_int, check_timeout
from ...errors import RPCDLError
from .redis_server import shared_local_server

log = logging.getLogger("rpcdl.cache")

DEFAULT_CAPACITY = 2**30


class StoreError(RPCDLError):
    """A backend failure, with a message naming the server."""


# ---------------------------------------------------------------------------- memory backend


class MemoryStore:
    """An in-process LRU store of serialized values, bounded by their total size in bytes.

    All memory caches of a process share one store (see :func:`_shared_memory_store`),
    so caches with the same ``dataset_name`` share entries, as with Redis.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self._capacity = capacity
        self._size = 0
        self._values: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """The most bytes of serialized values it keeps."""
        with self._lock:
            return self._capacity

    @property
    def size(self) -> int:
        """The bytes of serialized values it keeps now."""
        with self._lock:
            return self._size

    def grow(self, capacity: int) -> None:
        """Keep at least ``capacity`` bytes from now on."""
        with self._lock:
            self._capacity = max(self._capacity, capacity)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def set_many(self, items: Mapping[str, bytes]) -> None:
        with self._lock:
            for key, value in items.items():
                previous = self._values.pop(key, None)
                if previous is not None:
                    self._size -= len(previous)
                if len(value) > self._capacity:
                    continue  # larger than the whole store: not kept
                self._values[key] = value
                self._size += len(value)
            while self._size > self._capacity:
                _, evicted = self._values.popitem(last=False)
                self._size -= len(evicted)

    def num_keys(self) -> int:
        with self._lock:
            return len(self._values)

    def describe(self) -> str:
        return f"memory (capacity {self.capacity} bytes)"


_memory_store: MemoryStore | None = None
_memory_lock = threading.Lock()


def _shared_memory_store(capacity: int) -> MemoryStore:
    """This process's memory store; its capacity is the largest any cache asked for."""
    global _memory_store
    with _memory_lock:
        if _memory_store is None:
            _memory_store = MemoryStore(capacity)
        else:
            _memory_store.grow(capacity)
        return _memory_store


class _MemoryBackend:
    def __init__(self, capacity_per_node: int = DEFAULT_CAPACITY):
        check_positive_int(capacity_per_node, "capacity_per_node")
        self.capacity = capacity_per_node
        self.store = _shared_memory_store(capacity_per_node)

    def get(self, key: str) -> bytes | None:
        return self.store.get(key)

    def set_many(self, items: Mapping[str, bytes]) -> None:
        self.store.set_many(items)

    def num_keys(self) -> int:
        return self.store.num_keys()

    def describe(self) -> str:
        return self.store.describe()

    def close(self) -> None:
        pass

    def __getstate__(self) -> dict[str, Any]:
        return {"capacity": self.capacity}  # a copy in another process uses that process's store

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["capacity"])


# ---------------------------------------------------------------------------- redis backend


def _check_hosts(hosts: Any) -> list[tuple[str, int]]:
    if isinstance(hosts, (str, bytes, Mapping)) or not isinstance(hosts, Sequence) or not hosts:
        raise ValueError(
            f"hosts must be a non-empty list like [{{'host': '127.0.0.1', 'port': 6379}}], or None to start "
            f"a local redis-server; got {hosts!r}"
        )
    checked = []
    for entry in hosts:
        if not isinstance(entry, Mapping) or "host" not in entry or "port" not in entry:
            raise ValueError(f"each entry of hosts must be a dict with 'host' and 'port', got {entry!r}")
        host, port = entry["host"], entry["port"]
        try:
            port = int(port)
        except (TypeError, ValueError):
            port = -1
        if not isinstance(host, str) or not host or not 0 < port < 65536:
            raise ValueError(f"bad Redis host {entry!r}: 'host' must be a name or address, 'port' in 1..65535")
        checked.append((host, port))
    return checked


class _RedisBackend:
    """Keys spread over one or several Redis servers.

    With ``cluster_mode`` each key lives on the server ``crc32(key) % len(hosts)``,
    a hash that every process computes alike. ``hosts=None`` starts (or reuses) a
    local redis-server owned by this process, stopped when it exits.
    """

    def __init__(
        self,
        hosts: Sequence[Mapping[str, Any]] | None = None,
        cluster_mode: bool = True,
        capacity_per_node: int = DEFAULT_CAPACITY,
        socket_timeout: float = 5.0,
        password: str | None = None,
    ):
        try:
            import redis
        except ImportError as exc:
            raise ImportError("the 'redis' cache backend needs redis-py: pip install 'rpcdl[redis]'") from exc
        check_positive_int(capacity_per_node, "capacity_per_node")
        if not isinstance(cluster_mode, bool):
            raise TypeError(f"cluster_mode must be True or False, got {cluster_mode!r}")
        check_timeout(socket_timeout, "socket_timeout")
        if hosts is None:
            server = shared_local_server(capacity_per_node)
            addresses = [(server.host, server.port)]
        else:
            addresses = _check_hosts(hosts)
            if not cluster_mode and len(addresses) > 1:
                raise ValueError(
                    f"{len(addresses)} hosts given with cluster_mode=False: give one host, or "
                    "cluster_mode=True to spread the keys over all of them"
                )
        self.addresses = addresses
        self.cluster_mode = cluster_mode
        self.capacity = capacity_per_node
        self.socket_timeout = float(socket_timeout)
        self.password = password
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        options = {
            "password": password,
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": min(self.socket_timeout, 2.0),
            "retry": Retry(NoBackoff(), 1),
        }
        self._clients = [redis.Redis(host=host, port=port, **options) for host, port in addresses]

    def _index(self, key: str) -> int:
        return zlib.crc32(key.encode()) % len(self._clients) if len(self._clients) > 1 else 0

    def _fail(self, index: int, exc: BaseException) -> StoreError:
        host, port = self.addresses[index]
        return StoreError(f"Redis server {host}:{port} failed: {type(exc).__name__}: {exc}")

    def get(self, key: str) -> bytes | None:
        index = self._index(key)
        try:
            return self._clients[index].get(key)
        except self._errors as exc:
            raise self._fail(index, exc) from exc

    def set_many(self, items: Mapping[str, bytes]) -> None:
        groups: dict[int, dict[str, bytes]] = {}
        for key, value in items.items():
            groups.setdefault(self._index(key), {})[key] = value
        for index, group in groups.items():
            try:
                self._clients[index].mset(group)
            except self._errors as exc:
                raise self._fail(index, exc) from exc

    def num_keys(self) -> int:
        total = 0
        for index, client in enumerate(self._clients):
            try:
                total += client.dbsize()
            except self._errors as exc:
                raise self._fail(index, exc) from exc
        return total

    def describe(self) -> str:
        return "redis " + ", ".join(f"{host}:{port}" for host, port in self.addresses)

    def close(self) -> None:
        for client in self._clients:
            try:
                client.close()
            except Exception:
                pass

    def __getstate__(self) -> dict[str, Any]:
        # A copy connects to the same servers; it never owns a server this process started.
        return {
            "hosts": [{"host": host, "port": port} for host, port in self.addresses],
            "cluster_mode": self.cluster_mode,
            "capacity_per_node": self.capacity,
            "socket_timeout": self.socket_timeout,
            "password": self.password,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)


BACKENDS: dict[str, type] = {"memory": _MemoryBackend, "redis": _RedisBackend}
