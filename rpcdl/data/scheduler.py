"""Ordered dispatch of calls to workers that may be slow, fail, restart or come back.

A :class:`WorkerPool` keeps what a client knows of its workers across passes
(epochs): their state, calls in flight, measured service time and probe
schedule. A :class:`Dispatch` is one pass over a source of payloads:

- each payload goes to the worker expected to finish it first (its calls in
  flight times its service time), at most its window of calls in flight (at
  least ``prefetch_factor``, more on a link with a long round trip), never to
  a worker much slower than the best one could be;
- at most the active workers' windows together are in flight or done and not
  yet handed out;
- finished tasks are handed out in source order (or as they complete); when
  the task the consumer waits for is late, a copy goes to another worker and
  the first answer wins;
- an infrastructure failure (:func:`rpcdl.errors.is_transient`, or a worker
  that lost its state) takes the worker out: its tasks go to the others, it is
  revived in the background and rejoins (see :func:`probe_async`); a task
  that timed out on every worker fails; an exception raised by user code is
  the task's result, not retried.

The pool runs no thread of its own: everything happens in the consumer's
``next()``, fed by the futures' callbacks through a queue. Several passes over
one pool may be open at once (two iterators of one loader): each owns its tasks
and its own queue of answers, while the workers' health, probes and the
per-worker limit of calls in flight are the pool's and hold across passes. The
passes of one pool are advanced by one thread at a time (as a training loop
does); a pass that is not advanced does not hold the others back: its
finished calls free their workers' slots whichever pass notices them. The
consumer reads the answers to its calls itself while it waits (see
:func:`rpcdl.rpc.client.answers_read_here`), which saves two thread switches per
answer; large answers are read by the connections' threads, in parallel.

The decisions (which worker, which copy, who is taken out, which probe is due,
whether none is left) are :mod:`rpcdl.data.scheduling_policy`'s, plain functions of
the records and the time of the pool's ``clock``; this module does the I/O.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..errors import RPCDLError, WorkerTimeout
from ..rpc.client import answers_read_here, ping_async, read_answers, read_in_background, rpc_async, sent_together
from ..rpc.held import outside_held_blocks
from ..rpc.rref import RRefNotFound
from .scheduler_parts import Call, Revive, Task, WorkerSlot, WorkerState, _Attempt, _StillBusy
from .scheduling_policy import AllDownWatch, SchedulingPolicy, active, is_worker_failure

__all__ = [
    "Call",
    "Dispatch",
    "NoWorkersLeft",
    "Revive",
    "Task",
    "WorkerPool",
    "WorkerSlot",
    "WorkerState",
    "probe_async",
]

log = logging.getLogger("rpcdl.scheduler")

_PROBE_TIMEOUT = 10.0


class NoWorkersLeft(RPCDLError, RuntimeError):
    """Every worker failed and none came back within the timeout."""


def does_nothing() -> None:
    """Runs on a worker for :func:`probe_async`: a call that does nothing."""


def probe_async(slot: WorkerSlot, timeout: float) -> torch.futures.Future:
    """Ask whether a worker that was taken out may be given tasks again: a future that fails if not.

    A worker taken out because a call timed out is most likely still running
    that call, which nothing can interrupt. Tasks sent to it would wait behind
    that call and time out in turn, failing on every worker for a cost that is
    not theirs. So it is sent a call that does nothing, queued behind its
    calls, together with a ping: it rejoins once the call is answered (it has
    a free slot), and the future fails with ``_StillBusy`` when only the
    ping was (it is alive, to be asked again). Any other worker is pinged: it
    answers at once, even while calls run.

    Args:
        slot: the worker, with the failure that took it out.
        timeout: seconds the probe may take.
    """
    ping = ping_async(slot.address, timeout=timeout)
    if not isinstance(slot.failure, (WorkerTimeout, _StillBusy)):
        return ping
    queued = rpc_async(slot.address, does_nothing, timeout=timeout)
    probed: torch.futures.Future = torch.futures.Future()
    torch.futures.collect_all([queued, ping]).add_done_callback(lambda _: _free_or_busy(queued, ping, probed))
    return probed


def _free_or_busy(queued: torch.futures.Future, ping: torch.futures.Future, probed: torch.futures.Future) -> None:
    try:
        queued.wait()
    except WorkerTimeout:
        try:
            ping.wait()
        except Exception as exc:  # unreachable, not only busy
            probed.set_exception(exc)
        else:
            probed.set_exception(_StillBusy("it answers pings but is still running calls that timed out"))
    except Exception as exc:
        probed.set_exception(exc)
    else:
        probed.set_result(None)


class WorkerPool:
    """The workers of one loader or mapper, and their health, across passes.

    Args:
        workers: worker addresses.
        prefetch_factor: calls in flight per worker at least (and tasks not
            handed out yet per active worker); a worker whose link needs more
            to stay busy gets more, up to ``max_window``
            (see :meth:`SchedulingPolicy.window <rpcdl.data.scheduling_policy.SchedulingPolicy.window>`).
        timeout: seconds a call may take before its task goes elsewhere; also
            how long to wait for a worker when none is left.
        revive: makes a failed worker usable again (default: a ping).
        forget: called with a worker's address when it lost its state (it
            restarted): the owner of that state drops its references.
        max_window: calls in flight per worker at most (default: ``4 * prefetch_factor``).
        clock: the time in seconds, monotonic (injected so that tests drive it).
    """

    def __init__(
        self,
        workers: Sequence[str],
        *,
        prefetch_factor: int,
        timeout: float,
        revive: Revive | None = None,
        forget: Callable[[str], None] | None = None,
        max_window: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.slots = [WorkerSlot(address, index) for index, address in enumerate(workers)]
        self.prefetch_factor = prefetch_factor
        self.timeout = float(timeout)
        self.policy = SchedulingPolicy(prefetch_factor=prefetch_factor, timeout=self.timeout, max_window=max_window)
        self.clock = clock
        self.revive = revive or (lambda slot: probe_async(slot, min(self.timeout, _PROBE_TIMEOUT)))
        self.forget = forget or (lambda address: None)
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # probes: one may end in a later pass
        self._passes: weakref.WeakSet[Dispatch] = weakref.WeakSet()
        self._passes_lock = threading.Lock()  # passes open and close on the consumer's thread, probes end on others

    @property
    def served(self) -> dict[str, int]:
        """Tasks each worker completed (and the pool accepted) so far."""
        return {slot.address: slot.served for slot in self.slots}

    def states(self) -> dict[str, str]:
        """Each worker's state: ``active``, ``down``, ``probing`` or ``excluded``."""
        return {slot.address: slot.state.value for slot in self.slots}

    def active(self) -> list[WorkerSlot]:
        """The workers that may be given tasks."""
        return active(self.slots)

    def windows(self) -> dict[str, dict[str, Any]]:
        """Each worker's scheduling state: ``state``, calls ``in_flight`` (all passes), the ``window`` of calls
        it may have in flight, and, in seconds (``None`` until measured), its ``service_time``, its shortest
        round trip ``rtt`` and its average ``round_trip`` over the last window of answers."""
        return {
            slot.address: {
                "state": slot.state.value,
                "in_flight": len(slot.in_flight),
                "window": self.policy.window(slot),
                "service_time": slot.service_time,
                "rtt": slot.rtt,
                "round_trip": slot.round_trip,
            }
            for slot in self.slots
        }

    def start(self, source: Iterator[Any], call: Call, *, in_order: bool = True) -> Dispatch:
        """Begin a pass over ``source``; iterate the result for finished tasks.

        Passes already open go on independently (close them to stop them).
        """
        self.policy.probe_all_down_now(self.slots, self.clock())
        dispatch = Dispatch(self, source, call, in_order)
        with self._passes_lock:
            self._passes.add(dispatch)
        return dispatch

    def probe_done(self, slot: WorkerSlot, future: torch.futures.Future) -> None:
        """A revival ended (any thread): queue it for the pool and wake every open pass to handle it."""
        self.events.put(("revived", slot, future))
        with self._passes_lock:
            open_passes = list(self._passes)
        for dispatch in open_passes:
            dispatch.events.put(("wake", None, None))

    def forget_pass(self, dispatch: Dispatch) -> None:
        """``dispatch`` closed: probes no longer wake it."""
        with self._passes_lock:
            self._passes.discard(dispatch)

    def release_answered(self, reader: queue.SimpleQueue) -> None:
        """Free the worker slots of calls answered for the other passes than ``reader``'s (its events queue):
        a pass that is not being advanced must not hold workers its answers no longer use."""
        if len(self._passes) < 2:  # a pass alone: the calls in flight are its own (a closed pass drops its own)
            return
        for slot in self.slots:
            answered = [a for a in slot.in_flight if a.events is not reader and a.future.done()]
            slot.in_flight.difference_update(answered)


class Dispatch(Iterator[Task]):
    """One pass: an iterator of finished :class:`~rpcdl.data.scheduler_parts.Task` objects (see the module)."""

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
        self._all_down = AllDownWatch(pool.timeout)

    def __next__(self) -> Task:
        if self.closed:
            raise StopIteration
        # Answers that came meanwhile free their workers' slots, and the task handed out last
        # left room in the window: top it up now, before waiting. (Not as a task is handed out:
        # the consumer still holds the one before, so the window would hold one batch more.)
        self._handle_events(wait=False)
        while True:
            self._dispatch()
            task = self._pop_finished()
            if task is not None:
                return task
            if self._source_done and not self._outstanding:
                self.close()
                raise StopIteration
            self._probe_due()
            self._handle_events()
            task = self._pop_finished()  # before topping up: see above
            if task is not None:
                return task

    def close(self) -> None:
        """End the pass; answers still in flight are dropped when they arrive."""
        self.pool.forget_pass(self)
        self._end()

    def _end(self) -> None:
        self.closed = True
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
            self._end()  # the pool's weak set has already dropped this pass (and a finalizer must not take its lock)

    def _head(self) -> Task:
        return next(iter(self._outstanding.values()))  # tasks go in in source order: the first is the oldest

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
        return self.pool.policy.pass_window(self.pool.slots)

    def _pick(self) -> WorkerSlot | None:
        return self.pool.policy.pick(self.pool.slots, self.pool.clock())

    def _dispatch(self) -> None:
        copy = self._hedge()
        if copy is None and not self._waiting and (self._source_done or len(self._outstanding) >= self._window()):
            return
        with sent_together(), answers_read_here():  # one system call per worker for what goes out now
            if copy is not None:  # first: the consumer waits for it; it must not wait for a slot behind new tasks
                self._send(*copy)
            self._send_waiting()

    def _send_waiting(self) -> None:
        window = self._window()
        while True:
            if not self._waiting:
                if self._source_done or len(self._outstanding) >= window:
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
            if slot.state is not WorkerState.ACTIVE:  # it failed: the pass's window shrank
                window = self._window()

    def _send(self, task: Task, slot: WorkerSlot) -> None:
        attempt = _Attempt(task, slot, self.pool.clock(), self.events)
        try:
            future = self._call(task, slot)
        except Exception as exc:
            if is_worker_failure(exc):
                self._waiting.appendleft(task)
                self._mark_down(slot, exc)
            else:  # the payload cannot be sent: the error is its result
                self._finish(task, slot, error=exc)
            return
        attempt.future = future
        task.attempts.append(attempt)
        self.pool.policy.sent(slot, attempt)
        # Not self: a dropped pass is collected (and closed) while its calls run.
        future.add_done_callback(lambda done: attempt.events.put(("result", attempt, done)))

    def _hedge(self) -> tuple[Task, WorkerSlot] | None:
        """The task the consumer waits for and another worker to send a copy to, if it needs one."""
        if not self.in_order or not self._outstanding:
            return None
        head = self._head()
        slot = self.pool.policy.hedge(head, self.pool.slots, self.pool.clock())
        return None if slot is None else (head, slot)

    # ------------------------------------------------------------------ events

    def _wait_time(self) -> float:
        awaiting_head = self.in_order and bool(self._outstanding)
        return self.pool.policy.wait_time(self.pool.slots, self.pool.clock(), awaiting_head)

    def _handle_events(self, wait: bool = True) -> None:
        in_flight = [attempt.future for slot in self.pool.slots for attempt in slot.in_flight]
        timeout = self._wait_time() if wait else 0.0
        if read_answers(in_flight, timeout) is not None:  # read here (their events are queued), or none came in time
            timeout = 0.0
        events = self.events
        try:
            event = events.get(timeout=timeout) if timeout > 0 else (None if events.empty() else events.get_nowait())
        except queue.Empty:
            event = None
        while event is not None:
            kind, subject, future = event
            if kind == "result":
                self._on_result(subject, future, arrived_now=wait)
            elif kind == "retry":  # another pass took the worker of this task out
                self._retry(subject)
                self._waiting = collections.deque(sorted(self._waiting, key=lambda task: task.seq))
            try:
                event = None if events.empty() else events.get_nowait()
            except queue.Empty:
                event = None
        while not self.pool.events.empty():
            try:
                _, slot, future = self.pool.events.get_nowait()
            except queue.Empty:
                break
            self._on_revived(slot, future)
        self.pool.release_answered(self.events)
        self._check_no_workers()

    def _on_result(self, attempt: _Attempt, future: torch.futures.Future, arrived_now: bool = True) -> None:
        slot, task = attempt.slot, attempt.task
        slot.in_flight.discard(attempt)
        try:
            value = future.wait()
        except Exception as exc:
            if not attempt.live or task.done:
                if is_worker_failure(exc) and slot.state == WorkerState.ACTIVE:
                    self._mark_down(slot, exc)  # a copy elsewhere saved the task, yet this worker failed
                return
            attempt.live = False
            if not is_worker_failure(exc):
                self._finish(task, slot, error=exc)
                return
            if slot.state == WorkerState.ACTIVE:  # else another pass took it out already
                self._mark_down(slot, exc)
            if isinstance(exc, WorkerTimeout):
                task.timeouts += 1
                if self.pool.policy.gives_up(task, self.pool.slots):
                    exc.add_note(
                        f"task {task.seq} timed out on {task.timeouts} workers: it takes longer than "
                        f"timeout={self.pool.timeout:g}s; raise the timeout"
                    )
                    self._finish(task, slot, error=exc)
                    return
            self._retry(task)
            return
        self.pool.policy.observe(slot, attempt, self.pool.clock(), measure_link=arrived_now)
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
        for attempt in self.pool.policy.take_down(slot, exc, self.pool.clock()):
            if attempt.events is self.events:
                self._retry(attempt.task)
            else:
                attempt.events.put(("retry", attempt.task, None))
        self._waiting = collections.deque(sorted(self._waiting, key=lambda task: task.seq))

    # ------------------------------------------------------------------ revival

    def _probe_due(self) -> None:
        for slot in self.pool.policy.probes_due(self.pool.slots, self.pool.clock()):
            self._probe(slot)

    def _probe(self, slot: WorkerSlot) -> None:
        try:
            future = self.pool.revive(slot)
        except Exception as exc:
            future = torch.futures.Future()
            future.set_exception(exc)
        future.add_done_callback(lambda done, slot=slot, pool=self.pool: pool.probe_done(slot, done))

    def _on_revived(self, slot: WorkerSlot, future: torch.futures.Future) -> None:
        try:
            future.wait()
            failure = None
        except Exception as exc:
            failure = exc
        was_busy = isinstance(slot.failure, _StillBusy)
        state = self.pool.policy.probe_ended(slot, failure, self.pool.clock())
        if state == WorkerState.ACTIVE:
            log.warning("worker %s is back", slot.address)
        elif state == WorkerState.PROBING:
            if not was_busy:
                log.warning("worker %s is not back yet: %s; it rejoins when they end", slot.address, failure)
            self._probe(slot)
        elif state == WorkerState.EXCLUDED:
            log.error("worker %s is kept out: %s", slot.address, failure)

    def _check_no_workers(self) -> None:
        message = self._all_down.check(self.pool.slots, self.pool.clock())
        if message is not None:
            self.close()
            raise NoWorkersLeft(message)
