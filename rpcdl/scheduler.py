"""Ordered dispatch of calls to workers that may be slow, fail, restart or come back.

A :class:`WorkerPool` keeps what a client knows of its workers across passes
(epochs): their state, calls in flight, measured service time and probe
schedule. A :class:`Dispatch` is one pass over a source of payloads:

- each payload goes to the worker expected to finish it first (its calls in
  flight times its service time), at most ``prefetch_factor`` calls per worker,
  never to a worker much slower than the best one could be;
- at most ``prefetch_factor`` payloads per active worker are in flight or done
  and not yet handed out;
- finished tasks are handed out in source order (or as they complete); when
  the task the consumer waits for is late, a copy goes to another worker and
  the first answer wins;
- an infrastructure failure (:func:`rpcdl.errors.is_transient`, or a worker
  that lost its state) takes the worker out: its tasks go to the others, it is
  revived in the background and rejoins; a task that timed out on every worker
  fails; an exception raised by user code is the task's result, not retried.

The pool runs no thread of its own: everything happens in the consumer's
``next()``, fed by the futures' callbacks through a queue. Several passes over
one pool may be open at once (two iterators of one loader): each owns its tasks
and its own queue of answers, while the workers' health, probes and the
per-worker limit of calls in flight are the pool's and hold across passes. The
passes of one pool are advanced by one thread at a time (as a training loop
does); a pass that is not advanced does not hold the others back: its
finished calls free their workers' slots whichever pass notices them. The
consumer reads the answers to its calls itself while it waits (see
:func:`rpcdl.client.answers_read_here`), which saves two thread switches per
answer; large answers are read by the connections' threads, in parallel.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .client import answers_read_here, ping_async, read_answers, read_in_background, sent_together
from .errors import RPCDLError, WorkerTimeout, is_transient
from .held import outside_held_blocks
from .rref import RRefNotFound
from .scheduler_parts import _FIRST_PROBE_DELAY, Call, Revive, Task, WorkerSlot, WorkerState, _Attempt

__all__ = ["Call", "Dispatch", "NoWorkersLeft", "Revive", "Task", "WorkerPool", "WorkerSlot", "WorkerState"]

log = logging.getLogger("rpcdl.scheduler")

_HEDGE_FACTOR = 3.0  # a head task older than this many service times gets a copy elsewhere
_SLOW_FACTOR = 2.0  # a worker expected to finish later than this times the best is passed over
_MIN_HEDGE_AGE = 0.05
_PROBE_TIMEOUT = 10.0
_MAX_PROBE_DELAY = 5.0
_IDLE_WAIT = 0.5


class NoWorkersLeft(RPCDLError, RuntimeError):
    """Every worker failed and none came back within the timeout."""


class WorkerPool:
    """The workers of one loader or mapper, and their health, across passes.

    Args:
        workers: worker addresses.
        prefetch_factor: calls in flight per worker (and tasks not handed out
            yet per active worker).
        timeout: seconds a call may take before its task goes elsewhere; also
            how long to wait for a worker when none is left.
        revive: makes a failed worker usable again (default: a ping).
        forget: called with a worker's address when it lost its state (it
            restarted): the owner of that state drops its references.
    """

    def __init__(
        self,
        workers: Sequence[str],
        *,
        prefetch_factor: int,
        timeout: float,
        revive: Revive | None = None,
        forget: Callable[[str], None] | None = None,
    ):
        self.slots = [WorkerSlot(address, index) for index, address in enumerate(workers)]
        self.prefetch_factor = prefetch_factor
        self.timeout = float(timeout)
        self.revive = revive or (lambda slot: ping_async(slot.address, timeout=min(self.timeout, _PROBE_TIMEOUT)))
        self.forget = forget or (lambda address: None)
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # probes: one may end in a later pass
        self._passes: weakref.WeakSet[Dispatch] = weakref.WeakSet()

    @property
    def served(self) -> dict[str, int]:
        """Tasks each worker completed (and the pool accepted) so far."""
        return {slot.address: slot.served for slot in self.slots}

    def states(self) -> dict[str, str]:
        """Each worker's state: ``active``, ``down``, ``probing`` or ``excluded``."""
        return {slot.address: slot.state.value for slot in self.slots}

    def active(self) -> list[WorkerSlot]:
        return [slot for slot in self.slots if slot.state == WorkerState.ACTIVE]

    def start(self, source: Iterator[Any], call: Call, *, in_order: bool = True) -> Dispatch:
        """Begin a pass over ``source``; iterate the result for finished tasks.

        Passes already open go on independently (close them to stop them).
        """
        now = time.monotonic()
        for slot in self.slots:
            if slot.state == WorkerState.DOWN:
                slot.probe_at = now
        dispatch = Dispatch(self, source, call, in_order)
        self._passes.add(dispatch)
        return dispatch

    def probe_done(self, slot: WorkerSlot, future: torch.futures.Future) -> None:
        """A revival ended (any thread): queue it for the pool and wake every open pass to handle it."""
        self.events.put(("revived", slot, future))
        while True:
            try:  # the consumer may open or close a pass meanwhile: then copy again
                open_passes = list(self._passes)
                break
            except RuntimeError:
                continue
        for dispatch in open_passes:
            dispatch.events.put(("wake", None, None))

    def release_answered(self, reader: queue.SimpleQueue) -> None:
        """Free the worker slots of calls answered for the other passes than ``reader``'s (its events queue):
        a pass that is not being advanced must not hold workers its answers no longer use."""
        for slot in self.slots:
            answered = [a for a in slot.in_flight if a.events is not reader and a.future.done()]
            slot.in_flight.difference_update(answered)


class Dispatch(Iterator[Task]):
    """One pass: an iterator of finished :class:`Task` objects (see the module)."""

    def __init__(self, pool: WorkerPool, source: Iterator[Any], call: Call, in_order: bool):
        self.pool = pool
        self.in_order = in_order
        self.closed = False
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # this pass's answers (and wake-ups)
        self._source = source
        self._call = call
        self._seq = itertools.count()
        self._source_done = False
        self._outstanding: dict[int, Task] = {}  # pulled, not handed out
        self._waiting: collections.deque[Task] = collections.deque()  # to (re)send, oldest first
        self._finished: collections.deque[Task] = collections.deque()  # in completion order
        self._all_down_since: float | None = None

    def __next__(self) -> Task:
        if self.closed:
            raise StopIteration
        # Answers that came meanwhile free their workers' slots, and the task handed out last
        # left room in the window: top it up now, before waiting. (Not as a task is handed out:
        # the consumer still holds the one before, so the window would hold one batch more.)
        self._handle_events(wait=False)
        self._dispatch()
        while True:
            task = self._pop_finished()
            if task is not None:
                return task
            if self._source_done and not self._outstanding:
                self.close()
                raise StopIteration
            self._dispatch()
            self._probe_due()
            self._handle_events()

    def close(self) -> None:
        """End the pass; answers still in flight are dropped when they arrive."""
        self.closed = True
        self.pool._passes.discard(self)
        unread = []
        for task in self._outstanding.values():
            for attempt in task.attempts:
                attempt.live = False
                attempt.slot.in_flight.discard(attempt)
                unread.append(attempt.future)
        read_in_background(unread)  # nobody reads for this pass any more; a worker must not block sending them
        self._outstanding.clear()
        self._waiting.clear()
        self._finished.clear()

    def __del__(self):
        if not self.closed:
            self.close()

    def _head(self) -> Task:
        return self._outstanding[min(self._outstanding)]

    def _pop_finished(self) -> Task | None:
        if self.in_order:
            if not self._outstanding or not self._head().done:
                return None
            task = self._head()
        else:
            if not self._finished:
                return None
            task = self._finished.popleft()
        del self._outstanding[task.seq]
        return task

    # ------------------------------------------------------------------ dispatch

    def _window(self) -> int:
        return self.pool.prefetch_factor * max(len(self.pool.active()), 1)

    def _default_service_time(self) -> float:
        times = [slot.service_time for slot in self.pool.slots if slot.service_time is not None]
        return min(times) if times else 1.0

    def _pick(self, exclude: WorkerSlot | None = None) -> WorkerSlot | None:
        """The active worker expected to finish a new task first, unless it is much slower than the best."""
        candidates = [slot for slot in self.pool.active() if slot is not exclude]
        if not candidates:
            return None
        default = self._default_service_time()
        best_possible = min(slot.expected_done(default) for slot in candidates)
        free = [slot for slot in candidates if len(slot.in_flight) < self.pool.prefetch_factor]
        if not free:
            return None
        chosen = min(free, key=lambda slot: (slot.expected_done(default), len(slot.in_flight), slot.index))
        if chosen.expected_done(default) > _SLOW_FACTOR * best_possible and not chosen.due_for_trial(time.monotonic()):
            return None  # better to wait for a faster worker
        return chosen

    def _dispatch(self) -> None:
        copy = self._hedge()
        if copy is None and not self._waiting and (self._source_done or len(self._outstanding) >= self._window()):
            return
        with sent_together(), answers_read_here():  # one system call per worker for what goes out now
            if copy is not None:  # first: the consumer waits for it; it must not wait for a slot behind new tasks
                self._send(*copy)
            self._send_waiting()

    def _send_waiting(self) -> None:
        while True:
            if not self._waiting:
                if self._source_done or len(self._outstanding) >= self._window():
                    break
                try:
                    with outside_held_blocks():  # the source may be another stage that waits for its answers
                        payload = next(self._source)
                except StopIteration:
                    self._source_done = True
                    break
                task = Task(next(self._seq), payload)
                self._outstanding[task.seq] = task
                self._waiting.append(task)
            slot = self._pick()
            if slot is None:
                break
            self._send(self._waiting.popleft(), slot)

    def _send(self, task: Task, slot: WorkerSlot) -> None:
        attempt = _Attempt(task, slot, time.monotonic(), self.events)
        try:
            future = self._call(task, slot)
        except Exception as exc:
            if _worker_failure(exc):
                self._waiting.appendleft(task)
                self._mark_down(slot, exc)
            else:  # the payload cannot be sent: the error is its result
                self._finish(task, slot, error=exc)
            return
        attempt.future = future
        task.attempts.append(attempt)
        slot.in_flight.add(attempt)
        slot.last_sent = attempt.sent_at
        # Not self: a dropped pass is collected (and closed) while its calls run.
        future.add_done_callback(lambda done: attempt.events.put(("result", attempt, done)))

    def _hedge(self) -> tuple[Task, WorkerSlot] | None:
        """The task the consumer waits for and another worker to send a copy to, when it is late on
        its worker or another is expected to finish it much sooner (a slow worker's trial task)."""
        if not self.in_order or not self._outstanding:
            return None
        head = self._head()
        live = [attempt for attempt in head.attempts if attempt.live]
        if head.done or len(live) != 1 or len(head.attempts) > 2:
            return None
        attempt = live[0]
        default = self._default_service_time()
        age = time.monotonic() - attempt.sent_at
        late = age >= max(_HEDGE_FACTOR * default, _MIN_HEDGE_AGE)
        remaining_here = (attempt.slot.service_time or default) - age
        if not late and remaining_here <= _SLOW_FACTOR * default:
            return None
        slot = self._pick(exclude=attempt.slot)
        if slot is not None and (late or remaining_here > _SLOW_FACTOR * slot.expected_done(default)):
            return head, slot
        return None

    # ------------------------------------------------------------------ events

    def _wait_time(self) -> float:
        now = time.monotonic()
        deadline = now + _IDLE_WAIT
        probes = [slot.probe_at for slot in self.pool.slots if slot.state == WorkerState.DOWN]
        if probes:
            deadline = min(deadline, min(probes))
        if self.in_order and self._outstanding:
            deadline = min(deadline, now + max(_MIN_HEDGE_AGE, self._default_service_time()))
        return max(0.0, deadline - now)

    def _handle_events(self, wait: bool = True) -> None:
        in_flight = [attempt.future for slot in self.pool.slots for attempt in slot.in_flight]
        timeout = self._wait_time() if wait else 0.0
        if read_answers(in_flight, timeout) is not None:  # read here (their events are queued), or none came in time
            timeout = 0.0
        try:
            event = self.events.get(timeout=timeout) if timeout > 0 else self.events.get_nowait()
        except queue.Empty:
            event = None
        while event is not None:
            kind, subject, future = event
            if kind == "result":
                self._on_result(subject, future)
            elif kind == "retry":  # another pass took the worker of this task out
                self._retry(subject)
                self._waiting = collections.deque(sorted(self._waiting, key=lambda task: task.seq))
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                event = None
        while True:
            try:
                _, slot, future = self.pool.events.get_nowait()
            except queue.Empty:
                break
            self._on_revived(slot, future)
        self.pool.release_answered(self.events)
        self._check_no_workers()

    def _on_result(self, attempt: _Attempt, future: torch.futures.Future) -> None:
        slot, task = attempt.slot, attempt.task
        slot.in_flight.discard(attempt)
        try:
            value = future.wait()
        except Exception as exc:
            if not attempt.live or task.done:
                if _worker_failure(exc) and slot.state == WorkerState.ACTIVE:
                    self._mark_down(slot, exc)  # a copy elsewhere saved the task, yet this worker failed
                return
            attempt.live = False
            if not _worker_failure(exc):
                self._finish(task, slot, error=exc)
                return
            if slot.state == WorkerState.ACTIVE:  # else another pass took it out already
                self._mark_down(slot, exc)
            if isinstance(exc, WorkerTimeout):
                task.timeouts += 1
                if task.timeouts >= sum(s.state != WorkerState.EXCLUDED for s in self.pool.slots):
                    exc.add_note(
                        f"task {task.seq} timed out on {task.timeouts} workers: it takes longer than "
                        f"timeout={self.pool.timeout:g}s; raise the timeout"
                    )
                    self._finish(task, slot, error=exc)
                    return
            self._retry(task)
            return
        slot.observe(attempt, time.monotonic())
        if attempt.live and not task.done and not self.closed:
            slot.served += 1
            self._finish(task, slot, value=value)

    def _finish(self, task: Task, slot: WorkerSlot, value: Any = None, error: BaseException | None = None) -> None:
        task.done, task.value, task.error, task.worker = True, value, error, slot.address
        for attempt in task.attempts:
            if attempt.live:
                attempt.live = False
                attempt.slot.in_flight.discard(attempt)
        task.attempts = []  # no task <-> attempt cycle: the value goes when the consumer drops it
        if not self.in_order:  # in order, tasks are handed out from _outstanding
            self._finished.append(task)

    def _retry(self, task: Task) -> None:
        if not task.done and not any(a.live for a in task.attempts) and task not in self._waiting:
            self._waiting.appendleft(task)

    def _mark_down(self, slot: WorkerSlot, exc: BaseException) -> None:
        if slot.state == WorkerState.EXCLUDED:
            return
        if slot.state == WorkerState.ACTIVE:
            log.warning("worker %s left: %s", slot.address, exc)
        if isinstance(exc, RRefNotFound):
            self.pool.forget(slot.address)
        slot.state = WorkerState.DOWN
        slot.failure = exc
        slot.probe_at = time.monotonic() + slot.probe_delay
        slot.probe_delay = min(slot.probe_delay * 2, _MAX_PROBE_DELAY)
        for attempt in list(slot.in_flight):
            attempt.live = False
            if attempt.events is self.events:
                self._retry(attempt.task)
            else:
                attempt.events.put(("retry", attempt.task, None))
        slot.in_flight.clear()
        self._waiting = collections.deque(sorted(self._waiting, key=lambda task: task.seq))

    # ------------------------------------------------------------------ revival

    def _probe_due(self) -> None:
        now = time.monotonic()
        for slot in self.pool.slots:
            if slot.state != WorkerState.DOWN or slot.probe_at > now:
                continue
            slot.state = WorkerState.PROBING
            try:
                future = self.pool.revive(slot)
            except Exception as exc:
                future = torch.futures.Future()
                future.set_exception(exc)
            future.add_done_callback(lambda done, slot=slot, pool=self.pool: pool.probe_done(slot, done))

    def _on_revived(self, slot: WorkerSlot, future: torch.futures.Future) -> None:
        if slot.state != WorkerState.PROBING:
            return
        try:
            future.wait()
        except Exception as exc:
            slot.failure = exc
            if is_transient(exc):
                slot.state = WorkerState.DOWN
                slot.probe_at = time.monotonic() + slot.probe_delay
                slot.probe_delay = min(slot.probe_delay * 2, _MAX_PROBE_DELAY)
            else:
                log.error("worker %s is kept out: %s", slot.address, exc)
                slot.state = WorkerState.EXCLUDED
            return
        log.warning("worker %s is back", slot.address)
        slot.state = WorkerState.ACTIVE
        slot.probe_delay = _FIRST_PROBE_DELAY
        slot.service_time = None
        slot.last_done = 0.0

    def _check_no_workers(self) -> None:
        if self.pool.active():
            self._all_down_since = None
            return
        now = time.monotonic()
        if self._all_down_since is None:
            self._all_down_since = now
        recoverable = any(slot.state != WorkerState.EXCLUDED for slot in self.pool.slots)
        if recoverable and now - self._all_down_since < self.pool.timeout:
            return
        self.close()
        details = "; ".join(f"{slot.address} ({slot.state.value}: {slot.failure})" for slot in self.pool.slots)
        raise NoWorkersLeft(f"no worker is left (waited {self.pool.timeout:g}s for one to come back): {details}")


def _worker_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the worker failed (rather than the user's code)."""
    return is_transient(exc) or isinstance(exc, RRefNotFound)
