"""The worker's slots (:mod:`rpcdl.server.slots`) with real executor threads: every call queued runs once, no
more than ``parallel`` at a time, an executor parked with nothing to run wakes for the next call, and a stop
ends the executors.

The sessions here are plain records of the answers they are given (the slots' logic apart from sockets);
the sockets' side is covered by ``tests/test_sessions.py``.
"""

from __future__ import annotations

import threading
import time

import pytest

from rpcdl.rpc.rref import RRefStore
from rpcdl.server.slots import Slots
from rpcdl.transport.wire import Frame, Kind


class RecordingSession:
    """A session that records the call ids of the answers it is sent."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.call_context = ()
        self.closed = False
        self.answered: list[int] = []
        self.answer_came = threading.Semaphore(0)

    def send(self, frame: Frame, answers_call: bool = False, hold: bool = False) -> None:
        self.answered.append(frame.call_id)  # list.append is atomic: executors send concurrently
        self.answer_came.release()


class Executing:
    """Runs a call: counts the calls running at once (the most ever seen), answers with the call's id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.running = 0
        self.most = 0

    def __call__(self, session: RecordingSession, frame: Frame) -> Frame:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0)  # another executor may run meanwhile
        with self._lock:
            self.running -= 1
        return Frame(Kind.RESULT, frame.call_id)


def executor_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("rpcdl-executor-")]


@pytest.fixture
def slots():
    executing = Executing()
    made = Slots(3, executing, RRefStore())
    made.executing = executing
    made.start()
    yield made
    made.stop(timeout=5.0)


def test_a_parked_executor_wakes_for_each_call_made_one_at_a_time(slots, switching_often):
    session = RecordingSession("one at a time")
    for call_id in range(1, 151):
        slots.enqueue(session, Frame(Kind.CALL, call_id))
        assert session.answer_came.acquire(timeout=5.0), f"call {call_id} was queued but never ran"
    assert session.answered == list(range(1, 151))


def test_calls_from_many_threads_each_run_once_and_at_most_parallel_at_a_time(slots, switching_often):
    sessions = [RecordingSession(f"client {i}") for i in range(4)]

    def make_calls(session: RecordingSession, first: int) -> None:
        for call_id in range(first, first + 100):
            slots.enqueue(session, Frame(Kind.CALL, call_id))

    threads = [
        threading.Thread(target=make_calls, args=(session, 1000 * i), name=f"test-caller-{i}")
        for i, session in enumerate(sessions)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10.0)
    for session in sessions:
        for _ in range(100):
            assert session.answer_came.acquire(timeout=5.0), f"{session.peer}: a queued call never ran"
    for i, session in enumerate(sessions):
        assert sorted(session.answered) == list(range(1000 * i, 1000 * i + 100))  # each once, none lost
    assert 1 <= slots.executing.most <= 3


def test_stop_ends_the_executors_parked_with_nothing_to_run():
    slots = Slots(4, Executing(), RRefStore())
    before = set(executor_threads())
    slots.start()
    session = RecordingSession("one call")
    slots.enqueue(session, Frame(Kind.CALL, 7))
    assert session.answer_came.acquire(timeout=5.0)
    mine = [thread for thread in executor_threads() if thread not in before]
    assert len(mine) == 4
    started = time.monotonic()
    slots.stop(timeout=5.0)
    assert not any(thread.is_alive() for thread in mine), "a parked executor did not exit on stop()"
    assert time.monotonic() - started < 5.0
