"""Making one call: its arguments checked and pickled, the call submitted to this process's connection to the
worker, and, for a synchronous call, its answer awaited.

Threading model: any thread calls. The state here is two caches, each a
:func:`functools.lru_cache` (which keeps itself coherent under concurrent
use): addresses as checked, and the limits of the environment.
"""

from __future__ import annotations

import functools
import os
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..address import format_address, parse_address
from ..checks import check_timeout
from ..errors import WorkerUnavailable
from ..serialization.pickling import dumps_for
from ..transport.wire import MAX_BUFFERS_ENV, MAX_MESSAGE_BYTES_ENV, SMALLEST_MESSAGE_LIMIT, Kind, Limits
from .calls import Call, describe
from .connection import Connection
from .environment import Variables
from .pool import connection_to

_LIMITS = Variables(MAX_MESSAGE_BYTES_ENV, MAX_BUFFERS_ENV)
_ATTEMPTS = 3  # connections a call tries, when the one it found closes before the call leaves


@functools.lru_cache(maxsize=4096)
def _checked_address(host: str) -> str:
    return format_address(*parse_address(host))


def check_address(host: Any) -> str:
    """``host`` as a checked ``"host:port"`` (remembered for the next calls).

    Raises:
        ValueError: it is not a valid worker address.

    Example::

        >>> check_address("localhost:6543")
        'localhost:6543'
    """
    return _checked_address(host) if isinstance(host, str) else format_address(*parse_address(host))


@functools.lru_cache(maxsize=64)
def _limits_for(max_message_bytes: str | None, max_buffers: str | None) -> Limits:
    return Limits()  # which reads those variables: they are the key


def _outgoing_limits() -> Limits:
    """The limits of the environment, built again only when ``RPCDL_MAX_*`` change."""
    if _LIMITS.unset():
        return _limits_for(None, None)
    return _limits_for(os.environ.get(MAX_MESSAGE_BYTES_ENV), os.environ.get(MAX_BUFFERS_ENV))


def named_arguments(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` and ``kwargs`` by the names messages give them: ``"argument 0"``, ``"keyword argument 'k'"``."""
    return {
        **{f"argument {i}": v for i, v in enumerate(args)},
        **{f"keyword argument {k!r}": v for k, v in kwargs.items()},
    }


def unpicklable_part(address: str, parts: Mapping[str, Any]) -> str | None:
    """Which of ``parts`` (name: value) does not pickle for ``address``, with its type and why; ``None`` if all do.

    Only called once sending failed: each part is pickled again on its own.

    Example::

        >>> import threading
        >>> unpicklable_part("h:1", {"argument 0": 1, "argument 1": threading.Lock()})
        "argument 1 (a _thread.lock): cannot pickle '_thread.lock' object"
    """
    for name, value in parts.items():
        try:
            dumps_for(address, value)
        except Exception as exc:
            kind = type(value)
            where = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
            return f"{name} (a {where}): {exc}"
    return None


def prepare(host: Any, func: Callable, args: Any, kwargs: Any, timeout: Any) -> tuple[str, float, bytes, list]:
    """Check a call's arguments and pickle it.

    Returns:
        ``(address, timeout, payload, buffers)``: the worker's address and the timeout as checked, the pickled
        function and arguments, and their out-of-band buffers (tensors, arrays).

    Raises:
        TypeError: ``func`` is not callable, ``args`` or ``kwargs`` are of the wrong type, or they do not pickle.
        ValueError: a bad address or timeout.
        LimitExceeded: the call is larger than the limits (``RPCDL_MAX_*``).
    """
    address = check_address(host)
    if type(timeout) is not float or not timeout > 0.0:
        timeout = check_timeout(timeout)
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
        payload, buffers = dumps_for(address, (func, tuple(args), dict(kwargs)))
    except Exception as exc:
        parts = {"the function itself": func, **named_arguments(args, kwargs)}
        culprit = unpicklable_part(address, parts) or f"it: {exc}"
        raise TypeError(f"cannot send {describe(func)} to worker {address}: cannot pickle {culprit}") from exc
    if buffers or len(payload) > SMALLEST_MESSAGE_LIMIT:
        sizes = [b.nbytes for b in buffers]
        _outgoing_limits().check_outgoing(len(payload), sizes, lambda: f"the call of {describe(func)}")
    return address, timeout, payload, buffers


def submit(
    kind: Kind,
    address: str,
    timeout: float,
    what: str | Callable,
    payload: bytes = b"",
    buffers: Sequence = (),
    *,
    ref: int = 0,
    pin_memory: bool = False,
    transform_for: Callable[[Connection], Callable[[Any], Any]] | None = None,
    token: Any = None,
    ssl_context: ssl.SSLContext | None = None,
) -> Call:
    """Make a call over this process's connection to ``address`` (a new one if that closes first).

    Args:
        kind: the frame's kind (a call, a ping, a stats request).
        address: the worker, checked.
        timeout: seconds until the call is overdue, connecting included.
        what: the function called, or a text such as ``"a ping"`` (for messages).
        payload: the pickled call.
        buffers: its out-of-band buffers.
        ref: the id of the RRef the result is kept under on the worker, or 0.
        pin_memory: receive the answer's tensors into pinned memory.
        transform_for: given the connection the call goes over, what to apply to the result.
        token: the shared secret, or as :func:`~rpcdl.rpc.pool.connection_to` defaults.
        ssl_context: the TLS context, or as :func:`~rpcdl.rpc.pool.connection_to` defaults.

    Returns:
        The call: its future completes with the answer.

    Raises:
        WorkerUnavailable: every connection tried closed before the call left.
    """
    started = time.monotonic()
    for _ in range(_ATTEMPTS):
        connection = connection_to(address, timeout, token, ssl_context)
        transform = transform_for(connection) if transform_for is not None else None
        call = Call(connection, timeout, what, pin_memory=pin_memory, transform=transform, started=started)
        if connection.submit(kind, call, payload, buffers, ref):
            return call
    raise WorkerUnavailable(f"could not keep a connection to worker {address} open")


def call_and_wait(
    host: Any,
    func: Callable,
    args: Any = None,
    kwargs: Any = None,
    timeout: float = 120.0,
    *,
    token: Any = None,
    ssl_context: ssl.SSLContext | None = None,
) -> Any:
    """Run ``func(*args, **kwargs)`` on a worker and return its result: :func:`rpcdl.rpc_sync` without its
    options (``rref``, ``pin_memory``): the call is submitted, and this thread waits on its future (and
    unpickles the answer).
    """
    address, timeout, payload, buffers = prepare(host, func, args, kwargs, timeout)
    call = submit(Kind.CALL, address, timeout, func, payload, buffers, token=token, ssl_context=ssl_context)
    return call.future.wait()
