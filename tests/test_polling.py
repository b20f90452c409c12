"""Polling for bytes microseconds away: the window's setting, the poller's rule, and rpc_sync's awaited calls.

The poller runs over a real socket pair; the client's calls go to a peer that
runs the worker's real handshake and records the flags of the frames it reads.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

import rpcdl
from rpcdl.serialization.pickling import dumps
from rpcdl.transport.handshake import server_negotiate
from rpcdl.transport.polling import POLL_ENV, Poller, window_from_environment
from rpcdl.transport.wire import AWAITED, COMPRESSED, Frame, FrameReader, Kind, Limits, encode_frame

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pair():
    left, right = socket.socketpair()
    yield left, right
    left.close()
    right.close()


@pytest.mark.parametrize(("text", "seconds"), [("", 200e-6), ("0", 0.0), (" 50 ", 50e-6), ("100000", 0.1)])
def test_the_window_comes_from_the_environment_in_microseconds(monkeypatch, text, seconds):
    monkeypatch.setenv(POLL_ENV, text)
    assert window_from_environment() == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["-1", "1.5", "fast", "100001"])
def test_a_bad_window_fails_at_once_naming_the_variable_for_workers_and_callers(monkeypatch, text):
    monkeypatch.setenv(POLL_ENV, text)
    with pytest.raises(ValueError, match=f"{POLL_ENV} must be a whole number of microseconds from 0"):
        window_from_environment()
    with pytest.raises(ValueError, match=POLL_ENV):
        rpcdl.Worker()
    with pytest.raises(ValueError, match=POLL_ENV):
        rpcdl.rpc_sync("127.0.0.1:9", abs, (-1,), timeout=1)  # before any connection is tried


def test_a_poller_returns_as_bytes_land_within_its_window(pair):
    left, right = pair
    poller = Poller(left, 0.1)
    sender = threading.Timer(0.005, right.send, (b"x",))
    sender.start()
    assert poller.wait()  # the bytes came 5 ms into a 100 ms window
    sender.join()
    assert left.recv(1) == b"x"
    poller.arrived()
    assert poller.pays


def test_a_poller_stops_polling_once_bytes_came_late_and_starts_again_once_they_come_quickly(pair):
    left, right = pair
    poller = Poller(left, 0.001)
    assert not poller.wait()  # nothing within 1 ms
    time.sleep(0.05)
    right.send(b"late")
    assert left.recv(4) == b"late"
    poller.arrived()
    assert not poller.pays
    right.send(b"now")
    assert not poller.wait()  # not polling: says the read may block, though bytes are there
    assert left.recv(3) == b"now"
    poller.arrived()  # these came at once
    assert poller.pays
    right.send(b"!")
    assert poller.wait()


def test_ready_tells_whether_a_read_would_find_bytes_now_or_within_a_wait(pair):
    left, right = pair
    poller = Poller(left, 0.0)  # ready() does not poll: the window does not matter
    assert not poller.ready()
    right.send(b"x")
    assert poller.ready()
    assert left.recv(1) == b"x"
    sender = threading.Timer(0.005, right.send, (b"y",))
    sender.start()
    assert poller.ready(5.0)
    sender.join()


def test_a_window_of_zero_never_polls(pair):
    left, right = pair
    poller = Poller(left, 0.0)
    right.send(b"x")
    assert not poller.wait()
    poller.arrived()
    assert not poller.pays


def test_a_poller_returns_when_its_socket_is_closed_under_it(pair):
    left, right = pair
    poller = Poller(left, 0.1)
    right.close()
    assert poller.wait()  # the end of the stream is there to read


def test_the_awaited_flag_crosses_the_wire_on_a_small_frame_and_layout_flags_keep_their_checks(pair):
    left, right = pair
    reader = FrameReader(left, Limits(), stall_timeout=5)
    right.sendall(encode_frame(Frame(Kind.CALL, 7, 0, b"payload", [], AWAITED))[0])
    frame = reader.read_frame()
    assert (frame.kind, frame.call_id, frame.payload, frame.flags) == (Kind.CALL, 7, b"payload", AWAITED)
    right.sendall(encode_frame(Frame(Kind.RESULT, 8, 0, b"p", [], COMPRESSED))[0])
    with pytest.raises(rpcdl.ProtocolError, match="did not negotiate compression"):
        reader.read_frame()


def test_rpc_sync_marks_its_call_awaited_on_either_path_and_rpc_async_does_not():
    listener = socket.create_server(("127.0.0.1", 0))
    flags: list[int] = []

    def serve() -> None:
        sock, _ = listener.accept()
        with sock:
            sock.settimeout(10)
            server_negotiate(sock, None, "client")
            reader = FrameReader(sock, Limits(), stall_timeout=10)
            with contextlib.suppress(rpcdl.ConnectionLost):  # the client's shutdown ends it
                answer_until_closed(sock, reader)

    def answer_until_closed(sock: socket.socket, reader: FrameReader) -> None:
        while (frame := reader.read_frame()) is not None:
            if frame.kind is Kind.PING:
                sock.sendall(encode_frame(Frame(Kind.PONG, frame.call_id))[0])
                continue
            flags.append(frame.flags)
            payload, _ = dumps(len(flags))
            sock.sendall(encode_frame(Frame(Kind.RESULT, frame.call_id, payload=payload))[0])

    thread = threading.Thread(target=serve, name="recording-peer", daemon=True)
    thread.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        rpcdl.ping(address)
        assert rpcdl.rpc_sync(address, abs, (-1,)) == 1
        assert rpcdl.rpc_async(address, abs, (-1,)).wait() == 2
        assert rpcdl.rpc_sync(address, abs, (-1,)) == 3
        assert rpcdl.rpc_sync(address, len, (b"x" * (1 << 17),)) == 4  # too large to read alone: the usual path
        assert flags == [AWAITED, 0, AWAITED, AWAITED]
    finally:
        rpcdl.shutdown()
        thread.join(5)
        listener.close()
