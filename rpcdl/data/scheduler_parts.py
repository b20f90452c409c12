"""What a :class:`~rpcdl.data.scheduler.WorkerPool` knows of each worker and each task.

Plain records, read and changed only by the thread advancing a pass; the
decisions that change them are :mod:`rpcdl.data.scheduling_policy`'s.
"""

from __future__ import annotations

import enum
import queue
from collections.abc import Callable
from typing import Any

import torch

FIRST_PROBE_DELAY = 0.2


class WorkerState(enum.Enum):
    """What a worker is to the scheduler."""

    ACTIVE = "active"
    DOWN = "down"  # failed; revived when its probe is due
    PROBING = "probing"  # a revival is in flight
    EXCLUDED = "excluded"  # cannot serve (its dataset differs, say): never used again


class WorkerSlot:
    """What the client knows of one worker.

    Its estimates, in seconds (``None`` until measured): ``service_time``, the
    time a call costs it (the wait for an answer, counted from the later of the
    call's sending and the answer before); ``rtt``, the shortest round trip of
    a call (latency and work, no wait); ``round_trip``, the average round trip
    over the last window of answers. ``window``: the calls it may have in
    flight (``None``: ``prefetch_factor``), adapted by
    :meth:`rpcdl.data.scheduling_policy.SchedulingPolicy.observe`.
    """

    __slots__ = (
        "address",
        "answers",
        "downs",
        "failure",
        "in_flight",
        "index",
        "last_done",
        "last_sent",
        "probe_at",
        "probe_delay",
        "probes",
        "round_trip",
        "round_trips",
        "rtt",
        "served",
        "service_time",
        "state",
        "window",
        "window_filled",
    )  # fmt: skip

    def __init__(self, address: str, index: int):
        self.address = address
        self.index = index
        self.state = WorkerState.ACTIVE
        self.in_flight: set[_Attempt] = set()
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
        self.served = 0

    def expected_done(self, default: float) -> float:
        """When a new call sent now would finish, in service times from now."""
        return (len(self.in_flight) + 1) * (self.service_time or default)


class Task:
    """One payload of a pass; once ``done``, its ``value`` or ``error`` and the ``worker`` that gave it."""

    __slots__ = ("attempts", "done", "error", "payload", "seq", "timeouts", "value", "worker")

    def __init__(self, seq: int, payload: Any):
        self.seq = seq
        self.payload = payload
        self.attempts: list[_Attempt] = []
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.worker = ""
        self.timeouts = 0


class _Attempt:
    """One call of a task to a worker."""

    __slots__ = ("events", "future", "live", "sent_at", "slot", "task")

    def __init__(self, task: Task, slot: WorkerSlot, sent_at: float, events: queue.SimpleQueue):
        self.task, self.slot, self.sent_at, self.live = task, slot, sent_at, True
        self.events = events  # the queue of the pass that sent it
        self.future: torch.futures.Future | None = None


#: Sends a task to a worker: returns the call's future. Raising a transient
#: error or :class:`~rpcdl.rpc.rref.RRefNotFound` takes the worker out.
Call = Callable[[Task, WorkerSlot], torch.futures.Future]
#: Makes a failed worker usable again: a future that completes when it is, or
#: fails with ``_StillBusy`` to be asked again at once.
Revive = Callable[[WorkerSlot], torch.futures.Future]


class _StillBusy(Exception):
    """A probed worker answers pings but is still running calls: it is probed again at once."""
