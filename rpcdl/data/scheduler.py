"""One pass over a source of payloads, each sent to workers that may be slow, fail, restart or come back.

A :class:`Dispatch` is one pass (an epoch of a loader, a pass of a remote map)
over a :class:`~rpcdl.data.worker_pool.WorkerPool`:

- each payload goes to the worker expected to finish it first (its calls in
  flight times its service time), at most its window of calls in flight (at
  least ``prefetch_factor`` and ``MIN_WINDOW``, more on a link with a long
  round trip), never to a worker much slower than the best one could be;
- at most the active workers' windows together are in flight or done and not
  yet handed out;
- finished tasks are handed out in source order (or as they complete); when
  the task the consumer waits for is late, a copy goes to another worker and
  the first answer wins;
- a worker that stops answering while the others go on (stopped, hung) is
  taken out as soon as that is clear, long before ``timeout``
  (:meth:`~rpcdl.data.scheduling_policy.SchedulingPolicy.hung`); a worker
  that joins the pool's fleet is set up and given tasks mid-pass, one that
  leaves it is given no more;
- an infrastructure failure (:func:`rpcdl.errors.is_transient`, or a worker
  that lost its state) takes the worker out: its tasks go to the others, it is
  revived in the background and rejoins (see :mod:`rpcdl.data.probes`); a task
  that timed out on every worker fails; an exception raised by user code is
  the task's result, not retried.

The decisions (which worker, which copy, who is taken out, which probe is due,
whether none is left) are :mod:`rpcdl.data.scheduling_policy`'s, plain
functions of the records; this module does the pass's I/O.

Why a layer of its own: this is where one pass meets the network. It owns
what belongs to one pass alone (its source, its tasks pulled, sent, finished,
its order of handing out) and does what a decision leads to: the calls, the
waits for their answers, the retries. It asks the policy itself, under the
pool's lock, with the pool's records in use (``PoolState.in_use``) and the
time read once per step: the policy reads no clock, and nothing stands
between the two. What a task carries is not its business (a chunk of batches
for the loader, see :mod:`rpcdl.data.chunked_pass`).

Threading: no thread of its own; everything happens in the consumer's
``next()``. A pass's own fields (its source, its tasks waiting, outstanding
and finished, its state) belong to the thread advancing it, one thread at a
time: a second thread entering ``next()`` meanwhile gets a ``RuntimeError``
(:class:`~rpcdl.data.guard.EntryGuard`). The pool's records (workers, calls in
flight) are reached under the pool's lock, in short steps; the lock is let go
while the pass waits for answers and while it pulls from its source (user
code, or another stage waiting for its own answers). Several passes of one
pool may be advanced at once by different threads. The futures' callbacks run
on other threads and only put typed events on the pass's queue
(:mod:`rpcdl.data.events`); the futures are completed by this process's event
loop, and the consumer unpickles each answer it takes, outside the pool's lock.

A pass that is dropped without being closed is freed by reference counting
(nothing here refers back to it) and its calls are let go by the pool at its
next step (see :meth:`rpcdl.data.worker_pool.PoolState.reclaim_dropped`).
"""

from __future__ import annotations

import collections
import enum
import functools
import itertools
import queue
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import RPCDLError, WorkerHung, WorkerLeaving, WorkerTimeout
from ..rpc.calls import when_answered
from .events import Answered, Orphaned, PassEvent, post
from .guard import EntryGuard
from .records import Attempt, Task, TaskState, WorkerSlot, WorkerState
from .scheduling_policy import AllDownWatch, is_worker_failure
from .worker_pool import PassRecord, PoolState, Registration, WorkerPool

__all__ = ["Call", "Dispatch", "NoWorkersLeft", "PassState"]

#: Sends a task to the worker at an address and returns the call's future. Raising a transient
#: error or :class:`~rpcdl.errors.RRefNotFound` takes the worker out.
Call = Callable[[Task, str], torch.futures.Future]


#: The states of a worker whose calls in flight may still answer: a failure there takes it out.
_SERVING = (WorkerState.ACTIVE, WorkerState.DRAINING)


class NoWorkersLeft(RPCDLError, RuntimeError):
    """Every worker failed and none came back within the timeout."""


class PassState(enum.Enum):
    """Where a pass is."""

    OPEN = "open"  #: pulling from its source
    SOURCE_EXHAUSTED = "source exhausted"  #: every payload pulled; handing out what is outstanding
    CLOSED = "closed"  #: ended, closed or done or without workers; hands out nothing more


def _unpickle(future: torch.futures.Future) -> None:
    """Have the answer of ``future`` (done) unpickled now, in this thread, so that no lock is held meanwhile."""
    try:
        future.wait()
    except Exception:  # its error is taken where the answer is handled
        pass


class _Closed(Exception):
    """The pass was closed by another thread while this one advanced it."""


class Dispatch(Iterator[Task]):
    """One pass: an iterator of finished :class:`~rpcdl.data.records.Task` objects (see the module).

    Args:
        pool: the workers.
        source: the payloads.
        call: sends a task to a worker.
        in_order: hand out tasks in source order (else as they complete).

    Example::

        >>> pool = WorkerPool(workers, prefetch_factor=2, timeout=30.0)  # doctest: +SKIP
        >>> squares = Dispatch(pool, iter(range(4)), lambda task, address: rpcdl.rpc_async(
        ...     address, pow, (task.payload, 2)))  # doctest: +SKIP
        >>> [task.value for task in squares]  # doctest: +SKIP
        [0, 1, 4, 9]
    """

    def __init__(self, pool: WorkerPool, source: Iterator[Any], call: Call, *, in_order: bool = True):
        self.pool = pool
        self.in_order = in_order
        self.state = PassState.OPEN
        self._source = source
        self._call = call
        self._seq = itertools.count()
        self._outstanding: dict[int, Task] = {}  # pulled, not handed out, in source order
        self._waiting: collections.deque[Task] = collections.deque()  # to (re)send, oldest first
        self._finished: collections.deque[Task] = collections.deque()  # in completion order
        self._all_down = AllDownWatch(pool.timeout, joins=pool.fleet.changing)
        self._entry = EntryGuard("this pass")
        self._events: queue.SimpleQueue[PassEvent] = queue.SimpleQueue()  # its calls' answers, from any thread
        with pool.locked() as shared:
            self._record: PassRecord = shared.open_pass(self, self._events)

    def __next__(self) -> Task:
        if not self._entry.try_enter():
            raise self._entry.busy()
        try:
            if self.state is PassState.CLOSED:
                raise StopIteration
            return self._next()
        except _Closed:
            self._end()
            raise StopIteration from None
        finally:
            self._entry.leave()

    def _next(self) -> Task:
        # Answers that came meanwhile free their workers' slots, and the task handed out last left
        # room in the window: top it up now, before waiting. (Not as a task is handed out: the
        # consumer still holds the one before, so the window would hold one batch more.)
        self._step(wait=False)
        while True:
            task = self._pop_finished()
            if task is not None:
                return task
            if self.state is PassState.SOURCE_EXHAUSTED and not self._outstanding:
                self._end()
                raise StopIteration
            self._step(wait=True)

    def close(self) -> None:
        """End the pass; answers still in flight are dropped when they arrive.

        Any thread may close a pass: one advancing it meanwhile stops at its next step.
        """
        if self._entry.try_enter():
            try:
                self._end()
            finally:
                self._entry.leave()
        else:
            with self.pool.locked() as shared:
                shared.close_pass(self._record)

    def _end(self) -> None:
        with self.pool.locked() as shared:
            shared.close_pass(self._record)  # its calls in flight are let go
        self.state = PassState.CLOSED
        self._source = iter(())
        self._outstanding.clear()
        self._waiting.clear()
        self._finished.clear()

    def _check_open(self) -> None:
        if self._record.state is Registration.CLOSED:  # closed by another thread: end here
            raise _Closed

    def _head(self) -> Task:
        return next(iter(self._outstanding.values()))  # tasks go in in source order: the first is the oldest

    def _pop_finished(self) -> Task | None:
        if self.in_order:
            if not self._outstanding:
                return None
            task = self._head()
            if task.state is not TaskState.DONE:
                return None
        else:
            if not self._finished:
                return None
            task = self._finished.popleft()
        del self._outstanding[task.seq]
        return task

    # ------------------------------------------------------------------ one step

    def _step(self, wait: bool) -> None:
        """Handle the answers that came (waiting for one first when ``wait``), then send what may go,
        pulling from the source while the pass has room."""
        timeout = 0.0
        if wait:
            with self.pool.locked() as shared:
                self._check_open()
                shared.reclaim_dropped()  # what dropped passes hold may be what this one waits for
                shared.follow_fleet()
                shared.start_due_probes()
                awaiting_head = self.in_order and bool(self._outstanding)
                timeout = shared.policy.wait_time(shared.in_use, shared.clock(), awaiting_head)
        events = self._take_events(timeout)  # outside the lock: waiting, and unpickling the answers
        with self.pool.locked() as shared:
            self._check_open()
            message = self._handle(shared, events, arrived_now=wait) if events or wait else None
            if message is None:
                room = self._send_ready(shared)
        if message is not None:
            self._end()
            raise NoWorkersLeft(message)
        pulled = 0
        while pulled < room and self._pull():  # outside the lock: the source is user code, or another stage
            pulled += 1
        if pulled:
            with self.pool.locked() as shared:
                self._check_open()
                self._send_waiting(shared, shared.clock())

    def _send_ready(self, shared: PoolState) -> int:
        """Send a copy of the head if it is late, then what waits; how many tasks the pass may pull now."""
        shared.follow_fleet()  # a worker that joined is set up at once, one that left given nothing more
        now = shared.clock()
        if self.in_order and self._outstanding:
            head = self._head()
            slot = shared.policy.hedge(head, shared.in_use, now)
            if slot is not None:  # first: the consumer waits for it; it must not wait for a slot behind new tasks
                self._send(shared, head, slot)
        self._send_waiting(shared, now)
        if self._waiting or self.state is not PassState.OPEN:
            return 0
        return shared.policy.pass_window(shared.in_use) - len(self._outstanding)

    def _pull(self) -> bool:
        try:
            payload = next(self._source)
        except StopIteration:
            self.state = PassState.SOURCE_EXHAUSTED
            return False
        task = Task(next(self._seq), payload)
        self._outstanding[task.seq] = task
        self._waiting.append(task)
        return True

    def _send_waiting(self, shared: PoolState, now: float) -> None:
        while self._waiting:
            slot = shared.policy.pick(shared.in_use, now)
            if slot is None:
                return
            self._send(shared, self._waiting.popleft(), slot)

    def _send(self, shared: PoolState, task: Task, slot: WorkerSlot) -> None:
        sent_at = shared.clock()
        try:
            future = self._call(task, slot.address)
        except Exception as exc:
            if isinstance(exc, WorkerLeaving):
                shared.drain(slot, exc)
                self._retry(task)
            elif is_worker_failure(exc):
                self._take_down(shared, slot, exc)
                self._retry(task)
            else:  # the payload cannot be sent: the error is its result
                self._finish(shared, task, slot, error=exc)
            return
        attempt = Attempt(task.seq, slot.index, self._record.number, sent_at, future)
        when_answered(future, functools.partial(post, self._events, Answered(attempt)))  # first: it always ends
        task.attempts.append(attempt)
        shared.policy.sent(slot, attempt, shared.answers)

    # ------------------------------------------------------------------ events

    def _handle(self, shared: PoolState, events: list[PassEvent], arrived_now: bool) -> str | None:
        """Handle ``events`` and the pool's ended probes; the error to raise if no worker is left."""
        for event in events:
            if type(event) is Answered:
                self._on_answered(shared, event.attempt, arrived_now)
            elif type(event) is Orphaned:
                task = self._outstanding.get(event.attempt.seq)
                if task is not None:
                    self._retry(task)
                    self._sort_waiting()
        shared.handle_probe_ends()
        shared.release_answered(self._record)
        policy, in_use, now = shared.policy, shared.in_use, shared.clock()
        # After the answers that came: their workers are not silent.
        for slot, why in policy.hung(in_use, now, shared.answers, reserve=shared.reserve_size > 0):
            self._take_down(shared, slot, WorkerHung(f"worker {slot.address}: {why}"))
        _, overdue = policy.drains_ended(shared.in_use, now)  # those with none in flight are DOWN from now on
        for slot in overdue:
            self._take_down(shared, slot, WorkerTimeout(f"worker {slot.address} drained past its drain timeout"))
        return self._all_down.check(shared.in_use, now, reserve=shared.reserve_size)

    def _take_events(self, timeout: float) -> list[PassEvent]:
        events: list[PassEvent] = []
        queued = self._events
        if timeout > 0:
            try:
                events.append(queued.get(timeout=timeout))
            except queue.Empty:
                return events
        while not queued.empty():  # only this thread takes from it: what is there stays there
            events.append(queued.get_nowait())
        for event in events:
            if type(event) is Answered:
                _unpickle(event.attempt.future)
        return events

    def _on_answered(self, shared: PoolState, attempt: Attempt, arrived_now: bool) -> None:
        try:
            value, error = attempt.future.wait(), None  # done: this does not wait
        except Exception as exc:
            value, error = None, exc
        live = shared.answered(attempt, worker_failed=error is not None and is_worker_failure(error))
        slot = shared.slots[attempt.worker]
        task = self._outstanding.get(attempt.seq)
        if error is None:
            shared.observe(attempt, measure_link=arrived_now)
            if live and task is not None and task.state is TaskState.PENDING:
                self._finish(shared, task, slot, value=value)
            return
        if isinstance(error, WorkerLeaving):  # not run there: its calls in flight still answer
            shared.drain(slot, error)
            if live and task is not None and task.state is TaskState.PENDING:
                self._retry(task)
                self._sort_waiting()
            return
        if not live or task is None or task.state is TaskState.DONE:
            if is_worker_failure(error) and slot.state in _SERVING:
                self._take_down(shared, slot, error)  # a copy elsewhere saved the task, yet this worker failed
            return
        if not is_worker_failure(error):
            self._finish(shared, task, slot, error=error)
            return
        if slot.state in _SERVING:  # else another pass took it out already
            self._take_down(shared, slot, error)
        if isinstance(error, WorkerTimeout):
            task.timeouts += 1
            if shared.policy.gives_up(task, shared.in_use, reserve=shared.reserve_size):
                error.add_note(
                    f"task {task.seq} timed out on {task.timeouts} workers: it takes longer than "
                    f"timeout={self.pool.timeout:g}s; raise the timeout"
                )
                self._finish(shared, task, slot, error=error)
                return
        self._retry(task)

    def _finish(
        self, shared: PoolState, task: Task, slot: WorkerSlot, value: Any = None, error: BaseException | None = None
    ) -> None:
        shared.drop([attempt for attempt in task.attempts if attempt.live])  # a copy elsewhere is not needed
        task.finish(slot.address, value, error)
        if not self.in_order:  # in order, tasks are handed out from _outstanding
            self._finished.append(task)

    def _retry(self, task: Task) -> None:
        if task.state is TaskState.PENDING and not any(a.live for a in task.attempts) and task not in self._waiting:
            self._waiting.appendleft(task)

    def _sort_waiting(self) -> None:
        self._waiting = collections.deque(sorted(self._waiting, key=lambda task: task.seq))

    def _take_down(self, shared: PoolState, slot: WorkerSlot, failure: BaseException) -> None:
        for attempt in shared.take_down(slot, failure, self._record):
            task = self._outstanding.get(attempt.seq)
            if task is not None:
                self._retry(task)
        self._sort_waiting()
