"""A worker's lifecycle against real clients: stops that race connections and calls, threads it leaves, names.

Each test starts a real :class:`rpcdl.Worker` in this process and reaches it
over loopback sockets: raw clients that run the real handshake
(:func:`blocking_wire.client_negotiate`) and speak frames, or
rpcdl's own client. Concurrency tests switch threads every microsecond.
"""

from __future__ import annotations

import operator
import pickle
import socket
import threading
import time

from blocking_wire import FrameReader, client_negotiate, io_stream

import rpcdl
from rpcdl.errors import ConnectionLost
from rpcdl.server.worker import Phase
from rpcdl.transport.wire import Frame, Kind, Limits, encode_frame

_WAIT = 10.0


def _call_bytes(call_id: int, function, *args) -> bytes:
    payload = pickle.dumps((function, args, {}), protocol=5)
    return b"".join(bytes(piece) for piece in encode_frame(Frame(Kind.CALL, call_id, 0, payload)))


def _raw_round_trip(address: str, call_id: int) -> Kind | None:
    """Connect, run the handshake, send one call, read its answer, hang up: the answer's kind
    (``None``: the worker closed or refused the connection, as a stopping worker does)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=_WAIT) as sock:
            client_negotiate(sock, None, address, compression="off")
            stream = io_stream(sock, receive=_WAIT, send=_WAIT)
            stream.sendall(_call_bytes(call_id, operator.add, call_id, 1))
            reader = FrameReader(stream, Limits(), stall_timeout=_WAIT)
            frame = reader.read_frame()
            if frame is not None and frame.kind == Kind.LEAVING:  # the worker drains: the answer comes next
                frame = reader.read_frame()
    except (OSError, ConnectionLost, rpcdl.ProtocolError):
        return None
    assert frame is not None
    if frame.kind == Kind.RESULT:
        assert pickle.loads(frame.payload) == call_id + 1
    return frame.kind


def _threads_of(before: set[threading.Thread]) -> list[str]:
    """The names of the threads alive now that started since ``before`` and belong to a worker."""
    prefixes = ("rpcdl-accept-", "rpcdl-peer-", "rpcdl-service-", "rpcdl-promoter-", "rpcdl-executor-")
    return sorted(t.name for t in set(threading.enumerate()) - before if t.name.startswith(prefixes))


def test_a_stop_racing_clients_that_connect_and_call_leaves_no_thread_and_no_session(switching_often, thread_errors):
    before = set(threading.enumerate())
    worker = rpcdl.Worker(timeout=_WAIT, parallel=2).start()
    outcomes: list[Kind | None] = []
    stop_clients = threading.Event()

    def client(k: int) -> None:
        call_id = 1
        while not stop_clients.is_set():
            outcomes.append(_raw_round_trip(worker.address, call_id))
            call_id += 1

    clients = [threading.Thread(target=client, args=(k,), name=f"test-client-{k}") for k in range(4)]
    for thread in clients:
        thread.start()
    try:
        deadline = time.monotonic() + 30
        while outcomes.count(Kind.RESULT) < 20 and time.monotonic() < deadline:  # sessions come and go
            time.sleep(0.01)
        assert worker.stop(grace=5.0)  # while clients keep connecting and calling
    finally:
        stop_clients.set()
        for thread in clients:
            thread.join(timeout=30)
    assert outcomes.count(Kind.RESULT) >= 20
    assert set(outcomes) <= {Kind.RESULT, Kind.REJECTED, None}
    assert not thread_errors
    stats = worker.stats()
    assert (stats["clients"], stats["calls_in_flight"], stats["draining"]) == (0, 0, True)
    deadline = time.monotonic() + _WAIT
    while _threads_of(before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads_of(before) == []


def test_a_worker_never_started_stops_at_once_and_a_second_stop_waits_for_the_first(embedded_worker):
    idle = rpcdl.Worker(timeout=_WAIT)
    assert idle.phase is Phase.NEW
    assert idle.stop(grace=1.0) and idle.wait(0) and idle.phase is Phase.STOPPED
    assert idle.start().phase is Phase.STOPPED  # a stopped worker does not start again

    worker = embedded_worker()
    rpcdl.rpc_async(worker.address, time.sleep, (0.5,))  # a call in flight: the first stop drains it
    deadline = time.monotonic() + _WAIT
    while worker.stats()["calls_in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    first = threading.Thread(target=worker.stop, args=(5.0,), name="test-first-stop")
    first.start()
    while worker.phase is Phase.SERVING:
        time.sleep(0.001)
    assert worker.stop(grace=5.0)  # returns once the first stop has finished
    assert worker.phase is Phase.STOPPED and worker.wait(0)
    first.join(timeout=_WAIT)


def test_wait_returns_when_another_thread_stops_the_worker(embedded_worker):
    worker = embedded_worker()
    assert not worker.wait(0.05)
    stopping = threading.Timer(0.1, worker.stop, kwargs={"grace": 1.0})
    stopping.name = "test-stopping"
    stopping.start()
    assert worker.wait(_WAIT)
    stopping.join(timeout=_WAIT)


def test_every_thread_a_worker_starts_is_named_and_ends_with_it():
    before = set(threading.enumerate())

    def started() -> list[str]:
        names = (t.name for t in set(threading.enumerate()) - before)
        return sorted(name for name in names if name != "rpcdl-loop")  # the client's own (the process's loop)

    with rpcdl.Worker(timeout=_WAIT, parallel=3) as worker:
        assert _raw_round_trip(worker.address, 1) == Kind.RESULT
        assert rpcdl.rpc_sync(worker.address, operator.mul, (6, 7)) == 42
        names = started()
        assert all(name.startswith("rpcdl-") for name in names), names
        # the loop (rpcdl-loop) accepts, runs the handshakes and serves the sessions: the executors are the rest
        assert set(names) - {"rpcdl-loop"} == {"rpcdl-executor-0", "rpcdl-executor-1", "rpcdl-executor-2"}
    rpcdl.shutdown()
    deadline = time.monotonic() + _WAIT
    while _threads_of(before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads_of(before) == []


def _open_session(address: str) -> socket.socket:
    """A raw client past its handshake whose one call was answered: a session the worker serves."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=_WAIT)
    client_negotiate(sock, None, address, compression="off")
    stream = io_stream(sock, receive=_WAIT, send=_WAIT)
    stream.sendall(_call_bytes(7, operator.add, 7, 1))
    frame = FrameReader(stream, Limits(), stall_timeout=_WAIT).read_frame()
    assert frame is not None and frame.kind == Kind.RESULT and pickle.loads(frame.payload) == 8
    return sock


def test_a_worker_has_the_same_threads_with_64_clients_as_with_one():
    def worker_threads() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("rpcdl-"))

    clients: list[socket.socket] = []
    with rpcdl.Worker(timeout=_WAIT, parallel=2) as worker:
        try:
            clients.append(_open_session(worker.address))
            with_one = worker_threads()
            clients += [_open_session(worker.address) for _ in range(63)]
            assert worker.stats()["clients"] == 64
            assert worker_threads() == with_one
            assert "rpcdl-loop" in with_one
        finally:
            for sock in clients:
                sock.close()


def test_stats_read_while_sessions_come_and_go(embedded_worker, switching_often, thread_errors):
    worker = embedded_worker(parallel=2)
    done = threading.Event()
    readings: list[dict] = []

    def read_stats() -> None:
        while not done.is_set():
            readings.append(worker.stats())

    reader = threading.Thread(target=read_stats, name="test-stats-reader")
    reader.start()
    try:
        for call_id in range(1, 21):
            assert _raw_round_trip(worker.address, call_id) == Kind.RESULT
    finally:
        done.set()
        reader.join(timeout=_WAIT)
    assert readings and not thread_errors
    assert all(r["clients"] >= 0 and r["calls_in_flight"] >= 0 for r in readings)
    assert worker.stats()["calls_served"] == 20 and worker.stats()["connections_total"] == 20
    deadline = time.monotonic() + _WAIT  # each session ends once its service thread sees the hang-up
    while worker.stats()["clients"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.stats()["clients"] == 0
