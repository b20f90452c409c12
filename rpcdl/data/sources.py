"""Where a client finds its workers: a list, a file, a DNS name, a Redis registry, or any ``addresses()``.

A :class:`WorkerSource` lists the workers' addresses now. :func:`worker_source`
turns what a user gives (a list, ``"HOST:PORT,HOST:PORT"``, a file path,
``"dns://NAME:PORT"``, ``"redis://HOST:PORT[/DB]?key=KEY"``, an object with
``addresses()``) into one. A :class:`Fleet` is what a dataset and its loaders
follow: the source's latest list, numbered by version, with this client's own
share of it (``workers[rank::world_size]`` for a fixed list; rendezvous
hashing for a changing source, so that a join or a leave moves few workers
between ranks).

Threading: a fleet over a changing source runs one daemon thread,
``rpcdl-fleet-SOURCE``, that asks the source every ``interval`` seconds (the
source's I/O: a file's read, a DNS lookup, a Redis query never runs on a
training step). A dataset waiting for its fleet to come up asks too; the
fleet's asking lock lets one thread at a time ask the source (its I/O and its
own fields, such as ``last_error``). The latest :class:`Membership` is
guarded by the fleet's lock, a leaf never held while asking, which readers
(the pools, under their own lock) take for a copy. The thread holds
only a weak reference to its fleet (no callback) and ends at its next tick
once the fleet is gone, or at :meth:`Fleet.close`. A process forked from one
with a fleet starts its own thread on its first read.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..address import check_workers, format_address, parse_address
from ..checks import environment_number
from ..errors import WorkerUnavailable
from ..registry import RegistryURL, live_addresses

__all__ = [
    "DEFAULT_START_TIMEOUT",
    "START_TIMEOUT_ENV",
    "AddressList",
    "DnsSource",
    "FileSource",
    "Fleet",
    "Membership",
    "RedisRegistry",
    "WorkerSource",
    "own_share",
    "start_timeout",
    "worker_source",
]

log = logging.getLogger("rpcdl.fleet")

START_TIMEOUT_ENV = "RPCDL_START_TIMEOUT"
#: Seconds a trainer waits for its first worker (``RPCDL_START_TIMEOUT`` overrides): pulling a worker image
#: and starting it on a cluster takes minutes.
DEFAULT_START_TIMEOUT = 600.0
#: Seconds between two looks at a changing source.
DEFAULT_INTERVAL = 2.0
#: Seconds between two log lines of a trainer waiting for its fleet.
WAIT_LOG_EVERY = 10.0


def start_timeout(given: float | None = None) -> float:
    """Seconds to wait for the fleet to come up: ``given``, else ``RPCDL_START_TIMEOUT``, else 600.

    Example::

        >>> start_timeout(30.0)
        30.0
    """
    if given is not None:
        return float(given)
    return environment_number(
        START_TIMEOUT_ENV,
        DEFAULT_START_TIMEOUT,
        float,
        "a number of seconds >= 0 (how long a trainer waits for its workers to come up)",
        lambda seconds: seconds >= 0,
    )


class WorkerSource:
    """Where the workers are (``rpcdl.WorkerSource``): subclass it and define ``addresses()``.

    Any object with an ``addresses()`` method is accepted wherever workers are
    (it need not subclass this); this class adds a name for log lines and the
    default of whether the list changes.

    Attributes:
        changing: whether :meth:`addresses` may give another list later (then it is asked every few seconds).

    Example::

        >>> class Two(WorkerSource):  # rpcdl.WorkerSource
        ...     def addresses(self):
        ...         return ["127.0.0.1:6543", "127.0.0.1:6544"]
        >>> Two().addresses()
        ['127.0.0.1:6543', '127.0.0.1:6544']
        >>> rpcdl.RPCDataset(Two(), MyDataset)  # doctest: +SKIP
    """

    changing: bool = True

    def addresses(self) -> list[str]:
        """The workers' ``HOST:PORT`` addresses now (an empty list while none is up)."""
        raise NotImplementedError

    def describe(self) -> str:
        """What it is, for log lines and errors."""
        return repr(self)


class AddressList(WorkerSource):
    """A fixed list of addresses.

    Example::

        >>> AddressList(["127.0.0.1:6543"]).addresses()
        ['127.0.0.1:6543']
    """

    changing = False

    def __init__(self, addresses: Sequence[str]):
        self._addresses = check_workers(addresses)

    def addresses(self) -> list[str]:
        """The list given."""
        return list(self._addresses)

    def describe(self) -> str:
        """The addresses."""
        return ", ".join(self._addresses)

    def __reduce__(self) -> tuple[type, tuple[list[str]]]:
        return AddressList, (self._addresses,)


def _split(text: str) -> list[str]:
    return [part.strip() for line in text.splitlines() for part in line.split(",") if part.strip()]


class FileSource(WorkerSource):
    """A text file, one ``HOST:PORT`` per line (what ``rpcdl worker --address-file`` appends): re-read when it
    changes; a line added joins, a line removed drains. Blank lines and ``#`` comments are skipped; a missing
    file lists no worker (yet).

    Args:
        path: the file.

    Example::

        >>> FileSource("workers.txt").addresses()  # doctest: +SKIP
        ['10.0.0.5:6543', '10.0.0.6:6543']
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def addresses(self) -> list[str]:
        """The addresses in the file now (malformed lines are reported and skipped)."""
        try:
            with open(self.path, encoding="utf-8") as file:
                text = file.read()
        except FileNotFoundError:
            return []
        found: list[str] = []
        for entry in _split("\n".join(line.split("#", 1)[0] for line in text.splitlines())):
            try:
                parse_address(entry)
            except ValueError as exc:
                log.warning("%s: %s (skipped)", self.path, exc)
                continue
            if entry not in found:
                found.append(entry)
        return found

    def describe(self) -> str:
        """The path."""
        return f"the file {self.path}"

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return FileSource, (self.path,)


def _resolve(name: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({format_address(info[4][0], port) for info in infos})


#: How a :class:`DnsSource` resolves a name: ``resolver(name, port) -> ["HOST:PORT", ...]``, raising
#: ``socket.gaierror`` when the name does not resolve. Tests put their own here (``DnsSource(resolver=...)``).
Resolver = Callable[[str, int], list[str]]


class DnsSource(WorkerSource):
    """``dns://NAME:PORT``: every address ``NAME`` resolves to (a Kubernetes headless Service), resolved again
    every few seconds. A name that does not resolve (yet) lists no worker, and says so.

    Args:
        name: the DNS name.
        port: the workers' port.
        resolver: how to resolve (default: the system's, ``getaddrinfo``).

    Example::

        >>> DnsSource("localhost", 6543).addresses()  # doctest: +SKIP
        ['127.0.0.1:6543']
    """

    def __init__(self, name: str, port: int, resolver: Resolver | None = None):
        self.name, self.port = name, port
        self._resolver = resolver or _resolve
        self.last_error: str | None = None  # why the name gave nothing, for log lines (asked by one thread at a time)

    def addresses(self) -> list[str]:
        """The addresses the name resolves to now."""
        try:
            found = self._resolver(self.name, self.port)
        except OSError as exc:
            self.last_error = f"{self.name} does not resolve ({getattr(exc, 'strerror', None) or exc})"
            return []
        self.last_error = None
        return list(found)

    def describe(self) -> str:
        """The URL."""
        return f"dns://{format_address(self.name, self.port)}"

    def __reduce__(self) -> tuple[Any, ...]:
        return DnsSource, (self.name, self.port, None if self._resolver is _resolve else self._resolver)


class RedisRegistry(WorkerSource):
    """``redis://HOST:PORT[/DB]?key=KEY[&ttl=SECONDS]``: the live members of the registry that workers join
    with ``rpcdl worker --register URL``.

    The layout (documented with the worker's side, ``rpcdl.registry``): a sorted
    set at ``KEY`` (default ``rpcdl:workers``), member a worker's address,
    score its last heartbeat on the Redis server's clock; an entry is live
    while its score is within ``ttl`` seconds (default 15) of the server's
    ``TIME``. Needs the ``redis`` extra (``pip install rpcdl[redis]``).

    Args:
        url: the registry's URL.

    Raises:
        ValueError: the URL is malformed (the message shows the form).

    Example::

        >>> RedisRegistry("redis://127.0.0.1:6379/0?key=rpcdl:workers").addresses()  # doctest: +SKIP
        ['10.0.0.5:6543']
    """

    def __init__(self, url: str):
        self.url = url
        self.registry = RegistryURL.parse(url)  # the layout is rpcdl.registry's, the worker side's
        self.last_error: str | None = None  # (its fleet asks it from one thread at a time)
        self._client: Any = None  # made on first use

    def addresses(self) -> list[str]:
        """The live members now (none while the registry cannot be reached, which is said)."""
        try:
            if self._client is None:
                self._client = self.registry.client()
            members = live_addresses(self.registry, self._client)
        except ImportError:
            raise ImportError("a redis:// worker source needs redis-py: pip install 'rpcdl[redis]'") from None
        except Exception as exc:  # redis' own errors: the registry is not there (yet)
            self.last_error = f"the registry {self.describe()} cannot be read ({exc})"
            self._client = None
            return []
        self.last_error = None
        return members

    def describe(self) -> str:
        """The URL."""
        return self.url

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return RedisRegistry, (self.url,)


def worker_source(workers: Any) -> WorkerSource:
    """The source ``workers`` names: a list of ``HOST:PORT``, the path of a file (an existing one, a string
    with a ``/``, or any ``os.PathLike``), ``"dns://NAME:PORT"``, ``"redis://..."``, or any object with
    ``addresses()`` (returned as it is).

    Raises:
        TypeError: ``workers`` is none of those (a bare ``"HOST:PORT"`` string included: give a list).
        ValueError: an address or a URL is malformed.

    Example::

        >>> worker_source("dns://workers.ns.svc:6543").describe()
        'dns://workers.ns.svc:6543'
    """
    if hasattr(workers, "addresses") and callable(workers.addresses):
        return workers
    if isinstance(workers, os.PathLike):
        return FileSource(workers)
    if isinstance(workers, str):
        text = workers.strip()
        if text.startswith("dns://"):
            host, port = parse_address(text[len("dns://") :])
            return DnsSource(host, port)
        if text.startswith("redis://"):
            return RedisRegistry(text)
        path = os.path.expandvars(os.path.expanduser(text))
        if os.path.isfile(path) or os.sep in path:  # a path, perhaps of a file not written yet
            return FileSource(path)
        # A bare "HOST:PORT" string is the classic mistake for [address]: check_workers says so.
    return AddressList(workers)


def own_share(addresses: Sequence[str], rank: int, world_size: int, changing: bool) -> frozenset[str]:
    """The workers rank ``rank`` of ``world_size`` prefers.

    For a fixed list, ``addresses[rank::world_size]`` (``addresses[rank % n]``
    with fewer workers than ranks). For a changing source, each address goes
    to the rank it hashes highest with (rendezvous hashing): a worker that
    joins or leaves moves no other worker between ranks. A rank that no
    address hashes to prefers the one that hashes highest with it.

    Example::

        >>> sorted(own_share(["a:1", "b:1", "c:1", "d:1"], rank=1, world_size=2, changing=False))
        ['b:1', 'd:1']
    """
    if not addresses:
        return frozenset()
    if not changing:
        if len(addresses) < world_size:
            return frozenset([addresses[rank % len(addresses)]])
        return frozenset(addresses[rank::world_size])

    def score(address: str, r: int) -> int:
        return int.from_bytes(hashlib.blake2b(f"{address}|{r}".encode(), digest_size=8).digest(), "big")

    own = frozenset(a for a in addresses if max(range(world_size), key=lambda r: score(a, r)) == rank)
    return own or frozenset([max(addresses, key=lambda a: score(a, rank))])


@dataclasses.dataclass(frozen=True)
class Membership:
    """The fleet at one moment: its ``addresses`` (in the order the source gave), this client's ``own`` share,
    and a ``version`` that grows with every change."""

    version: int
    addresses: tuple[str, ...]
    own: frozenset[str]


class _Watching(enum.Enum):
    NOT_STARTED = "not started"  #: no thread in this process yet (a fixed list never has one)
    RUNNING = "running"
    CLOSED = "closed"


class Fleet:
    """The workers a dataset and its loaders follow: a source's latest list, and this rank's share of it.

    Args:
        source: where the workers are (anything :func:`worker_source` accepts).
        rank, world_size: this client's place among the ranks (its share).
        interval: seconds between two looks at a changing source.

    Example::

        >>> fleet = Fleet(["127.0.0.1:6543", "127.0.0.1:6544"], rank=1, world_size=2)
        >>> sorted(fleet.membership().own)
        ['127.0.0.1:6544']
    """

    def __init__(self, source: Any, rank: int = 0, world_size: int = 1, interval: float = DEFAULT_INTERVAL):
        self.source = worker_source(source)
        self.rank, self.world_size, self.interval = rank, world_size, interval
        self.changing = bool(getattr(self.source, "changing", True))
        self._asking = threading.Lock()  # one thread at a time asks the source (its I/O, its own fields)
        self._lock = threading.Lock()  # guards what follows; a leaf, never held while asking
        self._membership = Membership(0, (), frozenset())
        self._watching = _Watching.NOT_STARTED
        self._pid = os.getpid()
        self._stop = threading.Event()
        self.refresh()

    def __reduce__(self) -> tuple[type, tuple[Any, int, int, float]]:
        return Fleet, (self.source, self.rank, self.world_size, self.interval)

    def describe(self) -> str:
        """The source, for log lines."""
        describe = getattr(self.source, "describe", None)
        return describe() if callable(describe) else repr(self.source)

    def why_empty(self) -> str | None:
        """Why the source lists nothing, when it knows (a name that does not resolve, a registry not reachable)."""
        with self._asking:
            return getattr(self.source, "last_error", None)

    def membership(self) -> Membership:
        """The latest list (and, for a changing source, the watch started in this process)."""
        with self._lock:
            watching = self._watching
            if self.changing and (
                watching is _Watching.NOT_STARTED or (watching is _Watching.RUNNING and self._pid != os.getpid())
            ):
                self._start_watch()
            return self._membership

    def refresh(self) -> Membership:
        """Ask the source now (on the caller's thread) and return the list."""
        addresses = self._ask()
        with self._lock:
            if addresses is not None and addresses != self._membership.addresses:
                own = own_share(addresses, self.rank, self.world_size, self.changing)
                self._membership = Membership(self._membership.version + 1, addresses, own)
            return self._membership

    def close(self) -> None:
        """Stop watching the source (the thread ends within a tick)."""
        with self._lock:
            self._watching = _Watching.CLOSED
        self._stop.set()

    def _ask(self) -> tuple[str, ...] | None:
        try:
            with self._asking:
                found = self.source.addresses()
        except Exception as exc:  # a user's source: say it, keep the last list
            log.warning("the worker source %s failed: %s; keeping the last list", self.describe(), exc)
            return None
        valid = []
        for address in found:
            try:
                parse_address(address)
            except (TypeError, ValueError) as exc:
                log.warning("the worker source %s gave %s (skipped)", self.describe(), exc)
                continue
            if address not in valid:
                valid.append(address)
        return tuple(valid)

    def _start_watch(self) -> None:
        # Holding the lock.
        self._watching = _Watching.RUNNING
        self._pid = os.getpid()
        thread = threading.Thread(
            target=_watch, args=(weakref.ref(self), self.interval), name=f"rpcdl-fleet-{self.describe()}", daemon=True
        )
        thread.start()

    def stopped(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._stop.is_set()

    def wait_for_workers(self, timeout: float) -> Membership:
        """Wait until the source lists a worker, saying every 10 s what it waits for.

        Raises:
            WorkerUnavailable: none within ``timeout`` seconds (the message says what the source gave).
        """
        started = time.monotonic()
        said = started
        while True:
            membership = self.refresh()
            if membership.addresses:
                return membership
            now = time.monotonic()
            why = self.why_empty() or "it lists no worker yet"
            if now - started >= timeout:
                raise WorkerUnavailable(
                    f"no rpcdl worker came up within {timeout:g}s: {self.describe()}: {why}; set "
                    f"{START_TIMEOUT_ENV} to wait longer"
                )
            if now - said >= WAIT_LOG_EVERY:
                said = now
                log.warning(
                    "waiting for rpcdl workers (%.0fs of %gs): %s: %s", now - started, timeout, self.describe(), why
                )
            time.sleep(min(self.interval, 0.5))


def _watch(fleet_ref: weakref.ref[Fleet], interval: float) -> None:
    """The fleet's thread: look at the source every ``interval`` seconds while the fleet lives."""
    while True:
        fleet = fleet_ref()
        if fleet is None or fleet.stopped():
            return
        stop = fleet._stop
        del fleet  # between looks the thread must not keep it alive
        if stop.wait(interval):
            return
        fleet = fleet_ref()
        if fleet is None:
            return
        before = fleet.membership().addresses
        after = fleet.refresh().addresses
        if after != before:
            joined = [a for a in after if a not in before]
            gone = [a for a in before if a not in after]
            log.info("%s: joined %s, left %s", fleet.describe(), joined or "none", gone or "none")
        del fleet
