"""Which new connections a worker admits to a handshake: a bound like OpenSSH's ``MaxStartups``.

A connection is unauthenticated until its handshake passes, and each one in its
handshake holds a socket and a handshake in progress on the worker's loop for
up to the handshake deadline. So a worker holds at most ``limit`` of them
(``RPCDL_MAX_HANDSHAKES``, default 256):

* below ``start`` (half the limit) a new connection is admitted;
* from ``start`` on, a new connection makes room with a probability that rises
  linearly to 1 at the limit (early random drops: a flood seldom fills the table);
* making room evicts the oldest handshake in progress if it has lasted at least
  ``grace`` seconds (an honest client needs milliseconds): its socket is shut
  down and the newcomer admitted. When even the oldest is younger, the newcomer
  is refused instead (:class:`Full`; the worker tells it so) and retries.

So a client arriving while a flood of idle connections, or a drip of slow
handshakes, goes on gets in at once (it evicts the oldest of them), and a client
admitted has at least ``grace`` seconds to finish before anything can evict it.

Threads: the process loop (``rpcdl-loop``) admits each connection it accepts
(:meth:`Admission.admit`, which evicts), and its handshake, on the loop too,
says when its socket changes (:meth:`Admission.rebind`, as it wraps it in
TLS) and when it leaves (:meth:`Admission.leave`). The admission's lock
(``_lock``) guards the table of handshakes in progress, the random generator,
and each :class:`Pending`'s socket and state, for every read and write, so
that the admission may be used from any thread. A :class:`QuietLog` guards
its counts with its own lock. An eviction shuts a socket down under that
lock (its handshake then fails its read), and a handshake closes its socket,
or hands it to a session, only after leaving: a socket is never shut down
once another owner has it.
"""

from __future__ import annotations

import enum
import logging
import random
import socket
import threading
import time
from dataclasses import dataclass

from ..checks import environment_number

#: Clients (sessions) a worker serves at once unless told otherwise (``Worker(max_sessions=)``,
#: ``rpcdl worker --max-sessions``); one more is refused once its handshake proved its token.
DEFAULT_MAX_SESSIONS = 1024
MAX_HANDSHAKES_ENV = "RPCDL_MAX_HANDSHAKES"
#: Connections in their handshake a worker holds at once, unless ``RPCDL_MAX_HANDSHAKES`` says otherwise.
DEFAULT_MAX_HANDSHAKES = 256
_MOST_GRACE = 1.0  # seconds; at most a quarter of the handshake deadline


class PendingState(enum.Enum):
    """Where a connection admitted to a handshake is."""

    IN_HANDSHAKE = "in handshake"
    EVICTED = "evicted"  #: its socket was shut down to make room for a newer connection
    LEFT = "left"  #: its handshake is done with the admission


class Pending:
    """A connection in its handshake: its peer and when it was accepted (both fixed), its socket and its
    state (both guarded by the admission's lock)."""

    def __init__(self, sock: socket.socket, peer: str, accepted_at: float):
        self.peer = peer
        self.accepted_at = accepted_at
        self.sock = sock
        self.state = PendingState.IN_HANDSHAKE


@dataclass(frozen=True)
class Full:
    """A new connection refused: ``pending`` handshakes in progress, none evictable yet, ``limit`` at most."""

    pending: int
    limit: int


def max_handshakes() -> int:
    """The most connections a worker holds in their handshake: ``RPCDL_MAX_HANDSHAKES``, else 256.

    Raises:
        ValueError: ``RPCDL_MAX_HANDSHAKES`` is not a whole number >= 1.

    Example::

        >>> max_handshakes()  # doctest: +SKIP
        256
    """
    return environment_number(
        MAX_HANDSHAKES_ENV,
        DEFAULT_MAX_HANDSHAKES,
        int,
        "a whole number >= 1 (connections a worker holds in their handshake at once)",
        lambda count: count >= 1,
    )


class Admission:
    """The connections in their handshake on one worker, and the policy that bounds them (see the module).

    Args:
        limit: the most handshakes in progress at once.
        handshake_timeout: the worker's deadline for a whole handshake; a
            handshake is evictable after a quarter of it (a second at most).
        seed: seeds the random drops (tests); ``None``: from the system.

    Example::

        >>> admission = Admission(limit=256, handshake_timeout=10.0)
        >>> pending = admission.admit(sock, "10.0.0.7:51234")  # doctest: +SKIP
    """

    def __init__(self, limit: int, handshake_timeout: float, seed: int | None = None):
        self.limit = limit
        self.start = max(1, limit // 2)
        self.grace = min(_MOST_GRACE, handshake_timeout / 4)
        self._lock = threading.Lock()
        self._pending: dict[Pending, None] = {}  # in the order of acceptance: the oldest first
        self._random = random.Random(seed)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def admit(self, sock: socket.socket, peer: str, now: float | None = None) -> Pending | Full:
        """Admit a connection just accepted, evicting the oldest handshake if the policy makes room.

        Args:
            sock: the accepted socket.
            peer: its address, for messages.
            now: when it was accepted (``time.monotonic()``); default now.

        Returns:
            its :class:`Pending` entry, or :class:`Full`: refuse it.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            count = len(self._pending)
            if self._makes_room(count):
                oldest = next(iter(self._pending), None)
                if oldest is None or now - oldest.accepted_at < self.grace:
                    return Full(count, self.limit)
                del self._pending[oldest]
                oldest.state = PendingState.EVICTED
                _shut_down(oldest.sock)  # its handshake fails its next read, and closes it
            pending = Pending(sock, peer, now)
            self._pending[pending] = None
            return pending

    def _makes_room(self, count: int) -> bool:
        if count < self.start:
            return False
        if count >= self.limit:
            return True
        return self._random.random() < (count - self.start + 1) / (self.limit - self.start + 1)

    def rebind(self, pending: Pending, sock: socket.socket) -> bool:
        """Record ``pending``'s new socket (its TLS wrapper); return ``False`` if it was evicted meanwhile."""
        with self._lock:
            if pending.state is not PendingState.IN_HANDSHAKE:
                return False
            pending.sock = sock
            return True

    def leave(self, pending: Pending) -> bool:
        """``pending``'s handshake is over (passed or failed); return ``False`` if it was evicted first.

        Leaving again changes nothing (and returns ``True``).
        """
        with self._lock:
            if pending.state is PendingState.EVICTED:
                return False
            if pending.state is PendingState.IN_HANDSHAKE:
                pending.state = PendingState.LEFT
                del self._pending[pending]
            return True


class QuietLog:
    """Warnings that a flood would repeat thousands of times, at most one per ``every`` seconds per kind.

    The first of a kind is logged at once; those that follow within ``every``
    seconds are counted, and the next warning says how many there were.

    Args:
        log: where the warnings go.
        every: seconds between two warnings of one kind.

    Example::

        >>> quiet = QuietLog(logging.getLogger("rpcdl.worker"))
        >>> quiet.warning("full", "refused connection from %s: the worker is full", "10.0.0.7:51234")  # doctest: +SKIP
    """

    def __init__(self, log: logging.Logger, every: float = 10.0):
        self._log = log
        self._every = every
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}  # kind -> when its next warning may be logged
        self._held: dict[str, int] = {}  # kind -> warnings not logged since

    def warning(self, kind: str, message: str, *args: object) -> None:
        """Log ``message % args`` unless a warning of ``kind`` was logged less than ``every`` seconds ago."""
        now = time.monotonic()
        with self._lock:
            if now < self._next.get(kind, now):
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            held = self._held.pop(kind, 0)
            self._next[kind] = now + self._every
        if held:
            message += f" (and {held} more like it in the last {self._every:g}s)"
        self._log.warning(message, *args)


def _shut_down(sock: socket.socket) -> None:
    """Shut the TCP connection down under its handshake, which then fails its read and closes it.

    Through :class:`socket.socket`'s own method: :meth:`ssl.SSLSocket.shutdown` would
    also drop the TLS object that handshake is using.
    """
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:  # detached by a TLS wrapper not recorded yet: rebind tells its handshake
        pass
