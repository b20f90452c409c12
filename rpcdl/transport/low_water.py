"""The receive low-water mark of a socket the loop reads: a large part lands in a few receives, not hundreds.

A non-blocking socket read on readiness is read as soon as its first segment
arrives, and a receive stops at whatever had arrived by then: a large buffer
costs a wakeup of the loop and a receive for every few segments, each paying
the loop's turn, the protocol's calls and the kernel's work per call. While
the frame receiver is in the middle of a payload or buffer received into its
own memory, the peer must send the rest of it whatever happens, so the socket
may stay quiet until much of it is there: :class:`LowWater` sets the socket's
``SO_RCVLOWAT`` to what is due (at most :data:`MOST_BYTES`), and back to one
byte between such parts, when the next bytes may be all the peer sends for a
while. The mark never exceeds what is due, so no part waits past its last
byte: that byte makes the socket readable as it would have (the part's last
receive is larger, and is copied after it arrived rather than as it arrives).

Linux reports a TCP socket readable below its mark when the receive window
is nearly closed or memory is short, and at the end of the stream, so a mark
the buffer cannot hold never stalls the stream; elsewhere, where a
non-blocking receive below the mark may find nothing, the mark is left
alone. A peer sending slower than the mark fills would keep its bytes out of
sight of the owner's check for a stalled peer: after :data:`PATIENCE`
seconds without progress the mark drops to one byte until the next receive.

Threading: a :class:`LowWater` belongs to the loop's thread (``rpcdl-loop``,
:mod:`rpcdl.transport.event_loop`), which reads its socket; its state and its
timer are that thread's alone.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from dataclasses import dataclass

LEAST_BYTES = 64 * 1024  #: a part due below this size is received as it comes (the mark stays at one byte)
MOST_BYTES = 4 << 20  #: the highest mark set: a large buffer arrives in receives of about this size
PATIENCE = 0.5  #: seconds a raised mark may hold bytes back without progress before it drops to one byte


class _Lowered:
    """The mark is one byte: the socket is readable as soon as anything arrives."""


@dataclass
class _Raised:
    """The mark is ``mark`` bytes, ``due`` bytes were due at the last receive; ``timer`` looks for progress."""

    mark: int
    due: int
    timer: asyncio.TimerHandle


class _Off:
    """Nothing is set: not on Linux, the platform refused ``SO_RCVLOWAT``, or the socket closed."""


_LOWERED = _Lowered()
_OFF = _Off()


class LowWater:
    """The ``SO_RCVLOWAT`` of one socket, set by the loop that reads it (see the module).

    Args:
        sock: the connected socket, read on ``loop``.
        loop: the loop whose thread reads ``sock`` and calls this object.

    Example::

        >>> low_water = LowWater(sock, process_loop())  # doctest: +SKIP
        >>> low_water.expect(protocol.bytes_due)  # after each turn of receives  # doctest: +SKIP
    """

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self._sock = sock
        self._loop = loop
        self._state: _Lowered | _Raised | _Off = _LOWERED if sys.platform.startswith("linux") else _OFF

    @property
    def mark(self) -> int:
        """The low-water mark set now, in bytes (one when the socket is read as its bytes come)."""
        state = self._state
        return state.mark if isinstance(state, _Raised) else 1

    def expect(self, due: int) -> None:
        """After a turn of receives: ``due`` bytes must still arrive before the stream can go on (0: none is
        sure to). Sets the mark to what is due, up to :data:`MOST_BYTES`, or to one byte below
        :data:`LEAST_BYTES`."""
        state = self._state
        mark = min(due, MOST_BYTES) if due >= LEAST_BYTES else 1
        if isinstance(state, _Raised):
            if mark == state.mark:
                state.due = due
            elif not self._set(mark):
                state.timer.cancel()
            elif mark == 1:
                state.timer.cancel()
                self._state = _LOWERED
            else:
                state.mark, state.due = mark, due
        elif isinstance(state, _Lowered) and mark != 1 and self._set(mark):
            self._state = _Raised(mark, due, self._loop.call_later(PATIENCE, self._look, due))

    def close(self) -> None:
        """The socket is closing: no more looks for progress."""
        state = self._state
        if isinstance(state, _Raised):
            state.timer.cancel()
        self._state = _OFF

    def _look(self, due_before: int) -> None:
        """``PATIENCE`` after the mark was raised or last looked at: drop it if nothing arrived since."""
        state = self._state
        if not isinstance(state, _Raised):
            return
        if state.due != due_before:
            state.timer = self._loop.call_later(PATIENCE, self._look, state.due)
            return
        if self._set(1):  # the kernel reports the socket readable at once if bytes wait
            self._state = _LOWERED

    def _set(self, mark: int) -> bool:
        """Set ``SO_RCVLOWAT``; whether the platform took it."""
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
        except OSError:
            self._state = _OFF
            return False
        return True
