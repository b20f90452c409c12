"""The client side: this process's connections to workers and the calls made over them.

Each process keeps one connection per worker (and per credentials), shared by
all its threads, with many calls in flight, each answered by id in any order
(see :mod:`rpcdl.rpc.connection` for its threads). A connection is opened in the
background by its first call: a worker that refuses connections is retried
for ``RPCDL_CONNECT_GRACE`` seconds (20 by default), so trainers may start a
little before their workers; a peer that is not an rpcdl worker is named at
once (see :mod:`rpcdl.rpc.dial`). A process forked from a client never reuses its
parent's connections.

Threading model: any thread may call; the pool of connections is shared,
changed under ``_pool_lock`` (and read without it); each connection has its own thread
(``rpcdl-connection-HOST:PORT``, see :mod:`rpcdl.rpc.connection`); what a thread
holds back is its own (:mod:`rpcdl.rpc.held`).

Calls may be held back and sent together, and their answers read by the
thread that made them (:func:`sent_together`, :func:`answers_read_here`):
:mod:`rpcdl.rpc.held` states the rule that keeps stages composable.
"""

from __future__ import annotations

import logging
import os
import select
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from .._lifecycle import ExitPhase, at_exit, in_forked_child
from ..address import format_address, parse_address
from ..checks import check_timeout
from ..errors import WorkerUnavailable
from ..serialization.pickling import dumps_for
from ..transport.security import TLS_CA_ENV, TOKEN_ENV, TOKEN_FILE_ENV, Token, default_client_tls, resolve_token
from ..transport.wire import MAX_BUFFERS_ENV, MAX_MESSAGE_BYTES_ENV, SMALLEST_MESSAGE_LIMIT, Kind, Limits
from .calls import Call, CallFuture, ReadBy, describe
from .connection import Connection, _Closed
from .connection_thread import IDLE_TICK
from .dial import connect_grace
from .environment import Variables
from .held import answers_read_here, outside_held_blocks, send_held, sent_together
from .live_threads import join_connection_threads
from .rref import RRef, holding_handle, install_rpc_sync, new_uid

__all__ = [
    "Connection", "answers_read_here", "connection_to", "outside_held_blocks", "ping", "ping_async",
    "read_answers", "read_in_background", "remote", "rpc_async", "rpc_sync", "sent_together", "shutdown", "stats",
]  # fmt: skip

_T = TypeVar("_T")
log = logging.getLogger("rpcdl.client")
_EXIT_GRACE = 10.0  # seconds exit waits for connection threads still completing calls


def read_in_background(futures: Iterable[torch.futures.Future]) -> None:
    """Give the answers of ``futures`` made under :func:`answers_read_here` back to their connections' threads.

    For a thread that stops reading before they are all answered.
    """
    for future in futures:
        call = future._call() if isinstance(future, CallFuture) else None
        if call is not None and future._connection is not None:
            future._connection.read_in_background(call)


def read_answers(futures: Iterable[torch.futures.Future], timeout: float) -> bool | None:
    """Read, in this thread, the answers arriving for ``futures`` (calls to any workers).

    Waits up to ``timeout`` seconds for the first answer, then reads what is
    there and returns; the futures complete (and their callbacks run) here.

    Returns:
        ``True`` if answers were read; ``False`` if none came within
        ``timeout``; ``None`` if they cannot be read here (another thread is
        reading one of the connections, and completes the futures it reads).
    """
    send_held()  # this thread waits now: what it holds must not wait with it
    calls = [future._call() for future in futures if isinstance(future, CallFuture)]
    connections = {
        call.future._connection for call in calls if call is not None and call.read_by is not ReadBy.BACKGROUND
    }
    if not connections:
        return None  # no answer for this thread to read: their connections' threads read them
    deadline = time.monotonic() + timeout
    while True:
        read_any = False
        waiting = []
        for connection in connections:
            state = connection.read_if_ready()
            if state is None:
                return None
            read_any |= state
            waiting.append(connection)
        if read_any:
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        poller = select.poll()
        try:
            for connection in waiting:
                sock = connection.readable_socket()
                if sock is not None:
                    poller.register(sock, select.POLLIN)
        except (OSError, ValueError):  # closed meanwhile: its futures have failed
            return None
        poller.poll(min(remaining, IDLE_TICK) * 1000)


# ---------------------------------------------------------------------------- pool

_pool: dict[tuple, Connection] = {}
_pool_lock = threading.Lock()


def _key(address: str, token: Token | None, ssl_context: ssl.SSLContext | None) -> tuple:
    return (address, token.secret if token is not None else None, ssl_context)


def connection_to(
    address: str,
    timeout: float = 120.0,
    token: str | bytes | Token | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> Connection:
    """Return this process's connection to ``address``, opening one if needed."""
    if token is None and ssl_context is None and _CREDENTIALS.unset():
        key = (address, None, None)  # what resolve_token and default_client_tls return then
    else:
        token = resolve_token(token)
        if ssl_context is None:
            ssl_context = default_client_tls()
        key = _key(address, token, ssl_context)
    connection = _pool.get(key)  # a read: the lock is for opening one
    if connection is not None and not connection.closed:
        return connection
    with _pool_lock:
        connection = _pool.get(key)
        if connection is None or connection.closed:
            connection = Connection(address, token, ssl_context, timeout, grace=connect_grace(), on_close=_forget)
            _pool[key] = connection
    return connection


def _forget(connection: Connection) -> None:
    with _pool_lock:
        for key, value in list(_pool.items()):
            if value is connection:
                del _pool[key]


def _after_fork_in_child() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = {}, threading.Lock()


in_forked_child(_after_fork_in_child)


def shutdown() -> None:
    """Close every connection of this process; calls in flight fail with ConnectionLost.

    Later calls open new connections, so this is safe to call at any time.
    """
    with _pool_lock:
        connections = list(_pool.values())
        _pool.clear()
    for connection in connections:
        connection.close()
    join_connection_threads(timeout=1.0)


def _shutdown_at_exit() -> None:
    """Close the connections and wait for their threads, closed ones included: one may be completing a
    call, and a thread still inside torch's C++ futures when the interpreter finalizes aborts the process
    ("terminate called without an active exception")."""
    shutdown()
    still_running = join_connection_threads(timeout=_EXIT_GRACE)
    if still_running:
        log.warning(
            "rpcdl: %d connection thread(s) still running %gs after exit began (a callback of a call that "
            "does not return?): %s; the process may abort",
            len(still_running),
            _EXIT_GRACE,
            ", ".join(still_running),
        )


at_exit(ExitPhase.CONNECTIONS, _shutdown_at_exit)


# ---------------------------------------------------------------------------- calls


_CREDENTIALS = Variables(TOKEN_ENV, TOKEN_FILE_ENV, TLS_CA_ENV)
_LIMITS = Variables(MAX_MESSAGE_BYTES_ENV, MAX_BUFFERS_ENV)
_addresses: dict[str, str] = {}  # each address as given -> as checked (a few per process)
_limits: dict[tuple[str | None, str | None], Limits] = {}  # by the environment variables they come from


def _check_address(host: Any) -> str:
    address = _addresses.get(host) if isinstance(host, str) else None
    if address is None:
        address = format_address(*parse_address(host))
        if len(_addresses) < 4096:
            _addresses[host] = address
    return address


def _outgoing_limits() -> Limits:
    """The limits of the environment, built again only when ``RPCDL_MAX_*`` change."""
    key = (None, None) if _LIMITS.unset() else (os.environ.get(MAX_MESSAGE_BYTES_ENV), os.environ.get(MAX_BUFFERS_ENV))
    limits = _limits.get(key)
    if limits is None:
        limits = _limits[key] = Limits()
    return limits


def _submit(
    kind: Kind,
    host: str,
    timeout: float,
    what: str | Callable,
    payload: bytes = b"",
    buffers: Sequence = (),
    *,
    sync: bool = False,
    ref: int = 0,
    pin_memory: bool = False,
    transform: Callable | None = None,
    token: Any = None,
    ssl_context: ssl.SSLContext | None = None,
    on_connection: Callable[[Connection], Any] | None = None,
) -> Call:
    call = Call(timeout, what, sync=sync, pin_memory=pin_memory, transform=transform)
    for _ in range(3):
        connection = connection_to(host, timeout, token, ssl_context)
        if on_connection is not None:
            on_connection(connection)
        try:
            connection.submit(kind, call, payload, buffers, ref)
            return call
        except _Closed:
            continue
    raise WorkerUnavailable(f"could not keep a connection to worker {host} open")


def _serialize_call(host: str, func: Callable, args: Any, kwargs: Any) -> tuple[bytes, list]:
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__}: {func!r}")
    if args is None:
        args = ()
    elif not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list of positional arguments, got {type(args).__name__}")
    if kwargs is None:
        kwargs = {}
    elif type(kwargs) is not dict and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a dict of keyword arguments, got {type(kwargs).__name__}")
    try:
        payload, buffers = dumps_for(host, (func, tuple(args), dict(kwargs)))
    except Exception as exc:
        raise TypeError(f"cannot send {describe(func)} and its arguments to worker {host}: {exc}") from exc
    if buffers or len(payload) > SMALLEST_MESSAGE_LIMIT:
        sizes = [b.nbytes for b in buffers]
        _outgoing_limits().check_outgoing(len(payload), sizes, lambda: f"the call of {describe(func)}")
    return payload, buffers


def _prepared_call(host: str, func: Callable, args: Any, kwargs: Any, timeout: Any) -> tuple[str, float, bytes, list]:
    """A call's arguments checked and pickled: ``(address, timeout, payload, buffers)``."""
    address = _check_address(host)
    if type(timeout) is not float or not timeout > 0.0:
        timeout = check_timeout(timeout)
    payload, buffers = _serialize_call(address, func, args, kwargs)
    return address, timeout, payload, buffers


def _call(
    host: str,
    func: Callable,
    args: Any,
    kwargs: Any,
    *,
    sync: bool,
    pin_memory: bool = False,
    rref: bool = False,
    timeout: float = 120.0,
    token: str | bytes | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> Call:
    address, timeout, payload, buffers = _prepared_call(host, func, args, kwargs, timeout)
    uid, transform, on_connection = 0, None, None
    if rref:
        uid = new_uid()
        handles: list = []

        def transform(_: Any) -> RRef:
            return RRef._from_handle(handles[-1])

        def on_connection(connection: Connection) -> None:
            handles.append(holding_handle(address, uid, connection))

    return _submit(
        Kind.CALL, address, timeout, func, payload, buffers, sync=sync, pin_memory=pin_memory, token=token,
        ssl_context=ssl_context, ref=uid, transform=transform, on_connection=on_connection,
    )  # fmt: skip


def rpc_async(
    host: str,
    func: Callable[..., _T],
    args: Sequence | None = None,
    kwargs: Mapping[str, Any] | None = None,
    pin_memory: bool = False,
    rref: bool = False,
    timeout: float = 120.0,
    *,
    token: str | bytes | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> torch.futures.Future[_T]:
    """Run ``func(*args, **kwargs)`` on a worker; return a future of the result.

    The call goes over this process's connection to the worker, and the
    future completes when the answer arrives. It is sent at once when no
    other call to that worker is in flight, when its arguments hold tensors
    (which the caller may change once this returns), or with ``rref=True``; otherwise it may
    wait briefly, to leave with the next calls in one system call: until the
    thread waits for any answer, 32 calls wait, or 0.5 ms pass, whichever
    comes first. Deferring never reorders calls. Functions and arguments go
    through cloudpickle, so lambdas and closures work; tensors travel without
    extra copies. An exception raised by ``func`` is raised by
    ``future.wait()`` with its own type, the remote traceback and the worker's
    address (see :mod:`rpcdl.errors`).

    Args:
        host: the worker, ``"host:port"``.
        func: the callable to run.
        args: positional arguments (tuple or list).
        kwargs: keyword arguments.
        pin_memory: receive tensors into pinned memory (when CUDA is available),
            ready for fast ``.cuda(non_blocking=True)`` copies.
        rref: keep the result on the worker and complete the future with an
            :class:`~rpcdl.RRef` to it.
        timeout: seconds to wait for the answer, connecting included; a
            worker that refuses connections fails the call sooner, after
            ``RPCDL_CONNECT_GRACE`` seconds (20 by default).
        token: the shared secret; defaults to ``RPCDL_TOKEN`` / ``RPCDL_TOKEN_FILE``.
        ssl_context: TLS context to verify the worker with; defaults to one from
            ``RPCDL_TLS_CA`` when set.

    Returns:
        A :class:`torch.futures.Future` of the result.

    Example::

        >>> fut = rpcdl.rpc_async("127.0.0.1:6543", torch.add, (torch.ones(2), 1))  # doctest: +SKIP
        >>> fut.wait()  # doctest: +SKIP
        tensor([2., 2.])
    """
    return _call(
        host, func, args, kwargs, sync=False, pin_memory=pin_memory, rref=rref, timeout=timeout,
        token=token, ssl_context=ssl_context,
    ).future  # fmt: skip


def rpc_sync(
    host: str,
    func: Callable[..., _T],
    args: Sequence | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    **options: Any,
) -> _T:
    """Run ``func(*args, **kwargs)`` on a worker and return its result.

    The blocking form of :func:`rpc_async`, which documents the arguments
    (``pin_memory``, ``rref``, ``token`` and ``ssl_context`` are accepted as
    keywords). The calling thread reads the answer itself, which saves a
    thread switch.

    Example::

        >>> rpcdl.rpc_sync("127.0.0.1:6543", min, (1, 2))  # doctest: +SKIP
        1
    """
    if options and not options.keys() <= _CREDENTIAL_OPTIONS:
        unknown = sorted(options.keys() - _SYNC_OPTIONS)
        if unknown:
            raise TypeError(
                f"rpc_sync() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                f"it takes {', '.join(sorted(_SYNC_OPTIONS))} besides host, func, args, kwargs and timeout"
            )
        return _call(host, func, args, kwargs, sync=True, timeout=timeout, **options).future.wait()
    address, timeout, payload, buffers = _prepared_call(host, func, args, kwargs, timeout)
    if not buffers and len(payload) <= _READ_ALONE_BYTES:
        connection = connection_to(address, timeout, options.get("token"), options.get("ssl_context"))
        try:
            answered, result = connection.call_sync(payload, func, timeout)
        except _Closed:  # _submit makes the call on a new connection
            answered, result = False, None
        if answered:
            return result
    return _submit(Kind.CALL, address, timeout, func, payload, buffers, sync=True, **options).future.wait()


_CREDENTIAL_OPTIONS = frozenset(("token", "ssl_context"))
_SYNC_OPTIONS = _CREDENTIAL_OPTIONS | {"pin_memory", "rref"}
_READ_ALONE_BYTES = 1 << 16  # rpc_sync's calls up to this size leave with the caller already reading (call_sync)

install_rpc_sync(rpc_sync)


def remote(
    host: str,
    func: Callable[..., _T],
    args: Sequence | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    **options: Any,
) -> RRef[_T]:
    """Run ``func`` on a worker, keep its result there and return an RRef to it at once.

    Calls made afterwards from this process that pass the RRef to the same
    worker wait for the result and receive the object itself. An exception
    raised by ``func`` is raised by :meth:`RRef.to_here` and by those calls.

    Example::

        >>> rref = rpcdl.remote("127.0.0.1:6543", torch.add, (torch.ones(2), 3))  # doctest: +SKIP
        >>> rref.to_here()  # doctest: +SKIP
        tensor([4., 4.])
    """
    return _call(host, func, args, kwargs, sync=False, rref=True, timeout=timeout, **options).transform(None)


def ping_async(host: str, timeout: float = 10.0, **options: Any) -> torch.futures.Future[float]:
    """:func:`ping` without waiting: a future of the round-trip time."""
    return _submit(Kind.PING, _check_address(host), check_timeout(timeout), "a ping", **options).future


def ping(host: str, timeout: float = 10.0, **options: Any) -> float:
    """Return the round-trip time to a worker in seconds; raise if it does not answer.

    The worker answers pings without queueing them behind running calls.

    Raises:
        WorkerUnavailable: the worker cannot be reached within ``timeout``.
        WorkerTimeout: it was reached but did not answer within ``timeout``.
    """
    return _submit(
        Kind.PING, _check_address(host), check_timeout(timeout), "a ping", sync=True, **options
    ).future.wait()


def stats(host: str, timeout: float = 10.0, **options: Any) -> dict[str, Any]:
    """Return a worker's counters: calls served and failed, bytes in and out, busy time, clients...

    Example::

        >>> rpcdl.stats("127.0.0.1:6543")["calls_served"]  # doctest: +SKIP
        42
    """
    call = _submit(Kind.STATS, _check_address(host), check_timeout(timeout), "a stats request", sync=True, **options)
    return call.future.wait()
