"""The scheduler's policy, driven by hand: no process, no socket, the time from a clock the test moves.

The policy alone (:mod:`rpcdl.scheduling_policy`) decides on plain records;
the passes (:class:`rpcdl.scheduler.Dispatch`) are driven with futures that
the test completes, and an injected clock.
"""

from __future__ import annotations

import heapq
import itertools
import queue

import pytest
import torch

from rpcdl import DatasetMismatch
from rpcdl.errors import WorkerTimeout, WorkerUnavailable
from rpcdl.scheduler import NoWorkersLeft, Task, WorkerPool, WorkerSlot, WorkerState
from rpcdl.scheduler_parts import FIRST_PROBE_DELAY, _Attempt
from rpcdl.scheduling_policy import MAX_PROBE_DELAY, AllDownWatch, SchedulingPolicy

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
    slot.in_flight.add(attempt)
    slot.last_sent = now
    return attempt


def _simulate(policy: SchedulingPolicy, durations: dict[str, float], tasks: int) -> dict[str, int]:
    """Run ``tasks`` tasks on serial workers taking ``durations`` seconds each; return tasks per worker."""
    slots = [WorkerSlot(address, index) for index, address in enumerate(durations)]
    free_at = dict.fromkeys(durations, 0.0)
    done: list[tuple[float, int, _Attempt]] = []
    order = itertools.count()
    served = dict.fromkeys(durations, 0)
    now, left = 0.0, tasks
    while left or done:
        slot = policy.pick(slots, now) if left else None
        if slot is not None:
            attempt = _send(policy, slot, now)
            free_at[slot.address] = max(now, free_at[slot.address]) + durations[slot.address]
            heapq.heappush(done, (free_at[slot.address], next(order), attempt))
            left -= 1
            continue
        # Nothing to send: wait for the next answer, or a trial falls due (the pass wakes at least this often).
        now = min(done[0][0], now + policy.wait_time(slots, now, awaiting_head=True)) if done else now + 0.01
        while done and done[0][0] <= now:
            _, _, attempt = heapq.heappop(done)
            attempt.slot.in_flight.discard(attempt)
            policy.observe(attempt.slot, attempt, now)
            served[attempt.slot.address] += 1
    return served


# ---------------------------------------------------------------------------- a straggler


def test_straggler_gets_fewer_tasks_and_the_fast_worker_is_preferred():
    policy = SchedulingPolicy(prefetch_factor=2, timeout=30.0)
    served = _simulate(policy, {"fast:1": 0.01, "slow:2": 0.2}, tasks=200)
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


def test_lost_worker_tasks_go_elsewhere_probed_with_backoff_and_it_rejoins():
    clock, calls = Clock(), Calls()
    probes: list[torch.futures.Future] = []

    def revive(slot: WorkerSlot) -> torch.futures.Future:
        probes.append(torch.futures.Future())
        return probes[-1]

    pool = WorkerPool(["w0:1", "w1:2"], prefetch_factor=1, timeout=30.0, revive=revive, clock=clock)
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
    clock.advance(0.01)
    with pytest.raises(NoWorkersLeft) as raised:
        dispatch._handle_events(wait=False)
    message = str(raised.value)
    assert "w0:1 (down: w0:1 refused the connection)" in message
    assert "w1:2 (down: w1:2 did not answer)" in message
    assert "waited 5s" in message
    assert dispatch.closed


def test_none_left_watch_resets_when_one_comes_back_and_gives_up_at_once_when_none_can():
    watch = AllDownWatch(timeout=5.0)
    slots = [WorkerSlot("w0:1", 0), WorkerSlot("w1:2", 1)]
    slots[0].state = slots[1].state = WorkerState.DOWN
    assert watch.check(slots, now=0.0) is None
    slots[1].state = WorkerState.ACTIVE
    assert watch.check(slots, now=4.0) is None
    slots[1].state = WorkerState.PROBING
    assert watch.check(slots, now=8.0) is None  # the wait starts again
    assert watch.check(slots, now=12.9) is None
    assert watch.check(slots, now=13.0) is not None
    excluded = [WorkerSlot("w2:3", 0)]
    excluded[0].state, excluded[0].failure = WorkerState.EXCLUDED, DatasetMismatch("another dataset")
    assert "w2:3 (excluded: another dataset)" in AllDownWatch(timeout=5.0).check(excluded, now=0.0)


# ---------------------------------------------------------------------------- the adaptive window


def _measure(policy: SchedulingPolicy, slot: WorkerSlot, rtt: float, interval: float) -> None:
    """An idle call answered after ``rtt``, then a busy stretch with answers ``interval`` apart."""
    now = 0.0
    idle = _send(policy, slot, now)
    pipelined = [_send(policy, slot, now) for _ in range(20)]
    slot.in_flight.clear()
    now += rtt
    policy.observe(slot, idle, now)
    for attempt in pipelined:
        now += interval
        policy.observe(slot, attempt, now)


def test_long_latency_link_gets_a_larger_window_than_loopback_within_the_bound():
    policy = SchedulingPolicy(prefetch_factor=2, timeout=30.0)
    loopback, remote = WorkerSlot("127.0.0.1:1", 0), WorkerSlot("10.0.0.2:1", 1)
    assert policy.window(loopback) == 2  # not measured yet: prefetch_factor
    _measure(policy, loopback, rtt=0.0105, interval=0.01)
    _measure(policy, remote, rtt=0.05, interval=0.01)
    assert policy.window(loopback) == 2
    assert policy.window(remote) == 5
    assert policy.pass_window([loopback, remote]) == 7
    far = WorkerSlot("10.0.0.3:1", 2)
    _measure(policy, far, rtt=1.0, interval=0.001)
    assert policy.window(far) == policy.max_window == 8  # 4 * prefetch_factor at most
    far.state = WorkerState.DOWN
    assert policy.pass_window([loopback, remote, far]) == 7  # only active workers count


def test_window_stays_between_prefetch_factor_and_its_maximum():
    policy = SchedulingPolicy(prefetch_factor=3, timeout=30.0, max_window=10)
    slot = WorkerSlot("w0:1", 0)
    for rtt in (0.0, 1e-6, 0.001, 0.1, 10.0):
        for interval in (0.0, 1e-6, 0.001, 0.1, 10.0):
            slot.rtt, slot.interval = rtt, interval
            assert 3 <= policy.window(slot) <= 10


def test_answers_read_late_do_not_grow_the_window():
    policy = SchedulingPolicy(prefetch_factor=2, timeout=30.0)
    slot = WorkerSlot("w0:1", 0)
    attempt = _send(policy, slot, 0.0)
    slot.in_flight.clear()
    policy.observe(slot, attempt, 5.0, measure_link=False)  # the consumer was busy for 5 s
    assert (slot.rtt, slot.interval, slot.service_time) == (None, None, 5.0)
    assert policy.window(slot) == 2


def test_pass_holds_at_most_the_windows_and_windows_are_visible():
    clock, calls = Clock(), Calls()
    pool = WorkerPool(["w0:1", "w1:2"], prefetch_factor=2, timeout=30.0, clock=clock)
    _measure(pool.policy, pool.slots[1], rtt=0.05, interval=0.01)  # a long link: window 5
    dispatch = pool.start(iter(range(100)), calls)
    dispatch._dispatch()
    assert len(dispatch._outstanding) == 7
    assert sorted(address for _, address in calls.where()) == ["w0:1"] * 2 + ["w1:2"] * 5
    windows = pool.windows()
    assert windows["w0:1"] == {
        "state": "active", "in_flight": 2, "window": 2, "service_time": None, "interval": None, "rtt": None
    }  # fmt: skip
    assert windows["w1:2"]["window"] == 5 and windows["w1:2"]["in_flight"] == 5
    assert windows["w1:2"]["rtt"] == pytest.approx(0.05)
    dispatch.close()
