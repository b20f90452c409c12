"""What a connection's own thread (``rpcdl-connection-HOST:PORT``) does: open the connection, then serve it.

Threading model: stated once, in :mod:`rpcdl.rpc.connection`. :class:`ConnectionThread`
holds the methods this thread runs, those the other threads call to wake
it (:meth:`~ConnectionThread._caller_left`, :meth:`~ConnectionThread._wake_serve_by`),
and what the reader it opens calls for the memory of answers (``_allocate``);
:class:`~rpcdl.rpc.connection.Connection` is made of it and holds the state.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import torch

from ..errors import AuthenticationError, ProtocolError, WorkerUnavailable
from ..transport import buffers, shm
from ..transport.polling import Poller
from ..transport.wire import FrameReader, encode_frame, io_stream
from .dial import dial
from .outbox import Outbox
from .state import ConnectionState, Reader

IDLE_TICK = 0.1  #: seconds: how often a reader with nothing to read looks at deadlines
RELEASE_TICK = 1.0  #: seconds: how often queued RRef releases are flushed when idle
_DEFER_DELAY = 0.0005  # seconds a frame deferred while the worker is busy may wait for the next, at most
_DEFER_FRAMES = 32  # frames deferred together that leave at once


class ConnectionThread:
    """The part of :class:`~rpcdl.rpc.connection.Connection` its own thread runs (see the module)."""

    def _run(self) -> None:
        try:
            sock = self._connect()
        except (AuthenticationError, ProtocolError) as exc:
            self._fail(str(exc), type(exc))
            return
        except WorkerUnavailable as exc:
            self._fail(str(exc), WorkerUnavailable)
            return
        if self._open(sock):
            self._serve()

    def _open(self, sock: socket.socket) -> bool:
        """CONNECTING -> OPEN over ``sock``, sending the frames queued meanwhile first; return whether it opened."""
        with self._lock:
            if self._state is ConnectionState.CLOSED:
                sock.close()
                return False
            self._sock = sock
            self._reader = FrameReader(
                sock, self._limits, self._io_timeout, decompress=self.compression != "off",
                segment=shm.receiver(self._segment, self._pins, self._allocate),
            )  # fmt: skip
            self._poller = Poller(sock, self._poll_window)
            self._outbox = Outbox(
                sock, [piece for frame in self._queued for piece in encode_frame(frame)],
                delay=_DEFER_DELAY, max_deferred=_DEFER_FRAMES, on_deferred=self._deferral_started,
            )  # fmt: skip
            self._queued = []
            self._state = ConnectionState.OPEN
            self._cond.notify_all()
        try:
            self._outbox.send(())
        except OSError as exc:
            self._fail(f"lost the connection to worker {self.address} while sending: {exc}")
            return False
        return True

    def _serve(self) -> None:
        """Until closed: read the background answers, fail overdue calls, flush RRef releases."""
        last_flush = time.monotonic()
        while True:
            with self._lock:
                if self._state is not ConnectionState.CLOSED and not self._background_turn_now():
                    self._sleep()
                if self._state is ConnectionState.CLOSED:
                    return
                now = time.monotonic()
                self._calls.adopt_unread(now)  # left unread too long by their caller
                expire = now >= self._calls.check_at
            if expire:
                self._expire(now)  # without the reading role: callbacks may wait for answers
            if self._outbox.deferred_until <= now:
                self._send([])  # frames deferred by a thread that went on with something else
            if self._has_releases() and now - last_flush > RELEASE_TICK:
                last_flush = now
                self._send([])
            with self._lock:
                take_role = (
                    self._state is ConnectionState.OPEN
                    and self._background_turn_now()
                    and self._role.take(Reader.BACKGROUND)
                )
            if take_role:
                self._read()

    def _background_turn_now(self) -> bool:
        """Whether the connection's thread may read background answers now (under ``_lock``)."""
        return bool(self._calls.background) and self._role.free and self._role.background_turn() <= time.monotonic()

    def _caller_left(self) -> None:
        """A caller gave the role back or stopped waiting: the background answers' turn may come (under ``_lock``)."""
        if self._serve_wakes_at and self._calls.background:
            self._wake_serve_by(self._role.background_turn())

    def _wake_serve_by(self, when: float) -> None:
        """Wake the connection's thread if it sleeps in :meth:`_sleep` past ``when`` (under ``_lock``)."""
        if self._serve_wakes_at > when:
            self._serve_wakes_at = 0.0
            self._serve_cond.notify()

    def _sleep(self) -> None:
        """Wait in ``_serve_cond`` until woken or something is due (under ``_lock``)."""
        now = time.monotonic()
        if self._calls.background:  # until the background answers' turn; a caller leaving wakes it then
            tick = min(max(self._role.background_turn() - now, 0.0), IDLE_TICK)
        elif self._calls.left_to_callers:
            tick = IDLE_TICK  # watching answers left to a caller
        else:
            tick = min(max(self._calls.check_at - now, 0.0) + 0.001, RELEASE_TICK)
        if self._outbox is not None:  # None while connecting
            tick = min(tick, max(self._outbox.deferred_until - now, 0.0))
        self._serve_wakes_at = now + tick
        try:
            self._serve_cond.wait(tick)
        finally:
            self._serve_wakes_at = 0.0

    def _pins(self, call_id: int) -> bool:
        """Whether the buffers of the answer to ``call_id`` are received into pinned memory."""
        return getattr(self._calls.get(call_id), "pin_memory", False) and shm.can_pin()

    def _allocate(self, call_id: int, size: int) -> Any:
        """Memory for a buffer of ``size`` bytes of the answer to ``call_id``, as the reader receives it."""
        if self._pins(call_id):
            return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
        return buffers.for_receiving(size)

    def _connect(self) -> socket.socket:
        sock, agreed = dial(
            self.address, self.host, self.port, self._token, self._ssl,
            handshake_timeout=self._limits.handshake_timeout, grace=self._grace, failed=self._connect_failed,
            pause=self._pause, compression=self.compression, shared_memory=self._offers_shm,
        )  # fmt: skip
        self.compression, self._segment = agreed.compression, agreed.segment
        self._idle_tick = IDLE_TICK  # a read finding nothing returns after this long
        return io_stream(sock, receive=IDLE_TICK, send=self._io_timeout)

    def _pause(self, seconds: float) -> None:
        """Wait between two attempts to connect; a close ends the wait."""
        with self._lock:
            if self._state is not ConnectionState.CLOSED:
                self._cond.wait(seconds)

    def _connect_failed(self, exc: OSError) -> float:
        """Note a failed attempt to connect; return until when calls still want a connection."""
        self._last_connect_error = exc
        self._expire(time.monotonic())
        with self._lock:
            if self._state is ConnectionState.CLOSED:
                raise WorkerUnavailable(self._error)
            return max(self._connect_deadline, self._calls.latest_deadline())
