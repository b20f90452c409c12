"""The loop's frame receiver: the frame reader's rules (limits, buffers, segments) from bytes in any pieces."""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np
import pytest
import torch

import rpcdl
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


# ---------------------------------------------------------------------------- runs of small buffers


class CountingAllocate:
    """``allocate`` that records each call and hands out fresh numpy memory, as a connection's does."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, call_id: int, size: int) -> np.ndarray:
        self.sizes.append(size)
        return np.empty(size, np.uint8)


def chunk_of_batches(count: int = 14) -> Frame:
    """A loader's chunk answer: ``count`` batches of 32 x float32[128] (16 KiB each)."""
    rng = np.random.default_rng(1)
    batches = [rng.standard_normal((32, 128), dtype=np.float32) for _ in range(count)]
    return Frame(Kind.RESULT, 21, 0, b"chunk", [b.reshape(-1).view(np.uint8) for b in batches])


@pytest.mark.parametrize("piece", [1, 7, 4096, 70_000, 1 << 30])
def test_a_run_of_small_buffers_is_one_allocation_and_each_buffer_a_view_of_it(piece):
    sent = chunk_of_batches()
    allocate = CountingAllocate()
    sink = Sink()
    protocol = FrameProtocol(sink, Limits(), allocate=allocate)
    feed(protocol, wire(sent, Frame(Kind.PONG, 3)), piece)
    check(sink.frames, [sent, Frame(Kind.PONG, 3)])
    assert allocate.sizes == [14 * 16384]  # one block, not one allocation per buffer
    got = sink.frames[0].buffers
    assert all(type(b) is np.ndarray and b.dtype == np.uint8 for b in got)
    starts = [b.__array_interface__["data"][0] for b in got]
    assert [s - starts[0] for s in starts] == [i * 16384 for i in range(14)]  # back to back in one block
    assert protocol.idle


def mixed_frame() -> tuple[Frame, list[int]]:
    """Buffers of every kind a socket frame carries, and the allocations a receiver makes for them."""
    rng = np.random.default_rng(2)

    def some(size: int) -> bytes:
        return rng.integers(0, 256, size, dtype=np.uint8).tobytes()

    sizes = [16, 32, 0, 48, 5, 7, 0, 64, 70_000, 16, 16, 60_000] + [60_000] * 17 + [3]
    buffers = [some(size) for size in sizes]
    runs = [
        16 + 32 + 0 + 48 + 5,  # the 5-byte one ends it: the next would start unaligned
        7,  # a run of one (the zero-size one behind it is at 7, unaligned)
        0 + 64,  # the large buffer after it stands alone
        70_000,
        16 + 16 + 60_000 * 17,  # the next 60 KB would pass buffers.MIN_BYTES
        60_000 + 3,
    ]
    return Frame(Kind.RESULT, 8, 0, b"mixed", buffers), runs


def test_mixed_runs_break_where_a_buffer_is_large_unaligned_or_would_pass_the_bound():
    sent, runs = mixed_frame()
    allocate = CountingAllocate()
    sink = Sink()
    feed(FrameProtocol(sink, Limits(), allocate=allocate), wire(sent), 5000)
    check(sink.frames, [sent])
    assert allocate.sizes == runs
    assert all(b.__array_interface__["data"][0] % 16 == 0 for b in sink.frames[0].buffers)


def test_any_split_of_a_frame_with_runs_gives_the_same_bytes():
    sizes = [16, 0, 32, 3, 16, 0, 0, 8, 100, 0]
    frames = [
        Frame(Kind.RESULT, 5, 0, b"pp", [bytes([i]) * size for i, size in enumerate(sizes)]),
        Frame(Kind.RESULT, 6, 0, b"", [b"", b""]),  # a run of nothing
        Frame(Kind.PONG, 7),
    ]
    data = wire(*frames)
    for at in range(len(data) + 1):
        for allocate in (CountingAllocate(), lambda call_id, size: bytearray(size)):
            sink = Sink()
            protocol = FrameProtocol(sink, Limits(), allocate=allocate)
            feed(protocol, data[:at], 1 << 30)
            feed(protocol, data[at:], 1 << 30)
            check(sink.frames, frames)
            assert not sink.failed and protocol.idle


def test_segment_and_compressed_buffers_end_runs():
    lz4_block = pytest.importorskip("lz4.block")
    segment = bytes(range(256)) * 4
    in_segment = Frame(
        Kind.RESULT,
        4,
        0,
        b"p",
        [b"a" * 16, b"b" * 16, segment[16:48], b"c" * 16, b"d" * 16],
        IN_SEGMENT,
        offsets=[NOT_IN_SEGMENT, NOT_IN_SEGMENT, 16, NOT_IN_SEGMENT, NOT_IN_SEGMENT],
    )
    allocate = CountingAllocate()
    sink = Sink()
    protocol = FrameProtocol(
        sink, Limits(), allocate=allocate, segment=lambda c, offset, size: memoryview(segment)[offset : offset + size]
    )
    feed(protocol, wire(in_segment), 3)
    check(sink.frames, [in_segment])
    assert allocate.sizes == [32, 32]

    data = bytes(range(256)) * 64
    packed = lz4_block.compress(data, store_size=False)
    raw = [b"e" * 16, b"f" * 16]
    compressed = Frame(Kind.RESULT, 5, 0, b"q", [*raw, packed, *raw], COMPRESSED, decoded_sizes=[0, 0, len(data), 0, 0])
    allocate = CountingAllocate()
    sink = Sink()
    feed(FrameProtocol(sink, Limits(), decompress=True, allocate=allocate), wire(compressed), 11)
    assert allocate.sizes == [32, len(data), 32]
    got = [bytes(memoryview(b).cast("B")) for b in sink.frames[0].buffers]
    assert got == [*raw, data, *raw]


def _placed(*tensors: torch.Tensor) -> list[tuple[int, bool]]:
    """Where each tensor's bytes are, and whether they are pinned (run by the worker on its arguments)."""
    return [(t.data_ptr(), t.is_pinned()) for t in tensors]


def test_small_tensors_cross_a_worker_both_ways_whole_and_the_answers_back_to_back(two_workers):
    sent = [torch.arange(32 * 128, dtype=torch.float32).reshape(32, 128) * (i + 1) for i in range(14)]
    sent += [torch.tensor([1.5, -2.5], dtype=torch.float64), torch.arange(3, dtype=torch.int8), torch.zeros(0)]
    got = rpcdl.rpc_sync(two_workers[0], list, (sent,))
    assert [(t.dtype, t.shape) for t in got] == [(t.dtype, t.shape) for t in sent]
    assert all(torch.equal(a, b) for a, b in zip(got, sent, strict=True))
    starts = [t.data_ptr() for t in got[:16]]  # the batches, the float64 and the int8 ones: one run
    assert [s - starts[0] for s in starts] == [*(i * 16384 for i in range(15)), 14 * 16384 + 16]
    assert all(t.data_ptr() % 16 == 0 for t in got if t.numel())

    placed = rpcdl.rpc_sync(two_workers[0], _placed, tuple(sent[:14]))  # the worker's receiver makes runs too
    assert [p - placed[0][0] for p, _ in placed] == [i * 16384 for i in range(14)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_a_run_received_for_a_pinned_call_is_pinned(two_workers):
    sent = [torch.full((32, 128), float(i)) for i in range(14)]
    got = rpcdl.rpc_sync(two_workers[0], list, (sent,), pin_memory=True)
    assert all(t.is_pinned() for t in got) and all(torch.equal(a, b) for a, b in zip(got, sent, strict=True))
