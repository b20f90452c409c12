"""Frames received on the event loop: an :class:`asyncio.BufferedProtocol` with the rules of the frame reader.

:class:`FrameProtocol` parses the layout of :mod:`rpcdl.transport.wire` (limits
checked before anything is allocated, lz4-compressed buffers, buffers in a
shared segment) from what the loop receives, and hands each whole frame to its
owner (:class:`FrameSink`). It is the one frame receiver of both sides: a
client's connection (:mod:`rpcdl.rpc.connection`) sets it on its transport or
:class:`~rpcdl.transport.socket_stream.SocketStream`, and a worker's session
(:mod:`rpcdl.server.session`) drives it from its socket as asyncio would
(``get_buffer``, ``recv_into``, ``buffer_updated``), without compression or a
segment, so a client's frame with either is a protocol error. The bytes land
so:

* small frames go through one staging buffer that every connection of the
  loop's thread shares (the loop reads one socket at a time), so an idle
  connection holds no receive buffer; what a read leaves of an unfinished
  small frame is kept by that connection alone, and only until it is whole;
* a large payload or out-of-band buffer is received straight into its final
  memory (``allocate``: pooled or pinned buffers), a payload above
  :data:`~rpcdl.transport.wire.GROWN_PAYLOAD_BYTES` into memory that grows with
  the bytes that arrived, so a header alone costs nothing;
* a run of consecutive small plain buffers (each below :data:`DIRECT_BYTES`,
  neither compressed nor in the segment, together below
  :data:`~rpcdl.transport.buffers.MIN_BYTES`, so never from the pool) is one
  part, on both sides: one ``allocate`` for all of it (so one question whether the call
  wants pinned memory), one copy or receive, and each buffer is a view of
  that block (a numpy slice where ``allocate`` gives a numpy array, so the
  tensors rebuilt from them are numpy's fast path, pinned where the block is).
  A buffer joins a run only where it starts :data:`RUN_ALIGN`-aligned in the
  block, as aligned as memory of its own would be. The cost: a buffer kept
  (a tensor the user holds) keeps its whole run's block alive, less than
  :data:`~rpcdl.transport.buffers.MIN_BYTES`.

Threading model: a protocol is driven by the one loop thread that owns its
transport (``rpcdl-loop``, :mod:`rpcdl.transport.event_loop`): its fields are
that thread's, and so is the staging buffer of the thread (a
:class:`threading.local`). Its sink's methods run on that thread too: they must
not block and must not unpickle (user code never runs on the loop).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import mmap
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..errors import ConnectionLost, FrameTooLarge, ProtocolError
from . import buffers, compression
from .wire import (
    COMPRESSED,
    GROWN_PAYLOAD_BYTES,
    HEADER,
    IN_SEGMENT,
    MAX_MESSAGE_BYTES_ENV,
    NOT_IN_SEGMENT,
    Frame,
    Kind,
    Limits,
)

_LAYOUT_FLAGS = COMPRESSED | IN_SEGMENT
STAGING_BYTES = 256 * 1024  #: the staging buffer of a loop thread, shared by its connections
DIRECT_BYTES = 64 * 1024  #: what is left of a payload or buffer from this size is received straight into it
RUN_ALIGN = 16  #: a buffer joins a run where it starts at a multiple of this in the block (as malloc aligns)


class FrameSink(Protocol):
    """What a :class:`FrameProtocol` hands its frames to (on the loop's thread)."""

    def frame_received(self, frame: Frame) -> None: ...  # a whole frame

    def receiving_failed(self, error: Exception) -> None: ...  # the stream broke the protocol: nothing more is read

    def stream_ended(self, error: Exception | None) -> None: ...  # the connection is lost (``None``: closed cleanly)


class _Need(enum.Enum):
    """What the protocol receives now."""

    HEADER = "header"
    TABLES = "tables"  #: the lengths, decoded sizes and offsets of the buffers
    PAYLOAD = "payload"
    BUFFER = "buffer"  #: an out-of-band buffer received into its own memory
    RUN = "run"  #: consecutive small plain buffers received into one block, each a view of it
    PACKED = "packed"  #: an lz4-compressed buffer, into scratch memory
    FAILED = "failed"  #: the stream broke the protocol: what arrives is dropped


_INTO_TARGET = (_Need.PAYLOAD, _Need.BUFFER, _Need.RUN, _Need.PACKED)  # parts with memory of their own


class _Staging(threading.local):
    view: memoryview | None = None  # of a bytearray that never changes size


_staging = _Staging()


def _staging_view() -> memoryview:
    view = _staging.view
    if view is None:
        view = _staging.view = memoryview(bytearray(STAGING_BYTES))
    return view


def _default_allocate(call_id: int, size: int) -> Any:
    return bytearray(size)


class _Frame:
    """The frame being received: its header, then its parts as they arrive."""

    __slots__ = (
        "buffers",
        "call_id",
        "count",
        "decoded",
        "flags",
        "kind",
        "offsets",
        "payload",
        "payload_size",
        "ref",
        "sizes",
    )

    def __init__(self, kind: Kind, flags: int, count: int, call_id: int, ref: int, payload_size: int) -> None:
        self.kind = kind
        self.flags = flags
        self.count = count
        self.call_id = call_id
        self.ref = ref
        self.payload_size = payload_size
        self.sizes: tuple[int, ...] = ()
        self.decoded: tuple[int, ...] = ()
        self.offsets: tuple[int, ...] = ()
        self.buffers: list[Any] = []
        self.payload: Any = b""


class FrameProtocol(asyncio.BufferedProtocol):
    """Receives frames into pooled or final memory on the loop and hands them to ``sink``.

    Args:
        sink: gets each whole frame, a protocol error, and the end of the stream.
        limits: the bounds checked before allocating.
        decompress: whether compressed frames are accepted (negotiated); otherwise one is a protocol error.
        segment: called with the call id, offset and size of each buffer in the shared segment; returns its
            memory. Without one, a frame with such buffers is a protocol error.
        allocate: called with the call id and size of each out-of-band buffer, or of a run of small ones
            (see the module); returns writable memory, a flat ``uint8`` numpy array for views that are arrays.
        leftover: bytes already received after the handshake: the start of the first frames.

    Example::

        >>> protocol = FrameProtocol(sink, Limits())  # doctest: +SKIP
        >>> transport.set_protocol(protocol); protocol.connection_made(transport)  # doctest: +SKIP
    """

    def __init__(
        self,
        sink: FrameSink,
        limits: Limits,
        *,
        decompress: bool = False,
        segment: Callable[[int, int, int], Any] | None = None,
        allocate: Callable[[int, int], Any] = _default_allocate,
        leftover: bytes = b"",
    ) -> None:
        self._sink = sink
        self._limits = limits
        self._decompress = decompress
        self._segment = segment
        self._allocate = allocate
        self._need = _Need.HEADER
        self._wanted = HEADER.size  # bytes the current part takes
        self._partial = bytearray()  # a part begun in the staging buffer (header, tables, small payload)
        self._frame: _Frame | None = None
        self._target: Any = None  # the memory a payload or buffer is received into
        self._view: memoryview | None = None
        self._filled = 0  # bytes of the target received so far
        self._index = 0  # the buffer being received (the first of a run)
        self._run_end = 0  # the index after a run's last buffer
        self._direct = False  # whether get_buffer handed out the target itself
        self._progress = time.monotonic()
        self.transport: asyncio.BaseTransport | None = None
        self.bytes_received = 0
        self._leftover = leftover

    # ------------------------------------------------------------------ asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        leftover, self._leftover = self._leftover, b""
        if leftover:
            self.bytes_received += len(leftover)
            try:
                self._consume(memoryview(leftover))
            except ProtocolError as exc:
                self._fail(exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        need = self._need
        if self._target is not None and need in _INTO_TARGET:
            left = self._wanted - self._filled
            if left >= DIRECT_BYTES:
                self._direct = True
                if type(self._target) is mmap.mmap and self._filled == len(self._target):
                    self._grow()
                return self._view[self._filled : self._filled + min(left, len(self._view) - self._filled)]
        self._direct = False
        return _staging_view()

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        self._progress = time.monotonic()
        if self._need is _Need.FAILED:
            return
        try:
            if self._direct:
                self._filled += nbytes
                if self._filled == self._wanted:
                    self._part_done()
            else:
                self._consume(_staging_view()[:nbytes])
        except ProtocolError as exc:  # FrameTooLarge included
            self._fail(exc)

    def eof_received(self) -> bool:
        return False  # the transport closes itself; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self._need is not _Need.FAILED and (self._frame is not None or self._partial):
            exc = exc or ConnectionLost("the peer closed the connection in the middle of a message")
        self._release()
        self._sink.stream_ended(exc)

    # ------------------------------------------------------------------ for the owner

    @property
    def idle(self) -> bool:
        """Whether no frame is begun: the protocol holds no memory of its own then."""
        return self._frame is None and not self._partial and self._need is _Need.HEADER

    @property
    def bytes_due(self) -> int:
        """Bytes still to come of the payload or buffer being received into its own memory: the peer sends
        them whatever happens (0 between such parts, when the next bytes may be all it sends for a while)."""
        return 0 if self._target is None else self._wanted - self._filled

    def stalled_for(self, now: float) -> float:
        """Seconds without a byte in the middle of a frame at ``now`` (0 between frames)."""
        return 0.0 if self.idle else now - self._progress

    # ------------------------------------------------------------------ parsing

    def _consume(self, data: memoryview) -> None:
        """Take ``data`` (received into the staging buffer) into the frames, part by part."""
        while data and self._need is not _Need.FAILED:
            need = self._need
            if self._target is not None and need in _INTO_TARGET:
                take = min(len(data), self._wanted - self._filled)
                if type(self._target) is mmap.mmap and self._filled == len(self._target):
                    self._grow()
                take = min(take, len(self._view) - self._filled)
                self._view[self._filled : self._filled + take] = data[:take]
                self._filled += take
                data = data[take:]
                if self._filled == self._wanted:
                    self._part_done()
                continue
            wanted = self._wanted
            if not self._partial and len(data) >= wanted:
                part, data = data[:wanted], data[wanted:]  # the usual small frame: whole in the staging buffer
            else:
                take = min(len(data), wanted - len(self._partial))
                self._partial += data[:take]
                data = data[take:]
                if len(self._partial) < wanted:
                    continue
                part, self._partial = memoryview(bytes(self._partial)), bytearray()
            if need is _Need.HEADER:
                self._header(part)
            elif need is _Need.TABLES:
                self._tables(part)
            else:
                self._payload(bytes(part))  # the staging buffer is overwritten by the next receive

    def _header(self, header: memoryview) -> None:
        number, flags, _, count, call_id, ref, payload_size = HEADER.unpack(header)
        kind = self._limits.check_incoming(number, count, call_id, payload_size)
        frame = self._frame = _Frame(kind, flags, count, call_id, ref, payload_size)
        compressed = bool(flags & COMPRESSED)
        if compressed and not self._decompress:
            raise ProtocolError("the peer sent a compressed frame on a connection that did not negotiate compression")
        if flags & IN_SEGMENT and (self._segment is None or compressed):
            raise ProtocolError("the peer sent a frame with buffers in a shared segment this connection does not have")
        if count:
            tables = 1 + (1 if compressed else 0) + (1 if flags & IN_SEGMENT else 0)
            self._expect(_Need.TABLES, 8 * count * tables)
        else:
            frame.sizes = frame.decoded = frame.offsets = ()
            self._start_payload()

    def _tables(self, raw: memoryview) -> None:
        frame = self._frame
        count = frame.count
        values = struct.unpack(f"!{len(raw) // 8}Q", raw)
        frame.sizes = values[:count]
        rest = values[count:]
        if frame.flags & COMPRESSED:
            frame.decoded, rest = rest[:count], rest[count:]
        else:
            frame.decoded = (0,) * count
        frame.offsets = rest[:count] if frame.flags & IN_SEGMENT else (NOT_IN_SEGMENT,) * count
        compressed = bool(frame.flags & COMPRESSED)
        limit = self._limits.max_message_bytes
        totals = [sum(frame.sizes)]
        if compressed:
            totals.append(sum(d or s for s, d in zip(frame.sizes, frame.decoded, strict=True)))
        for total in totals:
            if frame.payload_size + total > limit:
                raise FrameTooLarge(
                    f"frame announces {frame.payload_size + total} bytes{' decompressed' if compressed else ''}, "
                    f"the limit is {limit} ({MAX_MESSAGE_BYTES_ENV})",
                    frame.call_id,
                )
        largest = compression.MAX_BYTES
        if compressed and any(d and max(s, d) > largest for s, d in zip(frame.sizes, frame.decoded, strict=True)):
            raise ProtocolError(f"a compressed buffer announces more than lz4's largest block ({largest} bytes)")
        self._start_payload()

    def _start_payload(self) -> None:
        size = self._frame.payload_size
        if size == 0:
            self._payload(b"")
        elif size < DIRECT_BYTES:
            self._expect(_Need.PAYLOAD, size)
        elif size <= GROWN_PAYLOAD_BYTES:
            self._receive_into(_Need.PAYLOAD, bytearray(size), size)
        else:
            memory = mmap.mmap(-1, GROWN_PAYLOAD_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._receive_into(_Need.PAYLOAD, memory, size)

    def _payload(self, payload: Any) -> None:
        self._frame.payload = payload
        self._index = 0
        self._next_buffer()

    def _next_buffer(self) -> None:
        """Start receiving the next buffer, or hand the frame over when none is left."""
        frame = self._frame
        while self._index < frame.count:
            size, decoded, offset = frame.sizes[self._index], frame.decoded[self._index], frame.offsets[self._index]
            if offset != NOT_IN_SEGMENT:
                frame.buffers.append(self._segment(frame.call_id, offset, size))
                self._index += 1
                continue
            if decoded:
                self._receive_into(_Need.PACKED, bytearray(size), size)
            else:
                end, total = self._run(frame)
                if end - self._index > 1:
                    self._run_end = end
                    self._receive_into(_Need.RUN, self._allocate(frame.call_id, total), total)
                    size = total
                else:
                    self._receive_into(_Need.BUFFER, self._allocate(frame.call_id, size), size)
            if size:
                return
            self._part_done()
            return
        self._frame = None
        self._expect(_Need.HEADER, HEADER.size)
        self._sink.frame_received(
            Frame(frame.kind, frame.call_id, frame.ref, frame.payload, frame.buffers, frame.flags)
        )

    def _run(self, frame: _Frame) -> tuple[int, int]:
        """The end (an index) and the bytes of the run of small plain buffers from the current one."""
        sizes, decoded, offsets = frame.sizes, frame.decoded, frame.offsets
        end, total = self._index, 0
        while (
            end < frame.count
            and sizes[end] < DIRECT_BYTES
            and not decoded[end]
            and offsets[end] == NOT_IN_SEGMENT
            and total % RUN_ALIGN == 0
            and total + sizes[end] < buffers.MIN_BYTES
        ):
            total += sizes[end]
            end += 1
        return end, total

    def _run_views(self, block: Any) -> list[Any]:
        """The buffers of the run just received into ``block``, each a view of its bytes."""
        flat = block if type(block) is np.ndarray and block.dtype == np.uint8 else memoryview(block).cast("B")
        sizes = self._frame.sizes[self._index : self._run_end]
        return [flat[end - size : end] for size, end in zip(sizes, itertools.accumulate(sizes), strict=True)]

    def _part_done(self) -> None:
        """The payload or buffer received into its own memory is whole."""
        need, target, frame = self._need, self._target, self._frame
        self._view.release()
        self._target = self._view = None
        if need is _Need.PAYLOAD:
            self._payload(memoryview(target) if type(target) is mmap.mmap else target)
            return
        if need is _Need.RUN:
            frame.buffers.extend(self._run_views(target))
            self._index = self._run_end
            self._next_buffer()
            return
        if need is _Need.PACKED:
            buffer = self._allocate(frame.call_id, frame.decoded[self._index])
            try:
                compression.decompress_into(target, buffer)
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
            target = buffer
        frame.buffers.append(target)
        self._index += 1
        self._next_buffer()

    def _expect(self, need: _Need, size: int) -> None:
        self._need, self._wanted = need, size

    def _receive_into(self, need: _Need, target: Any, size: int) -> None:
        self._need, self._wanted, self._filled = need, size, 0
        self._target = target
        self._view = memoryview(target).cast("B") if type(target) is not mmap.mmap else memoryview(target)

    def _grow(self) -> None:
        """A growing payload's memory is full: double it, up to its size (pages move, bytes do not)."""
        self._view.release()
        self._target.resize(min(self._wanted, 2 * len(self._target)))
        self._view = memoryview(self._target)

    def _fail(self, error: ProtocolError) -> None:
        self._need = _Need.FAILED
        self._release()
        self._sink.receiving_failed(error)

    def _release(self) -> None:
        if self._view is not None:
            self._view.release()
        self._target = self._view = self._frame = None
        self._partial = bytearray()
