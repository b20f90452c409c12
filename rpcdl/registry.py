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
  (``ZREMRANGEBYSCORE``).

Optional parts of the URL: ``redis://:PASSWORD@HOST:PORT`` and ``rediss://``
(TLS). Reading and writing need redis-py (``pip install 'rpcdl[redis]'``).

Threading: nothing here keeps state; each call makes its own connection.
"""

from __future__ import annotations

import dataclasses
import math
import urllib.parse
from typing import Any

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
