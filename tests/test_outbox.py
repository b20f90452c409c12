"""The outbox of a connection over a real socket pair: many threads sending at once, and a peer that goes away."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from rpcdl.rpc import outbox as outbox_module
from rpcdl.rpc.outbox import Outbox

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


@pytest.mark.parametrize("rounds", [1, outbox_module._ROUNDS])
def test_threads_sending_at_once_each_keep_their_order_and_lose_nothing(rounds, monkeypatch):
    monkeypatch.setattr(outbox_module, "_ROUNDS", rounds)  # 1: the sender hands the role on after every write
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
