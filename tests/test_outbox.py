"""The outbox of a connection over a real socket pair: many threads sending at once, and a peer that goes away."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from rpcdl.rpc import outbox as outbox_module
from rpcdl.rpc.outbox import Outbox, OutboxState

pytestmark = pytest.mark.timeout(20)

_RECORD = struct.Struct("!II")  # thread, sequence number


def _receive_all(sock: socket.socket, size: int) -> bytes:
    received = bytearray()
    while len(received) < size:
        chunk = sock.recv(size - len(received))
        if not chunk:
            break
        received += chunk
    return bytes(received)


@pytest.mark.parametrize("rounds", [1, outbox_module.ROUNDS])
def test_threads_sending_at_once_each_keep_their_order_and_lose_nothing(rounds, monkeypatch):
    monkeypatch.setattr(outbox_module, "ROUNDS", rounds)  # 1: the sender hands the role on after every write
    ours, theirs = socket.socketpair()
    with ours, theirs:
        outbox = Outbox(ours, [b"first"])
        threads, per_thread = 8, 300
        barrier = threading.Barrier(threads)
        received = []
        reader = threading.Thread(
            target=lambda: received.append(_receive_all(theirs, 5 + threads * per_thread * _RECORD.size)),
            name="test-reader",
        )
        reader.start()

        def send(index: int) -> None:
            barrier.wait()
            for number in range(per_thread):
                outbox.send([_RECORD.pack(index, number)])

        senders = [threading.Thread(target=send, args=(i,), name=f"test-sender-{i}") for i in range(threads)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(10)
        reader.join(10)
        data = received[0]
        assert data[:5] == b"first"  # what was queued before any send goes first
        records = [_RECORD.unpack_from(data, offset) for offset in range(5, len(data), _RECORD.size)]
        assert len(records) == threads * per_thread
        for index in range(threads):
            assert [number for thread, number in records if thread == index] == list(range(per_thread))


def test_every_thread_sending_to_a_peer_that_went_away_gets_the_error_and_none_hangs():
    ours, theirs = socket.socketpair()
    theirs.close()
    outbox = Outbox(ours)
    errors = []
    barrier = threading.Barrier(4)

    def send() -> None:
        barrier.wait()
        try:
            for _ in range(100):
                outbox.send([b"x" * 1024])
        except OSError as exc:
            errors.append(type(exc))

    threads = [threading.Thread(target=send, name=f"test-sender-{i}") for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads)
    assert len(errors) == 4 and all(issubclass(error, OSError) for error in errors)
    with pytest.raises(OSError):
        outbox.send([b"later"])  # the error stays
    ours.close()


# ---------------------------------------------------------------------------- deferral: the state's transitions


def _nothing_arrived(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)
    return False


def test_a_deferred_frame_waits_and_leaves_with_the_next_send_in_order():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        armed = []
        outbox = Outbox(ours, delay=5.0, on_deferred=armed.append)
        assert outbox.state is OutboxState.IDLE and outbox.deferred_until == float("inf")
        before = time.monotonic()
        outbox.defer([b"one"])
        assert outbox.state is OutboxState.DEFERRED
        assert before + 5.0 <= outbox.deferred_until <= time.monotonic() + 5.0
        assert armed == [outbox.deferred_until]  # the owner is told when to flush, once
        outbox.defer([b"two"])
        assert outbox.state is OutboxState.DEFERRED and len(armed) == 1
        assert _nothing_arrived(theirs)
        outbox.send([b"three"])
        assert outbox.state is OutboxState.IDLE and outbox.deferred_until == float("inf")
        assert _receive_all(theirs, 11) == b"onetwothree"


def test_the_max_deferred_frame_sends_them_all_at_once():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        outbox = Outbox(ours, delay=5.0, max_deferred=3)
        outbox.defer([b"a"])
        outbox.defer([b"b", b"c"])
        assert outbox.state is OutboxState.DEFERRED
        outbox.defer([b"d"])
        assert outbox.state is OutboxState.IDLE
        assert _receive_all(theirs, 4) == b"abcd"
        outbox.defer([b"e"])  # counting starts again
        assert outbox.state is OutboxState.DEFERRED


def test_an_empty_send_writes_what_is_deferred_and_does_nothing_when_idle():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        outbox = Outbox(ours, [b"queued-while-connecting"], delay=5.0)
        assert outbox.state is OutboxState.DEFERRED  # the first pieces wait for the first send
        outbox.send(())
        assert outbox.state is OutboxState.IDLE
        outbox.send(())
        outbox.defer([b"later"])
        outbox.send(())
        assert outbox.state is OutboxState.IDLE
        assert _receive_all(theirs, 28) == b"queued-while-connectinglater"


class _DeferringWhileWriting:
    """A real socket whose first write lets another frame be deferred meanwhile (as another thread would)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.outbox, self.writes = sock, None, 0

    def sendmsg(self, views):
        self.writes += 1
        if self.writes == 1:
            assert self.outbox.state is OutboxState.SENDING
            self.outbox.defer([b"meanwhile"])  # joins what the sender writes
        return self.sock.sendmsg(views)


@pytest.mark.parametrize("rounds", [1, 2])
def test_frames_deferred_while_a_thread_writes_go_with_it_or_are_left_due_with_the_owner_told(rounds, monkeypatch):
    monkeypatch.setattr(outbox_module, "ROUNDS", rounds)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        armed = []
        wrapped = _DeferringWhileWriting(ours)
        outbox = Outbox(wrapped, delay=5.0, on_deferred=armed.append)
        wrapped.outbox = outbox
        outbox.send([b"first", b"!"])
        if rounds == 1:  # the sender's rounds are spent and nobody waits: left deferred, the owner told
            assert outbox.state is OutboxState.DEFERRED and armed == [outbox.deferred_until]
            outbox.send(())
        else:
            assert outbox.state is OutboxState.IDLE and armed == []
        assert _receive_all(theirs, 15) == b"first!meanwhile"


def test_deferring_after_the_socket_failed_raises():
    ours, theirs = socket.socketpair()
    theirs.close()
    with ours:
        outbox = Outbox(ours, delay=5.0)
        outbox.defer([b"x" * 1024])
        with pytest.raises(OSError):
            outbox.send(())
        with pytest.raises(OSError):
            outbox.defer([b"y"])


def test_threads_deferring_sending_and_flushing_at_once_keep_each_ones_order_and_lose_nothing():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        due = threading.Event()
        outbox = Outbox(ours, delay=0.0005, max_deferred=8, on_deferred=lambda until: due.set())
        threads, per_thread = 6, 400
        received = []
        reader = threading.Thread(
            target=lambda: received.append(_receive_all(theirs, threads * per_thread * _RECORD.size)),
            name="test-reader",
        )
        reader.start()
        stop = threading.Event()

        def owner() -> None:  # what the connection's thread does: flush once due
            while not stop.is_set():
                due.wait(0.01)
                due.clear()
                if outbox.deferred_until <= time.monotonic() + 0.001:
                    outbox.send(())

        flusher = threading.Thread(target=owner, name="test-owner")
        flusher.start()
        barrier = threading.Barrier(threads)

        def work(index: int) -> None:
            barrier.wait()
            for number in range(per_thread):
                record = [_RECORD.pack(index, number)]
                if index % 3 == 0:
                    outbox.send(record)
                else:
                    outbox.defer(record)
                    if number % 50 == 49 and index % 3 == 1:
                        outbox.send(())

        workers = [threading.Thread(target=work, args=(i,), name=f"test-worker-{i}") for i in range(threads)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join(10)
        deadline = time.monotonic() + 5
        while outbox.state is not OutboxState.IDLE and time.monotonic() < deadline:
            time.sleep(0.001)  # the owner flushes what is left, unasked
        reader.join(10)
        stop.set()
        flusher.join(5)
        data = received[0]
        records = [_RECORD.unpack_from(data, offset) for offset in range(0, len(data), _RECORD.size)]
        assert len(records) == threads * per_thread
        for index in range(threads):
            assert [number for thread, number in records if thread == index] == list(range(per_thread))
