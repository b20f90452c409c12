"""Polling for bytes microseconds away: the window's setting, the rule that decides it, the poller, and
rpc_sync's awaited calls.

The rule is pure and tested alone; the poller runs over a real socket pair (with a
thread holding the GIL for the contention it must notice); the client's calls go
to a peer that runs the worker's real handshake and records the flags of the
frames it reads. Nothing here asserts a speed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import threading
import time

import pytest

import rpcdl
from rpcdl.serialization.pickling import dumps
from rpcdl.transport.handshake import server_negotiate
from rpcdl.transport.polling import (
    OFF_CORE_SECONDS,
    POLL_ENV,
    QUIET_SECONDS,
    LoadSample,
    Poller,
    PollRule,
    running_threads,
    window_from_environment,
    window_is_explicit,
)
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
def test_a_bad_window_fails_at_once_naming_the_variable_for_callers(monkeypatch, text):
    monkeypatch.setenv(POLL_ENV, text)
    with pytest.raises(ValueError, match=f"{POLL_ENV} must be a whole number of microseconds from 0"):
        window_from_environment()
    with pytest.raises(ValueError, match=POLL_ENV):
        rpcdl.rpc_sync("127.0.0.1:9", abs, (-1,), timeout=1)  # before any connection is tried


@pytest.mark.parametrize(("text", "explicit"), [(None, False), ("", False), (" ", False), ("0", True), ("200", True)])
def test_only_a_window_set_in_the_environment_overrides_the_machine_s_say(monkeypatch, text, explicit):
    if text is None:
        monkeypatch.delenv(POLL_ENV, raising=False)
    else:
        monkeypatch.setenv(POLL_ENV, text)
    assert window_is_explicit() is explicit


# ---------------------------------------------------------------------------- the rule, pure


def test_the_rule_polls_while_bytes_come_within_the_window_and_never_with_a_window_of_zero():
    rule = PollRule(0.0002, adaptive=True)
    assert rule.may_poll(now=0.0)
    rule.arrived(waited=0.001)  # late: the next wait sleeps at once
    assert not rule.may_poll(now=1.0)
    rule.arrived(waited=0.00005)
    assert rule.may_poll(now=2.0)
    never = PollRule(0.0, adaptive=True)
    never.arrived(waited=0.0)
    assert not never.may_poll(now=0.0)


@pytest.mark.parametrize(("running", "cores", "allowed"), [(1, 1, True), (2, 2, True), (3, 2, False), (40, 32, False)])
def test_an_adaptive_rule_polls_only_while_no_runnable_thread_waits_for_a_core(running, cores, allowed):
    assert PollRule(0.0002, adaptive=True).machine_allows(running, cores) is allowed
    assert PollRule(0.0002, adaptive=False).machine_allows(running, cores)  # an explicit window: polls anyway


def test_a_poll_that_lost_its_core_stops_polling_for_a_while_then_one_window_tells_again():
    rule = PollRule(0.0002, adaptive=True)
    rule.polled(now=5.0, longest_gap=OFF_CORE_SECONDS / 2)  # a short gap: an interrupt, say
    assert rule.may_poll(now=5.0)
    rule.polled(now=5.0, longest_gap=0.003)  # another thread ran on its core for 3 ms
    assert not rule.may_poll(now=5.0 + QUIET_SECONDS / 2)
    assert rule.may_poll(now=5.0 + QUIET_SECONDS)
    explicit = PollRule(0.0002, adaptive=False)
    explicit.polled(now=5.0, longest_gap=0.003)
    assert explicit.may_poll(now=5.0)


def test_the_machine_s_runnable_threads_count_the_caller():
    assert running_threads() >= 1


# ---------------------------------------------------------------------------- the poller over a socket pair


def test_a_poller_returns_as_bytes_land_within_its_window(pair):
    left, right = pair
    poller = Poller(left, 0.1, adaptive=False)
    sender = threading.Timer(0.005, right.send, (b"x",))
    sender.start()
    assert poller.wait()  # the bytes came 5 ms into a 100 ms window
    sender.join()
    assert left.recv(1) == b"x"
    poller.arrived()
    assert poller.pays


def test_a_poller_stops_polling_once_bytes_came_late_and_starts_again_once_they_come_quickly(pair):
    left, right = pair
    poller = Poller(left, 0.001, adaptive=False)
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
    poller = Poller(left, 0.1, adaptive=False)
    right.close()
    assert poller.wait()  # the end of the stream is there to read


def _hold_the_gil_until(stop: threading.Event) -> None:
    # libc's usleep called with the GIL held (a PyDLL keeps it): the poller waits for the GIL for 2 ms at a time,
    # whatever the switch interval, while this thread sleeps and adds nothing to the machine's runnable threads
    usleep = ctypes.PyDLL(None).usleep
    while not stop.is_set():
        usleep(2000)


class IdleMachine(LoadSample):
    """A machine with a core to spare whatever the real load: the poller's own rule decides alone."""

    def running(self, now: float) -> int:
        return 1


@pytest.mark.parametrize("adaptive", [True, False])
def test_a_poller_that_loses_its_core_to_another_thread_stops_polling_unless_its_window_was_set(pair, adaptive):
    left, right = pair
    window = 0.03
    stop = threading.Event()
    hog = threading.Thread(target=_hold_the_gil_until, args=(stop,), name="gil-hog", daemon=True)
    hog.start()
    try:
        poller = Poller(left, window, adaptive=adaptive, load=IdleMachine())
        began = time.perf_counter()
        assert not poller.wait()  # nothing comes
        polled_for = time.perf_counter() - began
    finally:
        stop.set()
        hog.join()
    # it polled, and between two looks the other thread held the GIL (2 ms at a time, within the 30 ms window)
    assert polled_for >= window
    if adaptive:
        assert poller.rule.quiet_until > 0  # it saw the other thread take its core, and keeps quiet now
    else:
        assert poller.rule.quiet_until == 0  # an explicit window ignores contention
    right.send(b"x")
    assert poller.wait() is not adaptive  # an adaptive poller keeps quiet for a while; an explicit window polls


def test_an_adaptive_poller_does_not_poll_on_a_machine_with_no_spare_core(pair):
    left, _ = pair

    class BusyMachine(LoadSample):
        def running(self, now: float) -> int:
            return (os.cpu_count() or 1) + 1

    poller = Poller(left, 0.5, adaptive=True, load=BusyMachine())
    began = time.perf_counter()
    assert not poller.wait()
    assert time.perf_counter() - began < 0.25  # refused at once instead of polling for the 0.5 s window


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
