"""Passes over a pool, driven through ``next()`` and ``close()``; the pool's records driven directly.

The workers here are threads that complete the pass's futures (as connections'
threads do), each answering its calls in order, one at a time, as the test
scripts; revivals are scripted the same way. The clock is the real one: the
only timed assertions are lower bounds (a copy is not sent before the head is
late, a probe is not sent before its delay).
"""

from __future__ import annotations

import gc
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import eventually

from rpcdl.data.chunked_pass import ChunkedPass, ChunkSizer, ServedCounts
from rpcdl.data.events import Answered, Orphaned
from rpcdl.data.probes import Revival
from rpcdl.data.records import FIRST_PROBE_DELAY, Attempt, AttemptState, Task, WorkerState
from rpcdl.data.scheduler import Dispatch, NoWorkersLeft, PassState
from rpcdl.data.worker_pool import PassRecord, Registration, WorkerPool
from rpcdl.errors import WorkerTimeout, WorkerUnavailable

pytestmark = pytest.mark.timeout(30)

HANG = object()  # a call the worker holds until the test releases it


class FakeWorkers:
    """The pass's call: each worker a thread answering its calls in order, ``service`` seconds each.

    ``answer(payload, address)`` says what a call answers: a value, an exception
    (the call fails with it) or :data:`HANG` (held until :meth:`release`).
    """

    def __init__(self, services: dict[str, float], answer: Callable[[Any, str], Any] = lambda payload, _: payload):
        self.answer = answer
        self.sent: list[tuple[Any, str, float]] = []  # (payload, address, when), by the pass's threads
        self._lock = threading.Lock()
        self._held: list[tuple[torch.futures.Future, Any]] = []  # (future, payload)
        self._inboxes: dict[str, queue.SimpleQueue] = {address: queue.SimpleQueue() for address in services}
        self._threads = [
            threading.Thread(target=self._serve, args=(address, service), name=f"fake-worker-{address}", daemon=True)
            for address, service in services.items()
        ]
        for thread in self._threads:
            thread.start()

    def __call__(self, task: Task, address: str) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        with self._lock:
            self.sent.append((task.payload, address, time.monotonic()))
        self._inboxes[address].put((future, task.payload))
        return future

    def where(self) -> list[tuple[Any, str]]:
        with self._lock:
            return [(payload, address) for payload, address, _ in self.sent]

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def release(self, answer: Callable[[Any], Any] = lambda payload: "late") -> None:
        """Answer the calls held: ``answer(payload)`` each."""
        with self._lock:
            held, self._held = self._held, []
        for future, payload in held:
            future.set_result(answer(payload))

    def stop(self) -> None:
        for inbox in self._inboxes.values():
            inbox.put(None)
        for thread in self._threads:
            thread.join(10)
        self.release()

    def _serve(self, address: str, service: float) -> None:
        inbox = self._inboxes[address]
        while (call := inbox.get()) is not None:
            future, payload = call
            time.sleep(service)
            outcome = self.answer(payload, address)
            if outcome is HANG:
                with self._lock:
                    self._held.append((future, payload))
            elif isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)


class ScriptedSetup:
    """The pool's :class:`~rpcdl.data.probes.WorkerSetup`: each revival ends with the next outcome of the
    script (a :class:`~rpcdl.data.probes.Revival`, or the exception it fails with), at once."""

    def __init__(self, outcomes: Iterator[Revival | BaseException]):
        self.outcomes = outcomes
        self.calls: list[tuple[str, BaseException | None, float]] = []

    def revive_async(self, address: str, failure: BaseException | None) -> torch.futures.Future:
        self.calls.append((address, failure, time.monotonic()))
        future: torch.futures.Future = torch.futures.Future()
        outcome = next(self.outcomes)
        if isinstance(outcome, Revival):
            future.set_result(outcome)
        else:
            future.set_exception(outcome)
        return future


def _in_flight(pool: WorkerPool) -> dict[str, int]:
    return {address: entry["in_flight"] for address, entry in pool.windows().items()}


def _advance_in_thread(dispatch: Dispatch) -> tuple[threading.Thread, list]:
    outcome: list = []

    def advance() -> None:
        try:
            outcome.append(next(dispatch))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=advance, name="test-advance")
    thread.start()
    return thread, outcome


# ---------------------------------------------------------------------------- every task once


def test_every_task_once_in_order_and_the_pool_counts_no_call_after_the_pass():
    workers = FakeWorkers({"w0:1": 0.001, "w1:2": 0.002})
    try:
        pool = WorkerPool(list(workers._inboxes), prefetch_factor=2, timeout=30.0)
        dispatch = Dispatch(pool, iter(range(50)), workers)
        assert [task.value for task in dispatch] == list(range(50))
        assert dispatch.state is PassState.CLOSED
        assert _in_flight(pool) == {"w0:1": 0, "w1:2": 0}
        out_of_order = Dispatch(pool, iter(range(50)), workers, in_order=False)
        assert sorted(task.value for task in out_of_order) == list(range(50))
    finally:
        workers.stop()


def test_late_head_task_is_copied_and_the_copy_wins():
    workers = FakeWorkers({"w0:1": 0.0, "w1:2": 0.0}, lambda payload, address: HANG if address == "w0:1" else "copy")
    try:
        pool = WorkerPool(["w0:1", "w1:2"], prefetch_factor=1, timeout=30.0)
        with pool.locked() as state:
            for slot in state.slots:
                slot.service_time = 0.01  # measured: a head task older than 3 of them is late (0.05 s at least)
        dispatch = Dispatch(pool, iter([7]), workers)
        task = next(dispatch)
        assert (task.value, task.worker) == ("copy", "w1:2")
        assert workers.where() == [(7, "w0:1"), (7, "w1:2")]
        assert workers.sent[1][2] - workers.sent[0][2] >= 0.05  # not copied before it was late
        workers.release()  # the first call answers at last: dropped
        with pytest.raises(StopIteration):
            next(dispatch)
        assert _in_flight(pool) == {"w0:1": 0, "w1:2": 0}
        assert pool.states() == {"w0:1": "active", "w1:2": "active"}
    finally:
        workers.stop()


# ---------------------------------------------------------------------------- a worker lost and rejoining


def test_lost_worker_tasks_go_elsewhere_it_is_probed_with_backoff_and_rejoins():
    failed = []

    def answer(payload: int, address: str) -> Any:
        if address == "w0:1" and not failed:
            failed.append(time.monotonic())
            return WorkerUnavailable("w0:1 went away")
        return payload

    workers = FakeWorkers({"w0:1": 0.0, "w1:2": 0.02}, answer)
    setup = ScriptedSetup(iter([WorkerUnavailable("still away"), Revival.BACK]))
    try:
        pool = WorkerPool(["w0:1", "w1:2"], prefetch_factor=1, timeout=30.0, setup=setup)
        assert [task.value for task in Dispatch(pool, iter(range(60)), workers)] == list(range(60))  # once, in order
        (first, second) = [when for _, _, when in setup.calls]
        assert first - failed[0] >= FIRST_PROBE_DELAY and second - first >= 2 * FIRST_PROBE_DELAY  # backoff
        assert [str(failure) for _, failure, _ in setup.calls] == ["w0:1 went away", "still away"]
        rejoined = [when for payload, address, when in workers.sent if address == "w0:1" and when > second]
        assert rejoined, "the worker back is given tasks again"
        assert pool.states() == {"w0:1": "active", "w1:2": "active"}
    finally:
        workers.stop()


def test_a_worker_still_running_a_call_that_timed_out_is_probed_until_it_is_free():
    def answer(payload: int, _: str) -> Any:
        return WorkerTimeout("no answer in 1s") if payload == 0 else payload

    workers = FakeWorkers({"w0:1": 0.0}, answer)
    setup = ScriptedSetup(iter([*[Revival.BUSY] * 4, Revival.BACK]))
    try:
        pool = WorkerPool(["w0:1"], prefetch_factor=1, timeout=1.0, setup=setup)
        dispatch = Dispatch(pool, iter(range(2)), workers)
        first = next(dispatch)
        assert isinstance(first.error, WorkerTimeout)  # it timed out on every worker: its result
        assert "timed out on 1 workers" in str(first.error.__notes__)
        assert next(dispatch).value == 1
        failures = [failure for _, failure, _ in setup.calls]
        assert all(isinstance(failure, WorkerTimeout) for failure in failures)  # each asked with a call queued
        assert len(failures) == 5  # asked again at once while busy, until free
        assert workers.sent[-1][2] > setup.calls[-1][2]  # the next task went to the worker once it was back
        assert pool.states() == {"w0:1": "active"}
    finally:
        workers.stop()


def test_none_left_names_every_worker_and_the_last_failure_after_the_timeout():
    workers = FakeWorkers({"w0:1": 0.0, "w1:2": 0.0}, lambda _, address: WorkerUnavailable(f"{address} refused"))
    setup = ScriptedSetup(iter(lambda: WorkerUnavailable("refused again"), 0))
    try:
        pool = WorkerPool(["w0:1", "w1:2"], prefetch_factor=1, timeout=0.3, setup=setup)
        dispatch = Dispatch(pool, iter(range(4)), workers)
        started = time.monotonic()
        with pytest.raises(NoWorkersLeft) as raised:
            next(dispatch)
        assert time.monotonic() - started >= 0.3  # not before the timeout
        message = str(raised.value)
        assert "w0:1 (down: refused again)" in message and "w1:2 (down: refused again)" in message
        assert "waited 0.3s" in message
        assert dispatch.state is PassState.CLOSED
        assert {address for address, _, _ in setup.calls} == {"w0:1", "w1:2"}  # each asked since the wait began
    finally:
        workers.stop()


# ---------------------------------------------------------------------------- the window


def test_pass_holds_at_most_the_windows_and_windows_are_visible():
    workers = FakeWorkers({"w0:1": 0.0, "w1:2": 0.0}, lambda payload, _: HANG)
    try:
        pool = WorkerPool(["w0:1", "w1:2"], prefetch_factor=2, timeout=30.0)
        with pool.locked() as state:
            local, remote = state.slots
            local.service_time = 0.01
            remote.window, remote.rtt, remote.round_trip, remote.service_time = 5, 0.05, 0.06, 0.01  # as measured
        dispatch = Dispatch(pool, iter(range(100)), workers)
        thread, outcome = _advance_in_thread(dispatch)
        eventually(lambda: len(workers.sent) >= 8, "the windows filled", interval=0.005)
        time.sleep(0.2)
        assert sorted(address for _, address in workers.where()) == ["w0:1"] * 3 + ["w1:2"] * 5
        windows = pool.windows()
        assert windows["w0:1"] == {
            "state": "active", "in_flight": 3, "window": 3, "service_time": 0.01, "rtt": None, "round_trip": None
        }  # fmt: skip
        assert windows["w1:2"] == {
            "state": "active", "in_flight": 5, "window": 5, "service_time": 0.01, "rtt": 0.05, "round_trip": 0.06
        }  # fmt: skip
        eventually(lambda: workers.held() == 8, "the calls held", interval=0.005)
        workers.release(lambda payload: payload)
        thread.join(10)
        assert outcome[0].value == 0
        assert next(dispatch).value == 1
        # Answered and not handed out still count against the windows (as measured by now: the answers
        # read while the pass waited measure the link): two handed out, so few were pulled, not eight more.
        windows = sum(entry["window"] for entry in pool.windows().values())
        assert len(workers.sent) - 2 <= windows and len(workers.sent) < 8 + 8
        dispatch.close()
        assert _in_flight(pool) == {"w0:1": 0, "w1:2": 0}
    finally:
        workers.stop()


# ---------------------------------------------------------------------------- threads


def test_a_second_thread_in_a_pass_is_refused_and_a_close_from_another_thread_ends_it():
    workers = FakeWorkers({"w0:1": 0.0}, lambda payload, _: HANG)
    try:
        pool = WorkerPool(["w0:1"], prefetch_factor=2, timeout=30.0)
        dispatch = Dispatch(pool, iter(range(10)), workers)
        thread, outcome = _advance_in_thread(dispatch)
        eventually(lambda: workers.sent, "the first call", interval=0.005)
        with pytest.raises(RuntimeError, match="already being advanced by another thread"):
            next(dispatch)
        dispatch.close()
        thread.join(10)
        assert not thread.is_alive() and isinstance(outcome[0], StopIteration)
        assert dispatch.state is PassState.CLOSED
        assert _in_flight(pool) == {"w0:1": 0}
    finally:
        workers.stop()


def test_two_threads_advance_two_passes_of_one_pool_while_a_third_drops_passes():
    workers = FakeWorkers({"w0:1": 0.0005, "w1:2": 0.001, "w2:3": 0.0})
    pool = WorkerPool(list(workers._inboxes), prefetch_factor=2, timeout=30.0)
    results: dict[str, list] = {}
    stop = threading.Event()

    def run(name: str, in_order: bool) -> None:
        values = [task.value for task in Dispatch(pool, iter(range(300)), workers, in_order=in_order)]
        results[name] = values if in_order else sorted(values)

    def drop() -> None:
        while not stop.is_set():
            dropped = Dispatch(pool, iter(range(1000)), workers)
            next(dropped)  # and dropped with its window in flight

    threads = [threading.Thread(target=run, args=(str(k), k == 0), name=f"test-pass-{k}") for k in range(2)]
    dropper = threading.Thread(target=drop, name="test-dropper")
    try:
        for thread in [*threads, dropper]:
            thread.start()
        for thread in threads:
            thread.join(20)
        stop.set()
        dropper.join(20)
        assert results == {"0": list(range(300)), "1": list(range(300))}
        assert _in_flight(pool) == {"w0:1": 0, "w1:2": 0, "w2:3": 0}
    finally:
        stop.set()
        workers.stop()


# ---------------------------------------------------------------------------- no cycles


def test_dropped_passes_are_freed_by_reference_counting_and_their_calls_let_go():
    def answer(payload: Any, address: str) -> Any:
        if address == "w1:2":
            return HANG
        return (payload, 1e-6, 0) if isinstance(payload, list) else payload  # a chunk's answer, or a plain one

    workers = FakeWorkers({"w0:1": 0.001, "w1:2": 0.0}, answer)
    pool = WorkerPool(["w0:1", "w1:2"], prefetch_factor=2, timeout=30.0)
    sizer, served = ChunkSizer(4, timeout=30.0), ServedCounts(["w0:1", "w1:2"])
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        dispatch = Dispatch(pool, iter(range(100)), workers)
        next(dispatch)
        chunked = ChunkedPass(pool, iter(range(100)), workers, sizer, served)
        next(chunked)
        references = [weakref.ref(dispatch), weakref.ref(chunked)]
        assert sum(_in_flight(pool).values()) > 0
        del dispatch, chunked
        assert [reference() for reference in references] == [None, None]  # freed at once: no cycle holds them
        assert _in_flight(pool) == {"w0:1": 0, "w1:2": 0}  # let go at the next look
        gc.collect()
        ours = (Dispatch, ChunkedPass, Task, Attempt, Answered, PassRecord, queue.SimpleQueue)
        assert [type(thing).__name__ for thing in gc.garbage if isinstance(thing, ours)] == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        workers.stop()


# ---------------------------------------------------------------------------- the pool's records, directly


class _Owner:
    """Stands for a pass: the pool keeps a weak reference to it."""


def test_the_pool_tells_other_passes_of_their_orphans_reclaims_dropped_passes_and_frees_answered_calls():
    pool = WorkerPool(["w0:1", "w1:2"], prefetch_factor=4, timeout=30.0)
    first, second = _Owner(), _Owner()
    first_events, second_events = queue.SimpleQueue(), queue.SimpleQueue()
    with pool.locked() as state:
        mine = state.open_pass(first, first_events)
        theirs = state.open_pass(second, second_events)
        calls = {
            (owner.number, worker): Attempt(0, worker, owner.number, 0.0, torch.futures.Future())
            for owner in (mine, theirs)
            for worker in (0, 1)
        }
        for attempt in calls.values():
            state.policy.sent(state.slots[attempt.worker], attempt, state.answers)
        w0 = state.slots[0]
        own = state.take_down(w0, WorkerUnavailable("gone"), mine)
        assert own == [calls[mine.number, 0]] and w0.state is WorkerState.DOWN and not w0.in_flight
    orphan = second_events.get_nowait()
    assert type(orphan) is Orphaned and orphan.attempt is calls[theirs.number, 0]
    assert orphan.attempt.state is AttemptState.ORPHANED and first_events.empty()

    calls[theirs.number, 1].future.set_result("answered for the other pass")
    with pool.locked() as state:
        state.release_answered(mine)  # the other pass is not advanced: its answered call frees its worker
        assert state.slots[1].in_flight == {calls[mine.number, 1]}
        assert state.answered(calls[theirs.number, 1], worker_failed=False)  # still its task's result
    del second
    assert _in_flight(pool) == {"w0:1": 0, "w1:2": 1}  # the dropped one reclaimed
    assert theirs.state is Registration.CLOSED and mine.state is Registration.OPEN
    with pool.locked() as state:
        state.close_pass(mine)
        assert calls[mine.number, 1].state is AttemptState.DROPPED
    assert _in_flight(pool) == {"w0:1": 0, "w1:2": 0} and mine.state is Registration.CLOSED
