"""One persistent, multiplexed connection to a worker, and the calls in flight on it.

Threads and what each owns (the one statement of the connection's model):

* **The connection's own thread**, ``rpcdl-connection-HOST:PORT``
  (:mod:`rpcdl.rpc.connection_thread`), calls only the public methods below:
  it opens the connection (:meth:`Connection.connect`), then, until it closes,
  reads the answers of :attr:`~rpcdl.rpc.calls.ReadBy.BACKGROUND` calls (and,
  while no call is pending, what the worker sends unasked: its ``LEAVING``
  notice, or its closing the connection), fails overdue calls and flushes
  deferred frames and releases. It owns the socket's life: it opens it, and
  closes it once nobody reads or writes it
  (:meth:`Connection.finish`).
* **Any thread** makes calls, sends, waits for answers and closes.
* **One lock**, ``Connection._lock``, guards every mutable field: the
  lifecycle state (exactly one of :class:`~rpcdl.rpc.state.Connecting`,
  :class:`~rpcdl.rpc.state.Open`, :class:`~rpcdl.rpc.state.Closed`; a
  transition replaces it under the lock), the
  :class:`~rpcdl.rpc.state.ReadingRole`, the
  :class:`~rpcdl.rpc.state.PendingCalls`, the
  :class:`~rpcdl.rpc.state.Alarm` of the connection's thread, and the outbox
  of the :class:`~rpcdl.rpc.sending.Sending` component (it is handed the
  lock). No socket I/O and no user code (callbacks, unpickling) run under it,
  and no finalizer takes it.
* **The holder of the reading role** owns the
  :class:`~rpcdl.rpc.reading.Receiver` (the frame reader and its poller)
  while it holds the role.
* ``_releases`` is a lock-free queue (a :class:`collections.deque`): RRef
  finalizers append to it from any thread, at any allocation; whichever thread
  sends next drains it.

How the reading role moves:

* A thread waiting for a call's answer (:meth:`Connection.wait`) or in
  :func:`rpcdl.rpc.client.read_answers` (a *caller*) takes it when it is free,
  and reads every frame that arrives, background answers included. The
  connection's thread takes it only for background answers, and only when no
  caller reads or waits to and none has for :data:`BACKGROUND_DELAY`
  (:meth:`~rpcdl.rpc.state.ReadingRole.background_turn`): it does not compete
  with callers for the role and the GIL, yet the callbacks of a thread that
  never waits still run within a millisecond or two. The holder reads a turn
  of frames (one system call at most), then gives the role back *before* it
  completes their futures, so a callback that waits for another answer can
  take it; a holder interrupted mid-read (``KeyboardInterrupt``) gives it back
  too, and closes the connection.
* An ``rpc_sync`` that finds the role free and nothing being sent
  (:meth:`Connection.call_sync`) takes the role *before* its call leaves and
  keeps it until its answer is read: that call is in no other thread's view,
  so it needs no future and never joins the pending calls. If answers to
  other calls arrive first, it joins the pending calls as it gives the role
  back, and waits like any other call.
* A call leaves the pending calls exactly once: answered (by the reader,
  while it still holds the role, so nobody reads again for an answer already
  here), overdue, or failed by the close. Whoever removes it completes its future.

How calls leave: at once, except an asynchronous call without tensors
(buffers) that creates no RRef, made while others are in flight (the worker is
busy with them anyway): it is *deferred*
(:attr:`~rpcdl.rpc.outbox.OutboxState.DEFERRED`) and leaves with the next call
sent at once, with the :data:`~rpcdl.rpc.sending.DEFER_FRAMES`-th deferred,
before any thread that deferred it waits for answers (:func:`rpcdl.rpc.held.send_held`,
:meth:`Connection.wait`), or, sent by the connection's thread,
:data:`~rpcdl.rpc.sending.DEFER_DELAY` after the first of them was deferred,
whichever comes first. Order is kept. Before a thread waits for answers it
sends the calls it holds back (see :mod:`rpcdl.rpc.held` for why stages compose).
"""

from __future__ import annotations

import collections
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..address import parse_address
from ..errors import (
    AuthenticationError,
    ConnectionLost,
    FrameTooLarge,
    ProtocolError,
    UnknownHost,
    WorkerLeaving,
    WorkerUnavailable,
)
from ..transport import buffers, shm
from ..transport.compression import resolve_mode
from ..transport.control import decode_leaving
from ..transport.handshake import Agreement
from ..transport.polling import window_from_environment
from ..transport.security import Token
from ..transport.wire import AWAITED, Frame, Kind, Limits, io_stream
from . import held
from .answers import ANSWERS, deliver, outcome, overdue_error
from .calls import Call, ReadBy, describe_call, next_call_id
from .dial import dial
from .leaving import worker_left, worker_serves
from .outbox import OutboxState
from .reading import Receiver
from .sending import Sending
from .state import Alarm, Closed, Connecting, Leaving, Open, PendingCalls, Reader, ReadingRole

IDLE_TICK = 0.1  #: seconds: how often a reader with nothing to read looks at deadlines
RELEASE_TICK = 1.0  #: seconds: how often queued RRef releases are flushed when idle
CALLER_PATIENCE = 0.1  #: seconds answers left to their caller wait unread before the connection's thread reads them
BACKGROUND_DELAY = 0.001  #: seconds no caller must have been here before the connection's thread reads
SOCKET_CLOSE_WAIT = 5.0  #: seconds a closed connection's thread waits for readers and writers to leave the socket


class Chores(NamedTuple):
    """What the connection's thread has to do, as :meth:`Connection.await_chores` found it."""

    now: float  #: when it looked (``time.monotonic()``)
    overdue: bool  #: calls may be past their deadline: :meth:`Connection.expire_overdue`
    deferred_due: bool  #: deferred frames are due: :meth:`Connection.flush`
    releases_waiting: bool  #: RRefs or shared spans let go of wait to be freed on the worker


@dataclass(frozen=True)
class Status:
    """A connection's state at one moment (:meth:`Connection.status`), for messages and tests."""

    state: str  #: ``"connecting"``, ``"open"``, ``"leaving"`` or ``"closed"``
    reader: Reader  #: who holds the reading role
    readers_waiting: int  #: callers blocked until the role is free or their call is answered
    pending: int  #: calls waiting for an answer
    read_in_background: int  #: of those, how many the connection's thread reads
    left_to_callers: int  #: of those, how many their callers read (``answers_read_here``)
    outbox: OutboxState | None  #: what the outbox does; ``None`` unless open
    shared_memory: bool  #: whether answers' buffers may arrive in the worker's shared segment (same host)


class Connection:
    """One persistent, multiplexed connection to a worker.

    Use the functions of :mod:`rpcdl.rpc.client` rather than this class. A
    thread blocked in :func:`rpcdl.rpc_sync` reads its own answer (no thread
    switch on the way back); the connection's own thread reads the answers of
    asynchronous calls while no caller reads (a thread in ``future.wait()``
    reads them all), except those made under
    :func:`rpcdl.rpc.client.answers_read_here`, whose caller reads them (unless
    it leaves them unread for :data:`CALLER_PATIENCE`). Whoever reads completes
    the futures of the answers it reads. The module docstring states the
    threading model. A connection does nothing until its thread runs
    (:func:`rpcdl.rpc.connection_thread.start_connection` makes both).

    Args:
        address: the worker, ``"host:port"``.
        token: the shared secret, or ``None``.
        ssl_context: TLS context, or ``None`` for plain TCP.
        timeout: seconds the connection tries to open, and a peer may stall mid-message.
        grace: seconds to keep retrying a worker never reached while it refuses connections (see :mod:`rpcdl.rpc.dial`).
        on_close: called with this connection as it closes, before any call can find it closed (the pool
            forgets it); maybe more than once.
    """

    def __init__(
        self,
        address: str,
        token: Token | None,
        ssl_context: ssl.SSLContext | None,
        timeout: float,
        *,
        grace: float,
        on_close: Callable[[Connection], Any],
    ) -> None:
        self.address = address
        self.host, self.port = parse_address(address)
        self._token = token
        self._ssl = ssl_context
        self._io_timeout = timeout
        self._grace = grace
        self._on_close = on_close
        self._limits = Limits()
        self._asked_compression = resolve_mode()  # RPCDL_COMPRESSION; "on" without lz4 raises here
        self._offers_shm = shm.resolve_bytes() > 0  # RPCDL_SHM_BYTES=0 turns shared memory off
        self._poll_window = window_from_environment()  # RPCDL_POLL_MICROSECONDS: rpc_sync's wait for its answer
        self._pid = os.getpid()
        self._releases: collections.deque[int] = collections.deque()  # a lock-free queue (see the module)
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)  # callers waiting for the role or their answer
        self._chores = threading.Condition(self._lock)  # the connection's thread, waiting for something to do
        self._state: Connecting | Open | Closed = Connecting(time.monotonic() + timeout)
        self._role = ReadingRole(BACKGROUND_DELAY)
        self._calls = PendingCalls(CALLER_PATIENCE)
        self._alarm = Alarm()

    def __repr__(self) -> str:
        return f"<Connection to {self.address}, {self.status().state}>"

    @property
    def closed(self) -> bool:
        """Whether the connection is closed (for good)."""
        with self._lock:
            return isinstance(self._state, Closed)

    @property
    def compression(self) -> str:
        """The compression mode: asked for (``RPCDL_COMPRESSION``) until connected, then what the worker chose."""
        with self._lock:
            state = self._state
        return state.compression if isinstance(state, Open) else self._asked_compression

    @property
    def segment(self) -> shm.ClientSegment | None:
        """The worker's shared segment this connection maps (answers' buffers may live there), or ``None``."""
        with self._lock:
            state = self._state
        return state.segment if isinstance(state, Open) else None

    def credentials(self) -> dict[str, Any]:
        """The keyword arguments that reach this worker with the same credentials."""
        return {"token": self._token or "", "ssl_context": self._ssl}

    def status(self) -> Status:
        """Where the connection stands now: its state, who reads, the calls pending, the outbox."""
        with self._lock:
            state, role, calls = self._state, self._role, self._calls
            return Status(
                state=state.name,
                reader=role.holder,
                readers_waiting=role.waiters,
                pending=len(calls),
                read_in_background=calls.background,
                left_to_callers=calls.left_to_callers,
                outbox=state.sending.state if isinstance(state, Open) else None,
                shared_memory=isinstance(state, Open) and state.segment is not None,
            )

    # ------------------------------------------------------------------ calls

    def submit(self, kind: Kind, call: Call, payload: bytes = b"", buffers: Sequence = (), ref: int = 0) -> bool:
        """Make ``call``: its frame leaves now, with the next ones (deferred, or held by this thread), or once
        connected; its answer completes ``call.future``.

        Returns:
            Whether the call was made; ``False`` if the connection is closed (make it on a new one). A call made
            once the worker said it is leaving fails at once with :class:`~rpcdl.errors.WorkerLeaving` (made).
        """
        awaited = AWAITED if call.read_by is ReadBy.WAITER else 0  # its caller blocks: the worker may poll for the next
        frame = Frame(kind, call.call_id, ref, payload, buffers if type(buffers) is list else list(buffers), awaited)
        with self._lock:
            state = self._state
            if isinstance(state, Closed):
                return False
            if not isinstance(state, Leaving):
                busy = len(self._calls) > 0  # the worker has calls of ours to run: this one may wait for the next
                self._calls.add(call, call.started)
                if self._alarm.asleep:  # wake the connection's thread for this call's deadline, or for its answer
                    turn = self._role.background_turn() if call.read_by is ReadBy.BACKGROUND else call.deadline
                    self._wake_thread_by(min(turn, call.deadline))
                if isinstance(state, Connecting):
                    state.queued.append(frame)
                    return True
        if isinstance(state, Leaving):  # failed outside the lock: the future's callbacks may make calls
            call.future.fail(self._leaving_error(state.reason, call))
            return True
        if held.hold(self, frame):
            if call.read_by is ReadBy.WAITER:  # after what this thread holds, in the order it made the calls
                held.send_held()
            return True
        if call.read_by is ReadBy.WAITER:  # it waits: what it holds (enclosing blocks' calls) leaves first
            held.send_held()
            self._send(state.sending, [frame])
        elif busy and not frame.buffers and not ref:  # an RRef's creation leaves at once: others may name it
            self._defer(state.sending, frame)
        else:
            self._send(state.sending, [frame])
        return True

    def send(self, frames: list[Frame]) -> None:
        """Send ``frames``, which a thread held back, now (nothing once closed: their calls failed then)."""
        with self._lock:
            state = self._state
        if isinstance(state, Open):
            self._send(state.sending, frames)

    def flush(self) -> None:
        """Send what is deferred now, and the releases waiting (nothing once closed, or in a forked child)."""
        if os.getpid() != self._pid:
            return  # a forked child: the deferred frames are the parent's to send
        with self._lock:
            state = self._state
        if isinstance(state, Open):
            self._send(state.sending, [])

    def wait(self, call: Call) -> None:
        """Wait until ``call`` is answered (or fails), reading answers meanwhile."""
        held.send_held()
        future, calls, role, call_id = call.future, self._calls, self._role, call.call_id
        first = True
        while not future.done():
            with self._lock:
                state = self._state
                flush = first and isinstance(state, Open) and state.sending.state is OutboxState.DEFERRED
                first = False
                if not flush:
                    while call_id in calls and not (role.free and isinstance(self._state, Open)):
                        left = call.deadline - time.monotonic()
                        if left <= 0:
                            break
                        role.begin_waiting()
                        try:
                            self._answered.wait(min(left, RELEASE_TICK))
                        finally:
                            role.end_waiting(time.monotonic())
                            self._caller_left()
                    if call_id not in calls:
                        break  # answered or failed: whoever took it from the pending calls completes the future
                    left = call.deadline - time.monotonic()
                    overdue = left <= 0
                    if not overdue:
                        role.take(Reader.CALLER)
                        receiver = self._state.receiver
            if flush:  # other threads' deferred calls, maybe this one: they leave before this thread waits
                self._send(state.sending, [])
            elif overdue:
                self._expire(time.monotonic())
            elif receiver.nothing_arrives_within(left):
                self._end_turn([], None)  # a read would have blocked past the deadline: the call is overdue now
            else:
                self._read_turn(receiver)

    def call_sync(self, payload: bytes, subject: Callable, timeout: float) -> tuple[bool, Any]:
        """Call with ``payload`` (no buffers) and read the answer in this thread: :func:`rpcdl.rpc_sync`'s path.

        When nobody reads or sends, the caller takes the reading role *before*
        the call leaves and keeps it until the answer is here, so the call never
        joins the pending calls and needs no future. It polls for the answer
        before it blocks (:mod:`rpcdl.transport.polling`), and the call is marked
        awaited, so the worker polls for the next one. If other answers come
        first, it joins them as the caller gives the role back, and waits as
        any other.

        Returns:
            ``(True, result)``, or ``(False, None)`` when another thread reads or
            sends, this one holds calls back, or the connection is closed: make
            the call the usual way (which finds a new connection then).

        Raises:
            Exception: the remote error, or why no answer came (:class:`~rpcdl.errors.WorkerTimeout`, ...).
        """
        with self._lock:
            state = self._state
            alone = (
                isinstance(state, Open)
                and not isinstance(state, Leaving)
                and state.sending.state is OutboxState.IDLE
                and held.holds_nothing()
                and self._role.take(Reader.CALLER)
            )
        if not alone:
            return False, None
        started = time.monotonic()
        call_id = next_call_id()
        self._send(state.sending, [Frame(Kind.CALL, call_id, 0, payload, [], AWAITED)])
        receiver = state.receiver
        frames: list[Frame] = []
        error = None
        polled = receiver.poll_for_answer()
        try:
            while True:
                left = started + timeout - time.monotonic()
                if left <= 0.0:
                    break
                if receiver.nothing_arrives_within(left):
                    continue  # a read would have blocked past the deadline
                error = receiver.read(frames)
                if frames or error is not None:
                    break
        except BaseException as exc:  # raised in this thread mid-read (KeyboardInterrupt)
            self._end_turn(frames, exc)
            raise
        if polled:
            receiver.answer_arrived()
        answer = None
        for frame in frames:
            if frame.call_id == call_id and frame.kind in ANSWERS:
                answer = frame
        if answer is None and frames and error is None:
            call = Call(self, timeout, subject, sync=True, call_id=call_id, started=started)
            self._end_turn(frames, None, waiting=call)
            return True, call.future.wait()
        if answer is not None and len(frames) == 1 and error is None:  # the usual case: nothing else to complete
            with self._lock:
                self._give_role_back(answer)
            result, error = outcome(self.address, self, answer, subject)
        else:
            self._end_turn(frames, error)
            if answer is not None:
                result, error = outcome(self.address, self, answer, subject)
            elif isinstance(error, FrameTooLarge) and error.call_id == call_id:
                error = error.as_limit_exceeded(f"worker {self.address} answered {describe_call(subject)}")
            else:
                with self._lock:
                    state = self._state
                if isinstance(state, Closed):
                    error = state.error()
                else:
                    error = overdue_error(self.address, subject, timeout, True, None)
        if error is not None:
            raise error
        return True, result

    def read_if_ready(self) -> bool | None:
        """Read and deliver the frames arriving, in this thread, if no other thread reads.

        Returns:
            ``True`` if a frame was read, ``False`` if none is arriving yet,
            ``None`` if another thread is reading (it delivers what comes) or
            the connection is closed.
        """
        with self._lock:
            self._calls.caller_came(time.monotonic())
            state = self._state
            if isinstance(state, Closed) or not self._role.free:
                return None
            if isinstance(state, Connecting):
                return False
            self._role.take(Reader.CALLER)
        if not state.receiver.arrives_now():
            self._end_turn([], None)
            return False
        self._read_turn(state.receiver)
        return True

    def leaves_to_caller(self, calls: Iterable[Call]) -> bool:
        """Whether the answer of one of ``calls``, still pending, is left to its caller to read."""
        with self._lock:
            return self._calls.left_to_caller(calls)

    def readable_socket(self) -> socket.socket | None:
        """The socket to poll for answers, or ``None`` while connecting or once closed."""
        with self._lock:
            state = self._state
        return state.sock if isinstance(state, Open) else None

    def read_in_background(self, call: Call) -> None:
        """Let this connection's thread read the answer to ``call``."""
        with self._lock:
            if self._calls.adopt([call]):
                self._wake_thread_by(self._role.background_turn())

    def release(self, uid: int) -> None:
        """Queue ``uid`` to be freed on the worker: one atomic append, no lock (safe in a finalizer)."""
        self._releases.append(uid)

    def close(
        self,
        reason: str = "the connection was closed by rpcdl.shutdown()",
        error_type: type[Exception] = ConnectionLost,
    ) -> None:
        """Close the connection for good: the calls pending fail with ``error_type(reason)``; calls made on it
        later are refused (:meth:`submit` returns ``False``). Nothing if it is closed already."""
        self._on_close(self)  # first: nobody finds it closed in the pool (and retries on it)
        with self._lock:
            state = self._state
            if isinstance(state, Closed):
                return
            self._state = Closed(reason, error_type)
            pending = self._calls.clear()
            self._answered.notify_all()
            self._chores.notify()
        if isinstance(state, Open) and os.getpid() == self._pid:  # (a forked child must not cut its parent's)
            try:
                state.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread reading or writing it; its thread closes it
            except OSError:
                pass
        for call in pending:
            call.future.fail(error_type(reason))

    # ------------------------------------------------------------------ what the connection's thread calls

    def connect(self) -> Open | None:
        """Open the connection: dial the worker (retrying as :mod:`rpcdl.rpc.dial` says), then send the frames
        queued meanwhile. Run by the connection's thread, which owns the socket's life from then on.

        Returns:
            The open state (:meth:`finish` closes its socket), or ``None``: the connection is closed (its calls
            failed with why).
        """
        try:
            sock, agreed = dial(
                self.address,
                self.host,
                self.port,
                self._token,
                self._ssl,
                handshake_timeout=self._limits.handshake_timeout,
                grace=self._grace,
                failed=self._connect_failed,
                pause=self._pause,
                compression=self._asked_compression,
                shared_memory=self._offers_shm,
            )
        except (AuthenticationError, ProtocolError, UnknownHost) as exc:
            self.close(str(exc), type(exc))
            return None
        except WorkerUnavailable as exc:
            self.close(str(exc), WorkerUnavailable)
            return None
        return self._open(io_stream(sock, receive=IDLE_TICK, send=self._io_timeout), agreed)

    def await_chores(self) -> Chores | None:
        """Wait until the connection's thread has something to do; ``None`` once the connection is closed."""
        with self._lock:
            if isinstance(self._state, Open) and not self._background_turn_now():
                self._sleep()
            state = self._state
            if not isinstance(state, Open):
                return None
            now = time.monotonic()
            self._calls.adopt_unread(now)  # left unread too long by their caller
            return Chores(
                now=now,
                overdue=now >= self._calls.check_at,
                deferred_due=state.sending.due_at <= now,
                releases_waiting=state.sending.releases_waiting,
            )

    def expire_overdue(self) -> None:
        """Fail the calls past their deadline (without the reading role: callbacks may wait for answers)."""
        self._expire(time.monotonic())

    def read_background(self) -> None:
        """Read a turn of frames if the background answers' turn has come (no caller reads or waits to)."""
        with self._lock:
            state = self._state
            take = isinstance(state, Open) and self._background_turn_now() and self._role.take(Reader.BACKGROUND)
        if take:
            self._read_turn(state.receiver)

    def read_while_idle(self) -> None:
        """Read what arrives while no call is pending: a worker's ``LEAVING`` notice, or its closing the
        connection, is heard within a tick even by a process that makes no call now. Run by the
        connection's thread, after each wait for chores."""
        with self._lock:
            state = self._state
            take = isinstance(state, Open) and len(self._calls) == 0 and self._role.take(Reader.BACKGROUND)
        if not take:
            return
        if state.receiver.arrives_now():
            self._read_turn(state.receiver)
        else:
            self._end_turn([], None)

    def finish(self, opened: Open) -> None:
        """Close the socket of ``opened`` (what :meth:`connect` opened; the connection is closed now) once no
        thread reads or writes it any more: shut down, it sends them away at once. :data:`SOCKET_CLOSE_WAIT`
        at most. Run by the connection's thread as it ends."""
        deadline = time.monotonic() + SOCKET_CLOSE_WAIT
        with self._lock:
            while not (self._role.free and opened.sending.state is not OutboxState.SENDING):
                if time.monotonic() >= deadline:
                    break
                self._chores.wait(0.01)
        opened.sock.close()

    # ------------------------------------------------------------------ sending

    def _send(self, sending: Sending, frames: list[Frame]) -> None:
        try:
            sending.send(frames)
        except OSError as exc:
            self.close(f"lost the connection to worker {self.address} while sending: {exc or type(exc).__name__}")

    def _defer(self, sending: Sending, frame: Frame) -> None:
        try:
            sending.defer(frame)
        except OSError as exc:
            self.close(f"lost the connection to worker {self.address} while sending: {exc or type(exc).__name__}")
            return
        held.deferred_on(self)

    def _deferral_started(self, until: float) -> None:
        """Frames wait in the outbox: make sure the connection's thread flushes them by ``until``."""
        with self._lock:
            self._wake_thread_by(until)

    # ------------------------------------------------------------------ reading

    def _read_turn(self, receiver: Receiver) -> None:
        """Read a turn of frames, give the role back, deliver them. The caller holds the reading role."""
        frames: list[Frame] = []
        try:
            error = receiver.read(frames)
        except BaseException as exc:  # raised in this thread mid-read (KeyboardInterrupt)
            self._end_turn(frames, exc)
            raise
        self._end_turn(frames, error)

    def _end_turn(self, frames: list[Frame], error: BaseException | None, waiting: Call | None = None) -> None:
        """Give the reading role back, then complete the calls ``frames`` answer; ``waiting``, a call whose
        caller has read on its own so far (:meth:`call_sync`), joins the pending calls first. An ``error``
        that ended the reading closes the connection: the stream may have stopped inside a frame."""
        answered = []
        reason = None
        drain_timeout = 0.0
        if any(frame.kind is Kind.LEAVING for frame in frames):  # the worker drains: no call of ours goes there now
            notices = [frame for frame in frames if frame.kind is Kind.LEAVING]
            frames = [frame for frame in frames if frame.kind is not Kind.LEAVING]
            try:
                drain_timeout, reason = decode_leaving(notices[-1].payload)
            except ProtocolError as exc:
                error = error or exc
        unexpected = frames[-1] if frames and frames[-1].kind not in ANSWERS else None
        with self._lock:
            state = self._state
            if reason is not None and isinstance(state, Open) and not isinstance(state, Leaving):
                self._state = Leaving(state, reason)
            else:
                reason = None  # closed meanwhile, or told already
            if waiting is not None and not isinstance(state, Closed):
                self._calls.add(waiting, waiting.started)
            # taken while still reading: a thread waiting for these calls must not take the role to read
            # answers that are already here
            for frame in frames:
                call = self._calls.pop(frame.call_id) if frame is not unexpected else None
                if call is not None:  # otherwise its caller gave up waiting, or reads it itself (call_sync)
                    answered.append((frame, call))
            self._give_role_back(frames[-1] if frames and unexpected is None else None)
        if waiting is not None and isinstance(state, Closed):
            waiting.future.fail(state.error())
        if reason is not None:
            worker_left(self.address, reason, drain_timeout)
        for frame, call in answered:
            deliver(self.address, self, frame, call)
        if isinstance(error, FrameTooLarge):  # the worker's limits are higher: that call fails for good
            with self._lock:
                call = self._calls.pop(error.call_id)
            if call is not None:
                call.future.fail(error.as_limit_exceeded(f"worker {self.address} answered {call.what}"))
        if error is not None:
            self.close(f"lost the connection to worker {self.address}: {error or type(error).__name__}")
        elif unexpected is not None:
            self.close(f"worker {self.address} sent an unexpected {unexpected.kind.name} frame")

    def _give_role_back(self, last_answer: Frame | None) -> None:
        """The reader gives the role back, having read ``last_answer`` last, if any (under ``_lock``)."""
        self._role.give_back(time.monotonic())
        if last_answer is not None:
            size = len(last_answer.payload) + (last_answer.buffer_bytes if last_answer.buffers else 0)
            self._calls.answers_are_large = size >= buffers.MIN_BYTES
        if self._role.waiters:
            self._answered.notify_all()
        self._caller_left()

    def _leaving_error(self, reason: str, call: Call) -> WorkerLeaving:
        return WorkerLeaving(
            f"worker {self.address} is leaving ({reason}): {call.what} was not sent; make it on another worker",
            self.address,
        )

    def _pins(self, call_id: int) -> bool:
        """Whether the answer to ``call_id`` is received into pinned memory (the reader asks, holding the role)."""
        with self._lock:
            call = self._calls.get(call_id)
        return call is not None and call.pin_memory

    def _expire(self, now: float) -> None:
        """Fail the calls past their deadline at ``now``."""
        with self._lock:
            overdue = self._calls.pop_overdue(now)
            if overdue:
                self._answered.notify_all()
            state = self._state
            connect_error = state.last_error if isinstance(state, Connecting) else None
        for call in overdue:  # outside the lock: callbacks may make calls
            error = overdue_error(
                self.address, call.subject, call.timeout, not isinstance(state, Connecting), connect_error
            )
            call.future.fail(error)

    # ------------------------------------------------------------------ the connection's thread, under the lock

    def _background_turn_now(self) -> bool:
        """Whether the connection's thread may read background answers now (under ``_lock``)."""
        return bool(self._calls.background) and self._role.free and self._role.background_turn() <= time.monotonic()

    def _caller_left(self) -> None:
        """A caller gave the role back or stopped waiting: the background answers' turn may come (under ``_lock``)."""
        if self._calls.background:
            self._wake_thread_by(self._role.background_turn())

    def _wake_thread_by(self, when: float) -> None:
        """Wake the connection's thread if it sleeps in :meth:`_sleep` past ``when`` (under ``_lock``)."""
        if self._alarm.wake_by(when):
            self._chores.notify()

    def _sleep(self) -> None:
        """Wait until woken or something is due (under ``_lock``, the connection open)."""
        now = time.monotonic()
        if self._calls.background:  # until the background answers' turn; a caller leaving wakes it then
            tick = min(max(self._role.background_turn() - now, 0.0), IDLE_TICK)
        elif self._calls.left_to_callers:
            tick = IDLE_TICK  # watching answers left to a caller
        else:
            tick = min(max(self._calls.check_at - now, 0.0) + 0.001, RELEASE_TICK)
        tick = min(tick, max(self._state.sending.due_at - now, 0.0))
        self._alarm.sleep_until(now + tick)
        try:
            self._chores.wait(tick)
        finally:
            self._alarm.woke()

    # ------------------------------------------------------------------ connecting, in the connection's thread

    def _open(self, sock: socket.socket, agreed: Agreement) -> Open | None:
        """CONNECTING -> OPEN over ``sock``, sending the frames queued meanwhile first; return the open state, or
        ``None`` if the connection was closed meanwhile."""
        receiver = Receiver(sock, self._limits, self._io_timeout, agreed, self._poll_window, IDLE_TICK, self._pins)
        with self._lock:
            state = self._state
            if isinstance(state, Connecting):
                sending = Sending(
                    sock, self._lock, state.queued, self._releases, agreed.segment, self._deferral_started
                )
                self._state = opened = Open(sock, receiver, sending, agreed.segment, agreed.compression)
                self._answered.notify_all()
        if not isinstance(state, Connecting):  # closed meanwhile: nobody else has seen this socket
            sock.close()
            return None
        worker_serves(self.address)
        self._send(sending, [])
        return opened

    def _pause(self, seconds: float) -> None:
        """Wait between two attempts to connect; a close ends the wait."""
        with self._lock:
            if not isinstance(self._state, Closed):
                self._chores.wait(seconds)

    def _connect_failed(self, exc: OSError) -> float:
        """Note a failed attempt to connect; fail the calls overdue; return until when calls still want a
        connection.

        Raises:
            WorkerUnavailable: the connection was closed meanwhile.
        """
        with self._lock:
            state = self._state
            if isinstance(state, Connecting):
                state.attempt_failed(exc)
        self._expire(time.monotonic())
        with self._lock:
            state = self._state
            if not isinstance(state, Connecting):
                raise WorkerUnavailable(state.reason if isinstance(state, Closed) else "connected meanwhile")
            return state.wanted_until(self._calls.latest_deadline())
