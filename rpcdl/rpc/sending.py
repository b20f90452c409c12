"""Sending on an open connection: the outbox, small calls deferred while the worker is busy, and releases.

Threading model: any thread sends. The :class:`~rpcdl.rpc.outbox.Outbox` is
guarded by the connection's lock, which the connection hands it, so the
connection reads its state (:attr:`Sending.idle`, :attr:`Sending.due_at`)
atomically with its own; no method here is called with that lock held, and
none holds it during I/O. The releases (ids of RRefs, spans of the shared
segment this process let go of) wait in lock-free queues
(:class:`collections.deque`, whose ``append`` and ``popleft`` are atomic):
finalizers append to them at any time, in any thread, and whichever thread
sends next drains them into its frames.
"""

from __future__ import annotations

import collections
import socket
import threading
from collections.abc import Callable
from typing import Any

from ..transport.control import drain, encode_release
from ..transport.shm import ClientSegment
from ..transport.wire import Frame, Kind, encode_frame
from .outbox import Outbox, OutboxState

DEFER_DELAY = 0.0005  #: seconds a frame deferred while the worker is busy may wait for the next, at most
DEFER_FRAMES = 32  #: frames deferred together that leave at once


class Sending:
    """How frames leave one open connection.

    Args:
        sock: the connected socket (or TLS stream).
        lock: the connection's lock: it guards the outbox.
        first: frames to send before any other (those of calls made while connecting); they leave with the
            first send, or when due, now.
        releases: the ids of RRefs this process let go of: a queue finalizers append to.
        segment: the worker's shared segment this process maps (its spans let go of are freed too), or ``None``.
        on_deferred: called with the time deferred frames are due, each time frames start waiting with nobody
            writing (outside the lock): the connection's thread flushes them by then.
    """

    def __init__(
        self,
        sock: socket.socket,
        lock: threading.Lock,
        first: list[Frame],
        releases: collections.deque[int],
        segment: ClientSegment | None,
        on_deferred: Callable[[float], Any],
    ) -> None:
        self._outbox = Outbox(
            sock,
            [piece for frame in first for piece in encode_frame(frame)],
            lock=lock,
            delay=DEFER_DELAY,
            max_deferred=DEFER_FRAMES,
            on_deferred=on_deferred,
        )
        self._releases = releases
        self._segment = segment

    @property
    def state(self) -> OutboxState:
        """What the outbox does (read under the connection's lock)."""
        return self._outbox.state

    @property
    def due_at(self) -> float:
        """When the frames deferred now are due (``inf`` with none; read under the connection's lock)."""
        return self._outbox.deferred_until

    @property
    def releases_waiting(self) -> bool:
        """Whether this process let go of RRefs or spans of the shared segment that the worker should free."""
        return bool(self._releases) or (self._segment is not None and self._segment.releases_waiting)

    def send(self, frames: list[Frame]) -> None:
        """Send ``frames`` after what was sent or deferred before, with the releases waiting; return once they
        are in the socket (the caller may change its tensors then). ``[]`` sends what is deferred, if anything.

        Raises:
            OSError: the socket failed, on this send or an earlier one.
        """
        if self.releases_waiting:
            frames = [*self._release_frames(), *frames]
        if len(frames) == 1:
            pieces = encode_frame(frames[0])
        else:
            pieces = [piece for frame in frames for piece in encode_frame(frame)]
        self._outbox.send(pieces)

    def defer(self, frame: Frame) -> None:
        """Queue ``frame`` (no buffers) to leave with the next frames sent, or by :attr:`due_at`
        (see :meth:`~rpcdl.rpc.outbox.Outbox.defer`).

        Raises:
            OSError: the socket failed earlier.
        """
        self._outbox.defer(encode_frame(frame))

    def _release_frames(self) -> list[Frame]:
        uids = drain(self._releases)
        frames = [Frame(Kind.RELEASE, payload=encode_release(uids))] if uids else []
        return [*self._segment.release_frames(), *frames] if self._segment is not None else frames
