"""One persistent, multiplexed connection to a worker, and the calls in flight on it.

Threading model (the one statement of it; :mod:`rpcdl.rpc.state` holds the state):

* Each :class:`Connection` has one thread of its own, ``rpcdl-connection-HOST:PORT``.
  It opens the connection (:mod:`rpcdl.rpc.dial`), then reads the answers of
  :attr:`~rpcdl.rpc.calls.ReadBy.BACKGROUND` calls, fails overdue calls,
  flushes RRef releases and deferred calls, until the connection closes.
* Any thread may make calls and send; threads sending at once share system calls
  (:class:`~rpcdl.rpc.outbox.Outbox`).
* A call goes at once, except an asynchronous one without tensors (buffers) that
  creates no RRef, made while others are in flight (the worker is busy with them
  anyway): it is *deferred* (:attr:`~rpcdl.rpc.outbox.OutboxState.DEFERRED`) and
  leaves with the next call sent at once, with the ``_DEFER_FRAMES``-th deferred,
  before any thread that deferred it waits for answers (:func:`rpcdl.rpc.held.send_held`,
  :meth:`Connection.wait`), or, sent by the connection's thread, ``_DEFER_DELAY``
  after the first of them was deferred, whichever comes first. Order is kept.
* All state lives in three objects changed only under ``_lock``: the
  :class:`~rpcdl.rpc.state.ConnectionState` (CONNECTING -> OPEN -> CLOSED,
  never back), the :class:`~rpcdl.rpc.state.ReadingRole` and the
  :class:`~rpcdl.rpc.state.PendingCalls`. No socket I/O and no user code
  (callbacks, unpickling) run under it.
* Reading the socket is a role one thread holds at a time. A thread waiting for
  a call's answer (:meth:`Connection.wait`) or in
  :func:`rpcdl.rpc.client.read_answers` (a *caller*) takes it when it is free,
  and reads every frame that arrives, background answers included. The
  connection's thread takes it only for background answers, and only when no
  caller reads or waits to and none has for ``_BACKGROUND_DELAY``
  (:meth:`~rpcdl.rpc.state.ReadingRole.background_turn`): it does not compete
  with callers for the role and the GIL, yet the callbacks of a thread that
  never waits still run within a millisecond or two. The holder reads the
  frames there are (one system call at most), then gives the role back
  *before* it completes their futures, so a callback that waits for another
  answer can take it; a holder interrupted mid-read (``KeyboardInterrupt``)
  gives it back too, and closes the connection.
* An ``rpc_sync`` that finds the role free and nothing being sent
  (:meth:`Connection.call_sync`) takes the role *before* its call leaves and
  keeps it until its answer is read: that call is in no other thread's view,
  so it needs no future and never joins the pending calls. If answers to other
  calls arrive first, it joins the pending calls as it gives the role back,
  and waits like any other call.
* A call leaves :class:`~rpcdl.rpc.state.PendingCalls` exactly once: answered
  (by the reader, while it still holds the role, so nobody reads again for an
  answer already here), overdue, or failed by the close. Whoever removes it
  completes its future.
* Before a thread waits for answers it sends the calls it holds back
  (see :mod:`rpcdl.rpc.held` for why stages compose).
"""

from __future__ import annotations

import collections
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..address import parse_address
from ..errors import (
    ConnectionLost,
    FrameTooLarge,
    ProtocolError,
)
from ..transport import buffers, shm
from ..transport.compression import resolve_mode
from ..transport.control import drain, encode_release
from ..transport.polling import Poller, window_from_environment
from ..transport.security import Token
from ..transport.wire import AWAITED, Frame, FrameReader, Kind, Limits, encode_frame
from . import held
from .answers import ANSWERS as _ANSWERS
from .answers import deliver, outcome, overdue_error
from .calls import Call, ReadBy, describe_call, future_done, next_call_id
from .connection_thread import RELEASE_TICK, ConnectionThread
from .live_threads import live_thread
from .outbox import Outbox, OutboxState
from .state import ConnectionState, PendingCalls, Reader, ReadingRole

_CALLER_PATIENCE = 0.1  # answers left to their caller are read by the connection's thread after this long unread
_BACKGROUND_DELAY = 0.001  # the connection's thread reads background answers once no caller has been here this long
_BATCH = 64  # frames read in one turn with the reading role, at most

# read on every call: an enum member's lookup through its class costs ~0.05 us (3.11)
_CONNECTING, _OPEN, _CLOSED = ConnectionState.CONNECTING, ConnectionState.OPEN, ConnectionState.CLOSED
_IDLE, _DEFERRED = OutboxState.IDLE, OutboxState.DEFERRED
_CALLER, _CALL = Reader.CALLER, Kind.CALL


class _Closed(Exception):
    pass


class Connection(ConnectionThread):
    """One persistent, multiplexed connection to a worker.

    Use the functions of :mod:`rpcdl.rpc.client` rather than this class. A
    thread blocked in :func:`rpcdl.rpc_sync` reads its own answer (no thread
    switch on the way back); the connection's own thread reads the answers of
    asynchronous calls while no caller reads (a thread in ``future.wait()``
    reads them all), except those made under
    :func:`rpcdl.rpc.client.answers_read_here`, whose caller reads them (unless it
    leaves them unread for ``_CALLER_PATIENCE``). Whoever reads completes the
    futures of the answers it reads. The module docstring states the threading model.

    Args:
        address: the worker, ``"host:port"``.
        token: the shared secret, or ``None``.
        ssl_context: TLS context, or ``None`` for plain TCP.
        timeout: seconds the connection tries to open, and a peer may stall mid-message.
        grace: seconds to keep retrying while the worker refuses connections (see :mod:`rpcdl.rpc.dial`).
        on_close: called with this connection once it is closed (the pool forgets it).
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
    ):
        self.address = address
        self.host, self.port = parse_address(address)
        self._token = token
        self._ssl = ssl_context
        self._io_timeout = timeout
        self._limits = Limits()
        # asked for (RPCDL_COMPRESSION; "on" without lz4 raises here), then, once connected, what the worker chose
        self.compression = resolve_mode()
        self._offers_shm = shm.resolve_bytes() > 0  # RPCDL_SHM_BYTES=0 turns shared memory off
        self._poll_window = window_from_environment()  # RPCDL_POLL_MICROSECONDS: rpc_sync's wait for its answer
        self._segment: shm.ClientSegment | None = None  # once connected: the worker's, if this process mapped it
        self._lock = lock = threading.Lock()  # taken as itself: entering a Condition is a Python call
        self._cond = threading.Condition(lock)  # wakes threads waiting for the role or their answer
        self._serve_cond = threading.Condition(lock)  # wakes the connection's thread alone
        self._outbox: Outbox | None = None  # once OPEN
        self._state = _CONNECTING
        self._role = ReadingRole(_BACKGROUND_DELAY)
        self._calls = PendingCalls(_CALLER_PATIENCE)
        self._serve_wakes_at = 0.0  # when the connection's thread, asleep in _serve, looks again; 0 when awake
        self._queued: list[Frame] = []  # frames of calls made while CONNECTING
        self._releases: collections.deque[int] = collections.deque()
        self._error = ""
        self._sock: socket.socket | None = None
        self._reader: FrameReader | None = None
        self._poller: Poller | None = None  # once connected: call_sync's wait for its answer
        self._idle_tick = 0.0  # once connected: how long a read that finds nothing blocks
        self._connect_deadline = time.monotonic() + timeout
        self._grace = grace
        self._on_close = on_close
        self._last_connect_error: BaseException | None = None
        self._pid = os.getpid()
        self._thread = live_thread(self._run, name=f"rpcdl-connection-{address}")
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._state is _CLOSED

    def credentials(self) -> dict[str, Any]:
        """The keyword arguments that reach this worker with the same credentials."""
        return {"token": self._token or "", "ssl_context": self._ssl}

    # ------------------------------------------------------------------ calls

    def submit(self, kind: Kind, call: Call, payload: bytes = b"", buffers: Sequence = (), ref: int = 0) -> None:
        awaited = AWAITED if call.read_by is ReadBy.WAITER else 0  # its caller blocks: the worker may poll for the next
        frame = Frame(kind, call.call_id, ref, payload, buffers if type(buffers) is list else list(buffers), awaited)
        call.future._connection = self
        with self._lock:
            state = self._state
            if state is _CLOSED:
                raise _Closed(self._error)
            busy = len(self._calls) > 0  # the worker has calls of ours to run: this one may wait for the next
            self._calls.add(call, call.started)
            if self._serve_wakes_at:  # it sleeps: wake it for this call's deadline, or for its answer
                turn = self._role.background_turn() if call.read_by is ReadBy.BACKGROUND else call.deadline
                self._wake_serve_by(min(turn, call.deadline))
            if state is _CONNECTING:
                self._queued.append(frame)
                return
        if held.hold(self, frame):
            if call.read_by is ReadBy.WAITER:  # after what this thread holds, in the order it made the calls
                held.send_held()
            return
        if call.read_by is ReadBy.WAITER:  # it waits: what it holds (enclosing blocks' calls) leaves first
            held.send_held()
            self._send([frame])
        elif busy and not frame.buffers and not ref:  # an RRef's creation leaves at once: others may name it
            self._defer(frame)
        else:
            self._send([frame])

    def wait(self, call: Call) -> None:
        """Wait until ``call`` is answered (or fails), reading answers meanwhile."""
        held.send_held()
        outbox = self._outbox
        if outbox is not None and outbox.state is _DEFERRED:  # another thread's, maybe this call
            self._send([])
        future, calls, role, call_id = call.future, self._calls, self._role, call.call_id
        while not future_done(future):
            with self._lock:
                while call_id in calls and not (role.free and self._state is _OPEN):
                    left = call.deadline - time.monotonic()
                    if left <= 0:
                        break
                    role.begin_waiting()
                    try:
                        self._cond.wait(min(left, RELEASE_TICK))
                    finally:
                        role.end_waiting(time.monotonic())
                        self._caller_left()
                if call_id not in calls:
                    break  # answered or failed: whoever took it from the pending calls completes the future
                left = call.deadline - time.monotonic()
                overdue = left <= 0
                if not overdue:
                    role.take(_CALLER)
            if overdue:
                self._expire(time.monotonic())
            elif self._nothing_arrives_within(left):
                self._end_turn([], None)  # a read would have blocked past the deadline: the call is overdue now
            else:
                self._read()

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
            sends, or this one holds calls back: make the call the usual way.

        Raises:
            _Closed: the connection was closed before the call left (make it on a new one).
            Exception: the remote error, or why no answer came (:class:`~rpcdl.errors.WorkerTimeout`, ...).
        """
        with self._lock:
            state = self._state
            if state is _CLOSED:
                raise _Closed(self._error)
            busy = state is _CONNECTING or self._outbox.state is not _IDLE
            if busy or not held.holds_nothing() or not self._role.take(_CALLER):
                return False, None
        started = time.monotonic()
        call_id = next_call_id()
        self._send([Frame(_CALL, call_id, 0, payload, [], AWAITED)])
        frames: list[Frame] = []
        error = None
        poller = self._poller
        polled = not self._reader.buffered  # else the answer may be here: nothing to poll for, or to learn from
        if polled:
            poller.wait()
        try:
            while self._state is not _CLOSED:
                left = started + timeout - time.monotonic()
                if left <= 0.0:
                    break
                if self._nothing_arrives_within(left):
                    continue  # a read would have blocked past the deadline
                error = self._read_into(frames)
                if frames or error is not None:
                    break
        except BaseException as exc:  # raised in this thread mid-read (KeyboardInterrupt)
            self._end_turn(frames, exc)
            raise
        if polled:
            poller.arrived()
        answer = None
        for frame in frames:
            if frame.call_id == call_id and frame.kind in _ANSWERS:
                answer = frame
        if answer is None and frames and error is None:
            call = Call(timeout, subject, sync=True, call_id=call_id, started=started)
            call.future._connection = self
            self._end_turn(frames, None, waiting=call)
            return True, call.future.wait()
        if answer is not None and len(frames) == 1 and error is None:  # the usual case: nothing else to complete
            with self._lock:
                self._give_role_back(answer)
        else:
            self._end_turn(frames, error)
        if answer is not None:
            result, error = outcome(self.address, self, answer, subject)
        elif isinstance(error, FrameTooLarge) and error.call_id == call_id:
            error = error.as_limit_exceeded(f"worker {self.address} answered {describe_call(subject)}")
        elif self._state is _CLOSED:
            error = ConnectionLost(self._error)
        else:
            error = overdue_error(self.address, subject, timeout, True, None)
        if error is not None:
            raise error
        return True, result

    def _nothing_arrives_within(self, left: float) -> bool:
        """Whether a caller with ``left`` seconds to its deadline must not read: a read that finds nothing
        blocks for the idle tick, longer than that, and no bytes arrive in the time left."""
        return left < self._idle_tick and not self._arrives_within(left)

    def _arrives_within(self, seconds: float) -> bool:
        """Whether a frame is buffered or bytes arrive within ``seconds`` (``True`` once closed: reading says so)."""
        try:
            return self._reader.buffered or self._poller.ready(seconds)
        except (OSError, ValueError):
            return True

    def read_if_ready(self) -> bool | None:
        """Read and deliver the frames arriving, in this thread, if no other thread reads.

        Returns:
            ``True`` if a frame was read, ``False`` if none is arriving yet,
            ``None`` if another thread is reading (it delivers what comes) or
            the connection is closed.
        """
        with self._lock:
            self._calls.caller_came(time.monotonic())
            if not self._role.free or self._state is _CLOSED:
                return None
            if self._state is _CONNECTING or not (self._reader.buffered or self._poller.ready()):
                return False
            self._role.take(_CALLER)
        self._read()
        return True

    def readable_socket(self) -> socket.socket | None:
        """The socket to poll for answers, or ``None`` while connecting or once closed."""
        return self._sock if self._state is _OPEN else None

    def read_in_background(self, call: Call) -> None:
        """Let this connection's thread read the answer to ``call``."""
        with self._lock:
            if self._calls.adopt([call]):
                self._wake_serve_by(self._role.background_turn())

    def release(self, uid: int) -> None:
        """Queue ``uid`` to be freed on the worker (safe to call from a finalizer)."""
        if self._state is not _CLOSED and os.getpid() == self._pid:
            self._releases.append(uid)

    def close(self, reason: str = "the connection was closed by rpcdl.shutdown()") -> None:
        self._fail(reason)

    def _send(self, frames: list[Frame]) -> None:
        if self._has_releases():
            frames = [*self._release_frames(), *frames]
        if not frames:
            if os.getpid() != self._pid:
                return  # a forked child: the deferred frames are the parent's to send
            pieces: list = []  # flushes what is deferred
        elif len(frames) == 1:
            pieces = encode_frame(frames[0])
        else:
            pieces = [p for frame in frames for p in encode_frame(frame)]
        try:
            self._outbox.send(pieces)
        except OSError as exc:
            self._fail(f"lost the connection to worker {self.address} while sending: {exc or type(exc).__name__}")

    def _has_releases(self) -> bool:
        """Whether this process let go of RRefs or spans of the shared segment that the worker should free."""
        return bool(self._releases) or (self._segment is not None and self._segment.releases_waiting)

    def _release_frames(self) -> list[Frame]:
        """The frames that free what this process let go of: RRefs, and spans of the shared segment."""
        uids = drain(self._releases)
        frames = [Frame(Kind.RELEASE, payload=encode_release(uids))] if uids else []
        return [*self._segment.release_frames(), *frames] if self._segment else frames

    def _defer(self, frame: Frame) -> None:
        """Queue ``frame`` (no buffers) to leave with the next ones (see :meth:`Outbox.defer`)."""
        try:
            self._outbox.defer(encode_frame(frame))
        except OSError as exc:
            self._fail(f"lost the connection to worker {self.address} while sending: {exc or type(exc).__name__}")
            return
        held.deferred_on(self)

    def _deferral_started(self, until: float) -> None:
        """Frames wait in the outbox: make sure the connection's thread flushes them by ``until``."""
        with self._lock:
            self._wake_serve_by(until)

    def _expire(self, now: float) -> None:
        """Fail the calls past their deadline."""
        with self._lock:
            overdue = self._calls.pop_overdue(now)
            if overdue:
                self._cond.notify_all()
            connected = self._state is not _CONNECTING
        for call in overdue:  # outside the lock: callbacks may make calls
            error = overdue_error(self.address, call.subject, call.timeout, connected, self._last_connect_error)
            call.future.set_exception(error)

    def _fail(self, reason: str, error_type: type[Exception] = ConnectionLost) -> None:
        with self._lock:
            if self._state is _CLOSED:
                return
            self._state = _CLOSED
            self._error = reason
            pending = self._calls.clear()
            sock = self._sock
            self._cond.notify_all()
            self._serve_cond.notify()
        self._on_close(self)
        if sock is not None and os.getpid() == self._pid:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for call in pending:
            call.future.set_exception(error_type(reason))

    # ------------------------------------------------------------------ reading

    def _read(self) -> None:
        """Read the frames there are; give the role back; deliver them. The caller holds the reading role.

        One system call at most: after the first frame, only those whole in the reader's buffer, up to one
        with buffers (the next may have begun to arrive and no more; a caller reading several connections
        must not wait for it here)."""
        frames: list[Frame] = []
        try:
            error = self._read_into(frames)
        except BaseException as exc:  # raised in this thread mid-read (KeyboardInterrupt)
            self._end_turn(frames, exc)
            raise
        self._end_turn(frames, error)

    def _read_into(self, frames: list[Frame]) -> BaseException | None:
        """Read into ``frames`` (see :meth:`_read`): one frame first if it is empty, then those whole in the
        buffer after the last; return the error that ended the reading, if one did (the role is still held)."""
        reader = self._reader
        try:
            if not frames:
                frame = reader.read_frame(self._allocate)
                if frame is None:
                    return None
                frames.append(frame)
            while reader.holds_frame and len(frames) < _BATCH:
                frame = frames[-1]
                if frame.buffers or frame.kind not in _ANSWERS:
                    break
                frames.append(reader.read_frame(self._allocate))
        except (OSError, ProtocolError) as exc:  # FrameTooLarge included
            return exc
        return None

    def _end_turn(self, frames: list[Frame], error: BaseException | None, waiting: Call | None = None) -> None:
        """Give the reading role back, then complete the calls ``frames`` answer; ``waiting``, a call whose
        caller has read on its own so far (:meth:`call_sync`), joins the pending calls first. An ``error``
        that ended the reading closes the connection: the stream may have stopped inside a frame."""
        answered = []
        unexpected = frames[-1] if frames and frames[-1].kind not in _ANSWERS else None
        with self._lock:
            if waiting is not None:
                self._calls.add(waiting, waiting.started)
            # taken while still reading: a thread waiting for these calls must not take the role to read
            # answers that are already here
            for frame in frames:
                call = self._calls.pop(frame.call_id) if frame is not unexpected else None
                if call is not None:  # otherwise its caller gave up waiting, or reads it itself (call_sync)
                    answered.append((frame, call))
            self._give_role_back(frames[-1] if frames and unexpected is None else None)
        for frame, call in answered:
            deliver(self.address, self, frame, call)
        if isinstance(error, FrameTooLarge):  # the worker's limits are higher: that call fails for good
            with self._lock:
                call = self._calls.pop(error.call_id)
            if call is not None:
                call.future.set_exception(error.as_limit_exceeded(f"worker {self.address} answered {call.what}"))
        if error is not None:
            self._fail(f"lost the connection to worker {self.address}: {error or type(error).__name__}")
        elif unexpected is not None:
            self._fail(f"worker {self.address} sent an unexpected {unexpected.kind.name} frame")

    def _give_role_back(self, last_answer: Frame | None) -> None:
        """The reader gives the role back, having read ``last_answer`` last, if any (under ``_lock``)."""
        self._role.give_back(time.monotonic())
        if last_answer is not None:
            payload_bytes = len(last_answer.payload)
            size = payload_bytes + last_answer.buffer_bytes if last_answer.buffers else payload_bytes
            self._calls.answers_are_large = size >= buffers.MIN_BYTES
        if self._role.waiters:
            self._cond.notify_all()
        self._caller_left()
