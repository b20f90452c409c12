"""The receive low-water mark: a large buffer lands in a few receives, over real loopback sockets.

A :class:`~rpcdl.transport.socket_stream.SocketStream` on the process's loop
feeds the package's :class:`~rpcdl.transport.frame_protocol.FrameProtocol`;
the peer is the other end of the connection, a blocking socket. Receives are
counted (the protocol's ``buffer_updated`` calls), never timed.
"""

from __future__ import annotations

import queue
import socket
import sys
import time

import numpy as np
import pytest

from rpcdl.errors import ConnectionLost
from rpcdl.transport import event_loop
from rpcdl.transport.frame_protocol import FrameProtocol
from rpcdl.transport.low_water import LEAST_BYTES, MOST_BYTES, PATIENCE, LowWater
from rpcdl.transport.socket_stream import SocketStream
from rpcdl.transport.wire import Frame, Kind, Limits, encode_frame

pytestmark = pytest.mark.timeout(60)

BUFFER_BYTES = 16 << 20
PIECE = 64 * 1024
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the mark is set on Linux only")


class _Frames:
    """The protocol's sink: whole frames and the end, handed to the test's thread."""

    def __init__(self) -> None:
        self.frames: queue.SimpleQueue[Frame | Exception | None] = queue.SimpleQueue()

    def frame_received(self, frame: Frame) -> None:
        self.frames.put(frame)

    def receiving_failed(self, error: Exception) -> None:
        self.frames.put(error)

    def stream_ended(self, error: Exception | None) -> None:
        self.frames.put(error)


class _Counting(FrameProtocol):
    """The frame receiver, counting the receives that reach it."""

    def __init__(self, sink: _Frames) -> None:
        super().__init__(sink, Limits(), allocate=lambda call_id, size: np.empty(size, np.uint8))
        self.receives = 0

    def buffer_updated(self, nbytes: int) -> None:
        self.receives += 1
        super().buffer_updated(nbytes)


def _connected() -> tuple[socket.socket, socket.socket]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        near = socket.create_connection(listener.getsockname())
        far, _ = listener.accept()
    far.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return near, far


def _stream(near: socket.socket) -> tuple[SocketStream, _Counting, _Frames]:
    sink = _Frames()
    protocol = _Counting(sink)

    async def make() -> SocketStream:
        return SocketStream(near, protocol)

    return event_loop.run_coroutine(make(), timeout=10), protocol, sink


def _close(stream: SocketStream, far: socket.socket) -> None:
    async def abort() -> None:
        stream.abort()

    event_loop.run_coroutine(abort(), timeout=10)
    far.close()


def _wire(frame: Frame) -> bytes:
    return b"".join(bytes(piece) for piece in encode_frame(frame))


def _answer(call_id: int, buffer: bytes) -> bytes:
    return _wire(Frame(Kind.RESULT, call_id, 0, b"payload", [buffer]))


def _next_frame(sink: _Frames) -> Frame:
    frame = sink.frames.get(timeout=20)
    assert isinstance(frame, Frame), f"the stream ended instead: {frame!r}"
    return frame


@linux_only
def test_a_large_buffer_sent_in_small_pieces_arrives_in_a_few_receives():
    """Each piece would wake the loop for a receive of its own; the mark lets most of the buffer gather first,
    and the small frame after it arrives at once (the mark is back at one byte)."""
    near, far = _connected()
    stream, protocol, sink = _stream(near)
    buffer = np.random.default_rng(0).integers(0, 256, BUFFER_BYTES, dtype=np.uint8).tobytes()
    try:
        data = memoryview(_answer(7, buffer))
        for start in range(0, len(data), PIECE):
            far.sendall(data[start : start + PIECE])
            time.sleep(0.001)  # the loop would take each piece alone
        frame = _next_frame(sink)
        assert frame.call_id == 7 and bytes(frame.buffers[0]) == buffer
        pieces = len(data) // PIECE
        assert protocol.receives <= 32, f"{protocol.receives} receives for {pieces} pieces of {PIECE} bytes"
        far.sendall(_wire(Frame(Kind.RESULT, 8, 0, b"small")))
        assert _next_frame(sink).payload == b"small"
        assert near.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    finally:
        _close(stream, far)


def test_a_slow_peers_bytes_reach_the_protocol_before_the_mark_fills():
    """A peer sending less than the mark for longer than the patience: its bytes are received anyway, so the
    owner's check for a stalled peer sees them."""
    near, far = _connected()
    stream, protocol, _ = _stream(near)
    data = memoryview(_answer(1, bytes(BUFFER_BYTES)))
    try:
        far.sendall(data[:PIECE])  # the header and the start of the buffer: the rest is due
        deadline = time.monotonic() + 20
        while protocol.bytes_due == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        before = protocol.bytes_received
        sent = PIECE
        while protocol.bytes_received == before and time.monotonic() < deadline:
            far.sendall(data[sent : sent + 1024])  # far below the mark, however long it runs
            sent += 1024
            time.sleep(PATIENCE / 10)
        assert protocol.bytes_received > before, "the slow peer's bytes never reached the protocol"
        assert protocol.bytes_due > LEAST_BYTES, "the test sent too much: the mark was not in the way"
    finally:
        _close(stream, far)


@linux_only
def test_the_mark_follows_what_is_due_and_stops_at_close():
    near, far = _connected()

    async def marks() -> list[int]:
        low_water = LowWater(near, event_loop.process_loop())
        seen = []
        for due in (64 << 20, 300_000, LEAST_BYTES - 1, 0, 300_000):
            low_water.expect(due)
            seen.append((low_water.mark, near.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)))
        low_water.close()
        seen.append((low_water.mark, near.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)))
        low_water.expect(300_000)  # after close: nothing is set
        seen.append((low_water.mark, near.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)))
        return seen

    try:
        seen = event_loop.run_coroutine(marks(), timeout=10)
    finally:
        near.close()
        far.close()
    (large, large_set), *rest = seen
    assert large == MOST_BYTES
    assert 1 << 20 <= large_set <= MOST_BYTES  # the kernel may cap it at half its largest receive buffer
    assert rest == [(300_000, 300_000), (1, 1), (1, 1), (300_000, 300_000), (1, 300_000), (1, 300_000)]


def test_a_peer_closing_in_the_middle_of_a_large_part_ends_the_stream():
    """The end of the stream reaches the protocol with the mark raised: the frame begun is lost, and said so."""
    near, far = _connected()
    stream, protocol, sink = _stream(near)
    data = memoryview(_answer(3, bytes(BUFFER_BYTES)))
    try:
        far.sendall(data[: 2 * PIECE])
        deadline = time.monotonic() + 20
        while protocol.bytes_due == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert protocol.bytes_due > LEAST_BYTES  # the mark is raised now
        far.close()
        ended = sink.frames.get(timeout=20)
        assert isinstance(ended, ConnectionLost), ended
        assert stream.closed
    finally:
        _close(stream, far)
