"""A worker's slots: ``parallel`` places where calls run, and the queue of calls waiting for one.

Threading: the slots' lock guards every access to the count of slots taken,
the queue, the :class:`SlotsState` and the executors parked; an executor
with nothing to run parks on a lock of its own (held, so that it blocks),
and whoever queues a call it may run hands it that lock, released: one
C-level wake, no condition's waiter list. A call that arrives while nothing
is queued and an executor is parked does not queue: the loop takes the
executor off the parked list and a slot for it, under the slots' lock, and
hands it the call in its :class:`_Parked` record (``call``), which the
executor reads once its lock is released: that lock orders the write before
the read, and nobody else touches the record meanwhile. Calls arrive from
the process loop, which reads them (:meth:`Slots.enqueue`, see
:mod:`rpcdl.server.session`), and run only on the ``parallel`` executor
threads (``rpcdl-executor-N``): user code never runs on the loop. A thread whose call is done runs the next queued
call in the same slot if there is one (no thread switch per call), else frees
the slot; it frees the slot before posting a large answer, so the next call
runs meanwhile. The queue is fair by time
(:class:`~rpcdl.server.fair_queue.FairQueue`): each client's calls wait in
their own line, in the order they arrived; the thread that ran a call charges
its duration to its client, and a freed slot takes the next call of the
waiting client that has used the least time, so neither a client with many
calls queued nor one with long calls can starve one with few or short ones.
The same thread counts the call in the :class:`~rpcdl.server.time_shares.TimeShares`
(:meth:`Slots.time_shares`): how long it ran, and whether it was taken
while another client had a call waiting. Nothing else is called under the lock.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from time import perf_counter

from ..errors import ConnectionLost
from ..rpc.rref import RRefStore
from ..transport.control import encode_rejected
from ..transport.wire import Frame, Kind
from .call_runner import Session
from .fair_queue import FairQueue
from .time_shares import TimeShare, TimeShares

QUICK_CALL = 0.0005  #: seconds: the answer of a quicker call may wait for the next call's (see Session.send)
LARGE_ANSWER = 1 << 20  #: bytes of buffers from which an answer is sent after its slot is freed


class SlotsState(enum.Enum):
    """Whether the slots take calls."""

    NEW = "new"  #: executors not started
    OPEN = "open"
    STOPPED = "stopped"  #: executors gone; queued calls stay unanswered (their connections are closed)


class _Parked:
    """An executor waiting for a call: the lock it blocks on, and the call handed to it, if any."""

    __slots__ = ("call", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()  # held: acquiring it again blocks until whoever takes this record releases it
        self.call: tuple[Session, Frame] | None = None  # handed with a slot taken for it (see the module)


class Slots:
    """``parallel`` slots and the fair queue in front of them (a line per client, equal shares of time).

    Args:
        parallel: how many calls run at once.
        execute: runs a call of a session and returns its answer frame.
        store: the worker's RRef store (a call not run fails the RRef it was to fill).
    """

    def __init__(self, parallel: int, execute: Callable[[Session, Frame], Frame], store: RRefStore) -> None:
        self.parallel = parallel
        self._execute = execute
        self._store = store
        self._lock = threading.Lock()  # alone where nobody waits: see ClientConnection's
        self._parked: list[_Parked] = []  # executors waiting for a call they may run (or a stop)
        self._queue: FairQueue[Session, Frame] = FairQueue()
        self._shares = TimeShares()
        self._running = 0
        self._state = SlotsState.NEW
        self._threads = [
            threading.Thread(target=self._executor, name=f"rpcdl-executor-{i}", daemon=True) for i in range(parallel)
        ]

    def start(self) -> None:
        """Start the executor threads."""
        with self._lock:
            if self._state is not SlotsState.NEW:
                return
            self._state = SlotsState.OPEN
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float) -> None:
        """Have the executors exit (after their current call), waiting up to ``timeout`` seconds for each."""
        with self._lock:
            started = self._state is not SlotsState.NEW
            self._state = SlotsState.STOPPED
            parked, self._parked = self._parked, []
        for park in parked:
            park.lock.release()
        if started:
            for thread in self._threads:
                thread.join(timeout=timeout)

    def enqueue(self, session: Session, frame: Frame) -> None:
        """Queue a call of ``session`` for a free slot, after that session's other queued calls."""
        with self._lock:
            park = self._parked.pop() if self._running < self.parallel and self._parked else None
            if park is not None and not self._queue:  # nobody waits: the parked executor runs it, unqueued
                self._queue.pass_through(session)
                self._running += 1
                park.call = (session, frame)
            else:
                self._queue.push(session, frame)
        if park is not None:  # else whoever frees a slot takes it, or an executor not parked yet finds it
            park.lock.release()

    def time_shares(self) -> dict[str, TimeShare]:
        """The worker time each client got, by client address (see :mod:`rpcdl.server.time_shares`).

        Returns:
            A :class:`~rpcdl.server.time_shares.TimeShare` per client served
            recently: its calls, the seconds they ran, and the seconds run by
            those taken from the queue while another client had a call waiting.

        Example::

            >>> worker = rpcdl.Worker(parallel=1).start()  # doctest: +SKIP
            >>> rpcdl.rpc_sync(worker.address, sum, ([1, 2],))  # doctest: +SKIP
            3
            >>> [share.calls for share in worker.slots.time_shares().values()]  # doctest: +SKIP
            [1]
            >>> worker.stop()  # doctest: +SKIP
        """
        with self._lock:
            return self._shares.snapshot()

    def run(self, session: Session, frame: Frame, *, contended: bool = False, park: _Parked | None = None) -> bool:
        """Run a call in a slot already taken, then the queued calls while there are any; answer each.

        A large answer takes a while to send: its slot goes to the next queued
        call before it is posted, so that call runs while it goes out.

        Args:
            session: the session of the call.
            frame: the call.
            contended: whether the call was taken from the queue while another client had a call waiting.
            park: the record of the executor running it, which parks there when nothing is left queued, in the
                same hold of the lock that frees its slot (it then waits on that record's lock).

        Returns:
            Whether the executor was parked (a call handed to it meanwhile waits in ``park``).
        """
        parked = False
        while True:
            queued = answer = None
            started = perf_counter()
            try:
                # a closed session has nobody to answer: its calls are not run
                answer = self._refuse(frame) if session.closed else self._execute(session, frame)
            finally:
                woken = None
                large = answer is not None and bool(answer.buffers) and answer.buffer_bytes >= LARGE_ANSWER
                ran = perf_counter() - started
                with self._lock:
                    self._queue.charge(session, ran)
                    self._shares.add(session.peer, ran, contended=contended)
                    if self._queue and self._state is SlotsState.OPEN and not large:
                        contended = self._queue.clients() > 1
                        queued = self._queue.pop()
                    else:
                        self._running -= 1
                        if large and self._queue and self._parked:
                            woken = self._parked.pop()
                        elif park is not None and not self._queue and self._state is SlotsState.OPEN:
                            self._parked.append(park)  # takes what comes while its answer goes out
                            parked = True
                if woken is not None:
                    woken.lock.release()
            # a quick call's answer waits for the next of the same client, run next here: one system call for both
            session.send(
                answer, answers_call=True, hold=queued is not None and queued[0] is session and ran < QUICK_CALL
            )
            if queued is None:
                return parked
            session, frame = queued

    def _refuse(self, frame: Frame) -> Frame:
        if frame.ref:
            self._store.complete(frame.ref, error=ConnectionLost("the client disconnected"))
        return Frame(Kind.REJECTED, frame.call_id, payload=encode_rejected("the client disconnected"))

    def _executor(self) -> None:
        park = _Parked()
        parked = False  # by run(), as it freed its slot
        while True:
            if not parked:
                with self._lock:
                    if self._state is not SlotsState.OPEN:
                        return
                    runnable = bool(self._queue) and self._running < self.parallel
                    if runnable:
                        contended = self._queue.clients() > 1
                        session, frame = self._queue.pop()
                        self._running += 1
                    else:
                        self._parked.append(park)
                if runnable:
                    parked = self.run(session, frame, contended=contended, park=park)
                    continue
            park.lock.acquire()  # released by enqueue(), a freed slot or stop(), which took it off _parked
            handed, park.call = park.call, None
            # handed: nothing else was queued, so no other client waited
            parked = handed is not None and self.run(*handed, contended=False, park=park)
