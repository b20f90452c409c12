"""A real Connection against a real worker session in this process, over loopback: the hard interleavings.

The worker runs in this process, so the functions it runs share this module's
events and barriers with the test: they force the interleavings (a call that
blocks until the test lets it go) instead of sleeps. The peer that stops
mid-frame is a listening socket that runs the worker's real handshake, then
sends half a frame.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time

import pytest
from blocking_wire import FrameReader, server_negotiate
from helpers import GATES, eventually, gated, gated_workers

import rpcdl
import rpcdl.rpc.connection
from rpcdl.errors import ConnectionLost, WorkerTimeout, WorkerUnavailable
from rpcdl.rpc import client
from rpcdl.rpc.pool import close_idle_connections_to
from rpcdl.serialization.pickling import dumps
from rpcdl.transport.wire import Frame, Kind, Limits, encode_frame

pytestmark = pytest.mark.timeout(20)

_seen: list[int] = []


def seen(value: int) -> int:
    _seen.append(value)
    return value


@pytest.fixture
def worker():
    """A worker in this process, two slots, and a fresh client connection."""
    _seen.clear()
    with gated_workers(1) as [started]:
        yield started


def _gate(name: str) -> threading.Event:
    GATES[name] = threading.Event()
    return GATES[name]


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
    started = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"did not answer gated\(\) within 0.3s"):
        rpcdl.rpc_sync(address, gated, ("slow", 2), timeout=0.3)
    assert time.monotonic() - started < 2.0
    assert not connection.closed  # the other call goes on, undisturbed
    gate.set()
    assert background.wait() == 1  # the late answer of the expired call is dropped on the way
    assert rpcdl.rpc_sync(address, abs, (-2,)) == 2


# ---------------------------------------------------------------------------- deadlines


def test_rpc_sync_fails_at_its_deadline_and_the_late_answer_is_dropped(worker):
    address = worker.address
    connection = _opened(address)
    gate = _gate("late")
    started = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"did not answer gated\(\) within 0.3s"):
        rpcdl.rpc_sync(address, gated, ("late", 1), timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 2.0
    assert connection.status().pending == 0
    gate.set()
    assert rpcdl.rpc_sync(address, abs, (-2,)) == 2  # the late answer came first, and was dropped
    assert connection.status().pending == 0


def test_rpc_sync_with_a_large_argument_fails_at_its_deadline(worker):
    address = worker.address
    connection = _opened(address)
    gate = _gate("late")
    started = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"did not answer gated\(\) within 0.3s"):
        rpcdl.rpc_sync(address, gated, ("late", b"x" * (128 << 10)), timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 2.0
    assert connection.status().pending == 0
    gate.set()
    assert rpcdl.rpc_sync(address, abs, (-2,)) == 2  # the late answer is dropped on the way
    assert connection.status().pending == 0


class _Interrupted(Exception):
    pass


def _interrupt(signum, frame):
    raise _Interrupted


@pytest.mark.parametrize("alone", [True, False], ids=["rpc_sync", "future.wait"])
def test_an_exception_raised_in_a_thread_blocked_waiting_leaves_the_connection_serving(worker, alone):
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
    assert not connection.closed  # the thread never read the socket: the loop reads on
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
        more = [rpcdl.rpc_async(address, abs, (-k,)) for k in range(3)]
        outcome = []
        waiter = threading.Thread(
            target=lambda: outcome.append(_raised(lambda: rpcdl.rpc_sync(address, abs, (-9,)))), name="waiter"
        )
        waiter.start()
        eventually(lambda: connection.status().pending == 5, "the waiter's call is pending", timeout=5, interval=0.001)
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


def test_closing_the_connection_while_a_caller_waits_fails_its_call(worker):
    address = worker.address
    connection = client.connection_to(address)
    gate = _gate("never")
    outcome = []
    caller = threading.Thread(
        target=lambda: outcome.append(_raised(lambda: rpcdl.rpc_sync(address, gated, ("never", 0)))), name="caller"
    )
    caller.start()
    eventually(lambda: worker.stats()["calls_in_flight"] == 1, "the worker runs the call", timeout=5, interval=0.001)
    connection.close("closed by the test")
    caller.join(5)
    assert outcome == [ConnectionLost]
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
        eventually(lambda: connection.status().state == "open", "the connection is open", timeout=5, interval=0.001)
        second = rpcdl.rpc_async(address, abs, (-2,))
        gate.set()
        assert answered.wait(5)
        assert first.wait() == 42
        with pytest.raises(ConnectionLost, match="sent an unexpected CALL frame"):
            second.wait()
        assert connection.closed


def test_a_call_made_after_the_timer_was_set_for_an_answered_one_still_fails_on_time(worker):
    # The ping arms the overdue timer for its deadline and is answered; the later call, made alone, does not ask
    # the loop for a timer of its own: the first one finds nothing overdue and is set again for it.
    address = worker.address
    _opened(address)
    rpcdl.ping(address, timeout=0.5)
    _gate("stays")
    started = time.monotonic()
    late = rpcdl.rpc_async(address, gated, ("stays", 1), timeout=1.0)
    with pytest.raises(WorkerTimeout, match=r"did not answer gated\(\) within 1s"):
        late.wait()
    assert 1.0 <= time.monotonic() - started < 3.0


def test_a_call_sooner_than_the_timer_set_for_an_answered_one_fails_at_its_own_deadline(worker):
    address = worker.address
    _opened(address)
    rpcdl.ping(address, timeout=15.0)  # the timer is set for 15 s from now, and stays so
    _gate("sooner")
    started = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"did not answer gated\(\) within 0.3s"):
        rpcdl.rpc_sync(address, gated, ("sooner", 1), timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 2.0


def test_overdue_calls_fail_on_time_while_threads_race_the_timer(worker, switching_often):
    # Calls of every deadline, answered and overdue, made from several threads while the loop's timer fires:
    # a call added while the timer resets is seen by it, or sets one of its own.
    address = worker.address
    _opened(address)
    _gate("never")
    late: list[str] = []

    def calls(index: int) -> None:
        for round_ in range(4):
            rpcdl.ping(address, timeout=0.2 + 0.3 * ((index + round_) % 3))
            timeout = 0.1 + 0.1 * ((index * 3 + round_) % 4)
            started = time.monotonic()
            try:
                rpcdl.rpc_sync(address, gated, ("never", index), timeout=timeout)
            except WorkerTimeout:
                pass
            took = time.monotonic() - started
            if not timeout <= took < timeout + 1.5:
                late.append(f"caller {index}, round {round_}: a call of {timeout:g}s failed after {took:.2f}s")

    threads = [threading.Thread(target=calls, args=(i,), name=f"caller-{i}") for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert late == []
    assert client.connection_to(address).status().pending == 0


def test_closing_idle_connections_while_threads_call_fails_no_call(worker, switching_often):
    # A loader closes its idle connections to a worker it no longer needs while other threads of the process
    # call it: each connection is judged idle and closed in one step, so a call made meanwhile keeps it open or
    # goes over a new one. (Judged first and closed after, a call made in between failed with ConnectionLost.)
    # The closes come every millisecond, a storm beside a loader's, which closes on a change of its workers.
    address = worker.address
    _opened(address)
    stop = threading.Event()
    failed: list[str] = []
    answered = [0, 0]
    closed = [0]

    def calls(index: int) -> None:
        k = 0
        while not stop.is_set():
            try:
                assert rpcdl.rpc_sync(address, pow, (k, 1), timeout=10) == k
                answered[index] += 1
            except (ConnectionLost, WorkerUnavailable) as exc:
                failed.append(f"{type(exc).__name__}: {exc}")
            k += 1

    def closing() -> None:
        while not stop.is_set():
            closed[0] += close_idle_connections_to(address, "no longer needed")
            time.sleep(0.001)

    threads = [threading.Thread(target=calls, args=(i,), name=f"caller-{i}") for i in range(2)]
    threads.append(threading.Thread(target=closing, name="closer"))
    for thread in threads:
        thread.start()
    try:
        eventually(
            lambda: (min(answered) >= 1000 and closed[0] >= 100) or failed,
            f"calls and closes went on together (answered {answered}, closed {closed[0]})",
            timeout=15,
            interval=0.001,
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert failed == []
