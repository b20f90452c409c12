"""Bytes many threads send on one socket: the thread that finds nobody sending writes the others' too.

Threading model: any thread may call :meth:`Outbox.send` and :meth:`Outbox.defer`.
Every field (the state, :class:`OutboxState`, the queued pieces, the tickets)
is guarded by one lock, the outbox's own or the one its owner gives it (a
connection gives its own, and so reads the outbox's state atomically with its
other state); no socket I/O runs under it. One thread at a time is the
sender (``SENDING``) and writes, outside the lock; a thread that sends while
another does queues its pieces and waits until the sender has written them. So a send returns once its bytes
are in the socket, as if the thread had written them itself (its tensors may
change afterwards), and threads sending at once share one system call instead
of queueing for a lock to make one each. Order is the order of arrival, for
deferred pieces too. A sender writes at most :data:`ROUNDS` rounds while another
thread waits to send, then hands the role to it, so no thread sends for
others for ever; pieces only deferred (nobody waits for them) it leaves
``DEFERRED`` then.

Deferred pieces (:meth:`Outbox.defer`: bytes only, which nobody may change)
wait, ``DEFERRED``, for the next send, for ``max_deferred`` of them,
or until :attr:`Outbox.deferred_until`, when the owner (the connection's
thread, told by ``on_deferred``) flushes them with an empty send: so a thread making many calls
while the peer is busy anyway pays one system call for many.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..transport.wire import send_pieces

ROUNDS = 4  #: rounds of writes a sender makes for others, at most, while another thread waits to send
_INF = float("inf")


class OutboxState(enum.Enum):
    """What an outbox is doing: IDLE -> DEFERRED -> SENDING -> IDLE (or DEFERRED), any thread moving it on."""

    IDLE = "idle"  #: nothing queued, nobody writing
    DEFERRED = "deferred"  #: pieces queued, nobody writing: they leave with the next send, or when due
    SENDING = "sending"  #: a thread writes; pieces queued meanwhile it writes too, or hands to a waiting thread


class Outbox:
    """What threads send on ``sock``, written in arrival order with as few system calls as possible.

    Args:
        sock: a connected socket (or TLS stream) set up for frames.
        first: pieces to write before any sent later (the frames queued while connecting); they wait,
            ``DEFERRED``, for the first send.
        lock: the lock that guards the outbox (its owner's, to read :attr:`state` with its own state);
            by default one of its own. No method is called with it held.
        delay: seconds deferred pieces may wait, at most, before they are due (:attr:`deferred_until`).
        max_deferred: deferred frames that are written at once, without waiting any longer.
        on_deferred: called with :attr:`deferred_until`, outside the lock, each time pieces start waiting
            with nobody writing: whoever owns the outbox flushes them by then.
    """

    def __init__(
        self,
        sock: Any,
        first: Sequence[bytes | memoryview] = (),
        *,
        lock: threading.Lock | None = None,
        delay: float = 0.0005,
        max_deferred: int = 32,
        on_deferred: Callable[[float], Any] | None = None,
    ) -> None:
        self._sock = sock
        self._lock = lock if lock is not None else threading.Lock()
        self._cond = threading.Condition(self._lock)  # senders waiting for theirs to be written
        self._pieces: list[bytes | memoryview] = list(first)  # queued, not yet taken by the sender
        self.state = OutboxState.DEFERRED if self._pieces else OutboxState.IDLE  #: read under the lock
        #: when DEFERRED pieces are due, else inf (read under the lock)
        self.deferred_until = time.monotonic() if self._pieces else _INF
        self._deferred = 0  # frames deferred since the last write
        self._delay = delay
        self._max_deferred = max_deferred
        self._on_deferred = on_deferred
        self._queued = 0  # sends queued so far: the ticket of the last
        self._written = 0  # sends written (or failed) so far
        self._error: OSError | None = None

    def send(self, pieces: Sequence[bytes | memoryview]) -> None:
        """Write ``pieces`` after what was sent or deferred before; return once they are in the socket.

        An empty send writes what is deferred (a thread about to wait for answers, or the owner once
        they are due), and does nothing when nothing is.

        Raises:
            OSError: the socket failed, on this send or an earlier one.
        """
        with self._lock:
            if self._error is not None:
                raise self._error
            state = self.state
            if state is OutboxState.IDLE:  # the usual case: nobody else sends, nothing deferred
                if not pieces:
                    return
                self.state = OutboxState.SENDING  # as _become_sender: IDLE has nothing deferred, nothing due
                taken = pieces
            else:
                if state is OutboxState.DEFERRED:
                    taken, self._pieces = [*self._pieces, *pieces], []
                else:  # another thread sends: it writes these too, or leaves them to this one
                    self._queued += 1
                    ticket = self._queued
                    self._pieces.extend(pieces)
                    while self.state is OutboxState.SENDING and self._written < ticket:
                        self._cond.wait()
                    if self._error is not None:
                        raise self._error
                    if self._written >= ticket:
                        return
                    taken, self._pieces = self._pieces, []
                self._become_sender()
            upto, start = self._queued, self._written
        self._write(taken, upto, start)

    def defer(self, pieces: Sequence[bytes]) -> None:
        """Queue the pieces of one frame (bytes, which nobody changes) to leave with the next ones.

        They leave with the next send, with what the sender writing
        now writes, with the ``max_deferred``-th frame deferred, or (flushed by
        the owner, told by ``on_deferred``) by :attr:`deferred_until`.

        Raises:
            OSError: the socket failed earlier.
        """
        with self._lock:
            if self._error is not None:
                raise self._error
            self._pieces.extend(pieces)
            state = self.state
            if state is OutboxState.SENDING:
                return  # the sender writes them with the rest
            self._deferred += 1
            if self._deferred < self._max_deferred:
                if state is OutboxState.DEFERRED:
                    return
                until = self._start_deferring()
            else:
                until = None
                taken, self._pieces = self._pieces, []
                self._become_sender()
                upto, start = self._queued, self._written
        if until is not None:
            if self._on_deferred is not None:
                self._on_deferred(until)
            return
        self._write(taken, upto, start)

    def _start_deferring(self) -> float:
        """IDLE or SENDING -> DEFERRED: queued pieces wait, nobody writes; return when they are due (under the lock)."""
        self.state = OutboxState.DEFERRED
        self.deferred_until = until = time.monotonic() + self._delay
        return until

    def _become_sender(self) -> None:
        """DEFERRED or IDLE -> SENDING: the calling thread writes what it took (under ``_lock``)."""
        self.state = OutboxState.SENDING
        self.deferred_until = _INF
        self._deferred = 0

    def _write(self, pieces: Sequence[bytes | memoryview], upto: int, start: int) -> None:
        """Write ``pieces`` (those of sends up to ``upto``), then what others queued meanwhile, as the sender
        (which it became once sends up to ``start`` were written), a few rounds at most; then hand the role on:
        SENDING -> IDLE, or DEFERRED with pieces left (a thread waiting to send takes them, or they are due later)."""
        until = None
        for rounds_left in range(ROUNDS - 1, -1, -1):
            error = None
            try:
                if pieces:
                    send_pieces(self._sock, pieces)
            except OSError as exc:
                error = exc
            with self._lock:
                self._written = upto
                self._error = self._error or error
                if self._queued > start:  # threads waiting for their sends: those written go on, or take over
                    self._cond.notify_all()
                more = bool(self._pieces) and error is None
                if more and rounds_left > 0:
                    pieces, self._pieces = self._pieces, []
                    start, upto = upto, self._queued
                    continue
                if not more:
                    self.state = OutboxState.IDLE
                elif self._queued > upto:  # a thread waits to send: it writes what is left
                    self.state = OutboxState.DEFERRED
                    self.deferred_until = time.monotonic()
                else:  # only deferred pieces are left: they are due later
                    until = self._start_deferring()
                break
        if error is not None:
            raise error
        if until is not None and self._on_deferred is not None:
            self._on_deferred(until)
