"""A worker's session driven with raw frames over an in-process socket pair.

Each test starts a real :class:`rpcdl.Worker` in this process, hands it one end
of ``socket.socketpair()`` through :meth:`rpcdl.Worker.serve_socket` (the seam
its accept path uses after the handshake) and writes frames encoded by
:func:`rpcdl.transport.wire.encode_frame` on the other end. Functions travel as
plain pickles by reference, so the worker runs this module's own objects.
"""

from __future__ import annotations

import operator
import pickle
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from blocking_wire import FrameReader, io_stream
from helpers import eventually

import rpcdl
from rpcdl.errors import ConnectionLost
from rpcdl.server.worker import Phase
from rpcdl.transport.control import encode_release
from rpcdl.transport.wire import HEADER, Frame, Kind, Limits, encode_frame

_ANSWER_WAIT = 10.0  # seconds a test waits for one answer before failing


def _call(call_id: int, function, *args, ref: int = 0, flags: int = 0) -> bytes:
    payload = pickle.dumps((function, args, {}), protocol=5)
    return b"".join(bytes(piece) for piece in encode_frame(Frame(Kind.CALL, call_id, ref, payload, [], flags)))


def _control(kind: Kind, call_id: int = 0, payload: bytes = b"") -> bytes:
    return b"".join(bytes(piece) for piece in encode_frame(Frame(kind, call_id, payload=payload)))


class Client:
    """The raw client end of a socket pair served by a worker."""

    def __init__(self, worker: rpcdl.Worker, name: str):
        self.sock, served = socket.socketpair()
        self.session = worker.serve_socket(io_stream(served, receive=0.2, send=5.0), name)
        self.sock.settimeout(_ANSWER_WAIT)
        self.reader = FrameReader(self.sock, worker.limits, stall_timeout=_ANSWER_WAIT)

    def send(self, *frames: bytes) -> None:
        self.sock.sendall(b"".join(frames))

    def answer(self) -> Frame:
        frame = self.reader.read_frame()
        assert frame is not None, f"no answer within {_ANSWER_WAIT}s"
        return frame

    def close(self) -> None:
        self.sock.close()


def _value(frame: Frame):
    assert frame.kind == Kind.RESULT, f"expected a RESULT, got {frame.kind.name}"
    return pickle.loads(frame.payload, buffers=frame.buffers)


@pytest.fixture
def start_worker() -> Iterator:
    workers: list[rpcdl.Worker] = []
    clients: list[Client] = []

    def start(**options) -> tuple[rpcdl.Worker, callable]:
        worker = rpcdl.Worker(**{"timeout": 10, **options}).start()
        workers.append(worker)

        def connect(name: str = "pair") -> Client:
            client = Client(worker, name)
            clients.append(client)
            return client

        return worker, connect

    yield start
    for client in clients:
        client.close()
    for worker in workers:
        worker.stop(grace=1)


_barrier: threading.Barrier | None = None


def _meet() -> str:
    """Wait at the module's barrier: returns only once another call waits there too."""
    assert _barrier is not None
    _barrier.wait(timeout=_ANSWER_WAIT)
    return "met"


def test_pipelined_calls_all_answered_with_their_call_ids(start_worker):
    worker, connect = start_worker()
    client = connect()
    count = 300
    client.send(*(_call(call_id, operator.mul, call_id, 3) for call_id in range(1, count + 1)))
    answers = {}
    for _ in range(count):
        frame = client.answer()
        answers[frame.call_id] = _value(frame)
    assert answers == {call_id: call_id * 3 for call_id in range(1, count + 1)}
    eventually(lambda: worker.stats()["calls_in_flight"] == 0, "calls counted as answered")
    stats = worker.stats()
    assert stats["calls_served"] == count
    assert stats["calls_failed"] == 0


def test_failing_call_in_a_burst_answers_an_error_with_its_id(start_worker):
    _, connect = start_worker()
    client = connect()
    client.send(_call(1, operator.add, 1, 2), _call(2, operator.truediv, 1, 0), _call(3, operator.add, 3, 4))
    frames = {frame.call_id: frame for frame in (client.answer() for _ in range(3))}
    assert _value(frames[1]) == 3
    assert frames[2].kind == Kind.ERROR
    assert _value(frames[3]) == 7


def test_ping_answered_while_a_long_call_runs_inline(start_worker):
    _, connect = start_worker()
    client = connect()
    client.send(_call(1, time.sleep, 1.0), _control(Kind.PING, 77))
    first, second = client.answer(), client.answer()
    assert (first.kind, first.call_id) == (Kind.PONG, 77)
    assert (second.kind, second.call_id) == (Kind.RESULT, 1)


def test_pipelined_calls_run_at_once_in_two_slots(start_worker):
    global _barrier
    _barrier = threading.Barrier(2)
    _, connect = start_worker(parallel=2)
    client = connect()
    client.send(_call(1, _meet), _call(2, _meet))
    answers = {frame.call_id: _value(frame) for frame in (client.answer(), client.answer())}
    assert answers == {1: "met", 2: "met"}


def test_calls_of_two_clients_share_one_slot_in_arrival_order(start_worker):
    worker, connect = start_worker(parallel=1)
    first, second = connect("first"), connect("second")
    first.send(_call(1, time.sleep, 0.3))
    eventually(lambda: worker.stats()["calls_in_flight"] == 1, "the first call running")
    second.send(_call(2, operator.add, 40, 2))
    assert _value(second.answer()) == 42
    assert first.answer().call_id == 1
    assert worker.stats()["calls_served"] == 2


def test_client_closing_mid_frame_ends_its_session_and_the_worker_serves_others(start_worker):
    worker, connect = start_worker()
    leaving = connect("leaving")
    frame = _call(1, operator.add, 1, 2)
    leaving.send(frame[: HEADER.size + 3])
    eventually(lambda: worker.stats()["clients"] == 1, "the session counted")
    leaving.close()
    eventually(lambda: leaving.session.closed, "the session closed")
    eventually(lambda: worker.stats()["clients"] == 0, "the session forgotten")
    staying = connect("staying")
    staying.send(_call(2, operator.add, 2, 3))
    assert _value(staying.answer()) == 5


def test_frame_over_the_limit_is_refused_by_closing_the_connection(start_worker, caplog):
    _, connect = start_worker(limits=Limits(max_message_bytes=4096))
    client = connect()
    header = HEADER.pack(Kind.CALL, 0, 0, 0, 1, 0, 1 << 20)
    with caplog.at_level("WARNING", logger="rpcdl.worker"):
        client.send(header)
        with pytest.raises(ConnectionLost):
            client.reader.read_frame()
        eventually(lambda: client.session.closed, "the session closed")
    assert any("limit is 4096" in record.getMessage() for record in caplog.records)
    other = connect("other")
    other.send(_call(1, operator.add, 1, 1))
    assert _value(other.answer()) == 2


def test_release_of_an_rref_in_the_middle_of_a_stream(start_worker):
    worker, connect = start_worker()
    client = connect()
    client.send(_call(1, operator.add, 20, 22, ref=501), _call(2, operator.add, 1, 1, ref=502))
    assert {client.answer().call_id, client.answer().call_id} == {1, 2}
    assert worker.stats()["rrefs"] == 2
    client.send(
        _call(3, operator.add, 1, 2), _control(Kind.RELEASE, payload=encode_release([501])), _call(4, operator.neg, 4)
    )
    answers = {frame.call_id: _value(frame) for frame in (client.answer(), client.answer())}
    assert answers == {3: 3, 4: -4}
    eventually(lambda: worker.stats()["rrefs"] == 1, "the released RRef freed")
    client.close()
    eventually(lambda: worker.stats()["rrefs"] == 0, "the RRefs of a closed session freed")


def test_answers_held_back_in_a_burst_go_out_when_control_frames_end_it(start_worker):
    _, connect = start_worker()
    client = connect()
    client.send(_call(1, operator.add, 1, 1), _call(2, operator.add, 2, 2), _control(Kind.PING, 3))
    frames = {frame.call_id: frame for frame in (client.answer() for _ in range(3))}
    assert (_value(frames[1]), _value(frames[2]), frames[3].kind) == (2, 4, Kind.PONG)


def _quick_or_slow(value: int) -> int:
    """Most calls return at once; one in eight runs long enough to be promoted (its turn offered)."""
    if value % 8 == 0:
        time.sleep(0.03)
    return value


def test_clients_pipelining_quick_and_slow_calls_and_pings_get_each_answer_once(
    start_worker, switching_often, thread_errors
):
    worker, connect = start_worker(parallel=2)
    clients, calls, answers = [connect(f"client-{k}") for k in range(4)], 64, {}

    def drive(k: int, client: Client) -> None:
        frames = []
        for value in range(1, calls + 1):
            frames.append(_call(value, _quick_or_slow, value))
            if value % 5 == 0:
                frames.append(_control(Kind.PING, 1000 + value))
        client.send(*frames)
        received = []
        for _ in range(len(frames)):
            received.append(client.answer())
        answers[k] = received

    threads = [threading.Thread(target=drive, args=item, name=f"test-client-{item[0]}") for item in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not thread_errors
    assert sorted(answers) == [0, 1, 2, 3], "a client did not get all its answers"
    for received in answers.values():
        results = {frame.call_id: _value(frame) for frame in received if frame.kind == Kind.RESULT}
        pongs = sorted(frame.call_id for frame in received if frame.kind == Kind.PONG)
        assert results == {value: value for value in range(1, calls + 1)}  # each call once, none lost
        assert pongs == [1000 + value for value in range(5, calls + 1, 5)]
    eventually(lambda: worker.stats()["calls_in_flight"] == 0, "every call counted as answered")
    assert worker.stats()["calls_served"] == 4 * calls


_released = threading.Event()


def _until_released() -> str:
    """A call that runs until the test releases it (at most the answer wait)."""
    assert _released.wait(_ANSWER_WAIT)
    return "released"


def test_calls_arriving_while_the_worker_drains_are_rejected_and_the_running_call_finishes(start_worker):
    _released.clear()
    worker, connect = start_worker(parallel=1)
    client = connect()
    client.send(_call(1, _until_released))
    eventually(lambda: worker.stats()["calls_in_flight"] == 1, "the long call running")
    stopping = threading.Thread(target=worker.stop, args=(10.0,), name="test-stopping")
    stopping.start()
    eventually(lambda: worker.phase is Phase.DRAINING, "the worker draining")
    notice = client.answer()  # the worker tells its clients it leaves before it rejects anything
    assert (notice.kind, notice.call_id) == (Kind.LEAVING, 0)
    client.send(_call(2, operator.add, 1, 1))
    first = client.answer()
    _released.set()
    second = client.answer()
    assert (first.kind, first.call_id) == (Kind.REJECTED, 2)
    assert (second.kind, second.call_id, _value(second)) == (Kind.RESULT, 1, "released")
    stopping.join(timeout=20)
    assert worker.wait(0) and worker.phase is Phase.STOPPED
    assert worker.stats()["calls_rejected"] == 1
    assert client.session.closed
