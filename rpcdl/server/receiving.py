"""A session's frames, assembled on the loop from the bytes its socket has ready.

The worker's half of :class:`~rpcdl.transport.wire.FrameReader`, turned
inside out: the loop calls :meth:`FrameAssembler.receive` when the socket is
readable, and it returns the frames completed by what arrived, without ever
waiting. A client's frames carry neither compressed buffers nor buffers in a
shared segment (those only go from a worker to its client), so either flag is
a protocol error here.

Memory: small pieces of a frame (its header, its table of lengths, a small
payload or buffer) are received into one scratch buffer that every session
of the process shares (:class:`Scratch`, read on the loop only, one session at
a time); what a session keeps between two receives is only the start of its
next piece. A large piece is received straight into its own memory: a buffer
into memory from ``allocate`` (where the tensor will live), a large payload
into memory that grows as its bytes arrive (a header alone costs nothing).
So an idle session holds no receive buffer.

Threading: an assembler and the scratch buffer belong to the loop's thread
(``rpcdl-loop``, :mod:`rpcdl.transport.event_loop`); nothing else touches them.
"""

from __future__ import annotations

import mmap
import socket
import ssl
import struct
import time
from collections.abc import Callable
from typing import Any

from ..errors import ConnectionLost, FrameTooLarge, ProtocolError
from ..transport.wire import (
    COMPRESSED,
    GROWN_PAYLOAD_BYTES,
    HEADER,
    IN_SEGMENT,
    MAX_MESSAGE_BYTES_ENV,
    Frame,
    Kind,
    Limits,
)

SCRATCH_BYTES = 256 * 1024  #: the scratch buffer every session of a process shares
SMALL_PIECE = 64 * 1024  #: a piece of a frame this small goes through the scratch buffer
_RECEIVES_PER_TURN = 16  # receives for one session before the loop serves the others
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class Scratch:
    """The receive buffer the sessions of a process share (owned by the loop's thread).

    Args:
        size: its bytes; at least ``2 * SMALL_PIECE``.
    """

    def __init__(self, size: int = SCRATCH_BYTES):
        self.view = memoryview(bytearray(size))


class _Piece:
    """A large piece of a frame received straight into its own memory."""

    __slots__ = ("filled", "grown", "memory", "size")

    def __init__(self, size: int, memory: Any, grown: mmap.mmap | None = None):
        self.size = size
        self.memory = memory  # the whole piece once received
        self.grown = grown  # a large payload: memory that grows as it fills
        self.filled = 0

    def room(self) -> memoryview:
        if self.grown is not None:
            if self.filled == len(self.grown):
                self.grown.resize(min(self.size, 2 * self.filled))
            return memoryview(self.grown)[self.filled :]
        return memoryview(self.memory).cast("B")[self.filled :]


class _Building:
    """The frame being assembled: its header, then its parts as they arrive."""

    __slots__ = ("buffers", "call_id", "count", "flags", "kind", "payload", "payload_size", "ref", "sizes")

    def __init__(self, kind: Kind, flags: int, count: int, call_id: int, ref: int, payload_size: int):
        self.kind = kind
        self.flags = flags
        self.count = count
        self.call_id = call_id
        self.ref = ref
        self.payload_size = payload_size
        self.sizes: tuple[int, ...] = ()
        self.payload: Any = None
        self.buffers: list[Any] = []

    def next_size(self) -> int:
        """The size of the next piece: the table of lengths, the payload, then each buffer."""
        if self.count and not self.sizes:
            return 8 * self.count
        if self.payload is None:
            return self.payload_size
        return self.sizes[len(self.buffers)]

    def done(self) -> bool:
        return self.payload is not None and len(self.buffers) == self.count

    def frame(self) -> Frame:
        return Frame(self.kind, self.call_id, self.ref, self.payload, self.buffers, self.flags)


class FrameAssembler:
    """Turns the bytes a client sends into frames, checking :class:`~rpcdl.transport.wire.Limits` first.

    Args:
        limits: the bounds checked before anything is allocated.
        allocate: called with a call id and a size for each out-of-band buffer;
            returns writable memory of that size.
        scratch: the shared scratch buffer (see the module).

    Example::

        >>> assembler = FrameAssembler(Limits(), lambda call_id, size: bytearray(size), Scratch())
        >>> assembler.mid_frame
        False
    """

    def __init__(self, limits: Limits, allocate: Callable[[int, int], Any], scratch: Scratch):
        self._limits = limits
        self._allocate = allocate
        self._scratch = scratch
        self._kept = b""  # the start of the next small piece
        self._building: _Building | None = None
        self._large: _Piece | None = None
        self.bytes_read = 0
        self.progress_at = 0.0  #: ``time.monotonic()`` of the last byte received in the middle of a frame

    @property
    def mid_frame(self) -> bool:
        """Whether a frame has begun and not ended."""
        return bool(self._kept) or self._building is not None

    def receive(self, sock: socket.socket) -> list[Frame]:
        """Receive what ``sock`` (non-blocking) has ready; return the frames it completes.

        Raises:
            ConnectionLost: the peer closed the connection.
            FrameTooLarge: a frame announces more than the limits.
            ProtocolError: a frame breaks the protocol.
        """
        frames: list[Frame] = []
        for _ in range(_RECEIVES_PER_TURN):
            large = self._large
            if large is not None:
                room = large.room()
                try:
                    received = self._recv(sock, room)
                finally:
                    room.release()  # a grown mmap with a view exported cannot grow
                if received is None:
                    break
                large.filled += received
                if large.filled == large.size:
                    self._large = None
                    self._take(large.memory if large.grown is None else memoryview(large.grown), frames)
                continue
            view = self._scratch.view
            kept = len(self._kept)
            view[:kept] = self._kept
            received = self._recv(sock, view[kept:])
            if received is None:
                break
            self._kept = b""
            self._parse(view[: kept + received], frames)
            if received < len(view) - kept:  # it took all there was: the next receive would find nothing
                break
        if self.mid_frame:
            self.progress_at = time.monotonic()
        return frames

    def _recv(self, sock: socket.socket, target: memoryview) -> int | None:
        try:
            received = sock.recv_into(target)
        except _WOULD_BLOCK:
            return None
        if not received:
            raise ConnectionLost("the peer closed the connection")
        self.bytes_read += received
        return received

    def _parse(self, view: memoryview, frames: list[Frame]) -> None:
        """Consume ``view``: whole pieces taken, a large one begun, the start of a small one kept."""
        position, end = 0, len(view)
        while position < end:
            building = self._building
            size = HEADER.size if building is None else building.next_size()
            if size <= SMALL_PIECE:
                if end - position < size:
                    self._kept = bytes(view[position:end])
                    return
                self._take(view[position : position + size], frames)
                position += size
                continue
            large = self._begin_large(size)
            have = min(end - position, size)
            room = large.room()
            room[:have] = view[position : position + have]
            room.release()
            large.filled = have
            position += have
            if have == size:
                self._take(large.memory if large.grown is None else memoryview(large.grown), frames)
            else:
                self._large = large

    def _begin_large(self, size: int) -> _Piece:
        building = self._building
        assert building is not None  # a header is small
        if building.count and not building.sizes:  # a large table of lengths: plain memory
            return _Piece(size, bytearray(size))
        if building.payload is None:
            if size <= GROWN_PAYLOAD_BYTES:
                return _Piece(size, bytearray(size))
            grown = mmap.mmap(-1, GROWN_PAYLOAD_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            return _Piece(size, None, grown)
        return _Piece(size, self._allocate(building.call_id, size))

    def _take(self, piece: Any, frames: list[Frame]) -> None:
        """A whole piece of the frame being built (or a header): record it; a frame completed joins ``frames``."""
        building = self._building
        if building is None:
            self._building = building = self._header(piece)
        elif building.count and not building.sizes:
            building.sizes = struct.unpack(f"!{building.count}Q", piece)
            self._check_total(building)
        elif building.payload is None:  # small: copied out of the scratch buffer; large: its own memory
            building.payload = bytes(piece) if type(piece) is memoryview and piece.nbytes <= SMALL_PIECE else piece
        elif type(piece) is memoryview:  # a small buffer, in the scratch buffer: copy it out
            memory = self._allocate(building.call_id, piece.nbytes)
            memoryview(memory).cast("B")[:] = piece
            building.buffers.append(memory)
        else:
            building.buffers.append(piece)
        if building.done():
            frames.append(building.frame())
            self._building = None
        else:
            self._finish_empty_after(building, frames)

    def _finish_empty_after(self, building: _Building, frames: list[Frame]) -> None:
        if building.next_size() == 0 and self._building is building:
            self._take(memoryview(b""), frames)

    def _header(self, piece: Any) -> _Building:
        number, flags, _, count, call_id, ref, payload_size = HEADER.unpack(piece)
        kind = self._limits.check_incoming(number, count, call_id, payload_size)
        if flags & COMPRESSED:
            raise ProtocolError("the peer sent a compressed frame: a client's frames are never compressed")
        if flags & IN_SEGMENT:
            raise ProtocolError("the peer sent a frame with buffers in a shared segment: a client's never are")
        return _Building(kind, flags, count, call_id, ref, payload_size)

    def _check_total(self, building: _Building) -> None:
        total = building.payload_size + sum(building.sizes)
        if total > self._limits.max_message_bytes:
            raise FrameTooLarge(
                f"frame announces {total} bytes, the limit is {self._limits.max_message_bytes} "
                f"({MAX_MESSAGE_BYTES_ENV})",
                building.call_id,
            )
