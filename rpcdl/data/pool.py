"""The workers of a loader or a remote map, shared by its passes: their health, calls in flight and probes.

A :class:`WorkerPool` keeps what a client knows of its workers across passes
(epochs): each worker's :class:`~rpcdl.data.records.WorkerSlot` (its health,
calls in flight, estimates and probe schedule), the registry of open passes,
and the revivals in flight. The decisions are the
:class:`~rpcdl.data.scheduling_policy.SchedulingPolicy`'s; a pass
(:class:`~rpcdl.data.scheduler.Dispatch`) asks for them through
:meth:`WorkerPool.locked`.

The workers come from a :class:`~rpcdl.data.sources.Fleet`: a fixed list, or
a source that changes. At each step a pass takes in the fleet's changes
(:meth:`PoolState.follow_fleet`): a worker that joins is set up (a revival)
and then given tasks, one that leaves is given none while its calls in flight
finish; the other ranks' workers wait in reserve (``STANDBY``) until none of
this client's own is active.

Threading: the pool runs no thread of its own. Its state (:class:`PoolState`:
the workers' records, the state of every call in flight, the registry of
passes, the fleet version it follows and its count of answers) is guarded by
ONE lock, which every access holds: the threads
advancing its passes (several at once, one per pass) take it for each step,
and readers (:meth:`WorkerPool.states`, :meth:`WorkerPool.windows`) to copy
what they show. Nothing waits while holding it: a pass reads answers and pulls
from its source outside it, and what must not run under it (handing dropped
calls' answers to the connections' threads, starting revivals, logging) is
done by the thread leaving it, after it lets go (:meth:`PoolState.__exit__`).
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

import enum
import functools
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import WorkerHung
from ..rpc.client import read_in_background
from .events import WAKE, Orphaned, post_probe_end
from .flow import CALL_SECONDS
from .probes import PROBE_TIMEOUT, PingSetup, Revival, WorkerSetup
from .records import Attempt, AttemptState, Task, WorkerSlot, WorkerState
from .scheduling_policy import SchedulingPolicy, active
from .sources import Fleet

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
    (handing dropped answers to the connections' threads, starting revivals,
    logging) is queued here and done by the thread leaving it.

    Attributes:
        slots: the workers' records, in the order of their addresses.
        policy: the decisions.
        clock: the time in seconds, monotonic.
    """

    def __init__(self, fleet: Fleet, policy: SchedulingPolicy, clock: Callable[[], float], setup: WorkerSetup):
        self.policy = policy
        self.clock = clock
        self.fleet = fleet
        self.answers = 0  # answers from all the workers so far (see SchedulingPolicy.hung)
        membership = fleet.membership()
        self._version = membership.version
        # The workers listed now are set up by their dataset before the pool begins (those that failed to build
        # it are revived at their first call); the others' wait in reserve until this client's own are gone.
        self.slots: list[WorkerSlot] = []
        for index, address in enumerate(membership.addresses):
            own = address in membership.own
            self.slots.append(WorkerSlot(address, index, own, WorkerState.ACTIVE if own else WorkerState.STANDBY))
        self._by_address = {slot.address: slot for slot in self.slots}
        self._setup = setup
        self._lock = threading.Lock()
        self._passes: dict[int, PassRecord] = {}
        self._numbers = itertools.count(1)
        self._probe_events: queue.SimpleQueue = queue.SimpleQueue()  # revivals' ends, from any thread
        self._unread: list[torch.futures.Future] = []  # calls let go: their answers go to the connections' threads
        self._to_probe: list[WorkerSlot] = []
        self._notes: list[tuple[int, str, tuple]] = []  # log lines

    def __enter__(self) -> PoolState:
        self._lock.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not (self._unread or self._notes or self._to_probe):  # the usual step: nothing left for after
            self._lock.release()
            return
        unread, self._unread = self._unread, []
        notes, self._notes = self._notes, []
        probing, self._to_probe = self._to_probe, []
        starts = [(slot, slot.address, slot.failure) for slot in probing]
        waiting = tuple(weakref.ref(record.events) for record in self._passes.values()) if probing else ()
        self._lock.release()
        for level, message, args in notes:
            log.log(level, message, *args)
        if unread:
            read_in_background(unread)  # nobody reads for them any more; a worker must not block sending them
        for slot, address, failure in starts:
            self._start_probe(slot, address, failure, waiting)

    # ------------------------------------------------------------------ the fleet

    def follow_fleet(self) -> None:
        """Take in the fleet's changes since the last look: a worker that joined is set up and then given
        tasks; one that left is given none (its calls in flight finish); shares are updated."""
        membership = self.fleet.membership()  # the fleet's lock is a leaf: held for a copy
        if membership.version == self._version:
            return
        self._version = membership.version
        listed = set(membership.addresses)
        now = self.clock()
        for address in membership.addresses:
            slot = self._by_address.get(address)
            own = address in membership.own
            if slot is None:
                slot = WorkerSlot(address, len(self.slots), own, WorkerState.DOWN if own else WorkerState.STANDBY)
                slot.probe_at = now
                self.slots.append(slot)
                self._by_address[address] = slot
                self._notes.append((logging.WARNING, "worker %s joined (from %s)", (address, self.fleet.describe())))
            elif slot.state is WorkerState.LEFT:
                slot.state, slot.probe_at, slot.failure = WorkerState.DOWN, now, None
                self._notes.append((logging.WARNING, "worker %s is listed again", (address,)))
            slot.preferred = own
            if own and slot.state is WorkerState.STANDBY:
                slot.state, slot.probe_at = WorkerState.DOWN, now
        self._to_probe.extend(self.policy.probes_due(self.slots, now))  # those that joined: set up now
        for slot in self.slots:
            if slot.address not in listed and slot.state not in (WorkerState.LEFT, WorkerState.EXCLUDED):
                slot.state = WorkerState.LEFT
                slot.preferred = False
                message = "worker %s left %s: it is given no more calls (%d in flight finish)"
                self._notes.append(
                    (logging.WARNING, message, (slot.address, self.fleet.describe(), len(slot.in_flight)))
                )

    def hung(self) -> list[tuple[WorkerSlot, WorkerHung]]:
        """The active workers that stopped answering while the others went on, each with the error that
        takes it out (see :meth:`SchedulingPolicy.hung`)."""
        return [
            (slot, WorkerHung(f"worker {slot.address}: {why}"))
            for slot, why in self.policy.hung(self.slots, self.clock(), self.answers)
        ]

    # ------------------------------------------------------------------ passes

    def open_pass(self, owner: object, events: queue.SimpleQueue) -> PassRecord:
        """Register a new pass ``owner`` whose calls answer on ``events``; the workers that are down are
        probed at once."""
        self.reclaim_dropped()
        self.follow_fleet()
        self.policy.probe_all_down_now(self.slots, self.clock())
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
        for slot in self.slots:
            gone = [attempt for attempt in slot.in_flight if attempt.owner in owners]
            for attempt in gone:
                slot.in_flight.discard(attempt)
                attempt.state = AttemptState.DROPPED
                self._unread.append(attempt.future)

    # ------------------------------------------------------------------ calls

    def pass_window(self) -> int:
        """How many tasks a pass may hold pulled and not handed out."""
        return self.policy.pass_window(self.slots)

    def pick(self) -> WorkerSlot | None:
        """The worker to send a new task to now, if any."""
        return self.policy.pick(self.slots, self.clock())

    def hedge(self, head: Task) -> WorkerSlot | None:
        """Another worker to send a copy of ``head`` (the task a consumer waits for) to, if it needs one."""
        return self.policy.hedge(head, self.slots, self.clock())

    def wait_time(self, awaiting_head: bool) -> float:
        """How long a pass may wait for an answer before it must act."""
        return self.policy.wait_time(self.slots, self.clock(), awaiting_head)

    def sent(self, attempt: Attempt) -> None:
        """Count ``attempt``, a call just made, against its worker."""
        self.policy.sent(self.slots[attempt.worker], attempt, self.answers)

    def in_flight(self) -> list[torch.futures.Future]:
        """The futures of every call in flight, of every pass."""
        return [attempt.future for slot in self.slots for attempt in slot.in_flight]

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
                self.slots[attempt.worker].in_flight.discard(attempt)
                self._unread.append(attempt.future)
            attempt.state = AttemptState.DROPPED

    def release_answered(self, reader: PassRecord) -> None:
        """Free the workers of the calls answered for other passes than ``reader``'s: a pass that is not
        being advanced must not hold workers its answers no longer use."""
        if len(self._passes) < 2:  # a pass alone: the calls in flight are its own
            return
        number = reader.number
        for slot in self.slots:
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

    def gives_up(self, task: Task) -> bool:
        """Whether ``task`` timed out on as many workers as could serve it."""
        return self.policy.gives_up(task, self.slots)

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
        elif slot.state is WorkerState.ACTIVE:
            self._notes.append((logging.WARNING, "worker %s is down: %s", (slot.address, failure)))
        own = []
        for attempt in self.policy.take_down(slot, failure, self.clock()):
            record = self._passes.get(attempt.owner)
            if attempt.owner == by.number:
                own.append(attempt)
            elif record is not None and record.reference() is not None:
                record.events.put(Orphaned(attempt))
            else:  # its pass was dropped: nobody reads its answer
                self._unread.append(attempt.future)
        return own

    # ------------------------------------------------------------------ revival

    def start_due_probes(self) -> None:
        """Revive the workers whose probe is due (they are ``PROBING`` from now on); when none of this
        client's own workers is left, the others' in reserve are set up first."""
        called = self.policy.call_on_standby(self.slots, self.clock())
        if called:
            names = ", ".join(slot.address for slot in called)
            self._notes.append((logging.WARNING, "none of this rank's own workers is left: using %s", (names,)))
        self._to_probe.extend(self.policy.probes_due(self.slots, self.clock()))

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
            state = self.policy.probe_ended(slot, outcome, self.clock())
            if state is WorkerState.ACTIVE:
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
        prefetch_factor: calls in flight per worker at least (and tasks not
            handed out yet per active worker); a worker whose link needs more
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
            return [slot.address for slot in state.slots]

    def locked(self) -> PoolState:
        """The pool's state, to enter (``with pool.locked() as state:``): entering takes the pool's lock."""
        return self._state

    def states(self) -> dict[str, str]:
        """Each worker's state: ``active``, ``down``, ``probing``, ``excluded``, ``standby`` (another rank's,
        in reserve) or ``left`` (its source no longer lists it)."""
        with self._state as state:
            state.reclaim_dropped()
            state.follow_fleet()
            return {slot.address: slot.state.value for slot in state.slots}

    def active(self) -> list[tuple[int, str]]:
        """The workers that may be given tasks: their index in the pool and address."""
        with self._state as state:
            return [(slot.index, slot.address) for slot in active(state.slots)]

    def windows(self) -> dict[str, dict[str, Any]]:
        """Each worker's scheduling state: ``state``, calls ``in_flight`` (all passes), the ``window`` of calls
        it may have in flight, and, in seconds (``None`` until measured), its ``service_time``, its shortest
        round trip ``rtt`` and its average ``round_trip`` over the last window of answers."""
        with self._state as state:
            state.reclaim_dropped()
            return {
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
