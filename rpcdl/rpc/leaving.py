"""Which workers said they are leaving, as this process heard it, and who wants to know.

A worker that drains (SIGTERM, SIGINT, :meth:`rpcdl.Worker.drain`) sends each
client a ``LEAVING`` frame (:mod:`rpcdl.transport.control`). The connection that
reads it records the address here and stops taking calls for it
(:class:`~rpcdl.rpc.state.Leaving`); the data layer learns of it from
:func:`is_leaving`, a listener, or a new call failing with
:class:`~rpcdl.errors.WorkerLeaving`: it sends the worker no new call and
awaits the calls in flight there for as long as the worker drains
(:func:`drain_timeout`).

An address stays leaving until a connection to it completes a handshake
again (a worker serves there anew): meanwhile a new connection to it is not
retried for the connect grace, so a call to a worker that has left fails at
once instead of waiting for it to come back.

Threading model: the event loop (``rpcdl-loop``, which reads the frames)
records, any thread asks; one lock, ``_lock``, guards the leaving
addresses (with their drain timeouts) and the list of listeners. Listeners are called outside the lock, on
the loop; a forked child starts with neither.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .._lifecycle import in_forked_child

log = logging.getLogger("rpcdl.client")

_lock = threading.Lock()
_leaving: dict[str, float] = {}  # address -> the seconds its LEAVING notice said it drains
_listeners: list[Callable[[str], object]] = []


def is_leaving(address: str) -> bool:
    """Whether the worker at ``address`` told this process it is leaving (and no worker serves there since).

    Args:
        address: the worker, ``"host:port"`` as calls name it.

    Returns:
        ``True`` from the moment its ``LEAVING`` frame is read until a new
        connection to ``address`` completes its handshake.

    Example::

        >>> is_leaving("127.0.0.1:1")
        False
    """
    with _lock:
        return address in _leaving


def drain_timeout(address: str) -> float | None:
    """How long the worker at ``address`` said it lets its calls in flight finish, if it said it is leaving.

    Args:
        address: the worker, ``"host:port"`` as calls name it.

    Returns:
        the seconds of its ``LEAVING`` notice (``rpcdl worker --drain-timeout``),
        or ``None`` when it did not say it is leaving (or a worker serves
        there again since).

    Example::

        >>> drain_timeout("127.0.0.1:1") is None
        True
    """
    with _lock:
        return _leaving.get(address)


def add_leaving_listener(callback: Callable[[str], object]) -> None:
    """Call ``callback(address)`` each time a worker's ``LEAVING`` frame is read by this process.

    It runs on the event loop that read the frame (the thread ``rpcdl-loop``):
    it must return quickly and must not wait for an answer of a call; post an
    event to the thread that owns your state.
    An exception it raises is logged and ignored.

    Args:
        callback: takes the worker's ``"host:port"``.

    Example::

        >>> left = []
        >>> add_leaving_listener(left.append)
        >>> remove_leaving_listener(left.append)
    """
    with _lock:
        _listeners.append(callback)


def remove_leaving_listener(callback: Callable[[str], object]) -> None:
    """Stop calling ``callback`` (added by :func:`add_leaving_listener`); nothing if it is not there.

    Example::

        >>> remove_leaving_listener(print)
    """
    with _lock:
        if callback in _listeners:
            _listeners.remove(callback)


def worker_left(address: str, reason: str, drain_timeout: float = 0.0) -> None:
    """Record that the worker at ``address`` is leaving (its ``LEAVING`` frame was read), and tell the listeners.

    ``drain_timeout``: the seconds it said its calls in flight get to finish.
    """
    with _lock:
        _leaving[address] = drain_timeout
        listeners = list(_listeners)
    log.info("rpcdl worker %s is leaving (%s): no new calls go to it", address, reason)
    for callback in listeners:
        try:
            callback(address)
        except Exception:
            log.exception("a leaving listener failed for worker %s", address)


def worker_serves(address: str) -> None:
    """A connection to ``address`` completed its handshake: a worker serves there (again)."""
    with _lock:
        _leaving.pop(address, None)


def _after_fork_in_child() -> None:
    global _lock, _leaving, _listeners
    _lock, _leaving, _listeners = threading.Lock(), {}, []


in_forked_child(_after_fork_in_child)
