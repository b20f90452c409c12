"""A worker session's receiving: the frame receiver, set as a session sets it, over a real socket pair fed in pieces.

A session drives :class:`~rpcdl.transport.frame_protocol.FrameProtocol` from a
non-blocking socket (``get_buffer``, ``recv_into``, ``buffer_updated``), with no
compression and no shared segment agreed for what a client sends. It must give
the frames that were sent, whatever the bytes'
split across receives, refuse what a client may not send, and keep nothing
between frames.
"""

from __future__ import annotations

import random
import socket

import numpy as np
import pytest

from rpcdl.errors import ConnectionLost, FrameTooLarge, ProtocolError
from rpcdl.transport.frame_protocol import FrameProtocol
from rpcdl.transport.wire import COMPRESSED, Frame, Kind, Limits, encode_frame


class _Sink:
    """What a session is to its receiver: frames kept, a protocol error raised to the test."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []

    def frame_received(self, frame: Frame) -> None:
        self.frames.append(frame)

    def receiving_failed(self, error: Exception) -> None:
        raise error

    def stream_ended(self, error: Exception | None) -> None:
        raise AssertionError("a session learns of the end from recv_into, not from its receiver")


def _receiver(sink: _Sink, limits: Limits | None = None, allocate=None) -> FrameProtocol:
    return FrameProtocol(sink, limits or Limits(), allocate=allocate or _allocate)  # as ClientConnection makes it


def _receive(receiver: FrameProtocol, sock: socket.socket) -> None:
    """What the session does when its socket is readable: receive until it would block."""
    while True:
        target = receiver.get_buffer(-1)
        try:
            received = sock.recv_into(target)
        except BlockingIOError:
            return
        if not received:
            raise ConnectionLost("the peer closed the connection")
        target = None  # a growing payload's memory cannot grow while viewed
        receiver.buffer_updated(received)


def _wire(*frames: Frame) -> bytes:
    return b"".join(bytes(memoryview(piece).cast("B")) for frame in frames for piece in encode_frame(frame))


def _feed(data: bytes, sink: _Sink, receiver: FrameProtocol, sizes: random.Random) -> list[Frame]:
    """Send ``data`` in pieces of random sizes, receiving after each; return the frames completed."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    theirs.setblocking(False)
    try:
        position = 0
        while position < len(data):
            step = sizes.choice((1, 7, 33, 4096, 70_000, 1 << 20))
            try:
                position += theirs.send(data[position : position + step])
            except BlockingIOError:  # the pair's buffer is full: the receive below makes room
                pass
            _receive(receiver, ours)
        theirs.close()
        with pytest.raises(ConnectionLost):
            _receive(receiver, ours)
    finally:
        ours.close()
        theirs.close()
    return sink.frames


def _allocate(call_id: int, size: int) -> np.ndarray:
    return np.empty(size, dtype=np.uint8)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_frames_split_anywhere_come_out_whole_and_in_order(seed):
    rng = np.random.default_rng(seed)
    big = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    small = rng.integers(0, 256, 1000, dtype=np.uint8)
    sent = [
        Frame(Kind.CALL, 1, 0, b"p" * 10),
        Frame(Kind.PING, 2),
        Frame(Kind.CALL, 3, 9, b"q" * 200_000, [big, small, np.empty(0, np.uint8)]),
        Frame(Kind.CALL, 4, 0, bytes(2 << 20)),  # a large payload: memory that grows as it arrives
        Frame(Kind.RELEASE, 5, 0, b""),
    ]
    sink = _Sink()
    receiver = _receiver(sink)
    got = _feed(_wire(*sent), sink, receiver, random.Random(seed))
    assert [(f.kind, f.call_id, f.ref, bytes(f.payload)) for f in got] == [
        (f.kind, f.call_id, f.ref, bytes(f.payload)) for f in sent
    ]
    assert [len(f.buffers) for f in got] == [0, 0, 3, 0, 0]
    assert np.array_equal(got[2].buffers[0], big) and np.array_equal(got[2].buffers[1], small)
    assert len(got[2].buffers[2]) == 0
    assert receiver.idle  # nothing kept between frames


def test_a_compressed_frame_from_a_client_is_a_protocol_error():
    frame = Frame(Kind.CALL, 1, 0, b"x", [np.zeros(10, np.uint8)], COMPRESSED, decoded_sizes=[0])
    sink = _Sink()
    with pytest.raises(ProtocolError, match="compressed"):
        _feed(_wire(frame), sink, _receiver(sink), random.Random(0))


def test_a_header_past_the_limits_is_refused_before_anything_is_allocated():
    allocated: list[int] = []

    def allocate(call_id: int, size: int) -> np.ndarray:
        allocated.append(size)
        return np.empty(size, dtype=np.uint8)

    header = _wire(Frame(Kind.CALL, 1, 0, b"", [np.zeros(5000, np.uint8)]))[:48]  # header and one length
    sink = _Sink()
    with pytest.raises(FrameTooLarge, match="limit"):
        _feed(header, sink, _receiver(sink, Limits(max_message_bytes=4096), allocate), random.Random(0))
    assert allocated == []


def test_half_a_frame_is_mid_frame_and_a_whole_one_is_not():
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    try:
        sink = _Sink()
        receiver = _receiver(sink)
        data = _wire(Frame(Kind.PING, 7))
        theirs.sendall(data[:10])
        _receive(receiver, ours)
        assert sink.frames == [] and not receiver.idle
        theirs.sendall(data[10:])
        _receive(receiver, ours)
        (frame,) = sink.frames
        assert (frame.kind, frame.call_id, receiver.idle) == (Kind.PING, 7, True)
    finally:
        ours.close()
        theirs.close()
