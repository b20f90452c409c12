"""The Redis registry of workers: its URL, its layout, and reading its live members.

Workers join it with ``rpcdl worker --register redis://HOST:PORT[/DB]?key=KEY``
and trainers read it as a worker source with the same URL. This module is the
one place that states the layout:

* one sorted set at ``KEY`` (query parameter ``key``, default
  ``rpcdl:workers``) in database ``DB`` (the path, default 0);
* a member per worker: its advertised address, ``"host:port"``;
* its score: the time of the worker's last heartbeat, in seconds, on the
  **Redis server's clock** (``TIME``), so the hosts' clocks need not agree;
* a worker beats every ``ttl / 3`` seconds (``ZADD``); an entry is live while
  its score is within ``ttl`` seconds of the server's time now (query parameter
  ``ttl``, default 15 s; use the same URL on both sides);
* a worker that drains (SIGTERM) removes its entry at once (``ZREM``); workers
  also trim entries dead for longer than ``ttl`` as they beat
  (``ZREMRANGEBYSCORE``, before their own ``ZADD``: an entry of its own that
  expired is trimmed, and the ``ZADD`` that follows says it joins again);
* a counter at ``KEY:version`` (``INCR``), bumped whenever the member set
  changes otherwise than by a heartbeat of a live member: a worker that joins
  (its entry was absent or expired before its beat), one that leaves, a trim
  that removed an entry;
* a token at ``KEY:epoch``, set by the first worker that joins a server
  (``SET NX``), never deleted: a server that lost its data (restarted without
  persistence) has another one, or none, even when the counter climbed back
  to the same number.

A trainer (:class:`RegistryReader`) thus fetches the member set only when the
version changed, or when fewer entries are live than it lists (an entry
expired and nobody trimmed it yet): each look is one round trip of three
commands, ``TIME``, ``MGET KEY:version KEY:epoch`` and ``ZCOUNT`` (O(log N)),
with small answers, whatever the fleet's size. A heartbeat is ``TIME``, then
``ZREMRANGEBYSCORE`` and ``ZADD`` in one round trip, as before the version
(and ``INCR``, with ``SET NX`` of the epoch when it joined, when it joined or
trimmed).

Optional parts of the URL: ``redis://:PASSWORD@HOST:PORT`` and ``rediss://``
(TLS). Reading and writing need redis-py (``pip install 'rpcdl[redis]'``).

Threading: the functions keep no state; a :class:`RegistryReader` keeps what
it last read, for the one thread at a time that reads through it (its
caller's lock owns it).
"""

from __future__ import annotations

import dataclasses
import math
import time
import urllib.parse
import uuid
from typing import Any

from .errors import RegistryReset

DEFAULT_KEY = "rpcdl:workers"
DEFAULT_TTL = 15.0
_SCHEMES = ("redis", "rediss")


@dataclasses.dataclass(frozen=True)
class RegistryURL:
    """Where a registry lives: a parsed ``redis://HOST:PORT[/DB]?key=KEY[&ttl=SECONDS]``.

    Attributes:
        host: the Redis server's host.
        port: its port (default 6379).
        db: the database number (default 0).
        key: the sorted set's key.
        ttl: seconds an entry lives without a heartbeat.
        password: the password, or ``None``.
        tls: whether to connect with TLS (``rediss://``).
    """

    host: str
    port: int = 6379
    db: int = 0
    key: str = DEFAULT_KEY
    ttl: float = DEFAULT_TTL
    password: str | None = None
    tls: bool = False

    @classmethod
    def parse(cls, url: str) -> RegistryURL:
        """Parse a registry URL.

        Args:
            url: ``redis://HOST:PORT[/DB]?key=KEY[&ttl=SECONDS]``.

        Returns:
            The parsed URL.

        Raises:
            ValueError: it is not such a URL; the message says what is wrong.

        Example::

            >>> RegistryURL.parse("redis://10.0.0.5:6379/2?key=job7&ttl=9")
            RegistryURL(host='10.0.0.5', port=6379, db=2, key='job7', ttl=9.0, password=None, tls=False)
        """
        if not isinstance(url, str):
            raise ValueError(f"a registry URL is a string such as redis://HOST:6379?key=KEY, got {url!r}")
        shape = "redis://HOST:PORT[/DB]?key=KEY[&ttl=SECONDS]"
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in _SCHEMES:
            raise ValueError(f"a registry URL starts with redis:// or rediss:// ({shape}), got {url!r}")
        try:
            port = parts.port or 6379
        except ValueError:
            raise ValueError(f"the port of registry URL {url!r} is not a number in 1..65535") from None
        if not parts.hostname:
            raise ValueError(f"registry URL {url!r} names no host ({shape})")
        path = parts.path.strip("/")
        if not path:
            db = 0
        elif path.isdigit():
            db = int(path)
        else:
            raise ValueError(f"the path of registry URL {url!r} is a database number (/0, /1, ...), got /{path}")
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
        unknown = sorted(set(query) - {"key", "ttl"})
        if unknown:
            raise ValueError(
                f"registry URL {url!r} has unknown parameter(s) {', '.join(unknown)}: it takes key and ttl"
            )
        key = query.get("key", [DEFAULT_KEY])[-1]
        if not key:
            raise ValueError(f"registry URL {url!r} has an empty key=")
        ttl_text = query.get("ttl", [str(DEFAULT_TTL)])[-1]
        try:
            ttl = float(ttl_text)
        except ValueError:
            ttl = math.nan
        if not 0.0 < ttl < math.inf:
            raise ValueError(f"the ttl= of registry URL {url!r} is a positive number of seconds, got {ttl_text!r}")
        password = urllib.parse.unquote(parts.password) if parts.password else None
        return cls(parts.hostname, port, db, key, ttl, password, parts.scheme == "rediss")

    @property
    def version_key(self) -> str:
        """The key of the counter of membership changes, ``KEY:version``."""
        return f"{self.key}:version"

    @property
    def epoch_key(self) -> str:
        """The key of the token that names this server's copy of the registry, ``KEY:epoch``."""
        return f"{self.key}:epoch"

    @property
    def heartbeat(self) -> float:
        """Seconds between two heartbeats of a worker, a third of :attr:`ttl`."""
        return self.ttl / 3.0

    def client(self, timeout: float = 5.0) -> Any:
        """A redis-py client of this registry's server and database.

        Raises:
            ImportError: redis-py is not installed (the message says how to get it).
        """
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ImportError(
                "the Redis registry needs redis-py: pip install 'rpcdl[redis]' (or pip install redis)"
            ) from None
        return redis.Redis(
            host=self.host,
            port=self.port,
            db=self.db,
            password=self.password,
            ssl=self.tls,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),  # both sides ask again on their own clock: a failure says so at once
        )


def server_time(client: Any) -> float:
    """The Redis server's clock now, in seconds (``TIME``): the scores' clock."""
    seconds, microseconds = client.time()
    return seconds + microseconds / 1e6


def live_addresses(url: RegistryURL | str, client: Any = None) -> list[str]:
    """The addresses of the workers alive in a registry: those that beat within its ``ttl``.

    Args:
        url: the registry (a :class:`RegistryURL` or its text).
        client: a redis-py client to use (default: a new one for ``url``).

    Returns:
        The addresses, sorted.

    Raises:
        ValueError: a bad URL.
        redis.exceptions.RedisError: the server failed (unreachable, say).

    Example::

        >>> live_addresses("redis://127.0.0.1:6379?key=rpcdl:workers")  # doctest: +SKIP
        ['10.0.0.7:6543', '10.0.0.8:6543']
    """
    if isinstance(url, str):
        url = RegistryURL.parse(url)
    client = client if client is not None else url.client()
    oldest = server_time(client) - url.ttl
    members = client.zrangebyscore(url.key, f"({oldest!r}", "+inf")
    return sorted(member.decode() if isinstance(member, bytes) else member for member in members)


def beat(url: RegistryURL, client: Any, address: str) -> bool:
    """Trim entries dead for a ``ttl``, write one heartbeat of ``address``, and bump the version when the
    member set changed (``address`` joined, or an entry was trimmed).

    Args:
        url: the registry.
        client: a redis-py client of its server.
        address: the worker's advertised ``"host:port"``.

    Returns:
        Whether ``address`` joined with this beat (its entry was absent or expired).

    Raises:
        redis.exceptions.RedisError: the server failed.

    Example::

        >>> beat(RegistryURL.parse("redis://127.0.0.1:6379"), client, "10.0.0.7:6543")  # doctest: +SKIP
        True
    """
    now = server_time(client)
    pipe = client.pipeline(transaction=False)
    pipe.zremrangebyscore(url.key, "-inf", f"({now - url.ttl!r}")  # the dead, gone for a ttl (this one too)
    pipe.zadd(url.key, {address: now})
    trimmed, added = pipe.execute()
    joined = bool(added)  # absent, or trimmed just now: it joins
    if joined or trimmed:
        pipe = client.pipeline(transaction=False)
        if joined:
            pipe.set(url.epoch_key, uuid.uuid4().hex, nx=True)
        pipe.incr(url.version_key)
        pipe.execute()
    return joined


def leave(url: RegistryURL, client: Any, address: str) -> None:
    """Remove ``address`` from the registry (a worker that drains), bumping the version when it was there.

    Raises:
        redis.exceptions.RedisError: the server failed.

    Example::

        >>> leave(RegistryURL.parse("redis://127.0.0.1:6379"), client, "10.0.0.7:6543")  # doctest: +SKIP
    """
    if client.zrem(url.key, address):
        client.incr(url.version_key)


@dataclasses.dataclass(frozen=True)
class _Unread:
    """Nothing read yet."""


@dataclasses.dataclass(frozen=True)
class _Following:
    """The member set ``listed`` as of ``version`` of ``epoch`` (``None``: nobody registered yet)."""

    epoch: bytes | None
    version: int | None
    listed: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _Settling:
    """Reset at server time ``since``: the members register again; trusted once a heartbeat round is over."""

    since: float
    listed: tuple[str, ...]


class RegistryReader:
    """Reads a registry's live members as a trainer does, fetching the member set only when it changed.

    Each :meth:`read` is one round trip of ``TIME``, ``MGET`` of the version
    and the epoch, and ``ZCOUNT`` of the live entries; the set itself is
    fetched (``ZRANGEBYSCORE``) only when the version moved or fewer entries
    are live than were listed (one expired). An epoch that changed or went
    away means the server lost its data: :class:`~rpcdl.errors.RegistryReset` is raised
    until every live worker had time to beat again (half a ``ttl``).

    Args:
        url: the registry.
        client: a redis-py client (default: one made from ``url``).

    Example::

        >>> reader = RegistryReader(RegistryURL.parse("redis://127.0.0.1:6379"))  # doctest: +SKIP
        >>> reader.read()  # doctest: +SKIP
        ['10.0.0.7:6543']
    """

    def __init__(self, url: RegistryURL, client: Any = None) -> None:
        self.url = url
        self.client = client if client is not None else url.client()
        self._state: _Unread | _Following | _Settling = _Unread()

    def read(self) -> list[str]:
        """The live members now, sorted.

        Raises:
            RegistryReset: the server lost its data; the members are registering again.
            redis.exceptions.RedisError: the server failed (unreachable, timed out).
        """
        url, state = self.url, self._state
        cutoff = time.time() - url.ttl  # a first guess on this host's clock; corrected below when it errs
        pipe = self.client.pipeline(transaction=False)
        pipe.time()
        pipe.mget(url.version_key, url.epoch_key)
        pipe.zcount(url.key, f"({cutoff!r}", "+inf")
        (seconds, microseconds), (raw_version, epoch), live = pipe.execute()
        now = seconds + microseconds / 1e6
        version = None if raw_version is None else int(raw_version)
        if abs(now - url.ttl - cutoff) > 0.5:  # the clocks differ: count again on the server's
            live = self.client.zcount(url.key, f"({now - url.ttl!r}", "+inf")
        if isinstance(state, _Following):
            if state.epoch is not None and epoch != state.epoch:
                self._state = _Settling(now, state.listed)
                raise RegistryReset(self._reset_message(now, now))
            if version == state.version and live == len(state.listed):
                return list(state.listed)
        elif isinstance(state, _Settling) and now < state.since + url.ttl / 2:
            raise RegistryReset(self._reset_message(state.since, now))
        listed = tuple(self._fetch(now))
        self._state = _Following(epoch, version, listed)
        return list(listed)

    def _fetch(self, now: float) -> list[str]:
        members = self.client.zrangebyscore(self.url.key, f"({now - self.url.ttl!r}", "+inf")
        return sorted(member.decode() if isinstance(member, bytes) else member for member in members)

    def _reset_message(self, since: float, now: float) -> str:
        return (
            f"the registry lost its members (its {self.url.epoch_key} changed: the Redis server restarted "
            f"without its data?); the workers register again within a heartbeat "
            f"({now - since:.0f}s of {self.url.ttl / 2:g}s)"
        )
