"""The scheduler's policy, driven by hand: no process, no socket, the time given by the test.

The policy (:mod:`rpcdl.data.scheduling_policy`) decides on plain records
(:mod:`rpcdl.data.records`); the passes that act on its decisions are tested in
test_passes.py.
"""

from __future__ import annotations

import heapq
import itertools

import pytest
import torch

from rpcdl import DatasetMismatch
from rpcdl.data.probes import Revival
from rpcdl.data.records import Attempt, AttemptState, Task, WorkerSlot, WorkerState
from rpcdl.data.scheduling_policy import (
    DEFAULT_DRAIN_WAIT,
    DRAIN_MARGIN,
    MAX_PROBE_DELAY,
    MIN_WINDOW,
    AllDownWatch,
    SchedulingPolicy,
)
from rpcdl.errors import WorkerLeaving, WorkerTimeout, WorkerUnavailable

pytestmark = pytest.mark.timeout(20)


def _send(policy: SchedulingPolicy, slot: WorkerSlot, now: float) -> Attempt:
    attempt = Attempt(0, slot.index, 1, now, torch.futures.Future())
    policy.sent(slot, attempt)
    return attempt


class Simulation:
    """Workers as queues: each runs ``parallel`` calls at once, ``service`` seconds each, behind a link of
    ``latency`` seconds there and back. The policy picks the workers; the pass wakes as the scheduler does."""

    def __init__(self, policy: SchedulingPolicy, workers: dict[str, tuple[float, float, int]]):
        self.policy, self.workers = policy, dict(workers)
        self.slots = [WorkerSlot(address, index) for index, address in enumerate(workers)]
        self.free_at = {address: [0.0] * parallel for address, (_, _, parallel) in workers.items()}
        self.answers: list[tuple[float, int, Attempt]] = []
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
                slot = self.slots[attempt.worker]
                slot.in_flight.discard(attempt)
                self.policy.observe(slot, attempt, self.now)
                self.served[slot.address] += 1

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
    for _ in range(policy.window(fast)):  # the fast worker's window is full
        _send(policy, fast, 10.0)
    assert policy.pick([fast, slow], now=10.1) is None  # the slow one would finish later than waiting: wait
    assert policy.pick([fast, slow], now=10.3) is slow  # idle longer than its service time: a trial


# ---------------------------------------------------------------------------- a hedge won by the copy


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


@pytest.mark.parametrize("window", [None, 6])  # MIN_WINDOW (3), and a window grown for a long round trip
def test_a_head_that_waited_behind_a_full_window_is_not_late(window):
    policy = SchedulingPolicy(prefetch_factor=2, timeout=30.0)
    busy, idle = WorkerSlot("w0:1", 0), WorkerSlot("w1:2", 1)
    busy.service_time = idle.service_time = 0.1
    busy.window = window
    full = policy.window(busy)
    head = Task(0, None)
    head.attempts.append(_send(policy, busy, 0.0))  # sent last, into a full window: it runs after the others
    for _ in range(full - 1):
        _send(policy, busy, 0.0)
    assert policy.hedge(head, [busy, idle], now=full * 0.1 - 0.01) is None  # as long as the window explains
    assert policy.hedge(head, [busy, idle], now=(full + 1) * 0.1 - 0.01) is None  # within one service time more
    assert policy.hedge(head, [busy, idle], now=(full + 1) * 0.1 + 0.01) is idle  # later: a copy


# ---------------------------------------------------------------------------- a worker lost and rejoining


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


def test_a_worker_taken_down_orphans_its_calls_and_a_busy_one_is_probed_again_at_once():
    policy = SchedulingPolicy(prefetch_factor=2, timeout=30.0)
    slot = WorkerSlot("w0:1", 0)
    calls = [_send(policy, slot, 0.0), _send(policy, slot, 0.0)]
    assert set(policy.take_down(slot, WorkerTimeout("no answer"), now=1.0)) == set(calls)
    assert not slot.in_flight and all(call.state is AttemptState.ORPHANED and not call.live for call in calls)
    assert policy.probes_due([slot], now=1.0 + slot.probe_delay / 2) == [slot]  # the first delay, not the doubled
    assert policy.probe_ended(slot, Revival.BUSY, now=2.0) is WorkerState.PROBING
    assert isinstance(slot.failure, WorkerTimeout)  # what took it out: its next probe queues a call again
    assert policy.probe_ended(slot, Revival.BACK, now=3.0) is WorkerState.ACTIVE
    assert (slot.service_time, slot.window) == (None, None)  # measured afresh


# ---------------------------------------------------------------------------- none left


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
        assert policy.probe_ended(slot, Revival.BACK, now=0.8) is WorkerState.ACTIVE
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
        (0.01, 0.0, 1, {MIN_WINDOW}),  # loopback, one call at a time: its floor (it never idles)
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


def test_a_worker_shared_with_a_busier_client_keeps_a_call_of_ours_waiting_there():
    # prefetch_factor=1 on a worker whose other client's calls take 8 times as long as ours: each round trip of
    # ours waits behind one of theirs, which looks like calls of ours queued there. With one call in flight none
    # of ours would wait at the worker while its answer travels back, and its fair queue would give the turn away.
    policy = SchedulingPolicy(prefetch_factor=1, timeout=30.0)
    slot = WorkerSlot("shared:1", 0)
    first = _send(policy, slot, 0.0)
    slot.in_flight.clear()
    policy.observe(slot, first, 0.01)  # set-up: not measured
    quick = _send(policy, slot, 0.01)
    slot.in_flight.clear()
    policy.observe(slot, quick, 0.014)  # the other client was idle: 4 ms, no wait
    now = 0.014
    for _ in range(40):
        attempts = [_send(policy, slot, now) for _ in range(policy.window(slot))]
        for attempt in attempts:
            now += 0.036  # behind one of the other client's 32 ms calls
            slot.in_flight.discard(attempt)
            policy.observe(slot, attempt, now)
        assert policy.window(slot) == MIN_WINDOW
    assert policy.min_window == MIN_WINDOW == 3
    assert SchedulingPolicy(prefetch_factor=1, timeout=30.0, max_window=1).min_window == 1  # a bound asked for


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
    assert policy.window(slot) == MIN_WINDOW
    late = _send(policy, slot, 5.0)
    slot.in_flight.clear()
    policy.observe(slot, late, 5.02)  # read as it came: measured
    assert slot.rtt == pytest.approx(0.02)


def test_a_leaving_worker_takes_no_task_and_its_calls_are_awaited_until_its_drain_timeout():
    policy = SchedulingPolicy(prefetch_factor=2, timeout=120.0)
    leaving, other = WorkerSlot("a:1", 0), WorkerSlot("b:2", 1)
    slots = [leaving, other]
    first, second = _send(policy, leaving, 0.0), _send(policy, leaving, 0.0)
    notice = WorkerLeaving("a:1 is leaving", "a:1")
    assert policy.drain(leaving, notice, now=1.0, seconds=10.0)
    assert not policy.drain(leaving, notice, now=1.5, seconds=10.0)  # once
    assert leaving.state is WorkerState.DRAINING and leaving.drain_until == 11.0 + DRAIN_MARGIN
    assert policy.pick(slots, now=1.0) is other and policy.pick(slots, 1.0, anyone=True) is other
    assert first.live and second.live  # nothing orphaned: they are awaited
    assert policy.wait_time([leaving], now=1.0, awaiting_head=False) == pytest.approx(0.5)
    assert policy.wait_time([leaving], now=10.9 + DRAIN_MARGIN, awaiting_head=False) == pytest.approx(0.1)
    assert policy.drains_ended(slots, now=5.0) == ([], [])
    watch = AllDownWatch(timeout=0.0)
    assert watch.check([leaving], now=5.0) is None  # its calls may still answer
    leaving.in_flight.discard(first)
    assert policy.drains_ended(slots, now=20.0) == ([], [leaving])  # past its time with a call left: take out
    leaving.in_flight.discard(second)
    assert policy.drains_ended(slots, now=20.0) == ([leaving], [])  # none left: down, probed later
    assert leaving.state is WorkerState.DOWN and leaving.probe_at > 20.0
    unsaid = WorkerSlot("c:3", 2)
    assert policy.drain(unsaid, notice, now=0.0, seconds=None)
    assert unsaid.drain_until == DEFAULT_DRAIN_WAIT + DRAIN_MARGIN
    task = Task(0, None)
    task.timeouts = 1
    assert policy.gives_up(task, [unsaid, other])  # a leaving worker cannot serve it


def test_a_worker_whose_calls_were_let_go_unanswered_stays_silent_across_passes():
    """A stopped worker whose calls are all answered by copies elsewhere, and dropped as each pass ends, is
    still found hung: its silence counts from its oldest unanswered call, not from the newest pass's."""
    policy = SchedulingPolicy(prefetch_factor=2, timeout=30.0)
    stopped, other = WorkerSlot("w0:1", 0), WorkerSlot("w1:2", 1)
    for slot in (stopped, other):
        slot.state, slot.service_time = WorkerState.ACTIVE, 0.01
    old = _send(policy, stopped, now=0.0)
    policy.let_go(stopped, old)  # its pass ended; nothing was answered there
    assert not stopped.in_flight and stopped.unanswered_since == 0.0
    _send(policy, stopped, now=0.9)  # the next pass's call
    hung = policy.hung([stopped, other], now=1.2, answers=10)
    assert [slot for slot, _ in hung] == [stopped]  # silent since 0.0, while the others answered 10 calls
    answered = _send(policy, other, now=1.2)
    policy.observe(other, answered, now=1.3, answers=11)
    assert other.unanswered_since == float("inf")
