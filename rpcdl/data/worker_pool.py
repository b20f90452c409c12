"""The workers of a loader or a remote map, shared by its passes: their health, calls in flight and probes.

A :class:`WorkerPool` keeps what a client knows of its workers across passes
(epochs): each worker's :class:`~rpcdl.data.records.WorkerSlot` (its health,
calls in flight, estimates and probe schedule), the registry of open passes,
and the revivals in flight.

Why a layer of its own: a pass lives for one epoch, a worker's record for
the whole job, and several passes (an epoch and the next one prefetched, the
stages of a pipeline) use the same workers at once. What they share is kept
here, under one lock: the records, the reserve of other ranks' workers, the
fleet's changes, revivals, and which pass a call belongs to (so that an
orphaned call reaches its own pass). The decisions are not made here: they are
the :class:`~rpcdl.data.scheduling_policy.SchedulingPolicy`'s, which a pass
(:class:`~rpcdl.data.scheduler.Dispatch`) asks itself, holding the lock
(:meth:`WorkerPool.locked`), with the records in use and the time read once
per step; the methods here are the changes of state that take more than one
record or that log.

The workers come from a :class:`~rpcdl.data.sources.Fleet`: a fixed list, or
a source that changes. At each step a pass takes in the fleet's changes
(:meth:`PoolState.follow_fleet`): a worker that joins is set up (a revival)
and then given tasks, one that leaves is given none while its calls in flight
finish, one that says it is leaving (``DRAINING``) too, within its drain timeout.

What a step costs does not grow with the fleet: only this client's own share
and the other ranks' workers it called on have a record a step looks at
(``PoolState.in_use``); the others wait in reserve (``STANDBY``), a list of
addresses sorted by this client's hash of them, rebuilt only when the fleet
changes. When none of its own is active and a pass waits for data, they are
called on one at a time, from the top of that list; one no longer needed goes
back to it, and its idle connection is closed.

Threading: the pool runs no thread of its own. Its state (:class:`PoolState`:
the workers' records, the records in use, the reserve, the state of every call
in flight, the registry of passes, the fleet version it follows and its count
of answers) is guarded by ONE lock, which every access holds: the threads
advancing its passes (several at once, one per pass) take it for each step,
and readers (:meth:`WorkerPool.states`, :meth:`WorkerPool.windows`) to copy
what they show. Nothing waits while holding it: a pass waits for answers,
unpickles them and pulls from its source outside it, and what must not run
under it (starting revivals, closing idle connections, logging) is done by the
thread leaving it, after it lets go
(:meth:`PoolState.__exit__`).
The fleet's own lock is a leaf taken under the pool's, for a copy of its
latest list (its thread never takes the pool's). Other threads reach the pool
through queues only: a revival's future puts a
:class:`~rpcdl.data.events.ProbeEnded` on the pool's probe queue, handled by
the next pass that takes the lock; a pass's calls answer on its own queue.

A pass that is dropped without being closed (a ``break`` out of an epoch, an
iterator garbage) is freed by reference counting; the pool keeps only a weak
reference to it, without a callback, and reclaims its calls at the next step
of any pass or reader (:meth:`PoolState.reclaim_dropped`).
"""

from __future__ import annotations

import bisect
import enum
import functools
import hashlib
import itertools
import logging
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import WorkerHung
from ..rpc.client import drain_timeout
from ..rpc.pool import close_idle_connections_to
from .events import WAKE, Orphaned, post_probe_end
from .flow import CALL_SECONDS
from .probes import PROBE_TIMEOUT, PingSetup, Revival, WorkerSetup
from .records import Attempt, AttemptState, WorkerSlot, WorkerState
from .scheduling_policy import SchedulingPolicy, active
from .sources import Fleet, Membership

__all__ = ["PassRecord", "PoolState", "Registration", "WorkerPool"]

log = logging.getLogger("rpcdl.scheduler")


class Registration(enum.Enum):
    """Whether the pool counts a pass as open."""

    OPEN = "open"  #: its calls are the pool's to count and to tell it about
    CLOSED = "closed"  #: closed, or dropped and reclaimed; its calls were let go


class PassRecord:
    """The pool's record of one pass: its number, its events queue, a weak reference to it.

    The reference has no callback: the pool looks at it when it runs, and a pass
    found dropped is reclaimed then (see :meth:`PoolState.reclaim_dropped`).
    ``state`` belongs to the pool's lock.
    """

    __slots__ = ("events", "number", "reference", "state")

    def __init__(self, number: int, owner: object, events: queue.SimpleQueue):
        self.number = number
        self.reference = weakref.ref(owner)
        self.events = events
        self.state = Registration.OPEN


class PoolState:
    """A pool's shared state; entering it takes the pool's lock (see the module): ``with pool.locked() as state``.

    Every method is called holding the lock. What must not run under the lock
    (starting revivals, closing connections, logging) is queued here and done by the thread leaving it.

    Attributes:
        slots: every worker given a record (its index is its place here): this
            client's own share, the others' workers it called on, those that left.
        in_use: the records a step looks at: the own share and the others'
            workers called on (not those back in reserve, nor those that left
            with no call in flight). Per-step work grows with these alone.
        policy: the decisions; a pass asks it itself, holding the lock, with
            ``in_use`` and the time read from ``clock`` once per step.
        clock: the time in seconds, monotonic.
        answers: the answers from all the workers so far (see
            :meth:`SchedulingPolicy.hung <rpcdl.data.scheduling_policy.SchedulingPolicy.hung>`).
    """

    def __init__(self, fleet: Fleet, policy: SchedulingPolicy, clock: Callable[[], float], setup: WorkerSetup):
        self.policy = policy
        self.clock = clock
        self.fleet = fleet
        self.answers = 0  # answers from all the workers so far (see SchedulingPolicy.hung)
        membership = fleet.membership()
        self._version = membership.version
        self.slots: list[WorkerSlot] = []
        self.in_use: list[WorkerSlot] = []
        self._by_address: dict[str, WorkerSlot] = {}
        # The others' workers not in use, ascending by this client's key for them (see _standby_key): the
        # next called is the last. Not scanned per step.
        self._reserve: list[tuple[bytes, str]] = []
        self._salt = random.getrandbits(64).to_bytes(8, "big")  # jitter: a restarted rank picks others
        self._last_called = -float("inf")
        # The workers listed now in this client's share are set up by their dataset before the pool begins
        # (those that failed to build it are revived at their first call).
        for address in membership.addresses:
            if address in membership.own:
                self._add_slot(address, True, WorkerState.ACTIVE)
        self._fill_reserve(membership)
        self._setup = setup
        self._lock = threading.Lock()
        self._passes: dict[int, PassRecord] = {}
        self._numbers = itertools.count(1)
        self._probe_events: queue.SimpleQueue = queue.SimpleQueue()  # revivals' ends, from any thread
        self._to_probe: list[WorkerSlot] = []
        self._to_close: list[str] = []  # others' workers back in reserve: their idle connections close
        self._notes: list[tuple[int, str, tuple]] = []  # log lines

    def __enter__(self) -> PoolState:
        self._lock.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not (self._notes or self._to_probe or self._to_close):  # the usual step
            self._lock.release()
            return
        notes, self._notes = self._notes, []
        probing, self._to_probe = self._to_probe, []
        closing, self._to_close = self._to_close, []
        starts = [(slot, slot.address, slot.failure) for slot in probing]
        waiting = tuple(weakref.ref(record.events) for record in self._passes.values()) if probing else ()
        self._lock.release()
        for level, message, args in notes:
            log.log(level, message, *args)
        for address in closing:
            close_idle_connections_to(address, "another rank's worker this rank no longer needs")
        for slot, address, failure in starts:
            self._start_probe(slot, address, failure, waiting)

    # ------------------------------------------------------------------ records

    def slot_addresses(self) -> set[str]:
        """The addresses of the workers given a record."""
        return set(self._by_address)

    def reserve(self) -> list[str]:
        """The others' workers in reserve (``STANDBY``, not in use), the next to be called first."""
        return [address for _, address in reversed(self._reserve)]

    @property
    def reserve_size(self) -> int:
        """How many of the others' workers wait in reserve (what the policy weighs as ``reserve``)."""
        return len(self._reserve)

    def _add_slot(self, address: str, own: bool, state: WorkerState) -> WorkerSlot:
        slot = WorkerSlot(address, len(self.slots), own, state)
        self.slots.append(slot)
        self.in_use.append(slot)
        self._by_address[address] = slot
        return slot

    def _use(self, slot: WorkerSlot) -> None:
        if all(used is not slot for used in self.in_use):
            self.in_use.append(slot)

    def _standby_key(self, address: str) -> bytes:
        """This client's order of the others' workers: a hash of (rank, address) and a salt of its own, so that
        ranks whose own workers are gone call on different ones."""
        text = f"{self.fleet.rank}|{address}".encode()
        return hashlib.blake2b(text, digest_size=8, key=self._salt).digest()

    def _fill_reserve(self, membership: Membership) -> None:
        """The reserve anew: the listed workers of other ranks that have no record in use (O(W log W), at a
        change of the fleet only)."""
        reserve = []
        for address in membership.addresses:
            if address in membership.own:
                continue
            slot = self._by_address.get(address)
            if slot is None or slot.state is WorkerState.STANDBY:
                reserve.append((self._standby_key(address), address))
        reserve.sort()
        self._reserve = reserve

    def _keep_in_use(self) -> None:
        """Drop from ``in_use`` the records back in reserve and those that left with no call in flight."""
        self.in_use = [
            slot
            for slot in self.in_use
            if slot.state is not WorkerState.STANDBY and (slot.state is not WorkerState.LEFT or slot.in_flight)
        ]

    # ------------------------------------------------------------------ the fleet

    def follow_fleet(self) -> None:
        """Take in the fleet's changes since the last look: a worker that joined this client's share is set up
        and then given tasks; one that joined another's waits in reserve, untouched; one that left is given
        none (its calls in flight finish); shares are updated."""
        membership = self.fleet.membership()  # the fleet's lock is a leaf: held for a copy
        if membership.version == self._version:
            return
        self._version = membership.version
        listed = set(membership.addresses)
        now = self.clock()
        for address in membership.own:
            slot = self._by_address.get(address)
            if slot is None:
                slot = self._add_slot(address, True, WorkerState.DOWN)
                slot.probe_at = now
                self._notes.append((logging.INFO, "worker %s joined (from %s)", (address, self.fleet.describe())))
            elif slot.state is WorkerState.LEFT:
                slot.state, slot.probe_at, slot.failure = WorkerState.DOWN, now, None
                self._notes.append((logging.WARNING, "worker %s is listed again", (address,)))
                self._use(slot)
            elif slot.state is WorkerState.STANDBY:  # another rank's before, in reserve: now this one's own
                slot.state, slot.probe_at, slot.failure = WorkerState.DOWN, now, None
                self._use(slot)
        for slot in self.slots:
            slot.preferred = slot.address in membership.own  # one no longer own goes back to reserve when idle
            if slot.address not in listed and slot.state not in (WorkerState.LEFT, WorkerState.EXCLUDED):
                if slot.state is not WorkerState.STANDBY:
                    message = "worker %s left %s: it is given no more calls (%d in flight finish)"
                    self._notes.append(
                        (logging.WARNING, message, (slot.address, self.fleet.describe(), len(slot.in_flight)))
                    )
                slot.state = WorkerState.LEFT
            elif slot.state is WorkerState.LEFT and not (slot.preferred or slot.in_flight) and slot.address in listed:
                slot.state = WorkerState.STANDBY  # another rank's, listed again: back in reserve, untouched
        self._keep_in_use()
        self._fill_reserve(membership)
        self._to_probe.extend(self.policy.probes_due(self.in_use, now))  # those that joined: set up now

    # ------------------------------------------------------------------ passes

    def open_pass(self, owner: object, events: queue.SimpleQueue) -> PassRecord:
        """Register a new pass ``owner`` whose calls answer on ``events``; the workers that are down are
        probed at once."""
        self.reclaim_dropped()
        self.follow_fleet()
        self.policy.probe_all_down_now(self.in_use, self.clock())
        record = PassRecord(next(self._numbers), owner, events)
        self._passes[record.number] = record
        return record

    def close_pass(self, record: PassRecord) -> None:
        """The pass of ``record`` ends: its calls in flight are let go, and it is woken if it waits."""
        if record.state is Registration.CLOSED:
            return
        record.state = Registration.CLOSED
        del self._passes[record.number]
        self._let_go({record.number})
        record.events.put(WAKE)

    def reclaim_dropped(self) -> None:
        """Let go of the calls of the passes dropped without being closed."""
        dropped = [record for record in self._passes.values() if record.reference() is None]
        for record in dropped:
            record.state = Registration.CLOSED
            del self._passes[record.number]
        if dropped:
            self._let_go({record.number for record in dropped})

    def _let_go(self, owners: set[int]) -> None:
        for slot in self.in_use:  # a record out of use has no call in flight
            gone = [attempt for attempt in slot.in_flight if attempt.owner in owners]
            for attempt in gone:
                self.policy.let_go(slot, attempt)
                attempt.state = AttemptState.DROPPED

    # ------------------------------------------------------------------ calls

    def answered(self, attempt: Attempt, worker_failed: bool) -> bool:
        """The answer of ``attempt`` is being handled by its pass: it leaves its worker's calls in flight.

        Returns:
            whether it is live: its answer may be its task's result (else its
            worker was taken out, or its task no longer needs it).
        """
        if not attempt.live:
            return False
        self.slots[attempt.worker].in_flight.discard(attempt)
        attempt.state = AttemptState.FAILED if worker_failed else AttemptState.ANSWERED
        return True

    def drop(self, attempts: Sequence[Attempt]) -> None:
        """Let go of ``attempts``, still live: their task no longer needs them."""
        for attempt in attempts:
            if attempt.state is AttemptState.IN_FLIGHT:
                self.policy.let_go(self.slots[attempt.worker], attempt)
            attempt.state = AttemptState.DROPPED

    def release_answered(self, reader: PassRecord) -> None:
        """Free the workers of the calls answered for other passes than ``reader``'s: a pass that is not
        being advanced must not hold workers its answers no longer use."""
        if len(self._passes) < 2:  # a pass alone: the calls in flight are its own
            return
        number = reader.number
        for slot in self.in_use:
            answered = [a for a in slot.in_flight if a.owner != number and a.future.done()]
            for attempt in answered:
                slot.in_flight.discard(attempt)
                attempt.state = AttemptState.ANSWERED

    def observe(self, attempt: Attempt, measure_link: bool) -> None:
        """Learn from the answer of ``attempt``, seen now (see :meth:`SchedulingPolicy.observe`); count its
        duration in :data:`~rpcdl.data.flow.CALL_SECONDS`."""
        self.answers += 1
        now = self.clock()
        CALL_SECONDS.observe(now - attempt.sent_at)
        slot = self.slots[attempt.worker]
        self.policy.observe(slot, attempt, now, answers=self.answers, measure_link=measure_link)

    def drain(self, slot: WorkerSlot, notice: BaseException) -> None:
        """``slot`` said it is leaving (``notice``: a call it refused): no new task goes to it, its calls in
        flight are awaited for as long as it said it drains (see :meth:`SchedulingPolicy.drain`)."""
        seconds = drain_timeout(slot.address)
        if self.policy.drain(slot, notice, self.clock(), seconds):
            wait = "its drain timeout" if seconds is None else f"{seconds:g}s"
            message = "worker %s is leaving: it is given no more calls; its %d in flight are awaited (up to %s)"
            self._notes.append((logging.INFO, message, (slot.address, len(slot.in_flight), wait)))

    def take_down(self, slot: WorkerSlot, failure: BaseException, by: PassRecord) -> list[Attempt]:
        """Take a failed worker out; its calls in flight are orphaned.

        Returns:
            the orphans of ``by``'s pass, to send again; the other open passes
            are sent an :class:`~rpcdl.data.events.Orphaned` event for each of
            theirs.
        """
        if slot.state is WorkerState.EXCLUDED:
            return []
        if slot.state in (WorkerState.ACTIVE, WorkerState.LEFT) and isinstance(failure, WorkerHung):
            self._notes.append((logging.WARNING, "routing around worker %s: %s", (slot.address, failure)))
        elif slot.state is WorkerState.ACTIVE or (slot.state is WorkerState.DRAINING and slot.in_flight):
            self._notes.append((logging.WARNING, "worker %s is down: %s", (slot.address, failure)))
        own = []
        for attempt in self.policy.take_down(slot, failure, self.clock()):
            record = self._passes.get(attempt.owner)
            if attempt.owner == by.number:
                own.append(attempt)
            elif record is not None and record.reference() is not None:
                record.events.put(Orphaned(attempt))
        return own

    # ------------------------------------------------------------------ revival

    def start_due_probes(self) -> None:
        """The pass waits for data: revive the workers whose probe is due (they are ``PROBING`` from now on).
        When none of this client's own workers is active, one of the others' in reserve is called on (set up
        first), one at a time (see :meth:`SchedulingPolicy.wants_standby`); those no longer needed go back to
        the reserve, and their connections close."""
        now = self.clock()
        released = self.policy.idle_standbys(self.in_use, now)
        for slot in released:
            bisect.insort(self._reserve, (self._standby_key(slot.address), slot.address))
            self._to_close.append(slot.address)
        if released or any(slot.state is WorkerState.LEFT and not slot.in_flight for slot in self.in_use):
            self._keep_in_use()
        if self.policy.wants_standby(self.in_use, now, self._last_called, len(self._reserve)):
            _, address = self._reserve.pop()
            slot = self._by_address.get(address)
            if slot is None:
                slot = self._add_slot(address, False, WorkerState.STANDBY)
            else:
                self._use(slot)
            self.policy.call_standby(slot, now)
            self._last_called = now
            message = "none of this rank's own workers is left: using %s (another rank's; %d more in reserve)"
            self._notes.append((logging.WARNING, message, (address, len(self._reserve))))
        self._to_probe.extend(self.policy.probes_due(self.in_use, now))

    def handle_probe_ends(self) -> None:
        """Handle the revivals that ended: the workers rejoin, are probed again, or wait for their next probe."""
        probe_events = self._probe_events
        while not probe_events.empty():  # drained under the lock: what is there stays there
            event = probe_events.get_nowait()
            slot = event.slot
            try:
                outcome = event.future.wait()
            except Exception as exc:
                outcome = exc
            if not isinstance(outcome, (Revival, BaseException)):
                outcome = TypeError(f"a revival of worker {slot.address} gave {outcome!r}, not a Revival")
            failed_before = slot.failure is not None  # else it joined, or is listed again: said already
            state = self.policy.probe_ended(slot, outcome, self.clock())
            if state is WorkerState.ACTIVE and failed_before:
                self._notes.append((logging.WARNING, "worker %s is back", (slot.address,)))
            elif state is WorkerState.PROBING:
                message = "worker %s answers but still runs calls that timed out; it rejoins when they end"
                self._notes.append((logging.WARNING, message, (slot.address,)))
                self._to_probe.append(slot)
            elif state is WorkerState.EXCLUDED:
                self._notes.append((logging.ERROR, "worker %s is kept out: %s", (slot.address, outcome)))

    def _start_probe(
        self, slot: WorkerSlot, address: str, failure: BaseException | None, waiting: tuple[weakref.ref, ...]
    ) -> None:
        # Outside the lock (called as it is let go): a revival makes calls.
        try:
            future = self._setup.revive_async(address, failure)
        except Exception as exc:
            future = torch.futures.Future()
            future.set_exception(exc)
        future.add_done_callback(functools.partial(post_probe_end, self._probe_events, waiting, slot))


class WorkerPool:
    """The workers of one loader or mapper, and their health, across passes (see the module).

    Args:
        workers: worker addresses, or the :class:`~rpcdl.data.sources.Fleet` to follow.
        prefetch_factor: calls in flight per worker at least, 3 at least once
            it answered (and tasks not handed out yet per active worker); a
            worker whose link needs more
            to stay busy gets more, up to ``max_window``
            (see :meth:`SchedulingPolicy.window <rpcdl.data.scheduling_policy.SchedulingPolicy.window>`).
        timeout: seconds a call may take before its task goes elsewhere; also
            how long to wait for a worker when none is left.
        setup: what a worker needs before it serves, and how a failed one is
            revived (default: :class:`~rpcdl.data.probes.PingSetup`, a probe).
        max_window: calls in flight per worker at most (default: ``4 * prefetch_factor``).
        clock: the time in seconds, monotonic (injected so that tests drive it).

    Example::

        >>> pool = WorkerPool(["127.0.0.1:6543", "127.0.0.1:6544"], prefetch_factor=2, timeout=30.0)
        >>> pool.states()
        {'127.0.0.1:6543': 'active', '127.0.0.1:6544': 'active'}
    """

    def __init__(
        self,
        workers: Sequence[str] | Fleet,
        *,
        prefetch_factor: int,
        timeout: float,
        setup: WorkerSetup | None = None,
        max_window: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.fleet = workers if isinstance(workers, Fleet) else Fleet(list(workers))
        self.prefetch_factor = prefetch_factor
        self.timeout = float(timeout)
        policy = SchedulingPolicy(prefetch_factor=prefetch_factor, timeout=self.timeout, max_window=max_window)
        setup = setup if setup is not None else PingSetup(min(self.timeout, PROBE_TIMEOUT))
        self._state = PoolState(self.fleet, policy, clock, setup)

    @property
    def workers(self) -> list[str]:
        """Every worker the pool knows of, those that left included, in the order it learnt of them."""
        with self._state as state:
            known = [slot.address for slot in state.slots]
            given = state.slot_addresses()
            return known + [address for address in state.reserve() if address not in given]

    def locked(self) -> PoolState:
        """The pool's state, to enter (``with pool.locked() as state:``): entering takes the pool's lock."""
        return self._state

    def states(self) -> dict[str, str]:
        """Each worker's state: ``active``, ``down``, ``probing``, ``excluded``, ``standby`` (another rank's,
        in reserve) or ``left`` (its source no longer lists it)."""
        with self._state as state:
            state.reclaim_dropped()
            state.follow_fleet()
            states = dict.fromkeys(state.reserve(), WorkerState.STANDBY.value)
            states.update((slot.address, slot.state.value) for slot in state.slots)
            return states

    def active(self) -> list[tuple[int, str]]:
        """The workers that may be given tasks: their index in the pool and address."""
        with self._state as state:
            return [(slot.index, slot.address) for slot in active(state.in_use)]

    def windows(self) -> dict[str, dict[str, Any]]:
        """Each worker's scheduling state: ``state``, calls ``in_flight`` (all passes), the ``window`` of calls
        it may have in flight, and, in seconds (``None`` until measured), its ``service_time``, its shortest
        round trip ``rtt`` and its average ``round_trip`` over the last window of answers."""
        with self._state as state:
            state.reclaim_dropped()
            reserve = {
                address: {
                    "state": WorkerState.STANDBY.value,
                    "in_flight": 0,
                    "window": 0,
                    "service_time": None,
                    "rtt": None,
                    "round_trip": None,
                }
                for address in state.reserve()
            }
            return reserve | {
                slot.address: {
                    "state": slot.state.value,
                    "in_flight": len(slot.in_flight),
                    "window": state.policy.window(slot),
                    "service_time": slot.service_time,
                    "rtt": slot.rtt,
                    "round_trip": slot.round_trip,
                }
                for slot in state.slots
            }
