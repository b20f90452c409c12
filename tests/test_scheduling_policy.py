"""The scheduler's policy, driven by hand: no process, no socket, the time from a clock the test moves.

The policy alone (:mod:`rpcdl.data.scheduling_policy`) decides on plain records;
the passes (:class:`rpcdl.data.scheduler.Dispatch`) are driven with futures that
the test completes, and an injected clock.
"""

from __future__ import annotations

import heapq
import itertools
import queue

import pytest
import torch

from rpcdl import DatasetMismatch
from rpcdl.data.scheduler import NoWorkersLeft, Task, WorkerPool, WorkerSlot, WorkerState
from rpcdl.data.scheduler_parts import FIRST_PROBE_DELAY, _Attempt, _StillBusy
from rpcdl.data.scheduling_policy import MAX_PROBE_DELAY, AllDownWatch, SchedulingPolicy
from rpcdl.errors import WorkerTimeout, WorkerUnavailable

pytestmark = pytest.mark.timeout(20)


class Clock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Calls:
    """The pool's ``call``: records each (task, worker) and returns a future the test completes."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, str, torch.futures.Future]] = []

    def __call__(self, task: Task, slot: WorkerSlot) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        self.sent.append((task.payload, slot.address, future))
        return future

    def where(self) -> list[tuple[int, str]]:
        return [(payload, address) for payload, address, _ in self.sent]

    def future(self, payload: int, address: str) -> torch.futures.Future:
        return next(f for p, a, f in self.sent if (p, a) == (payload, address) and not f.done())


def _send(policy: SchedulingPolicy, slot: WorkerSlot, now: float) -> _Attempt:
    attempt = _Attempt(Task(0, None), slot, now, queue.SimpleQueue())
    policy.sent(slot, attempt)
    return attempt


class Simulation:
    """Workers as queues: each runs ``parallel`` calls at once, ``service`` seconds each, behind a link of
    ``latency`` seconds there and back. The policy picks the workers; the pass wakes as the scheduler does."""

    def __init__(self, policy: SchedulingPolicy, workers: dict[str, tuple[float, float, int]]):
        self.policy, self.workers = policy, dict(workers)
        self.slots = [WorkerSlot(address, index) for index, address in enumerate(workers)]
        self.free_at = {address: [0.0] * parallel for address, (_, _, parallel) in workers.items()}
        self.answers: list[tuple[float, int, _Attempt]] = []
        self.order = itertools.count()
        self.served = dict.fromkeys(workers, 0)
        self.most_in_flight = dict.fromkeys(workers, 0)
        self.now = 0.0

    def run(self, tasks: int) -> None:
        while tasks or self.answers:
            slot = self.policy.pick(self.slots, self.now) if tasks else None
            if slot is not None:
                self._send(slot)
                tasks -= 1
                continue
            wake = self.now + self.policy.wait_time(self.slots, self.now, awaiting_head=True)
            self.now = min(self.answers[0][0], wake) if self.answers else wake
            while self.answers and self.answers[0][0] <= self.now:
                _, _, attempt = heapq.heappop(self.answers)
                attempt.slot.in_flight.discard(attempt)
                self.policy.observe(attempt.slot, attempt, self.now)
                self.served[attempt.slot.address] += 1

    def _send(self, slot: WorkerSlot) -> None:
        service, latency, _ = self.workers[slot.address]
        attempt = _send(self.policy, slot, self.now)
        servers = self.free_at[slot.address]
        start = max(self.now + latency / 2, heapq.heappop(servers))
        heapq.heappush(servers, start + service)
        heapq.heappush(self.answers, (start + service + latency / 2, next(self.order), attempt))
        self.most_in_flight[slot.address] = max(self.most_in_flight[slot.address], len(slot.in_flight))

    def window(self, address: str) -> int:
        return self.policy.window(next(slot for slot in self.slots if slot.address == address))


# ---------------------------------------------------------------------------- a straggler


def test_straggler_gets_fewer_tasks_and_the_fast_worker_is_preferred():
    simulation = Simulation(
        SchedulingPolicy(prefetch_factor=2, timeout=30.0), {"fast:1": (0.01, 0, 1), "slow:2": (0.2, 0, 1)}
    )
    simulation.run(200)
    served = simulation.served
    assert sum(served.values()) == 200
    assert served["fast:1"] > 5 * served["slow:2"]
    assert served["slow:2"] >= 1  # tried, not forgotten


def test_slow_idle_worker_gets_a_trial_task_after_idling():
    policy = SchedulingPolicy(prefetch_factor=2, timeout=30.0)
    fast, slow = WorkerSlot("fast:1", 0), WorkerSlot("slow:2", 1)
    fast.service_time, slow.service_time = 0.01, 0.2
    slow.last_done = slow.last_sent = 10.0
    assert policy.pick([fast, slow], now=10.0) is fast
    _send(policy, fast, 10.0), _send(policy, fast, 10.0)  # the fast worker's window is full
    assert policy.pick([fast, slow], now=10.1) is None  # the slow one would finish later than waiting: wait
    assert policy.pick([fast, slow], now=10.3) is slow  # idle longer than its service time: a trial


# ---------------------------------------------------------------------------- a hedge won by the copy


def test_late_head_task_is_copied_and_the_copy_wins():
    clock, calls = Clock(), Calls()
    pool = WorkerPool(["w0:1", "w1:2"], prefetch_factor=1, timeout=30.0, clock=clock)
    for slot in pool.slots:
        slot.service_time = 0.1
    dispatch = pool.start(iter([7]), calls)
    dispatch._dispatch()
    assert calls.where() == [(7, "w0:1")]
    clock.advance(0.29)
    dispatch._dispatch()
    assert calls.where() == [(7, "w0:1")]  # not late yet: under 3 service times
    clock.advance(0.02)
    dispatch._dispatch()
    assert calls.where() == [(7, "w0:1"), (7, "w1:2")]  # late: a copy on the other worker

    calls.future(7, "w1:2").set_result("from the copy")
    task = next(dispatch)
    assert (task.value, task.worker) == ("from the copy", "w1:2")
    calls.future(7, "w0:1").set_result("late")
    with pytest.raises(StopIteration):
        next(dispatch)
    assert pool.served == {"w0:1": 0, "w1:2": 1}  # the late answer is dropped
    assert all(not slot.in_flight for slot in pool.slots)
    assert pool.states() == {"w0:1": "active", "w1:2": "active"}


def test_hedge_policy_copies_only_once():
    policy = SchedulingPolicy(prefetch_factor=2, timeout=30.0)
    slots = [WorkerSlot("w0:1", 0), WorkerSlot("w1:2", 1)]
    for slot in slots:
        slot.service_time = 0.1
    head = Task(0, None)
    first = _send(policy, slots[0], 0.0)
    head.attempts.append(first)
    assert policy.hedge(head, slots, now=0.2) is None
    assert policy.hedge(head, slots, now=0.5) is slots[1]
    head.attempts.append(_send(policy, slots[1], 0.5))
    assert policy.hedge(head, slots, now=5.0) is None  # two live attempts: no third


# ---------------------------------------------------------------------------- a worker lost and rejoining


class Probes(list):
    """The futures of the probes the pool started, completed by the test."""

    def revive(self, slot: WorkerSlot) -> torch.futures.Future:
        self.append(torch.futures.Future())
        return self[-1]


def test_lost_worker_tasks_go_elsewhere_probed_with_backoff_and_it_rejoins():
    clock, calls, probes = Clock(), Calls(), Probes()
    pool = WorkerPool(["w0:1", "w1:2"], prefetch_factor=1, timeout=30.0, revive=probes.revive, clock=clock)
    dispatch = pool.start(iter(range(4)), calls)
    dispatch._dispatch()
    assert calls.where() == [(0, "w0:1"), (1, "w1:2")]

    calls.future(0, "w0:1").set_exception(WorkerUnavailable("w0:1 went away"))
    dispatch._handle_events(wait=False)
    assert pool.states()["w0:1"] == "down"
    w0 = pool.slots[0]
    assert w0.probe_at == pytest.approx(clock() + FIRST_PROBE_DELAY)
    calls.future(1, "w1:2").set_result(1)
    dispatch._handle_events(wait=False)
    dispatch._dispatch()
    assert calls.where()[2] == (0, "w1:2")  # retried elsewhere, before the next new task

    dispatch._probe_due()
    assert probes == []  # not due yet
    clock.advance(FIRST_PROBE_DELAY)
    dispatch._probe_due()
    assert len(probes) == 1 and pool.states()["w0:1"] == "probing"
    probes[0].set_exception(WorkerUnavailable("still away"))
    dispatch._handle_events(wait=False)
    assert pool.states()["w0:1"] == "down"
    assert w0.probe_at == pytest.approx(clock() + 2 * FIRST_PROBE_DELAY)  # backoff
    clock.advance(2 * FIRST_PROBE_DELAY)
    dispatch._probe_due()
    probes[1].set_result(0.001)
    dispatch._handle_events(wait=False)
    assert pool.states()["w0:1"] == "active" and w0.probe_delay == FIRST_PROBE_DELAY

    results = []
    calls.future(0, "w1:2").set_result(0)
    results.append(next(dispatch).value)
    results.append(next(dispatch).value)  # task 1, done before
    for payload in (2, 3):
        address = next(a for p, a in calls.where() if p == payload)
        calls.future(payload, address).set_result(payload)
        results.append(next(dispatch).value)
    assert results == [0, 1, 2, 3]  # every task once, in order
    assert "w0:1" in {address for _, address in calls.where()[3:]}  # the rejoined worker is given tasks
    with pytest.raises(StopIteration):
        next(dispatch)


def test_a_worker_still_running_a_call_that_timed_out_is_probed_until_it_is_free():
    clock, calls, probes = Clock(), Calls(), Probes()
    pool = WorkerPool(["w0:1"], prefetch_factor=1, timeout=1.0, revive=probes.revive, clock=clock)
    dispatch = pool.start(iter(range(2)), calls)
    dispatch._dispatch()
    calls.future(0, "w0:1").set_exception(WorkerTimeout("w0:1 did not answer within 1s"))
    dispatch._handle_events(wait=False)
    assert pool.states()["w0:1"] == "down"
    clock.advance(FIRST_PROBE_DELAY)
    dispatch._probe_due()
    for attempt in range(1, 5):  # alive, but still running the call: asked again at once, the pass waits
        probes[-1].set_exception(_StillBusy("still running calls"))
        clock.advance(1.0)
        dispatch._handle_events(wait=False)
        assert len(probes) == attempt + 1 and pool.states()["w0:1"] == "probing"
    probes[-1].set_result(None)
    dispatch._handle_events(wait=False)
    assert pool.states()["w0:1"] == "active"
    assert isinstance(next(dispatch).error, WorkerTimeout)  # it timed out on every worker: its result
    dispatch._dispatch()
    assert calls.where()[1:] == [(1, "w0:1")]  # the next task, to the worker back
    calls.future(1, "w0:1").set_result(1)
    assert next(dispatch).value == 1


def test_probe_backoff_is_capped_and_a_deterministic_failure_excludes():
    policy = SchedulingPolicy(prefetch_factor=2, timeout=30.0)
    slot = WorkerSlot("w0:1", 0)
    policy.take_down(slot, WorkerUnavailable("gone"), now=0.0)
    now = 0.0
    for _ in range(10):
        now = slot.probe_at
        assert policy.probes_due([slot], now) == [slot]
        assert policy.probe_ended(slot, WorkerUnavailable("still gone"), now) == WorkerState.DOWN
    assert slot.probe_at - now == pytest.approx(MAX_PROBE_DELAY)
    assert policy.probes_due([slot], slot.probe_at) == [slot]
    assert policy.probe_ended(slot, DatasetMismatch("another dataset"), now) == WorkerState.EXCLUDED
    assert policy.take_down(slot, WorkerUnavailable("gone"), now) == []
    assert slot.state == WorkerState.EXCLUDED


# ---------------------------------------------------------------------------- none left


def test_none_left_names_every_worker_and_the_last_failure_after_the_timeout():
    clock, calls = Clock(), Calls()
    pool = WorkerPool(["w0:1", "w1:2"], prefetch_factor=1, timeout=5.0, clock=clock)
    dispatch = pool.start(iter(range(2)), calls)
    dispatch._dispatch()
    calls.future(0, "w0:1").set_exception(WorkerUnavailable("w0:1 refused the connection"))
    calls.future(1, "w1:2").set_exception(WorkerTimeout("w1:2 did not answer"))
    dispatch._handle_events(wait=False)  # both down: the wait begins
    clock.advance(4.99)
    dispatch._handle_events(wait=False)  # never before the timeout
    first, second = pool.slots
    assert pool.policy.probes_due([first], clock()) == [first]
    pool.policy.probe_ended(first, WorkerUnavailable("w0:1 refused the connection"), clock())
    clock.advance(0.01)
    dispatch._handle_events(wait=False)  # nor before each worker was asked again since: w1:2 was not
    assert pool.policy.probes_due([second], clock()) == [second]
    pool.policy.probe_ended(second, WorkerUnavailable("w1:2 refused the connection too"), clock())
    with pytest.raises(NoWorkersLeft) as raised:
        dispatch._handle_events(wait=False)
    message = str(raised.value)
    assert "w0:1 (down: w0:1 refused the connection)" in message
    assert "w1:2 (down: w1:2 refused the connection too)" in message
    assert "waited 5s" in message
    assert dispatch.closed


def test_none_left_watch_resets_when_one_comes_back_waits_for_a_probe_of_each_and_gives_up_at_once_when_none_can():
    watch = AllDownWatch(timeout=5.0)
    slots = [WorkerSlot("w0:1", 0), WorkerSlot("w1:2", 1)]
    slots[0].state = slots[1].state = WorkerState.DOWN
    assert watch.check(slots, now=0.0) is None
    slots[1].state = WorkerState.ACTIVE
    assert watch.check(slots, now=4.0) is None
    slots[1].state = WorkerState.DOWN
    assert watch.check(slots, now=8.0) is None  # the wait starts again
    slots[0].state = WorkerState.PROBING
    assert watch.check(slots, now=30.0) is None  # a probe in flight ends by its own timeout
    slots[0].state, slots[0].probes = WorkerState.DOWN, 1
    assert watch.check(slots, now=12.9) is None
    assert watch.check(slots, now=13.0) is None  # w1:2 was taken out and not asked since
    slots[1].probes = 1
    assert watch.check(slots, now=13.0) is not None
    excluded = [WorkerSlot("w2:3", 0)]
    excluded[0].state, excluded[0].failure = WorkerState.EXCLUDED, DatasetMismatch("another dataset")
    assert "w2:3 (excluded: another dataset)" in AllDownWatch(timeout=5.0).check(excluded, now=0.0)


def test_none_left_watch_starts_again_after_a_rejoin_it_did_not_see():
    """Both workers come back and are taken out again between two checks: the probes that brought them
    back are no answer to the new wait (a mapper's pass gave up so under load, its workers busy for a moment)."""
    policy, watch = SchedulingPolicy(prefetch_factor=2, timeout=0.5), AllDownWatch(timeout=0.5)
    slots = [WorkerSlot("w0:1", 0), WorkerSlot("w1:2", 1)]
    for slot in slots:
        policy.take_down(slot, WorkerTimeout("did not answer within 0.5s"), now=0.0)
    assert watch.check(slots, now=0.0) is None
    for slot in slots:  # each is probed, comes back, and times out again, all before the next check
        slot.state = WorkerState.PROBING
        assert policy.probe_ended(slot, None, now=0.8) is WorkerState.ACTIVE
        policy.take_down(slot, WorkerTimeout("did not answer within 0.5s"), now=1.4)
    assert watch.check(slots, now=1.5) is None  # the wait began again: not 1.5 s old, and none asked since
    assert watch.check(slots, now=2.1) is None  # past the timeout, but none asked since
    for slot in slots:
        slot.state = WorkerState.PROBING
        policy.probe_ended(slot, WorkerUnavailable("refused"), now=2.2)
    assert watch.check(slots, now=2.2) is not None


# ---------------------------------------------------------------------------- the adaptive window


@pytest.mark.parametrize(
    ("service", "latency", "parallel", "windows"),
    [
        (0.01, 0.0, 1, {2}),  # loopback, one call at a time: one runs, one waits, the worker never idles
        (0.01, 0.08, 1, {9, 10, 11}),  # the round trip covers 9 service times
        (0.04, 0.0, 4, {4, 5, 6}),  # four calls run at once
    ],
)
def test_window_follows_the_bandwidth_delay_product_within_the_bound(service, latency, parallel, windows):
    policy = SchedulingPolicy(prefetch_factor=2, timeout=30.0, max_window=16)
    workers = {f"w{index}:1": (service, latency, parallel) for index in range(2)}
    simulation = Simulation(policy, workers)
    assert [policy.window(slot) for slot in simulation.slots] == [1, 1]  # until the first answer
    simulation.run(2000)
    assert {simulation.window(address) for address in workers} <= windows
    assert all(most <= 16 for most in simulation.most_in_flight.values())


def test_window_is_capped_and_shrinks_when_the_link_slows_down():
    policy = SchedulingPolicy(prefetch_factor=2, timeout=30.0)
    simulation = Simulation(policy, {"remote:1": (0.01, 0.5, 1)})
    simulation.run(500)
    assert simulation.window("remote:1") == policy.max_window == 8  # 4 * prefetch_factor at most
    assert simulation.most_in_flight["remote:1"] <= 8
    simulation.workers["remote:1"] = (0.5, 0.5, 1)  # now the worker is the bottleneck: calls wait there
    simulation.run(40)
    assert simulation.window("remote:1") <= 3
    assert policy.pass_window(simulation.slots) == simulation.window("remote:1")
    simulation.slots[0].state = WorkerState.DOWN
    assert policy.pass_window(simulation.slots) == 2  # none active: prefetch_factor


def test_window_stays_between_prefetch_factor_and_its_maximum():
    policy = SchedulingPolicy(prefetch_factor=3, timeout=30.0, max_window=10)
    slot = WorkerSlot("w0:1", 0)
    assert policy.window(slot) == 1  # not measured yet: one call, to measure the round trip with no wait
    slot.service_time = 0.01
    for window in (None, 0, 1, 3, 7, 10, 11, 100):
        slot.window = window
        assert 3 <= policy.window(slot) <= 10


def test_answers_read_late_do_not_change_the_window():
    policy = SchedulingPolicy(prefetch_factor=2, timeout=30.0)
    slot = WorkerSlot("w0:1", 0)
    first = _send(policy, slot, 0.0)
    slot.in_flight.clear()
    policy.observe(slot, first, 0.01)
    assert slot.rtt is None  # the first answer paid for the connection's set-up
    attempts = [_send(policy, slot, 0.01) for _ in range(2)]
    slot.in_flight.clear()
    for attempt in attempts:
        policy.observe(slot, attempt, 5.0, measure_link=False)  # the consumer was busy for 5 s
    assert (slot.rtt, slot.round_trip, slot.window) == (None, None, None)
    assert policy.window(slot) == 2
    late = _send(policy, slot, 5.0)
    slot.in_flight.clear()
    policy.observe(slot, late, 5.02)  # read as it came: measured
    assert slot.rtt == pytest.approx(0.02)


def test_pass_holds_at_most_the_windows_and_windows_are_visible():
    clock, calls = Clock(), Calls()
    pool = WorkerPool(["w0:1", "w1:2"], prefetch_factor=2, timeout=30.0, clock=clock)
    local, remote = pool.slots
    local.service_time = 0.01
    remote.window, remote.rtt, remote.round_trip, remote.service_time = 5, 0.05, 0.06, 0.01  # as measured
    dispatch = pool.start(iter(range(100)), calls)
    dispatch._dispatch()
    assert len(dispatch._outstanding) == 7
    assert sorted(address for _, address in calls.where()) == ["w0:1"] * 2 + ["w1:2"] * 5
    windows = pool.windows()
    assert windows["w0:1"] == {
        "state": "active", "in_flight": 2, "window": 2, "service_time": 0.01, "rtt": None, "round_trip": None
    }  # fmt: skip
    assert windows["w1:2"] == {
        "state": "active", "in_flight": 5, "window": 5, "service_time": 0.01, "rtt": 0.05, "round_trip": 0.06
    }  # fmt: skip
    for payload, _, future in calls.sent:
        future.set_result(payload)
    assert next(dispatch).value == 0
    dispatch._handle_events(wait=False)
    dispatch._dispatch()
    assert len(dispatch._outstanding) == 7  # answers not handed out count: nothing more is pulled
    dispatch.close()
