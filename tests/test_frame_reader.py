"""The frame reader's waits over a real socket pair: idle between frames, stalled inside one.

A read that finds nothing within the socket's receive timeout is idle and
returns ``None``; once a frame has begun, the reader waits for the rest up
to its stall timeout, however the bytes are split.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time

import pytest
from blocking_wire import FrameReader, io_stream

from rpcdl.transport.wire import Frame, Kind, Limits, encode_frame

pytestmark = pytest.mark.timeout(30)

RECEIVE_TIMEOUT = 0.05


@pytest.fixture
def pair():
    left, right = socket.socketpair()
    yield io_stream(left, receive=RECEIVE_TIMEOUT, send=5.0), right
    left.close()
    right.close()


def _frame_bytes(call_id: int, payload: bytes = b"payload") -> bytes:
    return b"".join(encode_frame(Frame(Kind.RESULT, call_id, 0, payload, [])))


def _send_later(sock: socket.socket, pieces: list[bytes], pause: float) -> threading.Thread:
    def send() -> None:
        for piece in pieces:
            time.sleep(pause)
            sock.sendall(piece)

    sender = threading.Thread(target=send, name="test-sender")
    sender.start()
    return sender


def test_a_read_that_finds_nothing_is_idle_and_the_next_frame_is_read_whole(pair):
    reading, writing = pair
    reader = FrameReader(reading, Limits(), stall_timeout=5.0)
    started = time.monotonic()
    assert reader.read_frame() is None
    assert time.monotonic() - started < 1.0  # the receive timeout, not the stall timeout
    writing.sendall(_frame_bytes(7))
    frame = reader.read_frame()
    assert (frame.kind, frame.call_id, frame.payload) == (Kind.RESULT, 7, b"payload")


@pytest.mark.parametrize("split_at", [1, 10, 31, 33])
def test_a_frame_split_with_pauses_longer_than_the_receive_timeout_is_read_whole(pair, split_at):
    reading, writing = pair
    reader = FrameReader(reading, Limits(), stall_timeout=5.0)
    data = _frame_bytes(8, b"x" * 40)
    sender = _send_later(writing, [data[:split_at], data[split_at:]], pause=RECEIVE_TIMEOUT * 3)
    frames = []
    while not frames:
        frame = reader.read_frame()  # None while nothing of the frame came; never None once it began
        if frame is not None:
            frames.append(frame)
    sender.join()
    assert (frames[0].call_id, frames[0].payload) == (8, b"x" * 40)
    assert not reader.buffered


def test_a_peer_that_stops_inside_a_header_stalls_the_reader(pair):
    reading, writing = pair
    reader = FrameReader(reading, Limits(), stall_timeout=0.3)
    writing.sendall(_frame_bytes(9)[:5])
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="in the middle of a message"):
        reader.read_frame()
    assert 0.3 <= time.monotonic() - started < 3.0


def test_frames_that_arrive_together_are_read_from_the_buffer(pair):
    reading, writing = pair
    reader = FrameReader(reading, Limits(), stall_timeout=5.0)
    writing.sendall(_frame_bytes(1) + _frame_bytes(2, b"second"))
    time.sleep(0.05)  # both are in the socket before the first read
    assert reader.read_frame().call_id == 1
    assert reader.holds_frame
    reading.close()  # the second is read without touching the socket
    frame = reader.read_frame()
    assert (frame.call_id, frame.payload) == (2, b"second")


# ---------------------------------------------------------------------------- large buffers


def _buffer_frame(call_id: int, size: int) -> tuple[bytes, bytes]:
    data = bytes(range(256)) * (size // 256)
    return b"".join(bytes(piece) for piece in encode_frame(Frame(Kind.RESULT, call_id, 0, b"head", [data]))), data


@pytest.fixture
def tcp_pair():
    listener = socket.create_server(("127.0.0.1", 0))
    writing = socket.create_connection(listener.getsockname())
    reading, _ = listener.accept()
    listener.close()
    yield io_stream(reading, receive=RECEIVE_TIMEOUT, send=5.0), writing
    reading.close()
    writing.close()


@pytest.mark.parametrize("transport", ["pair", "tcp_pair"])
def test_a_large_buffer_in_pieces_with_pauses_lands_whole_in_its_memory_and_the_next_frames_follow(request, transport):
    reading, writing = request.getfixturevalue(transport)
    reader = FrameReader(reading, Limits(), stall_timeout=5.0)
    wire, data = _buffer_frame(3, 3 << 20)
    wire += _frame_bytes(4, b"after") + _frame_bytes(5, b"and after")
    cuts = [0, 100, 70_000, 1 << 20, (3 << 20) - 7, len(wire)]
    pieces = [wire[start:end] for start, end in itertools.pairwise(cuts)]
    sender = _send_later(writing, pieces, pause=RECEIVE_TIMEOUT * 2)  # each pause outlasts a receive
    received: list[bytearray] = []

    def allocate(call_id: int, size: int) -> bytearray:
        received.append(bytearray(size))
        return received[-1]

    frames = []
    while len(frames) < 3:
        frame = reader.read_frame(allocate)
        if frame is not None:
            frames.append(frame)
    sender.join()
    assert [frame.call_id for frame in frames] == [3, 4, 5]
    assert frames[0].payload == b"head" and frames[0].buffers[0] is received[0] and received[0] == data
    assert (frames[1].payload, frames[2].payload) == (b"after", b"and after")


def test_a_peer_that_stops_inside_a_large_buffer_stalls_the_reader(tcp_pair):
    reading, writing = tcp_pair
    reader = FrameReader(reading, Limits(), stall_timeout=0.3)
    wire, _ = _buffer_frame(6, 2 << 20)
    writing.sendall(wire[: 1 << 20])
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="in the middle of a message"):
        reader.read_frame()
    assert 0.3 <= time.monotonic() - started < 3.0
