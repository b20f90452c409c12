"""A real Connection against a real worker session in this process, over loopback: the hard interleavings.

The worker runs in this process, so the functions it runs share this module's
events and barriers with the test: they force the interleavings (a call that
blocks until the test lets it go) instead of sleeps. A longer idle tick for the
connection makes the reading role move only when a frame arrives, so who reads
which answer is decided by the test. The peer that stops mid-frame is a
listening socket that runs the worker's real handshake, then sends half a frame.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time

import pytest
from helpers import GATES, gated, gated_workers

import rpcdl
import rpcdl.rpc.connection
from rpcdl.errors import ConnectionLost, WorkerTimeout
from rpcdl.rpc import client, held
from rpcdl.rpc.connection_thread import thread_name
from rpcdl.rpc.state import Reader
from rpcdl.serialization.pickling import dumps
from rpcdl.transport.handshake import server_negotiate
from rpcdl.transport.wire import Frame, FrameReader, Kind, Limits, encode_frame

pytestmark = pytest.mark.timeout(20)

_seen: list[int] = []


def seen(value: int) -> int:
    _seen.append(value)
    return value


@pytest.fixture
def worker(monkeypatch):
    """A worker in this process, two slots, and a fresh client connection whose idle reads last 5 s."""
    monkeypatch.setattr(rpcdl.rpc.connection, "IDLE_TICK", 5.0)
    _seen.clear()
    with gated_workers(1) as [started]:
        yield started


def _gate(name: str) -> threading.Event:
    GATES[name] = threading.Event()
    return GATES[name]


def _until(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


def _opened(address: str) -> client.Connection:
    """The client's connection to ``address``, open (a ping went over it)."""
    connection = client.connection_to(address)
    rpcdl.ping(address)
    return connection


def _rpc_sync_in_a_thread(address: str, gate: str, value: int) -> tuple[threading.Thread, list]:
    """Start ``rpc_sync(address, gated, (gate, value))`` in a thread named ``caller``; its result goes in the list."""
    result: list = []
    caller = threading.Thread(
        target=lambda: result.append(rpcdl.rpc_sync(address, gated, (gate, value))), name="caller"
    )
    caller.start()
    return caller, result


def _calls_seen_by(worker: rpcdl.Worker) -> int:
    """Calls the worker has read, after a ping from another thread (frames sent before it are read first)."""
    thread = threading.Thread(target=rpcdl.ping, args=(worker.address,), name="test-ping")
    thread.start()
    thread.join()
    stats = worker.stats()
    return stats["calls_in_flight"] + stats["calls_served"] + stats["calls_failed"]


# ---------------------------------------------------------------------------- nested and held sends


def test_nested_sent_together_blocks_send_when_the_outermost_ends_in_order(worker):
    address = worker.address
    rpcdl.ping(address)
    with client.sent_together():
        first = rpcdl.rpc_async(address, seen, (1,))
        with client.sent_together():
            second = rpcdl.rpc_async(address, seen, (2,))
        assert _calls_seen_by(worker) == 0  # the inner block's end sends nothing
        third = rpcdl.rpc_async(address, seen, (3,))
        assert _calls_seen_by(worker) == 0
    assert [future.wait() for future in (first, second, third)] == [1, 2, 3]
    assert _seen == [1, 2, 3]


def test_a_held_block_whose_thread_waits_sends_first_and_calls_outside_it_go_after_the_held_ones(worker):
    address = worker.address
    with client.sent_together():
        held_call = rpcdl.rpc_async(address, seen, (1,))
        with client.outside_held_blocks():
            assert rpcdl.rpc_sync(address, seen, (2,)) == 2  # waits: the held call leaves first
        assert held_call.wait() == 1
        later = rpcdl.rpc_async(address, seen, (3,))
        assert later.wait() == 3  # waiting inside the block sends it; no deadlock
    assert _seen == [1, 2, 3]


def test_blocks_left_by_an_exception_send_what_they_held_and_give_the_thread_back_its_state(worker):
    address = worker.address
    rpcdl.ping(address)  # open: calls are held, not queued while connecting
    futures = []
    with pytest.raises(RuntimeError, match="left the block"), client.sent_together(), client.answers_read_here():
        futures.append(rpcdl.rpc_async(address, seen, (1,)))
        assert not held.holds_nothing() and held.reads_here()
        with client.outside_held_blocks():
            assert not held.reads_here()
            raise RuntimeError("left the block")
    assert held.holds_nothing() and not held.reads_here()
    assert futures[0].wait() == 1


# ---------------------------------------------------------------------------- a caller against the background reader


def test_the_background_reader_reads_the_answer_a_caller_waits_for(worker):
    address = worker.address
    connection = client.connection_to(address)
    gate = _gate("background")
    background = rpcdl.rpc_async(address, gated, ("background", 7))  # its answer is the connection thread's
    _until(lambda: connection.status().reader is Reader.BACKGROUND, "the connection's thread reads")
    delivered_on, delivered = [], threading.Event()
    waited = rpcdl.rpc_async(address, abs, (-5,))
    waited.add_done_callback(lambda _: (delivered_on.append(threading.current_thread().name), delivered.set()))
    assert waited.wait() == 5  # this thread waits for the role; the reader holding it delivers the answer
    assert delivered.wait(5) and delivered_on == [thread_name(address)]
    assert not background.done()
    gate.set()
    assert background.wait() == 7


def test_a_caller_holding_the_role_delivers_background_answers_then_its_own(worker):
    address = worker.address
    connection = _opened(address)
    gate = _gate("sync")
    caller, result = _rpc_sync_in_a_thread(address, "sync", 3)
    _until(lambda: connection.status().reader is Reader.CALLER, "the caller reads")
    delivered_on = []
    answer = _gate("background")  # opened once the callback is on: it cannot run here, on an answer already in
    background = rpcdl.rpc_async(address, gated, ("background", 4))
    background.add_done_callback(lambda _: (delivered_on.append(threading.current_thread().name), gate.set()))
    answer.set()
    caller.join(10)
    assert not caller.is_alive() and result == [3]
    assert background.wait() == 4
    assert delivered_on == ["caller"]  # read by the caller in recv when it arrived, its callback run there


def test_a_thread_waiting_for_its_answers_reads_the_background_ones_and_the_connections_thread_stays_out(
    worker, monkeypatch
):
    monkeypatch.setattr(rpcdl.rpc.connection, "BACKGROUND_DELAY", 60.0)  # its turn never comes in this test
    address = worker.address
    rpcdl.ping(address)  # a fresh connection; a caller was here just now
    connection = client.connection_to(address)
    read_on = []
    in_flight = []
    for k in range(200):
        if len(in_flight) >= 16:
            assert in_flight.pop(0).wait() >= 0
        future = rpcdl.rpc_async(address, abs, (-k,))  # background answers: waiting for them reads them
        future.add_done_callback(lambda _: read_on.append(threading.current_thread().name))
        in_flight.append(future)
    assert [future.wait() for future in in_flight] == list(range(184, 200))
    assert len(read_on) == 200 and set(read_on) == {"MainThread"}
    assert connection.status().reader is Reader.NOBODY and connection.status().pending == 0


def test_background_answers_nobody_waits_for_are_read_by_the_connections_thread_soon_after_a_caller_left(worker):
    address = worker.address
    assert rpcdl.rpc_sync(address, abs, (-1,)) == 1  # a caller read, and left
    done, read_on = threading.Event(), []
    answer = _gate("answer")  # opened once the callback is on: it cannot run here, on an answer already in
    future = rpcdl.rpc_async(address, gated, ("answer", 2))
    future.add_done_callback(lambda _: (read_on.append(threading.current_thread().name), done.set()))
    answer.set()
    assert done.wait(5)  # without any wait() of this thread
    assert read_on == [thread_name(address)] and future.value() == 2


def test_answers_read_here_are_left_to_their_caller_while_the_background_reader_reads_others(worker):
    address = worker.address
    connection = client.connection_to(address)
    other, mine_gate = _gate("other"), _gate("mine")
    background = rpcdl.rpc_async(address, gated, ("other", 1))
    _until(lambda: connection.status().reader is Reader.BACKGROUND, "the connection's thread reads")
    with client.answers_read_here():
        mine = [rpcdl.rpc_async(address, gated, ("mine", n)) for n in range(4)]
    assert (connection.status().left_to_callers, connection.status().read_in_background) == (4, 1)
    assert client.read_answers(mine, timeout=0.2) is None  # another thread reads: it delivers them
    mine_gate.set()
    assert [future.wait() for future in mine] == [0, 1, 2, 3]
    other.set()
    assert background.wait() == 1
    assert connection.status().pending == 0


def test_many_threads_calling_at_once_get_their_own_answers(worker):
    address = worker.address
    barrier = threading.Barrier(8)
    results: dict[int, list[int]] = {}

    def calls(index: int) -> None:
        barrier.wait()
        futures = [rpcdl.rpc_async(address, pow, (index, k)) for k in range(20)]
        syncs = [rpcdl.rpc_sync(address, pow, (index, k)) for k in range(5)]
        results[index] = [future.wait() for future in futures] + syncs

    threads = [threading.Thread(target=calls, args=(i,), name=f"caller-{i}") for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert results == {i: [i**k for k in range(20)] + [i**k for k in range(5)] for i in range(8)}
    assert client.connection_to(address).status().pending == 0


def test_a_deadline_expires_while_another_thread_reads(worker):
    address = worker.address
    connection = client.connection_to(address)
    gate = _gate("slow")
    background = rpcdl.rpc_async(address, gated, ("slow", 1))
    _until(lambda: connection.status().reader is Reader.BACKGROUND, "the connection's thread reads")
    started = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"did not answer gated\(\) within 0.3s"):
        rpcdl.rpc_sync(address, gated, ("slow", 2), timeout=0.3)
    assert time.monotonic() - started < 2.0
    assert connection.status().reader is Reader.BACKGROUND  # it read on, undisturbed
    gate.set()
    assert background.wait() == 1  # the late answer of the expired call is dropped on the way
    assert rpcdl.rpc_sync(address, abs, (-2,)) == 2


# ---------------------------------------------------------------------------- rpc_sync reading alone


def test_rpc_sync_on_an_idle_connection_reads_its_own_answer_without_joining_the_pending_calls(worker):
    address = worker.address
    connection = _opened(address)
    gate = _gate("alone")
    caller, result = _rpc_sync_in_a_thread(address, "alone", 3)
    _until(lambda: worker.stats()["calls_in_flight"] == 1, "the worker runs the call")
    assert connection.status().reader is Reader.CALLER  # taken before the call left
    assert connection.status().pending == 0  # no future, no entry: nobody else can read its answer
    gate.set()
    caller.join(5)
    assert result == [3]
    assert connection.status().reader is Reader.NOBODY and connection.status().pending == 0


def test_rpc_sync_reading_alone_fails_at_its_deadline_though_reads_block_longer_and_drops_the_late_answer(worker):
    address = worker.address
    connection = _opened(address)
    gate = _gate("late")
    started = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"did not answer gated\(\) within 0.3s"):
        rpcdl.rpc_sync(address, gated, ("late", 1), timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 2.0  # a read finding nothing blocks 5 s here
    assert connection.status().reader is Reader.NOBODY and connection.status().pending == 0
    gate.set()
    assert rpcdl.rpc_sync(address, abs, (-2,)) == 2  # reads the late answer first, and drops it
    assert connection.status().pending == 0


def test_rpc_sync_made_the_usual_way_fails_at_its_deadline_though_reads_block_longer(worker):
    """A 128 KiB argument makes the call the usual way (a pending call, read by whoever holds the role), as
    when the connection's thread still reads right after a ping: its caller must not read past its deadline."""
    address = worker.address
    connection = _opened(address)
    gate = _gate("late")
    started = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"did not answer gated\(\) within 0.3s"):
        rpcdl.rpc_sync(address, gated, ("late", b"x" * (128 << 10)), timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 2.0  # a read finding nothing blocks 5 s here
    assert connection.status().reader is not Reader.CALLER and connection.status().pending == 0
    gate.set()
    assert rpcdl.rpc_sync(address, abs, (-2,)) == 2  # the late answer is dropped on the way
    assert connection.status().pending == 0


class _Interrupted(Exception):
    pass


def _interrupt(signum, frame):
    raise _Interrupted


@pytest.mark.parametrize("alone", [True, False], ids=["rpc_sync", "future.wait"])
def test_an_exception_raised_in_a_thread_blocked_reading_frees_the_role_and_closes_the_connection(worker, alone):
    address = worker.address
    connection = _opened(address)
    gate = _gate("stuck")
    previous = signal.signal(signal.SIGALRM, _interrupt)  # as Ctrl-C would, in the main thread
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(_Interrupted):
            if alone:
                rpcdl.rpc_sync(address, gated, ("stuck", 1))
            else:
                rpcdl.rpc_async(address, gated, ("stuck", 1)).wait()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert connection.status().reader is not Reader.CALLER  # not held for ever by a thread that left
    if alone:  # (a future's waiter may have been waiting for the role, not reading, when interrupted)
        assert connection.closed  # the stream may have stopped inside a frame: it is not read again
    gate.set()
    assert rpcdl.rpc_sync(address, abs, (-4,)) == 4


# ---------------------------------------------------------------------------- a close in the middle of a read


@contextlib.contextmanager
def _scripted_peer(answer):
    """A peer that runs the worker's handshake, reads one call, calls ``answer(sock, call_id)``, then closes
    when told."""
    listener = socket.create_server(("127.0.0.1", 0))
    answered, close = threading.Event(), threading.Event()

    def serve() -> None:
        sock, _ = listener.accept()
        with sock:
            sock.settimeout(10)
            server_negotiate(sock, None, "client")
            frame = FrameReader(sock, Limits(), stall_timeout=10).read_frame()
            answer(sock, frame.call_id)
            answered.set()
            close.wait(10)

    thread = threading.Thread(target=serve, name="scripted-peer", daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}", answered, close
    finally:
        close.set()
        thread.join(5)
        listener.close()


def _half_an_answer(sock: socket.socket, call_id: int) -> None:
    whole = b"".join(bytes(piece) for piece in encode_frame(Frame(Kind.RESULT, call_id, payload=b"x" * 1000)))
    sock.sendall(whole[:-990])  # the header and 10 bytes of the payload


def _peer_that_stops_mid_frame():
    return _scripted_peer(_half_an_answer)


def test_a_peer_that_closes_in_the_middle_of_a_frame_fails_every_pending_call():
    with _peer_that_stops_mid_frame() as (address, half_sent, close):
        first = rpcdl.rpc_async(address, abs, (-1,))
        assert half_sent.wait(5)
        connection = client.connection_to(address)
        _until(lambda: connection.status().reader is Reader.BACKGROUND, "the connection's thread reads")
        more = [rpcdl.rpc_async(address, abs, (-k,)) for k in range(3)]
        outcome = []
        waiter = threading.Thread(
            target=lambda: outcome.append(_raised(lambda: rpcdl.rpc_sync(address, abs, (-9,)))), name="waiter"
        )
        waiter.start()
        _until(lambda: connection.status().readers_waiting == 1, "the waiter waits for the role")
        assert not first.done()  # half a frame: the reader waits for the rest
        started = time.monotonic()
        close.set()
        waiter.join(5)
        for future in [first, *more]:
            with pytest.raises(ConnectionLost, match=f"lost the connection to worker {address}"):
                future.wait()
        assert time.monotonic() - started < 2.0
        assert outcome == [ConnectionLost]
        assert connection.closed and connection.status().state == "closed"
        assert connection.status().pending == 0


def test_closing_the_connection_while_a_caller_reads_fails_its_call_and_frees_the_reader(worker):
    address = worker.address
    connection = client.connection_to(address)
    gate = _gate("never")
    outcome = []
    caller = threading.Thread(
        target=lambda: outcome.append(_raised(lambda: rpcdl.rpc_sync(address, gated, ("never", 0)))), name="caller"
    )
    caller.start()
    _until(lambda: connection.status().reader is Reader.CALLER, "the caller reads")
    connection.close("closed by the test")
    caller.join(5)
    assert outcome == [ConnectionLost]
    assert connection.status().reader is Reader.NOBODY
    gate.set()
    assert rpcdl.rpc_sync(address, abs, (-3,)) == 3  # a new connection


def _raised(action) -> type[BaseException] | None:
    try:
        action()
    except BaseException as exc:
        return type(exc)
    return None


def test_an_unexpected_frame_read_with_an_answer_delivers_the_answer_then_fails_the_rest():
    def answer_then_a_call(sock: socket.socket, call_id: int) -> None:
        payload, _ = dumps(42)
        answer = encode_frame(Frame(Kind.RESULT, call_id, payload=payload))
        stray = encode_frame(Frame(Kind.CALL, 12345, payload=b"?"))
        sock.sendall(b"".join(bytes(piece) for piece in [*answer, *stray]))  # one segment: read in one batch

    gate = threading.Event()
    with _scripted_peer(lambda sock, call_id: (gate.wait(10), answer_then_a_call(sock, call_id))) as (
        address,
        answered,
        _,
    ):
        first = rpcdl.rpc_async(address, abs, (-1,))
        connection = client.connection_to(address)
        _until(lambda: connection.status().state == "open", "the connection is open")
        second = rpcdl.rpc_async(address, abs, (-2,))
        gate.set()
        assert answered.wait(5)
        assert first.wait() == 42
        with pytest.raises(ConnectionLost, match="sent an unexpected CALL frame"):
            second.wait()
        assert connection.closed
