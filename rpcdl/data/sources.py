"""Where a client finds its workers: a list, a file, a DNS name, a Redis registry, or any ``addresses()``.

A :class:`WorkerSource` lists the workers' addresses now. :func:`worker_source`
turns what a user gives (a list, ``"HOST:PORT,HOST:PORT"``, a file path,
``"dns://NAME:PORT"``, ``"redis://HOST:PORT[/DB]?key=KEY"``, an object with
``addresses()``) into one. A :class:`Fleet` is what a dataset and its loaders
follow: the source's latest list, numbered by version, with this client's own
share of it (``workers[rank::world_size]`` for a fixed list; a balanced
assignment for a changing source, :mod:`rpcdl.data.shares`, that a join or a
leave disturbs little).

A read that fails is no news: a source raises
(:class:`~rpcdl.errors.SourceReadError` from the sources here: a file missing
or half-written, a name that does not resolve, a registry that cannot be
read), and the fleet keeps its last list,
says once that the source fails and once that it reads again, and asks again
with exponential backoff and jitter. A worker leaves only when a read that
succeeded no longer lists it.

Threading: a fleet over a changing source runs one daemon thread,
``rpcdl-fleet-SOURCE``, that asks the source every ``interval`` seconds (the
source's I/O: a file's read, a DNS lookup, a Redis query never runs on a
training step). A dataset waiting for its fleet to come up asks too; the
fleet's asking lock lets one thread at a time ask the source (its I/O and its
own fields, such as ``last_error``). The latest :class:`Membership` is
guarded by the fleet's lock, a leaf never held while asking, which readers
(the pools, under their own lock) take for a copy. Whether the source reads
(``_Reading``, or ``_Failing`` with the failure and its count) is
written by the asking thread under the fleet's lock too, so that readers
need not wait for a slow source. The thread holds
only a weak reference to its fleet (no callback) and ends at its next tick
once the fleet is gone, or at :meth:`Fleet.close`. A process forked from one
with a fleet starts its own thread on its first read.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import random
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..address import check_workers, format_address, parse_address
from ..checks import check_int, check_positive_int, check_timeout, environment_number
from ..errors import SourceReadError, WorkerUnavailable
from ..registry import RegistryReader, RegistryReset, RegistryURL
from .shares import assignment

__all__ = [
    "DEFAULT_START_TIMEOUT",
    "START_TIMEOUT_ENV",
    "WORKERS_ENV",
    "AddressList",
    "DnsSource",
    "FileSource",
    "Fleet",
    "Membership",
    "RedisRegistry",
    "SourceReadError",
    "WorkerSource",
    "own_share",
    "start_timeout",
    "worker_source",
    "workers_from_environment",
]

log = logging.getLogger("rpcdl.fleet")

START_TIMEOUT_ENV = "RPCDL_START_TIMEOUT"
#: The variable that names a trainer's workers when none are given: whatever ``workers=`` takes, as text.
WORKERS_ENV = "RPCDL_WORKERS"
#: Seconds a trainer waits for its first worker (``RPCDL_START_TIMEOUT`` overrides): pulling a worker image
#: and starting it on a cluster takes minutes.
DEFAULT_START_TIMEOUT = 600.0
#: Seconds between two looks at a changing source.
DEFAULT_INTERVAL = 2.0
#: Seconds between two log lines of a trainer waiting for its fleet.
WAIT_LOG_EVERY = 10.0
#: A source that fails is asked again after ``interval``, then twice as long each time, up to this many
#: intervals and at most :data:`BACKOFF_CAP` seconds (each wait drawn between half and all of it).
BACKOFF_INTERVALS = 16
BACKOFF_CAP = 30.0


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

    ``addresses()`` returns the workers listed now; a worker it no longer
    lists leaves (its calls in flight finish, it is given no more). When the
    source cannot be read now (a service down, a timeout), raise instead of
    returning ``[]``: any exception (:class:`~rpcdl.errors.SourceReadError` with a message
    that says what failed reads best in the log) keeps the last list, is said
    once, and the source is asked again with exponential backoff and jitter.
    Returning ``[]`` means that no worker is listed: every worker leaves.

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
        """The workers' ``HOST:PORT`` addresses now (an empty list while none is up).

        Raises:
            Exception: the source cannot be read now (best a :class:`~rpcdl.errors.SourceReadError`):
                the last list stands.
        """
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
    """The entries of ``text``, separated by commas, spaces or lines."""
    return text.replace(",", " ").split()


class FileSource(WorkerSource):
    """A text file, one ``HOST:PORT`` per line (what ``rpcdl worker --address-file`` appends): re-read when it
    changes; a line added joins, a line removed drains. Blank lines and ``#`` comments are skipped.

    A file that does not exist, cannot be read, is empty, or ends in a line
    being written (no newline yet, and not a whole address) is a failed read
    (:class:`~rpcdl.errors.SourceReadError`): the fleet keeps its last list.
    An empty file is one being rewritten (``echo ... > workers.txt``
    truncates it first), or one made for workers to append to. A file that
    lists no address (only blank or ``#`` lines) lists no worker.

    Args:
        path: the file.

    Example::

        >>> FileSource("workers.txt").addresses()  # doctest: +SKIP
        ['10.0.0.5:6543', '10.0.0.6:6543']
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def addresses(self) -> list[str]:
        """The addresses in the file now (malformed lines are reported and skipped).

        Raises:
            SourceReadError: the file does not exist, cannot be read, is empty, or its last line is being written.
        """
        try:
            with open(self.path, encoding="utf-8") as file:
                text = file.read()
        except FileNotFoundError:
            raise SourceReadError(f"the file {self.path} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise SourceReadError(f"the file {self.path} cannot be read ({exc})") from None
        if not text:  # truncated by a writer that has not written yet: no news of any worker
            raise SourceReadError(f"the file {self.path} is empty (to list no worker, write a '#' line)")
        lines = [line.split("#", 1)[0] for line in text.splitlines()]
        if not text.endswith("\n"):
            for entry in _split(lines[-1]):  # a writer is still at it, or the last address is whole
                try:
                    parse_address(entry)
                except ValueError:
                    raise SourceReadError(
                        f"the file {self.path} ends in a line being written ({entry!r} is not a whole address)"
                    ) from None
        found: list[str] = []
        for entry in _split("\n".join(lines)):
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
    every few seconds. A name that does not resolve is a failed read (:class:`~rpcdl.errors.SourceReadError`):
    the fleet keeps its last list (none before the first answer) and says why.

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

    def addresses(self) -> list[str]:
        """The addresses the name resolves to now.

        Raises:
            SourceReadError: the name does not resolve now (the resolver's error is in the message).
        """
        try:
            found = self._resolver(self.name, self.port)
        except OSError as exc:
            raise SourceReadError(f"{self.name} does not resolve ({getattr(exc, 'strerror', None) or exc})") from None
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
    ``TIME``; a counter beside it says when the set changed, so that it is
    fetched only then. A registry that cannot be read is a failed read
    (:class:`~rpcdl.errors.SourceReadError`): the fleet keeps its last list. Needs the
    ``redis`` extra (``pip install rpcdl[redis]``).

    Args:
        url: the registry's URL.

    Raises:
        ValueError: the URL is malformed (the message shows the form).
        ImportError: redis-py is not installed (the message says how to install it).

    Example::

        >>> RedisRegistry("redis://127.0.0.1:6379/0?key=rpcdl:workers").addresses()  # doctest: +SKIP
        ['10.0.0.5:6543']
    """

    def __init__(self, url: str):
        self.url = url
        self.registry = RegistryURL.parse(url)  # the layout is rpcdl.registry's, the worker side's
        try:
            self._reader = RegistryReader(self.registry)  # redis-py connects on first use
        except ImportError:
            raise ImportError("a redis:// worker source needs redis-py: pip install 'rpcdl[redis]'") from None

    def addresses(self) -> list[str]:
        """The live members now, sorted; the member set is fetched only when it changed.

        Raises:
            SourceReadError: the registry cannot be read now (unreachable, timed out, or its server lost its
                data and the workers register again).
        """
        try:
            return self._reader.read()
        except RegistryReset as exc:
            raise SourceReadError(f"{self.describe()}: {exc}") from None
        except Exception as exc:  # redis' own errors: the registry is not there (now)
            raise SourceReadError(f"the registry {self.describe()} cannot be read ({exc})") from None

    def describe(self) -> str:
        """The URL."""
        return self.url

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return RedisRegistry, (self.url,)


def worker_source(workers: Any) -> WorkerSource:
    """The source ``workers`` names: a list of ``HOST:PORT``, the path of a file (an existing one, a string
    with a ``/``, or any ``os.PathLike``), ``"dns://NAME:PORT"``, ``"redis://..."`` (or ``"rediss://..."``),
    or any object with ``addresses()`` (returned as it is).

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
        if text.startswith(("redis://", "rediss://")):
            return RedisRegistry(text)
        path = os.path.expandvars(os.path.expanduser(text))
        if os.path.isfile(path) or os.sep in path:  # a path, perhaps of a file not written yet
            return FileSource(path)
        # A bare "HOST:PORT" string is the classic mistake for [address]: check_workers says so.
    return AddressList(workers)


def workers_from_environment() -> WorkerSource | None:
    """The workers ``$RPCDL_WORKERS`` names, the one place that reads it: what ``workers=`` takes, as text.

    The variable holds a file path (one ``HOST:PORT`` per line, watched),
    ``dns://NAME:PORT``, ``redis://HOST:PORT[/DB]?key=KEY``, or addresses
    separated by commas or whitespace (a fixed list). ``~`` and ``$VARIABLES``
    in a path are expanded.

    Returns:
        the source, or ``None`` when the variable is unset or blank (the caller's default applies: local
        workers, for :class:`~rpcdl.integrations.lightning.RPCDataModule`).

    Raises:
        ValueError: an address or a URL in it is malformed (the message names the variable).

    Example::

        >>> os.environ["RPCDL_WORKERS"] = "cpu01:6543, cpu02:6543"
        >>> workers_from_environment().addresses()
        ['cpu01:6543', 'cpu02:6543']
        >>> os.environ["RPCDL_WORKERS"] = "/shared/job7/workers.txt"
        >>> workers_from_environment().describe()
        'the file /shared/job7/workers.txt'
        >>> del os.environ["RPCDL_WORKERS"]
    """
    text = os.environ.get(WORKERS_ENV, "").strip()
    if not text:
        return None
    try:
        if text.startswith(("dns://", "redis://", "rediss://")):
            return worker_source(text)
        path = os.path.expandvars(os.path.expanduser(text))
        if len(text.split()) == 1 and "," not in text and (os.path.isfile(path) or os.sep in path):
            return FileSource(path)
        return AddressList(_split(text))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"${WORKERS_ENV}={text!r}: {exc}; it takes a file path, dns://NAME:PORT, redis://HOST:PORT?key=KEY, "
            "or HOST:PORT addresses separated by commas or spaces"
        ) from None


def own_share(addresses: Sequence[str], rank: int, world_size: int, changing: bool) -> frozenset[str]:
    """The workers rank ``rank`` of ``world_size`` prefers.

    For a fixed list, ``addresses[rank::world_size]`` (``addresses[rank % n]``
    with fewer workers than ranks). For a changing source, the rank's share of
    :func:`rpcdl.data.shares.assignment`: ``floor(W/R)`` or ``ceil(W/R)``
    workers per rank (one with fewer workers than ranks), the same on every
    rank, and a join or a leave moves few workers between ranks.

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
    return frozenset(assignment(addresses, world_size)[rank])


@dataclasses.dataclass(frozen=True)
class Membership:
    """The fleet at one moment: its ``addresses`` (in the order the source gave), this client's ``own`` share,
    and a ``version`` that grows with every change."""

    version: int
    addresses: tuple[str, ...]
    own: frozenset[str]


@dataclasses.dataclass(frozen=True)
class _Reading:
    """The source's last read succeeded."""


@dataclasses.dataclass(frozen=True)
class _Failing:
    """The source's reads fail: the last ``failures`` in a row, since ``since`` (monotonic), the last with
    ``error``."""

    error: str
    failures: int
    since: float


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
        self.world_size = check_positive_int(world_size, "world_size", "the number of ranks")
        self.rank = check_int(rank, "rank", minimum=0, maximum=world_size - 1, meaning=f"one of the {world_size} ranks")
        self.interval = check_timeout(interval, "interval")
        self.source = worker_source(source)
        self.changing = bool(getattr(self.source, "changing", True))
        self._asking = threading.Lock()  # one thread at a time asks the source (its I/O, its own fields)
        self._lock = threading.Lock()  # guards what follows; a leaf, never held while asking
        self._health: _Reading | _Failing = _Reading()  # written by the asking thread, under both locks
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
        """Why the source lists nothing, when its last read failed: what failed (``"the file X does not
        exist"``, a name that does not resolve, a registry not reachable); ``None`` after a read that succeeded.

        Example::

            >>> Fleet("/no/such/workers.txt").why_empty()
            'the file /no/such/workers.txt does not exist'
        """
        with self._lock:
            health = self._health
        return self._naming(health.error) if isinstance(health, _Failing) else None

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
        """The source's list now, or ``None`` when the read failed (said once, until a read succeeds)."""
        with self._asking:
            try:
                found = self.source.addresses()
            except Exception as exc:  # any source's failure, a user's included: the last list stands
                error = str(exc) or type(exc).__name__
                with self._lock:
                    before = self._health
                    failures = before.failures + 1 if isinstance(before, _Failing) else 1
                    since = before.since if isinstance(before, _Failing) else time.monotonic()
                    self._health = _Failing(error, failures, since)
                    listed = len(self._membership.addresses)
                if isinstance(before, _Reading):
                    log.warning(
                        "rpcdl worker source %s; keeping its last list (%d workers) and asking again with backoff",
                        self._naming(error),
                        listed,
                    )
                return None
            with self._lock:
                before, self._health = self._health, _Reading()
        if isinstance(before, _Failing):
            failed_for = time.monotonic() - before.since
            log.warning("rpcdl worker source %s reads again (it failed for %.0fs)", self.describe(), failed_for)
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

    def _naming(self, error: str) -> str:
        """``error``, with the source's name in front unless it names it already."""
        name = self.describe()
        return error if name in error else f"{name}: {error}"

    def next_look(self) -> float:
        """Seconds until the source is asked again: about ``interval`` (with jitter) while it reads; after
        ``n`` failed reads in a row, ``interval * 2**(n-1)`` up to 16 intervals and 30 s, drawn between half
        and all of it, so that many trainers do not ask a recovering source at once."""
        with self._lock:
            health = self._health
        if isinstance(health, _Reading):
            return self.interval * random.uniform(0.8, 1.2)
        cap = max(self.interval, min(BACKOFF_CAP, self.interval * BACKOFF_INTERVALS))
        return min(cap, self.interval * 2 ** min(health.failures - 1, 30)) * random.uniform(0.5, 1.0)

    def _start_watch(self) -> None:
        # Holding the lock.
        self._watching = _Watching.RUNNING
        self._pid = os.getpid()
        thread = threading.Thread(
            target=_watch, args=(weakref.ref(self),), name=f"rpcdl-fleet-{self.describe()}", daemon=True
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
            why = self.why_empty() or f"{self.describe()} lists no worker yet"
            if now - started >= timeout:
                raise WorkerUnavailable(
                    f"no rpcdl worker came up within {timeout:g}s: {why}; set {START_TIMEOUT_ENV} to wait longer"
                )
            if now - said >= WAIT_LOG_EVERY:
                said = now
                log.warning(
                    "waiting for rpcdl workers (%.0fs of %gs, %s): %s", now - started, timeout, START_TIMEOUT_ENV, why
                )
            time.sleep(min(self.interval, 0.5))


def _watch(fleet_ref: weakref.ref[Fleet]) -> None:
    """The fleet's thread: look at the source every ``interval`` seconds (backing off while it fails) while the
    fleet lives."""
    while True:
        fleet = fleet_ref()
        if fleet is None or fleet.stopped():
            return
        stop = fleet._stop
        delay = fleet.next_look()
        del fleet  # between looks the thread must not keep it alive
        if stop.wait(delay):
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
