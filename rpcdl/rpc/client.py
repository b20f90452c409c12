"""The client side: calls to workers, their answers, and remote references (the module API).

Each process keeps one connection per worker (and per credentials), shared by
all its threads, with many calls in flight, each answered by id in any order
(:mod:`rpcdl.rpc.pool`). This process's one event loop (the thread
``rpcdl-loop``) owns every connection's socket: a caller submits a call and
waits on its future; the loop sends it, receives the answer and completes the
future; the thread that asks for the result unpickles it
(:mod:`rpcdl.rpc.connection` states who owns what). A connection is opened by
its first call (see :mod:`rpcdl.rpc.dial` for how long a worker not yet there
is awaited). A process forked from a client never reuses its parent's connections.

Threading model: any thread may call any function here; the module keeps no
state of its own. The pool of connections and the caches of checked calls
say at their top how they are shared (:mod:`rpcdl.rpc.pool`,
:mod:`rpcdl.rpc.invoke`).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from ..checks import check_timeout
from ..transport.wire import Kind
from .calls import Call
from .connection import Connection
from .invoke import call_and_wait, check_address, prepare, submit
from .leaving import add_leaving_listener, drain_timeout, is_leaving, remove_leaving_listener
from .pool import connection_to, shutdown
from .rref import RRef, held_rref, new_uid

__all__ = [
    "Connection",
    "add_leaving_listener",
    "connection_to",
    "drain_timeout",
    "is_leaving",
    "ping",
    "ping_async",
    "remote",
    "remove_leaving_listener",
    "rpc_async",
    "rpc_sync",
    "shutdown",
    "stats",
]

_T = TypeVar("_T")
_CREDENTIAL_OPTIONS = frozenset(("token", "ssl_context"))
_SYNC_OPTIONS = _CREDENTIAL_OPTIONS | {"pin_memory", "rref"}


def _rref_for(address: str, uid: int) -> Callable[[Connection], Callable[[Any], RRef]]:
    """What turns the answer of a call that keeps its result under ``uid`` into an RRef, given its connection.

    The reference is held from the moment the call goes over a connection, by what the call keeps: so the
    object is not freed before the answer comes, even if nobody held the RRef meanwhile."""

    def for_connection(connection: Connection) -> Callable[[Any], RRef]:
        rref = held_rref(address, uid, connection)
        return lambda _: rref

    return for_connection


def _call(
    host: str,
    func: Callable,
    args: Any,
    kwargs: Any,
    *,
    pin_memory: bool = False,
    rref: bool = False,
    timeout: float = 120.0,
    token: str | bytes | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> Call:
    address, timeout, payload, buffers = prepare(host, func, args, kwargs, timeout)
    uid = new_uid() if rref else 0
    return submit(
        Kind.CALL,
        address,
        timeout,
        func,
        payload,
        buffers,
        pin_memory=pin_memory,
        ref=uid,
        transform_for=_rref_for(address, uid) if rref else None,
        token=token,
        ssl_context=ssl_context,
    )


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

    The call goes over this process's connection to the worker: its event
    loop sends it (calls made in a burst leave together) and completes the
    future when the answer arrives; the thread that asks for the result
    unpickles it. Tensors in the arguments may be changed once this returns.
    Calls to one worker leave in the order they were made. Functions and arguments go
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
            ``RPCDL_CONNECT_GRACE`` seconds (20 by default), or at once if it
            served this process before (it stopped or died).
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
        host,
        func,
        args,
        kwargs,
        pin_memory=pin_memory,
        rref=rref,
        timeout=timeout,
        token=token,
        ssl_context=ssl_context,
    ).future


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
    keywords). The calling thread waits on the call's future and unpickles the answer.

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
        return _call(host, func, args, kwargs, timeout=timeout, **options).future.wait()
    return call_and_wait(host, func, args, kwargs, timeout, **options)


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
    return _call(host, func, args, kwargs, rref=True, timeout=timeout, **options).transform(None)


def ping_async(host: str, timeout: float = 10.0, **options: Any) -> torch.futures.Future[float]:
    """:func:`ping` without waiting: a future of the round-trip time."""
    return submit(Kind.PING, check_address(host), check_timeout(timeout), "a ping", **options).future


def ping(host: str, timeout: float = 10.0, **options: Any) -> float:
    """Return the round-trip time to a worker in seconds; raise if it does not answer.

    The worker answers pings without queueing them behind running calls.

    Raises:
        WorkerUnavailable: the worker cannot be reached within ``timeout``.
        WorkerTimeout: it was reached but did not answer within ``timeout``.
    """
    return submit(Kind.PING, check_address(host), check_timeout(timeout), "a ping", **options).future.wait()


def stats(host: str, timeout: float = 10.0, **options: Any) -> dict[str, Any]:
    """Return a worker's counters: calls served and failed, bytes in and out, busy time, clients...

    Example::

        >>> rpcdl.stats("127.0.0.1:6543")["calls_served"]  # doctest: +SKIP
        42
    """
    call = submit(Kind.STATS, check_address(host), check_timeout(timeout), "a stats request", **options)
    return call.future.wait()
