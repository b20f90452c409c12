"""The scheduler's decisions, as plain functions of the workers' and tasks' records and the time.

:class:`~rpcdl.data.scheduler.Dispatch` and :class:`~rpcdl.data.worker_pool.WorkerPool`
do the I/O (calls, futures, queues, logging); they ask a
:class:`SchedulingPolicy` what to do. Nothing here reads a clock, sleeps,
sends or waits: the time is an argument (``now``, from the pool's injected
clock), so the policy can be driven by hand. The policy updates the records it
is given (:class:`~rpcdl.data.records.WorkerSlot` holds a worker's state,
estimates and probe schedule) and returns decisions: which worker, which task
to copy where, which calls to retry, which probes are due, whether no worker
is left and what to report.

Threading: no thread, no lock of its own. A :class:`SchedulingPolicy` does not
change after it is made; the records it reads and updates belong to their
pool's lock, which its caller holds (see :mod:`rpcdl.data.worker_pool`). An
:class:`AllDownWatch` belongs to the thread advancing its pass.

Invariants, between any two steps of the threads advancing passes (each step
holds the pool's lock):

1. A worker is in exactly one :class:`~rpcdl.data.records.WorkerState`;
   only an ``ACTIVE`` worker is given tasks.
2. A worker is sent a call only while it has fewer than its
   :meth:`SchedulingPolicy.window` in flight, and
   ``min_window <= window <= max_window`` (1 until its first answer), where
   ``min_window`` is ``prefetch_factor``, or ``MIN_WINDOW`` (3) if larger.
3. A pass pulls a task from its source only while it holds fewer than
   :meth:`SchedulingPolicy.pass_window` pulled and not handed out (the active
   workers' windows together), so the client holds at most
   ``max_window`` answers per worker: the memory bound.
4. A task has at most two live calls (one and a copy; a failed call is
   retried only when none is live); one answer is accepted, later ones are
   dropped.
5. A ``DOWN`` worker has a probe time; each failed probe doubles its delay, up
   to ``MAX_PROBE_DELAY`` (5 s); rejoining resets it and the worker's estimates.
6. An ``EXCLUDED`` worker (a deterministic failure) never comes back.
7. "No worker left" is decided only when none is active, none is being
   probed (a worker alive but still running calls that timed out stays
   ``PROBING`` until they end), and either none can come back or ``timeout``
   seconds have passed since one was active.
8. While one of this client's own workers (``preferred``) is active, only
   own workers are given new tasks; the others' take tasks, and copies of
   late ones, when none of its own is. The others' wait in reserve
   (``STANDBY``: no slot scanned per batch, no connection) until the client
   waits for data with none of its own active: then they are called one at a
   time (:meth:`SchedulingPolicy.wants_standby`), the next only once the one
   before was set up (or failed) and, while one serves, only after
   ``STANDBY_GROW_AFTER`` seconds more of waiting. One idle for
   ``STANDBY_IDLE`` seconds, or down while an own worker is active, goes
   back to the reserve (:meth:`SchedulingPolicy.idle_standbys`).
9. An active worker with calls in flight that has not answered for
   ``HUNG_FACTOR`` times the longer of its own and the best service
   time (at least ``HUNG_FLOOR`` seconds), while the others answered
   ``HUNG_ANSWERS`` calls meanwhile, is hung: it is taken out like a
   worker whose call timed out (:class:`~rpcdl.errors.WorkerHung`), long before ``timeout``.
   The only active worker of a client with others' workers in reserve is
   judged against its own measured service time alone (at least
   ``HUNG_ALONE_FLOOR`` seconds); a client's only worker is not judged.
10. A worker that said it is leaving (``DRAINING``) is given no new task;
    its calls in flight are awaited until ``drain_until`` (its drain timeout
    and ``DRAIN_MARGIN``), and go elsewhere only if it fails first or that
    time passes. Once none is left in flight it is ``DOWN`` (probed, as a
    worker restarted at its address may serve again).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..errors import is_transient
from ..rpc.rref import RRefNotFound
from .probes import Revival
from .records import FIRST_PROBE_DELAY, Attempt, AttemptState, Task, TaskState, WorkerSlot, WorkerState

__all__ = [
    "DEFAULT_DRAIN_WAIT",
    "DRAIN_MARGIN",
    "HEDGE_SLACK",
    "HUNG_ALONE_FLOOR",
    "HUNG_ANSWERS",
    "HUNG_FACTOR",
    "HUNG_FLOOR",
    "MAX_PROBE_DELAY",
    "MAX_WINDOW_FACTOR",
    "MIN_WINDOW",
    "SLOW_FACTOR",
    "STANDBY_GROW_AFTER",
    "STANDBY_IDLE",
    "AllDownWatch",
    "SchedulingPolicy",
    "active",
    "any_active",
    "is_worker_failure",
    "own_active",
]

#: Service times past a full window: a head task older than its worker's window plus this many (of the best
#: worker's service time) gets a copy elsewhere. Sent to a worker with a full window, it waited behind the
#: others before running, which is no lateness.
HEDGE_SLACK = 1.0
SLOW_FACTOR = 2.0  # a worker expected to finish later than this times the best is passed over
MIN_HEDGE_AGE = 0.05
MAX_PROBE_DELAY = 5.0
IDLE_WAIT = 0.5
MAX_WINDOW_FACTOR = 4  # the adaptive window grows to at most this times prefetch_factor
#: Calls in flight per measured worker at least, whatever ``prefetch_factor`` says (unless ``max_window`` is
#: smaller): one runs, one waits there, and one covers the way back. The call that replaces an answer goes when
#: the consumer takes a batch, so the answer's delivery, the consumer's turn and the new call's delivery stand
#: between the two; with one call waiting, a worker idles whenever they take longer than one call runs. A worker
#: shared with other clients takes the next call from the client that used the least of its time, among those
#: with a call waiting (see :mod:`rpcdl.server.fair_queue`); a client with none waiting loses its turn.
MIN_WINDOW = 3
HUNG_FACTOR = 10.0  # silent for this many service times (its own or the best, the longer) while others answer: hung
HUNG_FLOOR = 1.0  # seconds of silence never taken for a hang, however fast the workers
HUNG_ANSWERS = 3  # answers the other workers gave during that silence (they are not all waiting on the client)
HUNG_ALONE_FLOOR = 5.0  # seconds of silence of a rank's only active worker before the reserve takes over
#: Seconds a worker of another rank, called on while none of this rank's own is active, may stay idle before it
#: goes back to the reserve (its connection is closed). Read when a policy is made: tests shorten it.
STANDBY_IDLE = 60.0
#: Seconds a rank served by others' workers only waits for data before it calls one more.
STANDBY_GROW_AFTER = 10.0
#: Seconds a leaving worker's calls in flight are awaited when its notice did not say how long it drains
#: (the default of ``rpcdl worker --drain-timeout``).
DEFAULT_DRAIN_WAIT = 30.0
#: Seconds added to a leaving worker's drain timeout: its last answers are still on their way when it ends.
DRAIN_MARGIN = 1.0
_SERVICE_WEIGHT = 0.5  # weight of a new sample in the service-time average (it follows changes fast)
_GROW_BELOW = 0.5  # calls waiting at a worker whose window was full: fewer, and the window grows by one
_LEAVE_FLOOR_BELOW = 0.25  # the same, to grow past min_window: round trips on loopback are noisy
_SHRINK_ABOVE = 1.5  # more, and it shrinks by one


def is_worker_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the worker failed (it is taken out) rather than the user's code (the task's result)."""
    return is_transient(exc) or isinstance(exc, RRefNotFound)


def _average(previous: float | None, sample: float, weight: float) -> float:
    return sample if previous is None else (1.0 - weight) * previous + weight * sample


class SchedulingPolicy:
    """Where tasks go, when to copy them, and how workers leave and rejoin.

    Args:
        prefetch_factor: calls in flight per worker at least (and the least
            window of a worker whose link is not measured yet); ``MIN_WINDOW``
            (3) at least once the worker answered, unless ``max_window`` is smaller.
        timeout: how long to wait for a worker to come back when none is left.
        max_window: calls in flight per worker at most, however long its link's
            round trip (default: ``4 * prefetch_factor``).
        standby_idle: seconds another rank's worker in use may idle before it
            goes back to the reserve (default: ``STANDBY_IDLE``).

    Example::

        >>> policy = SchedulingPolicy(prefetch_factor=2, timeout=30.0)
        >>> slots = [WorkerSlot("127.0.0.1:1", 0), WorkerSlot("127.0.0.1:2", 1)]
        >>> policy.pick(slots, now=0.0).address
        '127.0.0.1:1'
    """

    def __init__(
        self, *, prefetch_factor: int, timeout: float, max_window: int | None = None, standby_idle: float | None = None
    ):
        self.prefetch_factor = prefetch_factor
        self.timeout = float(timeout)
        self.max_window = max(max_window or MAX_WINDOW_FACTOR * prefetch_factor, prefetch_factor)
        self.min_window = min(max(prefetch_factor, MIN_WINDOW), self.max_window)
        self.standby_idle = STANDBY_IDLE if standby_idle is None else float(standby_idle)

    # ------------------------------------------------------------------ windows

    def window(self, slot: WorkerSlot) -> int:
        """How many calls ``slot`` may have in flight now (see :meth:`observe` for how it adapts).

        One until its first answer since it (re)joined: that answer pays for
        setting up the connection, and the next call finds the worker idle,
        which measures the round trip with no wait. Then at least
        ``min_window`` (``prefetch_factor``, and ``MIN_WINDOW`` at least): a
        worker shared with other clients makes every round trip look long,
        which alone would shrink the window to ``prefetch_factor``; with one
        call in flight, none waits at the worker while its answer travels
        back, and the worker's fair queue gives the others that turn.
        """
        if slot.service_time is None:
            return 1
        window = slot.window
        if window is None or window <= self.min_window:
            return self.min_window
        return window if window < self.max_window else self.max_window

    def pass_window(self, slots: Sequence[WorkerSlot]) -> int:
        """How many tasks a pass may hold pulled and not handed out: the active workers' windows together."""
        total = 0
        own = own_active(slots)
        for slot in slots:
            if slot.state is WorkerState.ACTIVE and (slot.preferred or not own):
                total += self.window(slot)
        return total or self.prefetch_factor

    def let_go(self, slot: WorkerSlot, attempt: Attempt) -> None:
        """``attempt``, in flight on ``slot``, is no longer awaited (its pass ended, or another copy answered):
        while its worker answers nothing, its silence still counts from when it was sent."""
        slot.in_flight.discard(attempt)
        if attempt.sent_at < slot.unanswered_since:
            slot.unanswered_since = attempt.sent_at

    def sent(self, slot: WorkerSlot, attempt: Attempt, answers: int = 0) -> None:
        """Record a call sent to ``slot``; ``answers``: how many the pool has had from all its workers so far."""
        if not slot.in_flight and slot.unanswered_since == math.inf:  # it was idle: its silence starts now
            slot.quiet_mark = answers
        slot.in_flight.add(attempt)
        slot.last_sent = attempt.sent_at
        if len(slot.in_flight) >= self.window(slot):
            slot.window_filled = True

    def observe(
        self, slot: WorkerSlot, attempt: Attempt, now: float, *, answers: int = 0, measure_link: bool = True
    ) -> None:
        """Learn from an answer to ``attempt`` seen at ``now``: the service time, and the window.

        The window follows the bandwidth-delay product of the worker and its
        link, as TCP Vegas does: ``rtt`` is the shortest round trip seen (the
        link's latency and the work, with no wait at the worker). Once per
        window of answers, the average round trip tells how many calls waited
        at the worker: ``window * (1 - rtt / average)``. Under half a call
        (and the window was full, so it was what limited the worker), the
        window grows by one; over one and a half, it shrinks by one, to
        ``min_window`` at least. To grow past ``min_window`` it takes
        under a quarter of a call: round trips on loopback are noisy, and the
        client's memory bound stays ``min_window`` per worker there. A
        loopback worker that runs one call at a time keeps its window at
        ``min_window`` (3 with ``prefetch_factor`` 1 to 3); a link with a
        long round trip, or a worker running calls in parallel, gets more calls in
        flight. A link that slows down makes calls wait: its window shrinks back.

        Args:
            answers: how many answers the pool has had from all its workers, this one included.
            measure_link: whether ``now`` is when the answer arrived. An answer
                that waited for a busy consumer says nothing of the link: it
                updates the service time only. The first answer since the
                worker (re)joined is not measured either: it paid for setting
                up the connection.
        """
        first = slot.service_time is None
        service = now - max(attempt.sent_at, slot.last_done)
        slot.last_done = now
        slot.quiet_mark = answers
        slot.unanswered_since = math.inf
        slot.service_time = _average(slot.service_time, service, _SERVICE_WEIGHT)
        if not measure_link or first:
            return
        round_trip = now - attempt.sent_at
        slot.rtt = round_trip if slot.rtt is None else min(slot.rtt, round_trip)
        slot.round_trips += round_trip
        slot.answers += 1
        window = self.window(slot)
        if slot.answers < window:
            return
        slot.round_trip = slot.round_trips / slot.answers
        waiting = window * (1.0 - slot.rtt / slot.round_trip) if slot.round_trip > 0 else 0.0
        if slot.window_filled and waiting < (_GROW_BELOW if window > self.min_window else _LEAVE_FLOOR_BELOW):
            window += 1
        elif waiting > _SHRINK_ABOVE:
            window -= 1
        slot.window = min(max(window, self.min_window), self.max_window)
        slot.round_trips, slot.answers = 0.0, 0
        slot.window_filled = len(slot.in_flight) >= slot.window

    # ------------------------------------------------------------------ choosing a worker

    def default_service_time(self, slots: Sequence[WorkerSlot]) -> float:
        """The service time assumed for a worker not measured yet: the best measured one (1 s if none)."""
        best = None
        for slot in slots:
            time = slot.service_time
            if time is not None and (best is None or time < best):
                best = time
        return 1.0 if best is None else best

    def due_for_trial(self, slot: WorkerSlot, now: float) -> bool:
        """An idle worker passed over as slow gets a task again after idling one service time."""
        return not slot.in_flight and now - max(slot.last_done, slot.last_sent) > (slot.service_time or 0.0)

    def pick(
        self, slots: Sequence[WorkerSlot], now: float, exclude: WorkerSlot | None = None, anyone: bool = False
    ) -> WorkerSlot | None:
        """The active worker expected to finish a new task first, with room in its window; ``None`` when
        none has room, or when the one with room is much slower than the best could be (better wait),
        unless it is due for a trial. Only this client's own workers while one is active, unless ``anyone``."""
        default = self.default_service_time(slots)
        best_possible = float("inf")
        chosen, chosen_key = None, None
        own_only = not anyone and own_active(slots)
        for slot in slots:  # one pass: the best any candidate could do, and the best one with room
            if slot.state is not WorkerState.ACTIVE or slot is exclude or (own_only and not slot.preferred):
                continue
            calls = len(slot.in_flight)
            done = slot.expected_done(default)
            if done < best_possible:
                best_possible = done
            if calls < self.window(slot):
                key = (done, calls, slot.index)
                if chosen_key is None or key < chosen_key:
                    chosen, chosen_key = slot, key
        if chosen is None:
            return None
        if chosen_key[0] > SLOW_FACTOR * best_possible and not self.due_for_trial(chosen, now):
            return None
        return chosen

    def hedge(self, head: Task, slots: Sequence[WorkerSlot], now: float) -> WorkerSlot | None:
        """Another worker to send a copy of ``head`` (the task the consumer waits for) to: when it is late
        on its worker, or another is expected to finish it much sooner (a slow worker's trial task)."""
        if head.state is TaskState.DONE or len(head.attempts) > 2:
            return None
        live = [attempt for attempt in head.attempts if attempt.live]
        if len(live) != 1:
            return None
        attempt = live[0]
        here = next((slot for slot in slots if slot.index == attempt.worker), None)
        if here is None:  # its worker went back to the reserve: nothing to compare with
            return None
        default = self.default_service_time(slots)
        age = now - attempt.sent_at
        late = age >= max((self.window(here) + HEDGE_SLACK) * default, MIN_HEDGE_AGE)
        remaining_here = (here.service_time or default) - age
        if not late and remaining_here <= SLOW_FACTOR * default:
            return None
        slot = self.pick(slots, now, exclude=here, anyone=True)
        if slot is not None and (late or remaining_here > SLOW_FACTOR * slot.expected_done(default)):
            return slot
        return None

    # ------------------------------------------------------------------ failover

    def take_down(self, slot: WorkerSlot, failure: BaseException, now: float) -> list[Attempt]:
        """Take a failed worker out and schedule its first probe.

        Returns:
            its calls that were in flight, now orphaned: their tasks are to
            be retried elsewhere (nothing, for an excluded worker).
        """
        if slot.state == WorkerState.EXCLUDED:
            return []
        slot.failure = failure
        if slot.state is not WorkerState.LEFT:  # one that left is not revived
            slot.state = WorkerState.DOWN
            slot.downs += 1
            self._schedule_probe(slot, now)
        orphans = list(slot.in_flight)
        for attempt in orphans:
            attempt.state = AttemptState.ORPHANED
        slot.in_flight.clear()
        return orphans

    def gives_up(self, task: Task, slots: Sequence[WorkerSlot], reserve: int = 0) -> bool:
        """Whether ``task`` timed out on as many workers as could serve it (those of ``slots`` and the
        ``reserve`` others' workers not called yet): its timeout is its result."""
        gone = (WorkerState.EXCLUDED, WorkerState.LEFT, WorkerState.DRAINING)
        return task.timeouts >= reserve + sum(slot.state not in gone for slot in slots)

    def hung(
        self, slots: Sequence[WorkerSlot], now: float, answers: int, reserve: bool | None = None
    ) -> list[tuple[WorkerSlot, str]]:
        """The active workers that stopped answering while the others went on (invariant 9), each with why.

        Args:
            answers: how many answers the pool has had from all its workers so far.
            reserve: whether others' workers wait in reserve (default: whether one of ``slots`` is ``STANDBY``).
        """
        found = []
        default = self.default_service_time(slots)
        active_now = [slot for slot in slots if slot.state is WorkerState.ACTIVE]
        if reserve is None:
            reserve = any(slot.state is WorkerState.STANDBY for slot in slots)
        for slot in slots:  # those that left finish their calls in flight: they are judged too
            if slot.state not in (WorkerState.ACTIVE, WorkerState.LEFT) or not slot.in_flight:
                continue
            others_answered = answers - slot.quiet_mark >= HUNG_ANSWERS
            # The only active worker, with others' in reserve: judged against its own measured service time.
            alone = active_now == [slot] and reserve and slot.service_time is not None
            if not (others_answered or alone):
                continue
            oldest = min(min(attempt.sent_at for attempt in slot.in_flight), slot.unanswered_since)
            silence = now - max(oldest, slot.last_done)
            expected = max(slot.service_time or default, default)
            limit = max(HUNG_FACTOR * expected, HUNG_FLOOR if others_answered else HUNG_ALONE_FLOOR)
            if silence < limit:
                continue
            own = "not measured" if slot.service_time is None else f"{slot.service_time:.3g}s"
            meanwhile = (
                f"the other workers answered {answers - slot.quiet_mark} calls"
                if others_answered
                else "other ranks' workers wait in reserve"
            )
            why = (
                f"it did not answer for {silence:.1f}s while {meanwhile} (its service time {own}, the best "
                f"{default:.3g}s): its calls go elsewhere, and it is probed until it answers again"
            )
            found.append((slot, why))
        return found

    def drain(self, slot: WorkerSlot, notice: BaseException, now: float, seconds: float | None) -> bool:
        """``slot`` said it is leaving (``notice``, a call it refused): it is given no new task, and its calls
        in flight are awaited for ``seconds`` (its drain timeout; ``None``: ``DEFAULT_DRAIN_WAIT``) and
        ``DRAIN_MARGIN`` (invariant 10).

        Returns:
            whether it began to drain now (it was active).
        """
        if slot.state is not WorkerState.ACTIVE:
            return False
        slot.state = WorkerState.DRAINING
        slot.failure = notice
        slot.drain_until = now + (DEFAULT_DRAIN_WAIT if seconds is None else seconds) + DRAIN_MARGIN
        return True

    def drains_ended(self, slots: Sequence[WorkerSlot], now: float) -> tuple[list[WorkerSlot], list[WorkerSlot]]:
        """The draining workers whose drain is over: those with no call left in flight (they are ``DOWN``
        from now on, probed as any worker taken out), and those whose ``drain_until`` passed with calls still
        in flight (to be taken out: their calls go elsewhere).

        Returns:
            ``(drained, overdue)``.
        """
        drained, overdue = [], []
        for slot in slots:
            if slot.state is not WorkerState.DRAINING:
                continue
            if not slot.in_flight:
                slot.state = WorkerState.DOWN
                slot.downs += 1
                self._schedule_probe(slot, now)
                drained.append(slot)
            elif now >= slot.drain_until:
                overdue.append(slot)
        return drained, overdue

    def wants_standby(self, slots: Sequence[WorkerSlot], now: float, last_called: float, reserve: int) -> bool:
        """Whether a client that waits for data should call one more of the others' workers in reserve
        (invariant 8): ``reserve`` of them wait, none of its own in ``slots`` is active nor being set up
        after it joined (a worker that failed is not waited for), none called is being set up (one at a
        time), and either none is active at all or the last was called (at ``last_called``)
        ``STANDBY_GROW_AFTER`` seconds ago or more."""
        if not reserve or own_active(slots):
            return False
        for slot in slots:
            if slot.state is WorkerState.PROBING and not slot.preferred:
                return False  # one at a time
            if slot.preferred and slot.failure is None and slot.state in (WorkerState.DOWN, WorkerState.PROBING):
                return False  # an own worker that joined, or is listed again, is being set up: it comes first
        return not any_active(slots) or now - last_called >= STANDBY_GROW_AFTER

    def call_standby(self, slot: WorkerSlot, now: float) -> None:
        """``slot``, another rank's worker in reserve, is called on: it is set up now (``DOWN``, its probe due)."""
        slot.state = WorkerState.DOWN
        slot.probe_at = now
        slot.probe_delay = FIRST_PROBE_DELAY

    def idle_standbys(self, slots: Sequence[WorkerSlot], now: float) -> list[WorkerSlot]:
        """The others' workers this client no longer needs, back to the reserve (``STANDBY``) from now on:
        those with no call in flight that idled ``standby_idle`` seconds, or that are down while one of
        its own workers is active (invariant 8)."""
        own = own_active(slots)
        released = []
        for slot in slots:
            if slot.preferred or slot.in_flight:
                continue
            idle = now - max(slot.last_done, slot.last_sent, slot.probe_at) >= self.standby_idle
            if (slot.state is WorkerState.ACTIVE and idle) or (slot.state is WorkerState.DOWN and own):
                slot.state = WorkerState.STANDBY
                released.append(slot)
        return released

    def probe_all_down_now(self, slots: Sequence[WorkerSlot], now: float) -> None:
        """A new pass begins: the workers that are down are probed at once."""
        for slot in slots:
            if slot.state == WorkerState.DOWN:
                slot.probe_at = now

    def probes_due(self, slots: Sequence[WorkerSlot], now: float) -> list[WorkerSlot]:
        """The down workers whose probe is due; they are ``PROBING`` from now on."""
        due = [slot for slot in slots if slot.state is WorkerState.DOWN and slot.probe_at <= now]
        for slot in due:
            slot.state = WorkerState.PROBING
        return due

    def probe_ended(self, slot: WorkerSlot, outcome: Revival | BaseException, now: float) -> WorkerState | None:
        """A probe of ``slot`` ended: with a :class:`~rpcdl.data.probes.Revival`, or with the exception it failed with.

        Returns:
            the worker's new state: ``ACTIVE`` (it is back: it rejoins,
            measured afresh), ``PROBING`` (it is busy: alive but still running
            calls that timed out; probe it again now), ``DOWN`` (a transient
            failure: probed again later, after a longer delay) or ``EXCLUDED``
            (a deterministic failure); ``None`` when the worker was not being
            probed (the answer is stale).
        """
        if slot.state != WorkerState.PROBING:
            return None
        slot.probes += 1
        if outcome is Revival.BACK:
            slot.state = WorkerState.ACTIVE
            slot.probe_delay = FIRST_PROBE_DELAY
            slot.last_done = 0.0
            slot.unanswered_since = math.inf
            slot.service_time = slot.rtt = slot.round_trip = slot.window = None
            slot.round_trips, slot.answers, slot.window_filled = 0.0, 0, False
        elif isinstance(outcome, BaseException):
            slot.failure = outcome
            if is_transient(outcome):
                slot.state = WorkerState.DOWN
                self._schedule_probe(slot, now)
            else:
                slot.state = WorkerState.EXCLUDED
        return slot.state  # busy: it stays PROBING, taken out by the timeout that took it out

    def _schedule_probe(self, slot: WorkerSlot, now: float) -> None:
        slot.probe_at = now + slot.probe_delay
        slot.probe_delay = min(slot.probe_delay * 2, MAX_PROBE_DELAY)

    def wait_time(self, slots: Sequence[WorkerSlot], now: float, awaiting_head: bool) -> float:
        """How long the pass may wait for an answer before it must act: a probe falls due, or the task the
        consumer waits for (``awaiting_head``) may need a copy."""
        deadline = now + IDLE_WAIT
        for slot in slots:
            if slot.state is WorkerState.DOWN and slot.probe_at < deadline:
                deadline = slot.probe_at
            elif slot.state is WorkerState.DRAINING and slot.drain_until < deadline:
                deadline = slot.drain_until
        if awaiting_head:
            deadline = min(deadline, now + max(MIN_HEDGE_AGE, self.default_service_time(slots)))
        return max(0.0, deadline - now)


class AllDownWatch:
    """Decides when a pass must give up because no worker is left (one per pass).

    Once no worker is active, the pass gives up when ``timeout`` seconds have
    passed *and* every worker that may come back was probed since (its probe
    ended): a worker taken out a moment ago, by a call that timed out say, is
    asked at least once. Probes fall due within ``MAX_PROBE_DELAY`` and end
    within the timeout, so the wait is bounded. A worker that came back and
    was taken out again since, even between two checks, starts the wait anew.

    Args:
        timeout: seconds to wait for a worker to come back once none is active.
        joins: whether workers may join (a changing source): then the pass waits
            ``timeout`` even when none of those it knows can come back.
    """

    def __init__(self, timeout: float, joins: bool = False):
        self.timeout = timeout
        self.joins = joins
        self.all_down_since: float | None = None
        self._counts_then: dict[str, tuple[int, int]] = {}  # each worker's (probes, downs) when the wait began

    def check(self, slots: Sequence[WorkerSlot], now: float, reserve: int = 0) -> str | None:
        """``None`` while a worker is active or may still come back in time; else the error to raise,
        naming every worker, its state and its last failure. ``reserve``: how many others' workers wait in
        reserve, not called yet (they may serve: the pass waits ``timeout`` for them)."""
        if any_active(slots):
            self.all_down_since = None
            return None
        then = self._counts_then
        if self.all_down_since is None or any(slot.downs != then.get(slot.address, (0, 0))[1] for slot in slots):
            self.all_down_since = now
            self._counts_then = then = {slot.address: (slot.probes, slot.downs) for slot in slots}
        if any(slot.state is WorkerState.PROBING for slot in slots):
            return None  # a probe that ends in failure has its own timeout
        if any(slot.state is WorkerState.DRAINING and slot.in_flight for slot in slots):
            return None  # its calls in flight still answer, up to its drain_until
        recoverable = [slot for slot in slots if slot.state not in (WorkerState.EXCLUDED, WorkerState.LEFT)]
        unasked = any(slot.probes == then.get(slot.address, (0, 0))[0] for slot in recoverable)
        if (recoverable or reserve or self.joins) and (now - self.all_down_since < self.timeout or unasked):
            return None
        details = "; ".join(f"{slot.address} ({slot.state.value}: {slot.failure})" for slot in slots)
        if reserve:
            details += f"; {reserve} other ranks' workers not tried"
        return f"no worker is left (waited {self.timeout:g}s for one to come back): {details}"


def active(slots: Sequence[WorkerSlot]) -> list[WorkerSlot]:
    """The workers that may be given tasks."""
    return [slot for slot in slots if slot.state is WorkerState.ACTIVE]


def any_active(slots: Sequence[WorkerSlot]) -> bool:
    """Whether a worker may be given tasks."""
    return any(slot.state is WorkerState.ACTIVE for slot in slots)


def own_active(slots: Sequence[WorkerSlot]) -> bool:
    """Whether one of this client's own workers may be given tasks."""
    return any(slot.preferred and slot.state is WorkerState.ACTIVE for slot in slots)
