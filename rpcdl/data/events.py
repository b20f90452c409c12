"""What other threads tell a pass or its pool: typed events, carried by queues.

A call's hook (``rpcdl.rpc.calls.when_answered``) runs on whichever thread
completes its future: the process's event loop, or the caller of
:func:`rpcdl.rpc_async` when the call fails at once. That thread may hold the
pool's lock, and the loop must never wait, so a hook only puts an
event on a queue (:func:`post`, :func:`post_probe_end`); the owner handles it
under the pool's lock at its next step.

Threading: the queues are :class:`queue.SimpleQueue` (any thread puts, the
owner gets); an event does not change once made. An event carries what its
handler needs and nothing points back from it to its queue, so a queue holding
events of a dropped pass is freed with it, by reference counting.
"""

from __future__ import annotations

import dataclasses
import queue
import weakref
from collections.abc import Sequence

import torch

from .records import Attempt, WorkerSlot

__all__ = ["WAKE", "Answered", "Orphaned", "PassEvent", "ProbeEnded", "Wake", "post", "post_probe_end"]


@dataclasses.dataclass(frozen=True, slots=True)
class Answered:
    """The call ``attempt`` was answered (its future is done): for the pass that sent it."""

    attempt: Attempt


@dataclasses.dataclass(frozen=True, slots=True)
class Orphaned:
    """Another pass took the worker of ``attempt`` out: its task must go elsewhere."""

    attempt: Attempt


@dataclasses.dataclass(frozen=True, slots=True)
class Wake:
    """Nothing to handle: look at the pool again (a probe ended, or the pass was closed by another thread)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ProbeEnded:
    """A revival of ``slot`` ended (``future`` done): for its pool, handled by whichever pass looks first."""

    slot: WorkerSlot
    future: torch.futures.Future


#: The one :class:`Wake` event.
WAKE = Wake()

#: What a pass's queue carries.
PassEvent = Answered | Orphaned | Wake


def post(events: queue.SimpleQueue, event: PassEvent, future: torch.futures.Future) -> None:
    """A future's callback: put ``event`` on ``events`` (``future`` is the one it waited for)."""
    events.put(event)


def post_probe_end(
    probes: queue.SimpleQueue,
    waiting: Sequence[weakref.ref[queue.SimpleQueue]],
    slot: WorkerSlot,
    future: torch.futures.Future,
) -> None:
    """A probe's callback: put :class:`ProbeEnded` on the pool's ``probes`` and wake the passes that were open
    when it began (``waiting``: weak references, without callbacks, so that a pass dropped meanwhile is not kept)."""
    probes.put(ProbeEnded(slot, future))
    for reference in waiting:
        events = reference()
        if events is not None:
            events.put(WAKE)
