"""Reading an open connection's socket: frames, in turns, for the one thread that holds the reading role.

Threading model: a :class:`Receiver` belongs to whichever thread holds its
connection's reading role (:class:`~rpcdl.rpc.state.ReadingRole`, changed
under the connection's lock): one thread at a time, so it has no lock of its
own. Its frame reader, its poller and their buffers are that thread's until it
gives the role back. The only thing it asks of others is whether a call wants
its answer in pinned memory (``pins``, which takes the connection's lock).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ProtocolError
from ..transport import buffers, shm
from ..transport.handshake import Agreement
from ..transport.polling import Poller
from ..transport.wire import Frame, FrameReader, Limits
from .answers import ANSWERS

BATCH = 64  #: frames read in one turn with the reading role, at most


class Receiver:
    """Reads the frames of one open connection, a turn at a time.

    Args:
        sock: the connected socket, set up by :func:`~rpcdl.transport.wire.io_stream`
            with ``idle_tick`` as its receive timeout.
        limits: the bounds checked before allocating.
        stall_timeout: seconds the peer may go without a byte in the middle of a frame.
        agreed: what the handshake settled (compression, shared segment).
        poll_window: seconds to poll for an answer expected soon (see :mod:`rpcdl.transport.polling`).
        idle_tick: seconds a read that finds nothing blocks.
        pins: whether the answer to the call of this id goes into pinned memory.
    """

    def __init__(
        self,
        sock: socket.socket,
        limits: Limits,
        stall_timeout: float,
        agreed: Agreement,
        poll_window: float,
        idle_tick: float,
        pins: Callable[[int], bool],
    ) -> None:
        self._pins = pins
        self._reader = FrameReader(
            sock,
            limits,
            stall_timeout,
            decompress=agreed.compression != "off",
            segment=shm.receiver(agreed.segment, self._pinned, self._allocate),
        )
        self._poller = Poller(sock, poll_window)
        self._idle_tick = idle_tick

    def read(self, frames: list[Frame]) -> BaseException | None:
        """Read a turn of frames into ``frames``; return the error that ended the reading, if one did.

        One system call at most: one frame first if ``frames`` is empty (``None``
        arrives if none starts within the idle tick), then those whole in the
        buffer after the last, up to one with buffers (the next may have begun to
        arrive and no more; a caller reading several connections must not wait
        for it here), and :data:`BATCH` frames in all.
        """
        reader = self._reader
        try:
            if not frames:
                frame = reader.read_frame(self._allocate)
                if frame is None:
                    return None
                frames.append(frame)
            while reader.holds_frame and len(frames) < BATCH:
                frame = frames[-1]
                if frame.buffers or frame.kind not in ANSWERS:
                    break
                frames.append(reader.read_frame(self._allocate))
        except (OSError, ProtocolError) as exc:  # FrameTooLarge included
            return exc
        return None

    def nothing_arrives_within(self, left: float) -> bool:
        """Whether a reader with ``left`` seconds to its deadline must not read: a read that finds nothing
        blocks for the idle tick, longer than that, and no bytes arrive in the time left."""
        return left < self._idle_tick and not self._arrives_within(left)

    def arrives_now(self) -> bool:
        """Whether a read would find bytes now (``True`` once the socket is closed: reading says so)."""
        return self._arrives_within(0.0)

    def poll_for_answer(self) -> bool:
        """Before a read that should end soon (an answer awaited), poll for its bytes rather than sleep, while
        that pays (see :class:`~rpcdl.transport.polling.Poller`).

        Returns:
            Whether it polled: then call :meth:`answer_arrived` once the answer is read. It does not when bytes
            are buffered already (the answer may be here: nothing to poll for, or to learn from).
        """
        if self._reader.buffered:
            return False
        self._poller.wait()
        return True

    def answer_arrived(self) -> None:
        """The answer :meth:`poll_for_answer` polled for was read: poll next time if it came within the window."""
        self._poller.arrived()

    def _arrives_within(self, seconds: float) -> bool:
        try:
            return self._reader.buffered or self._poller.ready(seconds)
        except (OSError, ValueError):
            return True

    def _pinned(self, call_id: int) -> bool:
        return shm.can_pin() and self._pins(call_id)

    def _allocate(self, call_id: int, size: int) -> Any:
        """Memory for a buffer of ``size`` bytes of the answer to ``call_id``, as the reader receives it."""
        if self._pinned(call_id):
            return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
        return buffers.for_receiving(size)
