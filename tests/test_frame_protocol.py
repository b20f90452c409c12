"""The loop's frame receiver: the frame reader's rules (limits, buffers, segments) from bytes in any pieces."""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np
import pytest

from rpcdl.errors import ConnectionLost, FrameTooLarge, ProtocolError
from rpcdl.transport import event_loop
from rpcdl.transport.frame_protocol import FrameProtocol
from rpcdl.transport.wire import COMPRESSED, IN_SEGMENT, NOT_IN_SEGMENT, Frame, Kind, Limits, encode_frame


class Sink:
    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.failed: list[Exception] = []
        self.ended: list[Exception | None] = []
        self.done = threading.Event()

    def frame_received(self, frame: Frame) -> None:
        self.frames.append(frame)

    def receiving_failed(self, error: Exception) -> None:
        self.failed.append(error)

    def stream_ended(self, error: Exception | None) -> None:
        self.ended.append(error)
        self.done.set()


def wire(*frames: Frame) -> bytes:
    return b"".join(bytes(memoryview(piece).cast("B")) for frame in frames for piece in encode_frame(frame))


def feed(protocol: FrameProtocol, data: bytes, piece: int) -> None:
    """Deliver ``data`` as the loop would, at most ``piece`` bytes a read."""
    at = 0
    while at < len(data):
        buffer = protocol.get_buffer(-1)
        size = min(len(buffer), piece, len(data) - at)
        buffer[:size] = data[at : at + size]
        del buffer  # as the loop drops it: a growing payload's memory may move
        protocol.buffer_updated(size)
        at += size


def sample_frames() -> list[Frame]:
    rng = np.random.default_rng(0)
    big = rng.integers(0, 255, 3 << 20, dtype=np.uint8)
    return [
        Frame(Kind.RESULT, 1, 0, b"small"),
        Frame(Kind.PONG, 2),
        Frame(Kind.RESULT, 3, 7, b"p" * 100_000),  # received straight into its memory
        Frame(Kind.RESULT, 4, 0, bytes(range(256)) * 12_000),  # grows past GROWN_PAYLOAD_BYTES
        Frame(Kind.RESULT, 5, 0, b"head", [big, np.arange(10, dtype=np.uint8), np.empty(0, np.uint8)]),
        Frame(Kind.LEAVING, 0, 0, b"x" * 40),
    ]


def check(received: list[Frame], sent: list[Frame]) -> None:
    assert [(f.kind, f.call_id, f.ref) for f in received] == [(f.kind, f.call_id, f.ref) for f in sent]
    for got, want in zip(received, sent, strict=True):
        assert bytes(got.payload) == bytes(want.payload)
        assert [bytes(memoryview(b).cast("B")) for b in got.buffers] == [
            bytes(memoryview(b).cast("B")) for b in want.buffers
        ]


@pytest.mark.parametrize("piece", [1, 7, 33, 4096, 1 << 30])
def test_frames_arrive_whole_whatever_pieces_the_bytes_come_in(piece):
    sent = sample_frames()
    if piece == 1:
        sent = sent[:2] + sent[-1:]  # byte by byte, only the small ones (fast)
    sink = Sink()
    protocol = FrameProtocol(sink, Limits())
    feed(protocol, wire(*sent), piece)
    check(sink.frames, sent)
    assert not sink.failed
    assert protocol.idle  # nothing of its own held between frames


def test_out_of_band_buffers_land_in_the_memory_allocate_gives():
    given: list[tuple[int, int]] = []

    def allocate(call_id: int, size: int) -> np.ndarray:
        given.append((call_id, size))
        return np.empty(size, np.uint8)

    sink = Sink()
    protocol = FrameProtocol(sink, Limits(), allocate=allocate)
    data = np.arange(200_000, dtype=np.uint8)
    feed(protocol, wire(Frame(Kind.RESULT, 9, 0, b"x", [data])), 1 << 30)
    assert given == [(9, 200_000)]
    assert isinstance(sink.frames[0].buffers[0], np.ndarray)
    assert np.array_equal(sink.frames[0].buffers[0], data)


def test_buffers_in_the_shared_segment_come_from_it():
    segment = bytes(range(200))
    asked: list[tuple[int, int, int]] = []

    def receive(call_id: int, offset: int, size: int) -> memoryview:
        asked.append((call_id, offset, size))
        return memoryview(segment)[offset : offset + size]

    frame = Frame(Kind.RESULT, 4, 0, b"p", [b"abc", segment[10:20]], IN_SEGMENT, offsets=[NOT_IN_SEGMENT, 10])
    sink = Sink()
    feed(FrameProtocol(sink, Limits(), segment=receive), wire(frame), 5)
    assert asked == [(4, 10, 10)]
    assert [bytes(b) for b in sink.frames[0].buffers] == [b"abc", segment[10:20]]

    sink = Sink()  # a connection without a segment: such a frame breaks the protocol
    feed(FrameProtocol(sink, Limits()), wire(frame), 1 << 30)
    assert not sink.frames
    assert isinstance(sink.failed[0], ProtocolError)


def test_a_frame_past_the_limits_fails_before_anything_is_allocated():
    allocated: list[int] = []
    sink = Sink()
    protocol = FrameProtocol(sink, Limits(max_message_bytes=4096), allocate=lambda c, s: allocated.append(s))
    feed(protocol, wire(Frame(Kind.RESULT, 11, 0, b"x", [np.zeros(8192, np.uint8)])), 1 << 30)
    assert not allocated and not sink.frames
    assert isinstance(sink.failed[0], FrameTooLarge) and sink.failed[0].call_id == 11
    feed(protocol, wire(Frame(Kind.RESULT, 12, 0, b"y")), 1 << 30)  # nothing more is read once failed
    assert not sink.frames and len(sink.failed) == 1

    sink = Sink()
    feed(FrameProtocol(sink, Limits(max_buffers=2)), wire(Frame(Kind.RESULT, 13, 0, b"", [b"a"] * 3)), 1 << 30)
    assert isinstance(sink.failed[0], FrameTooLarge) and "3 buffers" in str(sink.failed[0])


def test_unknown_kinds_and_unnegotiated_compression_break_the_protocol():
    sink = Sink()
    feed(FrameProtocol(sink, Limits()), b"\xff" + bytes(31), 1 << 30)
    assert "unknown frame kind 255" in str(sink.failed[0])
    sink = Sink()
    compressed = Frame(Kind.RESULT, 1, 0, b"", [b"abcd"], COMPRESSED, decoded_sizes=[0])
    feed(FrameProtocol(sink, Limits()), wire(compressed), 1 << 30)
    assert "did not negotiate compression" in str(sink.failed[0])


def test_compressed_buffers_are_decoded_into_their_memory():
    lz4_block = pytest.importorskip("lz4.block")
    data = bytes(range(256)) * 8192
    packed = lz4_block.compress(data, store_size=False)
    frame = Frame(Kind.RESULT, 2, 0, b"p", [packed], COMPRESSED, decoded_sizes=[len(data)])
    sink = Sink()
    feed(FrameProtocol(sink, Limits(), decompress=True), wire(frame), 70_000)
    assert bytes(memoryview(sink.frames[0].buffers[0]).cast("B")) == data


def test_on_the_loop_over_a_real_socket_and_a_peer_that_stops_mid_frame():
    ours, theirs = socket.socketpair()
    sink = Sink()
    protocol = FrameProtocol(sink, Limits())

    async def attach() -> None:
        await asyncio.get_running_loop().connect_accepted_socket(lambda: protocol, ours)

    event_loop.run_coroutine(attach(), timeout=10)
    sent = sample_frames()
    theirs.sendall(wire(*sent))
    half = wire(Frame(Kind.RESULT, 99, 0, b"z" * 1000))[:500]
    theirs.sendall(half)
    theirs.close()
    assert sink.done.wait(10)
    check(sink.frames, sent)
    assert isinstance(sink.ended[0], ConnectionLost)
