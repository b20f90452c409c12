"""Waiting for a socket's next bytes by polling, when they are microseconds away.

A thread blocked in ``recv`` sleeps, and the bytes that end its wait have the
kernel wake it: on an idle core, and above all in a virtual machine, that
costs 5-15 µs, as much as the rest of a round trip on loopback. A thread that
polls the socket without blocking sees the bytes as they land. So the two
waits that end within microseconds in a loop of :func:`rpcdl.rpc_sync` poll
first, for at most ``RPCDL_POLL_MICROSECONDS`` (200 by default; 0 turns polling
off): the caller's wait for its answer, and the worker's wait for that caller's
next call. Each polls only while it paid last time, that is while the bytes
came within the window, so a slow function or a caller that does other work
between calls costs one window, then none, until the bytes come quickly again.
A thread polling yields its core to any other process runnable there, between
two polls: a busy machine loses no work to it.

Threading: a :class:`Poller` belongs to the one thread that reads its socket at
a time (the reading role of a connection, the read turn of a session).
"""

from __future__ import annotations

import os
import select
import socket
import time

from ..checks import environment_number

POLL_ENV = "RPCDL_POLL_MICROSECONDS"
DEFAULT_MICROSECONDS = 200
_MAX_MICROSECONDS = 100_000


def window_from_environment() -> float:
    """Seconds to poll for bytes before sleeping: ``RPCDL_POLL_MICROSECONDS``, else 200 µs.

    Raises:
        ValueError: ``RPCDL_POLL_MICROSECONDS`` is not a whole number from 0 to 100,000.

    Example::

        >>> window_from_environment()  # doctest: +SKIP
        0.0002
    """
    microseconds = environment_number(
        POLL_ENV, DEFAULT_MICROSECONDS, int,
        f"a whole number of microseconds from 0 (never poll) to {_MAX_MICROSECONDS}: how long a caller of "
        "rpc_sync, or a worker, polls for bytes before sleeping",
        lambda microseconds: 0 <= microseconds <= _MAX_MICROSECONDS,
    )  # fmt: skip
    return microseconds / 1e6


class Poller:
    """Polls one socket for its next bytes, for at most ``window`` seconds, while that pays.

    Call :meth:`wait` before a blocking read that is expected to end soon,
    and :meth:`arrived` once that read returned. :meth:`ready` tells, without
    polling, whether a read would find bytes.

    Args:
        sock: the connected socket (or TLS stream) to poll.
        window: seconds to poll at most; 0 never polls.

    Example::

        >>> poller = Poller(sock, window_from_environment())  # doctest: +SKIP
        >>> poller.wait()  # doctest: +SKIP
        >>> frame = reader.read_frame()  # doctest: +SKIP
        >>> poller.arrived()  # doctest: +SKIP
    """

    __slots__ = ("_decrypted", "_pays", "_poll", "_since", "window")

    def __init__(self, sock: socket.socket, window: float):
        self.window = window
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)
        self._decrypted = getattr(sock, "pending", None)  # a TLS stream's bytes read from the socket already
        self._pays = window > 0
        self._since = 0.0

    @property
    def pays(self) -> bool:
        """Whether the bytes awaited last came within the window (the next :meth:`wait` polls)."""
        return self._pays

    def wait(self) -> bool:
        """Poll until bytes arrive or the window passes, if the bytes awaited last came within it.

        Returns:
            Whether bytes wait to be read; ``False`` if it did not poll, or the window passed.
        """
        self._since = started = time.perf_counter()
        if not self._pays:
            return False
        if self._decrypted is not None and self._decrypted():
            return True
        deadline = started + self.window
        poll, give_way = self._poll.poll, os.sched_yield
        while not poll(0):
            if time.perf_counter() >= deadline:
                return False
            give_way()  # to a process runnable on this core, if there is one: polling must not starve it
        return True

    def ready(self, within: float = 0.0) -> bool:
        """Whether bytes wait to be read now, or arrive within ``within`` seconds (sleeping, not polling)."""
        if self._decrypted is not None and self._decrypted():
            return True
        return bool(self._poll.poll(within * 1000))

    def arrived(self) -> None:
        """The bytes awaited since :meth:`wait` were read: poll next time if they came within the window."""
        self._pays = self.window > 0 and time.perf_counter() - self._since <= self.window
