"""Bytes on the wire: framing and limits. Nothing here unpickles.

A connection opens with a handshake (:mod:`rpcdl.transport.handshake`); then both sides
exchange frames::

    header   kind u8, flags u8, reserved u16, buffer count u32,
             call id u64, ref u64, payload length u64
    lengths  one u64 per out-of-band buffer: its size on the wire
    decoded  only with the COMPRESSED flag: one u64 per buffer, its size once
             decompressed (lz4, see :mod:`rpcdl.transport.compression`), 0 for one sent raw
    offsets  only with the IN_SEGMENT flag: one u64 per buffer, its offset in the connection's
             shared-memory segment (see :mod:`rpcdl.transport.shm`), NOT_IN_SEGMENT for one sent here
    payload  pickled by the serialization layer; control frames' own (:mod:`rpcdl.transport.control`)
    buffers  out-of-band buffers (those not in the segment), each received straight into its final memory

The flags byte has no other bits: a sender leaves them 0 and a receiver ignores them.

Every length received, compressed and decoded, is checked against :class:`Limits`
before anything is allocated; the sender checks its own frames first (:meth:`Limits.check_outgoing`).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..checks import environment_number
from ..errors import FrameTooLarge, LimitExceeded, ProtocolError
from .gathered import Gathered

HEADER = struct.Struct("!BBHIQQQ")  #: a frame header: kind, flags, reserved, buffers, call id, ref, payload bytes
_U64 = struct.Struct("!Q")
_INLINE_PAYLOAD = 64 * 1024
SMALLEST_MESSAGE_LIMIT = 1024  #: the lowest max_message_bytes: a payload this small, without buffers, fits any limits
COMPRESSED = 1  #: frame flag: a decoded size follows the lengths, and buffers with one are lz4-compressed
IN_SEGMENT = 2  #: frame flag: an offset follows the lengths, and buffers with one are in the shared segment
NOT_IN_SEGMENT = 2**64 - 1  #: the offset of a buffer sent on the socket in an IN_SEGMENT frame


class Kind(enum.IntEnum):
    """What a frame carries."""

    CALL = 1  #: client -> worker: run a function; ``ref`` is an RRef id to store the result under
    RESULT = 2  #: worker -> client: the pickled return value
    ERROR = 3  #: worker -> client: the pickled report of an exception
    REJECTED = 4  #: worker -> client: the call was not run (worker shutting down); UTF-8 reason (see .control)
    RELEASE = 5  #: client -> worker: free RRefs; payload is a sequence of u64 ids (see .control)
    PING = 6  #: either way: answered by a PONG with the same call id
    PONG = 7
    STATS = 8  #: client -> worker: ask for the counters
    STATS_REPLY = 9  #: worker -> client: the counters as JSON (see rpcdl.transport.control)
    STREAM = 10  #: client -> worker: send incompressible bytes back, a link's raw rate (see rpcdl.transport.control)
    STREAM_DATA = 11  #: worker -> client: one out-of-band buffer of those bytes and no payload
    SEGMENT_RELEASE = 12  #: client -> worker: free spans of the shared segment; u64 offsets (see .control)
    LEAVING = 13  #: worker -> client: the worker drains and will exit; no new calls (see .control)


_KINDS = {kind.value: kind for kind in Kind}

MAX_MESSAGE_BYTES_ENV = "RPCDL_MAX_MESSAGE_BYTES"
MAX_BUFFERS_ENV = "RPCDL_MAX_BUFFERS"
HANDSHAKE_TIMEOUT_ENV = "RPCDL_HANDSHAKE_TIMEOUT"
#: A payload larger than this is received into memory that grows as its bytes arrive (see FrameProtocol).
GROWN_PAYLOAD_BYTES = 1 << 20
_MAX_COUNT = 2**32 - 1  # the buffer count is a u32 in the header


def _default_max_message_bytes() -> int:
    return environment_number(MAX_MESSAGE_BYTES_ENV, 16 << 30, int, "a whole number")  # Limits checks the range


def _default_max_buffers() -> int:
    return environment_number(MAX_BUFFERS_ENV, 1 << 16, int, "a whole number")


def _default_handshake_timeout() -> float:
    return environment_number(HANDSHAKE_TIMEOUT_ENV, 10.0, float, "a number of seconds > 0")  # Limits checks it


@dataclass(frozen=True)
class Limits:
    """Bounds on one frame: what a peer may make us allocate, and what we may send.

    The receiving side closes a connection whose frame announces more (a
    broken or hostile peer). The sending side checks first, so that a result
    or arguments past a limit raise :class:`~rpcdl.errors.LimitExceeded`
    instead of breaking the connection. Workers and clients read the defaults
    from the environment, so set the same values on both sides.

    Args:
        max_message_bytes: largest frame (payload plus buffers); default
            ``RPCDL_MAX_MESSAGE_BYTES`` from the environment, else 16 GiB.
        max_buffers: most out-of-band buffers (tensors, arrays) in one frame;
            default ``RPCDL_MAX_BUFFERS`` from the environment, else 65,536.
        handshake_timeout: seconds a new connection has to finish the whole handshake, TLS
            included, counted from the worker's accept; default ``RPCDL_HANDSHAKE_TIMEOUT``
            from the environment, else 10.

    Example::

        >>> Limits(max_buffers=1 << 20).max_buffers
        1048576
    """

    max_message_bytes: int = field(default_factory=_default_max_message_bytes)
    max_buffers: int = field(default_factory=_default_max_buffers)
    handshake_timeout: float = field(default_factory=_default_handshake_timeout)

    def __post_init__(self):
        if self.max_message_bytes < SMALLEST_MESSAGE_LIMIT:
            raise ValueError(
                f"max_message_bytes ({MAX_MESSAGE_BYTES_ENV}) must be at least {SMALLEST_MESSAGE_LIMIT}, "
                f"got {self.max_message_bytes}"
            )
        if not 1 <= self.max_buffers <= _MAX_COUNT:
            raise ValueError(f"max_buffers ({MAX_BUFFERS_ENV}) must be in 1..{_MAX_COUNT}, got {self.max_buffers}")
        if self.handshake_timeout <= 0:
            raise ValueError(
                f"handshake_timeout ({HANDSHAKE_TIMEOUT_ENV}) must be a positive number of seconds, "
                f"got {self.handshake_timeout}"
            )

    def check_incoming(self, number: int, count: int, call_id: int, payload_size: int) -> Kind:
        """The kind of a frame whose header was read, checked before anything is allocated for it.

        Args:
            number: the header's kind number.
            count: the out-of-band buffers it announces.
            call_id: its call, named by the error.
            payload_size: the payload bytes it announces.

        Returns:
            the frame's :class:`Kind`.

        Raises:
            ProtocolError: an unknown kind.
            FrameTooLarge: more buffers or payload bytes than these limits take.

        Example::

            >>> Limits(max_buffers=4).check_incoming(int(Kind.PING), 0, 7, 0)
            <Kind.PING: 6>
        """
        kind = _KINDS.get(number)
        if kind is None:
            raise ProtocolError(f"unknown frame kind {number}")
        if count > self.max_buffers:
            raise FrameTooLarge(
                f"frame announces {count} buffers, the limit is {self.max_buffers} ({MAX_BUFFERS_ENV})", call_id
            )
        if payload_size > self.max_message_bytes:
            raise FrameTooLarge(
                f"frame announces {payload_size} bytes, the limit is {self.max_message_bytes} "
                f"({MAX_MESSAGE_BYTES_ENV})",
                call_id,
            )
        return kind

    def check_outgoing(self, payload_bytes: int, buffer_sizes: Sequence[int], what: str | Callable[[], str]) -> None:
        """Raise :class:`~rpcdl.errors.LimitExceeded` if a frame to send would break a limit.

        Args:
            payload_bytes: size of the pickled payload.
            buffer_sizes: size of each out-of-band buffer.
            what: what the frame is, for the error (``"the result of load()"``), or a function
                returning it, called only when a limit is broken.

        Example::

            >>> Limits(max_buffers=2).check_outgoing(10, [4, 4, 4], "the result of f()")  # doctest: +SKIP
            LimitExceeded: the result of f() holds 3 tensors or arrays (out-of-band buffers), more than ...
        """
        if len(buffer_sizes) > self.max_buffers:
            what = what if isinstance(what, str) else what()
            raise LimitExceeded(
                f"{what} holds {len(buffer_sizes)} tensors or arrays (out-of-band buffers), more than the limit of "
                f"{self.max_buffers} in one message: send fewer, larger ones (stack them, in a collate_fn say), or "
                f"raise the limit with {MAX_BUFFERS_ENV}=N in the environment of the workers and the trainers "
                "(or Worker(limits=rpcdl.transport.wire.Limits(max_buffers=N)) for an embedded worker)"
            )
        total = payload_bytes + sum(buffer_sizes)
        if total > self.max_message_bytes:
            what = what if isinstance(what, str) else what()
            raise LimitExceeded(
                f"{what} is {total} bytes, more than the limit of {self.max_message_bytes} bytes in one message: "
                f"send it in parts, or raise the limit with {MAX_MESSAGE_BYTES_ENV}=N in the environment of the "
                "workers and the trainers (or Worker(limits=rpcdl.transport.wire.Limits(max_message_bytes=N)) for an "
                "embedded worker)"
            )


@dataclass(slots=True)
class Frame:
    """One message: a kind, identifiers, a payload and out-of-band buffers."""

    kind: Kind
    call_id: int = 0
    ref: int = 0
    payload: bytes | bytearray | memoryview = b""
    buffers: list[Any] = field(default_factory=list)
    flags: int = 0
    decoded_sizes: list[int] | None = None  #: with the COMPRESSED flag: each buffer's decoded size, 0 if raw
    offsets: list[int] | None = None  #: with the IN_SEGMENT flag: each buffer's offset, or NOT_IN_SEGMENT

    @property
    def buffer_bytes(self) -> int:
        """The bytes of the out-of-band buffers, all together."""
        return sum(b.nbytes if type(b) is Gathered else memoryview(b).nbytes for b in self.buffers)


# ---------------------------------------------------------------------------- sending


def encode_frame(frame: Frame) -> list[memoryview | bytes]:
    """Return the pieces of ``frame`` in wire order, ready for one gathered write.

    The buffers are not copied: they go to the socket from their own memory
    (a :class:`~rpcdl.transport.gathered.Gathered` one as its pieces, back to back).
    """
    payload = frame.payload
    if not frame.buffers:
        head = HEADER.pack(frame.kind, frame.flags, 0, 0, frame.call_id, frame.ref, len(payload))
        return [head + payload] if len(payload) <= _INLINE_PAYLOAD else [head, payload]
    views = [
        b if type(b) is Gathered or (type(b) is memoryview and b.format == "B") else memoryview(b).cast("B")
        for b in frame.buffers
    ]
    lengths = (
        _U64.pack(views[0].nbytes) if len(views) == 1 else struct.pack(f"!{len(views)}Q", *(v.nbytes for v in views))
    )
    if frame.flags & COMPRESSED:
        lengths += struct.pack(f"!{len(views)}Q", *(frame.decoded_sizes or [0] * len(views)))
    head = HEADER.pack(frame.kind, frame.flags, 0, len(views), frame.call_id, frame.ref, len(payload))
    if frame.flags & IN_SEGMENT:
        lengths += struct.pack(f"!{len(views)}Q", *frame.offsets)
        views = [view for view, offset in zip(views, frame.offsets, strict=True) if offset == NOT_IN_SEGMENT]
    if Gathered in map(type, views):
        views = [piece for view in views for piece in (view.pieces if type(view) is Gathered else (view,))]
    if len(payload) <= _INLINE_PAYLOAD:
        return [head + lengths + bytes(payload), *views]
    return [head + lengths, payload, *views]
