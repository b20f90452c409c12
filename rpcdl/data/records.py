"""What a :class:`~rpcdl.data.worker_pool.WorkerPool` knows of each worker, and what a pass knows of its tasks.

Plain records; the decisions that change them are
:mod:`rpcdl.data.scheduling_policy`'s, the I/O is :mod:`rpcdl.data.worker_pool`'s and
:mod:`rpcdl.data.scheduler`'s.

Threading: no thread of its own. A :class:`WorkerSlot` and the state of an
:class:`Attempt` belong to their pool's lock: every access is made holding it
(:meth:`rpcdl.data.worker_pool.WorkerPool.locked`). A :class:`Task` belongs to the
thread advancing its pass, one at a time. An attempt's other fields are set
before it is shared and never change. Nothing here points back at what holds
it (an attempt names its task by number and its worker by index), so a dropped
pass is freed by reference counting alone.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import torch

__all__ = ["FIRST_PROBE_DELAY", "Attempt", "AttemptState", "Task", "TaskState", "WorkerSlot", "WorkerState"]

#: Seconds before a worker taken out is first probed; each failed probe doubles it.
FIRST_PROBE_DELAY = 0.2


class WorkerState(enum.Enum):
    """A worker's health, as its pool sees it (the only record of it: see :class:`WorkerSlot`)."""

    ACTIVE = "active"  #: given tasks
    DOWN = "down"  #: failed; revived when its probe is due
    PROBING = "probing"  #: a revival is in flight
    EXCLUDED = "excluded"  #: cannot serve, its dataset differs say; never used again
    STANDBY = "standby"  #: another rank's worker in reserve, set up and used once this rank's own are gone
    LEFT = "left"  #: no longer listed by its source; given no tasks while its calls in flight finish
    DRAINING = "draining"  #: said it is leaving; given no tasks, its calls in flight awaited until ``drain_until``


class WorkerSlot:
    """What the client knows of one worker: its health, its calls in flight, its estimates, its probes.

    Its estimates, in seconds (``None`` until measured): ``service_time``, the
    time a call costs it (the wait for an answer, counted from the later of the
    call's sending and the answer before); ``rtt``, the shortest round trip of
    a call (latency and work, no wait); ``round_trip``, the average round trip
    over the last window of answers. ``window``: the calls it may have in
    flight (``None``: the policy's ``min_window``), adapted by
    :meth:`rpcdl.data.scheduling_policy.SchedulingPolicy.observe`.
    ``failure``: what took it out last (``None`` while it never failed).
    ``drain_until``: while it drains (it said it is leaving), the time by
    the pool's clock until which its calls in flight are awaited.
    ``preferred``: whether it is in this client's own share of the fleet
    (a rank's ``workers[rank::world_size]``); the others are used only when
    none of the own ones is active.

    Args:
        address: the worker's ``host:port``.
        index: its place in the pool.
        preferred: whether it is in this client's own share.
        state: its state to begin with.
    """

    __slots__ = (
        "address",
        "answers",
        "downs",
        "drain_until",
        "failure",
        "in_flight",
        "index",
        "last_done",
        "last_sent",
        "preferred",
        "probe_at",
        "probe_delay",
        "probes",
        "quiet_mark",
        "round_trip",
        "round_trips",
        "rtt",
        "service_time",
        "state",
        "unanswered_since",
        "window",
        "window_filled",
    )

    def __init__(self, address: str, index: int, preferred: bool = True, state: WorkerState = WorkerState.ACTIVE):
        self.address = address
        self.index = index
        self.preferred = preferred
        self.state = state
        self.in_flight: set[Attempt] = set()  # calls sent and not answered, of every pass
        self.service_time: float | None = None
        self.rtt: float | None = None
        self.round_trip: float | None = None
        self.window: int | None = None
        self.round_trips = 0.0  # sum of the round trips measured since the window last changed
        self.answers = 0  # how many
        self.window_filled = False  # it had a full window of calls in flight since then
        self.last_done = 0.0
        self.last_sent = 0.0
        self.probe_at = 0.0
        self.probe_delay = FIRST_PROBE_DELAY
        self.probes = 0  # probes ended, whatever they found
        self.downs = 0  # times it was taken out
        self.failure: BaseException | None = None
        self.drain_until = 0.0  # while DRAINING: when its calls in flight stop being awaited
        self.quiet_mark = 0  # the pool's count of answers when it last answered, or was sent a call idle
        #: when the oldest call it was sent and never answered left, its answer no longer awaited (a pass
        #: ended, or a copy answered first): its silence goes on across passes until it answers (inf: none)
        self.unanswered_since = math.inf

    def expected_done(self, default: float) -> float:
        """When a new call sent now would finish, in service times from now.

        Example::

            >>> WorkerSlot("127.0.0.1:6543", 0).expected_done(default=0.5)
            0.5
        """
        return (len(self.in_flight) + 1) * (self.service_time or default)


class TaskState(enum.Enum):
    """Where a task of a pass is."""

    PENDING = "pending"  #: pulled from the source; waiting for a worker or in flight
    DONE = "done"  #: its ``value`` or its ``error`` is in, from ``worker``


class Task:
    """One payload of a pass; once :attr:`TaskState.DONE`, its ``value`` or ``error`` and the ``worker`` that gave it.

    ``attempts`` are its calls sent so far (emptied once it is done);
    ``timeouts`` counts those that timed out.
    """

    __slots__ = ("attempts", "error", "payload", "seq", "state", "timeouts", "value", "worker")

    def __init__(self, seq: int, payload: Any):
        self.seq = seq
        self.payload = payload
        self.state = TaskState.PENDING
        self.attempts: list[Attempt] = []
        self.value: Any = None
        self.error: BaseException | None = None
        self.worker = ""
        self.timeouts = 0

    def finish(self, worker: str, value: Any = None, error: BaseException | None = None) -> None:
        """Record the outcome: the task is done; its attempts are let go (their answers are dropped)."""
        self.state = TaskState.DONE
        self.value, self.error, self.worker = value, error, worker
        self.attempts = []


class AttemptState(enum.Enum):
    """Where a call of a task is, as its pool sees it."""

    IN_FLIGHT = "in flight"  #: sent, counted in its worker's calls in flight
    ANSWERED = "answered"  #: its answer came; it no longer counts against its worker
    FAILED = "failed"  #: its answer was its worker's failure; its task is sent again
    ORPHANED = "orphaned"  #: its worker was taken out; its answer is dropped, its task sent again
    DROPPED = "dropped"  #: its task is done or its pass closed; its answer is dropped


class Attempt:
    """One call of a task to a worker.

    Args:
        seq: the number of its task in its pass.
        worker: the index of its worker in the pool.
        owner: the number of the pass that sent it (see :class:`rpcdl.data.worker_pool.PassRecord`).
        sent_at: when it was sent, by the pool's clock.
        future: the call's future.
    """

    __slots__ = ("future", "owner", "sent_at", "seq", "state", "worker")

    def __init__(self, seq: int, worker: int, owner: int, sent_at: float, future: torch.futures.Future):
        self.seq, self.worker, self.owner, self.sent_at, self.future = seq, worker, owner, sent_at, future
        self.state = AttemptState.IN_FLIGHT

    @property
    def live(self) -> bool:
        """Whether its answer may still be its task's result (in flight, or answered and not handled yet)."""
        return self.state is AttemptState.IN_FLIGHT or self.state is AttemptState.ANSWERED
