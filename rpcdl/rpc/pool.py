"""This process's connections to workers: one per worker and credentials, shared by all its threads.

A connection is opened in the background by its first call: a worker that
refuses connections is retried for ``RPCDL_CONNECT_GRACE`` seconds (20 by
default), so trainers may start a little before their workers, unless it
served this process before or said it was leaving (it stopped or died: its
calls fail at once); a peer that is
not an rpcdl worker is named at once (see :mod:`rpcdl.rpc.dial`). A process
forked from a client never reuses its parent's connections.

Threading model: any thread may ask for a connection or shut them all down.
The pool is a dictionary that is never changed once published: a thread that
adds or removes a connection does it under ``_pool_lock``, on a copy, which it
then publishes by rebinding ``_pool`` (one atomic store). So a thread looking a
connection up reads ``_pool`` without the lock and sees a whole pool, a moment
old at most. A closing connection leaves the pool before it is closed, so a
call that finds it closed (:meth:`~rpcdl.rpc.connection.Connection.submit`
refuses it) finds another, new one when it asks again. A connection's lock
may be taken under ``_pool_lock`` (to close it only if idle, in one step),
never the other way round: a connection tells the pool it closes before it
takes its own lock.
Every connection's socket is owned by this process's one event loop (see
:mod:`rpcdl.rpc.connection`): no thread per connection. A forked child starts
with an empty pool and a new lock.
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Mapping

from .._lifecycle import ExitPhase, at_exit, in_forked_child
from ..transport.security import TLS_CA_ENV, TOKEN_ENV, TOKEN_FILE_ENV, Token, default_client_tls, resolve_token
from .connection import Connection
from .dial import connect_grace
from .environment import Variables

log = logging.getLogger("rpcdl.client")
_CREDENTIALS = Variables(TOKEN_ENV, TOKEN_FILE_ENV, TLS_CA_ENV)

_pool: Mapping[tuple, Connection] = {}  # never changed in place: replaced whole under _pool_lock
_pool_lock = threading.Lock()


def connection_to(
    address: str,
    timeout: float = 120.0,
    token: str | bytes | Token | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> Connection:
    """Return this process's connection to ``address`` with these credentials, opening one if needed.

    Args:
        address: the worker, ``"host:port"`` (as checked by the caller).
        timeout: seconds a new connection tries to open.
        token: the shared secret; defaults to ``RPCDL_TOKEN`` / ``RPCDL_TOKEN_FILE``.
        ssl_context: TLS context; defaults to one from ``RPCDL_TLS_CA`` when set.

    Returns:
        The connection, open or opening (or closing since: it then refuses calls, and the next one asked
        for is new).

    Example::

        >>> connection_to("127.0.0.1:6543").address  # doctest: +SKIP
        '127.0.0.1:6543'
    """
    if token is None and ssl_context is None and _CREDENTIALS.unset():
        key: tuple = (address, None, None)  # what resolve_token and default_client_tls return then
    else:
        token = resolve_token(token)
        if ssl_context is None:
            ssl_context = default_client_tls()
        key = (address, token.secret if token is not None else None, ssl_context)
    connection = _pool.get(key)  # a published pool: never changed in place
    if connection is not None:
        return connection
    return _open(key, address, timeout, token, ssl_context)


def _open(key: tuple, address: str, timeout: float, token: Token | None, ssl_context: ssl.SSLContext | None):
    global _pool
    with _pool_lock:
        connection = _pool.get(key)
        if connection is None:
            grace = connect_grace()  # only for a worker never reached (see rpcdl.rpc.dial)
            connection = Connection(address, token, ssl_context, timeout, grace=grace, on_close=_forget)
            _pool = {**_pool, key: connection}
            connection.start()
    return connection


def _forget(connection: Connection) -> None:
    """A connection closes: later calls open a new one."""
    global _pool
    with _pool_lock:
        if connection in _pool.values():
            _pool = {key: value for key, value in _pool.items() if value is not connection}


def close_connections_to(address: str, reason: str) -> None:
    """Close this process's connections to ``address``, a worker known to be gone: later calls open new ones.

    A connection to a process that was just killed may not have noticed yet; a
    call made on it would fail with :class:`~rpcdl.errors.ConnectionLost`
    instead of reaching the worker started in its place.

    Args:
        address: the worker, ``"host:port"`` as the connections were asked for.
        reason: why, for the calls still in flight there (they fail with ConnectionLost).

    Example::

        >>> close_connections_to("127.0.0.1:6543", "the worker process was killed")  # doctest: +SKIP
    """
    global _pool
    with _pool_lock:
        closing = [connection for key, connection in _pool.items() if key[0] == address]
        _pool = {key: connection for key, connection in _pool.items() if key[0] != address}
    for connection in closing:
        connection.close(reason)


def close_idle_connections_to(address: str, reason: str) -> int:
    """Close this process's connections to ``address`` that wait for no answer: a worker no longer needed.

    A connection with calls pending, or still connecting, is left open
    (another caller uses it, or is about to). Each is judged idle and closed
    in one step, under its lock: a call made meanwhile keeps it open, or
    finds it closed and opens a new one; no call is failed by the close.

    Args:
        address: the worker, ``"host:port"`` as the connections were asked for.
        reason: why, for the log and for a call that raced the close.

    Returns:
        how many connections were closed.

    Example::

        >>> close_idle_connections_to("127.0.0.1:6543", "no longer needed")  # doctest: +SKIP
        1
    """
    global _pool
    with _pool_lock:
        mine = {key: c for key, c in _pool.items() if key[0] == address}
        if not mine:
            return 0
        _pool = {key: c for key, c in _pool.items() if key[0] != address}  # lookups miss them from now on
        # Each decides under its own lock (taken under _pool_lock, never the other way round): a call made
        # meanwhile keeps it open, and it goes back into the pool before any other connection can be opened.
        kept = {key: c for key, c in mine.items() if not c.close_if_idle(reason)}
        if kept:
            _pool = {**_pool, **kept}
    closed = len(mine) - len(kept)
    if closed:
        log.info("closed the idle connection to %s: %s", address, reason)
    return closed


def _after_fork_in_child() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = {}, threading.Lock()


in_forked_child(_after_fork_in_child)


def shutdown() -> None:
    """Close every connection of this process; calls in flight fail with ConnectionLost.

    Later calls open new connections, so this is safe to call at any time, from any thread.

    Example::

        >>> rpcdl.shutdown()  # doctest: +SKIP
    """
    global _pool
    with _pool_lock:
        connections = list(_pool.values())
        _pool = {}
    for connection in connections:
        connection.close()


at_exit(ExitPhase.CONNECTIONS, shutdown)  # before the loop stops (ExitPhase.LOOP): their calls fail on it
