"""One persistent, multiplexed connection to a worker, owned by this process's event loop.

Threads and what each owns (the one statement of the connection's model):

* **The event loop's thread**, ``rpcdl-loop`` (:mod:`rpcdl.transport.event_loop`),
  owns the socket's reading side and the connection's life: it dials the
  worker and runs the handshake (:func:`rpcdl.rpc.dial.dial_on_loop`, TLS
  included), receives answers into pooled memory
  (:class:`~rpcdl.transport.frame_protocol.FrameProtocol`, for which the
  connection is the sink) and completes their futures, fails overdue calls
  (a timer at the earliest deadline), hears the worker's ``LEAVING`` notice,
  writes the frames of the calls handed to it (made while connecting or while
  other calls are in flight, and every frame of a TLS connection: one thread
  per TLS object), and sends releases (RRef ids, spans of the shared segment)
  on its tick. The timers and the dial's task are its
  alone. One loop serves every connection of the process: threads do not
  grow with workers.
* **Any thread** makes calls (:meth:`Connection.submit`) and waits on their
  futures; it unpickles the answers it asks for
  (:class:`~rpcdl.rpc.calls.CallFuture`). Over an open plain socket, a call
  made while none waits for the loop to write it is written by its caller
  (with the releases waiting):
  :class:`~rpcdl.transport.socket_stream.SocketStream` sends it at once, so
  a call costs one ``send`` and no wakeup of the loop, whether others are in
  flight (a loader's pipeline) or not (``rpc_sync``). Calls made while
  connecting, or while calls handed to the loop wait to be written, go to
  the loop, a burst in one write; until the loop has written them (those
  queued while connecting included), no caller writes, so a call written by
  its caller never overtakes one made before it. It never reads the socket.
* **One lock**, ``Connection._lock``, guards the lifecycle state (exactly one
  of :class:`~rpcdl.rpc.state.Connecting`, :class:`~rpcdl.rpc.state.Open`,
  :class:`~rpcdl.rpc.state.Leaving`, :class:`~rpcdl.rpc.state.Closed`; a
  transition replaces it under the lock), the
  :class:`~rpcdl.rpc.state.PendingCalls` (a call is added before a byte of
  it is written, so its answer always finds it) and the calls submitted but
  not yet written by the loop (``_submitted``, with ``_posted``: whether the
  loop was asked to write calls, submitted or queued while connecting, and
  has not written them yet), and the time
  the loop's overdue timer is armed for (``_overdue_at``; ``inf`` when none
  is), which a call reads to post the loop a sooner timer only when its
  deadline comes first. A burst of such calls costs the loop one wakeup: the
  first call of a burst posts the callback that takes them all. No I/O and
  no user code run under the lock.
* ``_this_process`` (module) marks the connections made in this process: a
  forked child replaces it (a fork hook, before any other code of the child
  runs), so its parent's connections refuse its calls without asking the
  system for the process id on every call.
* ``_releases`` is a lock-free queue (a :class:`collections.deque`): RRef
  finalizers append to it from any thread, at any allocation; whichever
  thread writes next sends what it holds, or the loop on its tick.

A call with tensors (out-of-band buffers) returns once they are written (or
what the socket did not take is copied), so its caller may change them then;
where the loop writes them, small ones are copied at once instead, which
costs less than a wait for the loop.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._lifecycle import in_forked_child
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
from ..transport.control import decode_leaving, drain, encode_release
from ..transport.event_loop import in_loop_thread, process_loop
from ..transport.frame_protocol import FrameProtocol
from ..transport.security import Token
from ..transport.socket_stream import SocketStream
from ..transport.wire import Frame, Kind, Limits, encode_frame
from .answers import ANSWERS, deliver, overdue_error
from .calls import Call
from .dial import dial_on_loop
from .leaving import worker_left, worker_serves
from .state import Closed, Connecting, Leaving, Open, PendingCalls

TICK = 1.0  #: seconds between two looks of the loop at an open connection: releases to send, a stalled peer
COPY_BYTES = 1 << 20  #: a call's buffers below this size are copied, above it their caller waits until written
JOINED_BYTES = 64 * 1024  #: pieces below this size are joined into one write with their neighbours
CLOSE_WAIT = 5.0  #: seconds a thread closing a connection waits for the loop to fail its calls


@dataclass(frozen=True)
class Status:
    """A connection's state at one moment (:meth:`Connection.status`), for messages and tests."""

    state: str  #: ``"connecting"``, ``"open"``, ``"leaving"`` or ``"closed"``
    pending: int  #: calls waiting for an answer (a moment old: the loop owns them)
    shared_memory: bool  #: whether answers' buffers may arrive in the worker's shared segment (same host)


class Connection:
    """One persistent, multiplexed connection to a worker, its socket owned by the event loop.

    Use the functions of :mod:`rpcdl.rpc.client` rather than this class. The
    module docstring states the threading model. A connection does nothing
    until :meth:`start` hands it to the loop (:func:`rpcdl.rpc.pool.connection_to` does).

    Args:
        address: the worker, ``"host:port"``.
        token: the shared secret, or ``None``.
        ssl_context: TLS context, or ``None`` for plain TCP.
        timeout: seconds the connection tries to open, and a peer may stall mid-message.
        grace: seconds to keep retrying a worker never reached while it refuses connections (see :mod:`rpcdl.rpc.dial`).
        on_close: called with this connection as it closes, before any call can find it closed (the pool
            forgets it); maybe more than once.

    Example::

        >>> connection = Connection("127.0.0.1:6543", None, None, 10.0, grace=20.0, on_close=print)  # doctest: +SKIP
        >>> connection.start()  # doctest: +SKIP
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
        self._process = _this_process  # whose connection this is (a forked child refuses it)
        self._loop = process_loop()  # this process's (a forked child's connections are new ones)
        self._releases: collections.deque[int] = collections.deque()  # a lock-free queue (see the module)
        self._lock = threading.Lock()
        self._state: Connecting | Open | Closed = Connecting(time.monotonic() + timeout)
        self._submitted: list[tuple[Frame, Call, threading.Event | None]] = []
        self._posted = False
        self._calls = PendingCalls()
        self._overdue_at = float("inf")
        # The loop's own:
        self._overdue_timer: asyncio.TimerHandle | None = None
        self._tick: asyncio.TimerHandle | None = None

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
        """Where the connection stands now: its state and the calls pending."""
        with self._lock:
            state = self._state
            pending = len(self._calls) + len(self._submitted)
        return Status(
            state=state.name,
            pending=pending,
            shared_memory=isinstance(state, Open) and state.segment is not None,
        )

    def start(self) -> None:
        """Hand the connection to the loop, which dials the worker; calls made meanwhile wait for it."""
        self._loop.call_soon_threadsafe(self._start_dialing)

    # ------------------------------------------------------------------ calls, from any thread

    def submit(
        self, kind: Kind, call: Call, payload: bytes = b"", buffers: Sequence = (), ref: int = 0, flags: int = 0
    ) -> bool:
        """Make ``call``: the loop sends its frame (once connected) and its answer completes ``call.future``;
        ``flags`` go in the frame.

        Returns:
            Whether the call was made; ``False`` if the connection is closed, or its parent's in a forked child
            (make it on a new one). A call made once the worker said it is leaving fails at once with
            :class:`~rpcdl.errors.WorkerLeaving` (made).
        """
        if self._process is not _this_process:
            return False
        frame = Frame(kind, call.call_id, ref, payload, buffers if type(buffers) is list else list(buffers), flags)
        written = None
        prepared = not frame.buffers  # whether the loop may write the frame whenever it likes
        retried = False
        while True:
            if not prepared and (retried or not self._writes_directly()):  # a hint; checked again under the lock
                written, prepared = _for_the_loop(frame), True
            direct = sooner = post = False
            with self._lock:
                state = self._state
                if isinstance(state, Closed):
                    return False
                if isinstance(state, Leaving):
                    break
                if self._writes_directly():
                    self._calls.add(call)  # before a byte is sent: the answer finds it
                    direct, sooner = True, call.deadline < self._overdue_at
                elif prepared:
                    self._submitted.append((frame, call, written))
                    post, self._posted = not self._posted, True
            if direct or prepared:
                break
            retried = True
        if isinstance(state, Leaving):  # failed outside the lock: the future's callbacks may make calls
            call.future.fail(self._leaving_error(state.reason, call))
            return True
        if direct:
            if sooner:
                self._loop.call_soon_threadsafe(self._arm_overdue_timer)
            self._write(state, [frame])
            return True
        if post:
            self._loop.call_soon_threadsafe(self._take_submitted)
        if written is not None:
            written.wait()
        return True

    def _writes_directly(self) -> bool:
        """Whether a call made now is written by its caller (see the module): open over a plain socket, none
        waiting for the loop to write it (exact under ``_lock``, a hint outside it)."""
        return _written_by_caller(self._state) and not self._posted

    def release(self, uid: int) -> None:
        """Queue ``uid`` to be freed on the worker: one atomic append, no lock (safe in a finalizer)."""
        self._releases.append(uid)

    def close(
        self,
        reason: str = "the connection was closed by rpcdl.shutdown()",
        error_type: type[Exception] = ConnectionLost,
    ) -> None:
        """Close the connection for good: the calls pending fail with ``error_type(reason)`` (before this
        returns, unless the loop is busy for :data:`CLOSE_WAIT`); calls made on it later are refused
        (:meth:`submit` returns ``False``). Nothing if it is closed already."""
        self._on_close(self)  # first: nobody finds it closed in the pool (and retries on it)
        with self._lock:
            state = self._state
            if isinstance(state, Closed):
                return
            self._state = closed = Closed(reason, error_type)
            submitted, self._submitted = self._submitted, []
        self._closed_from(state, closed, submitted, wait=True)

    def close_if_idle(self, reason: str) -> bool:
        """Close the connection if it is open and waits for no answer, deciding under its lock: a call made
        meanwhile either keeps it open or is refused (:meth:`submit` returns ``False``), never failed by the
        close. One still connecting is not idle: whoever asked for it is about to call (so a call refused
        here finds, when it asks again, a new connection that no such close can take from it).

        Its caller takes it out of the pool first (:func:`rpcdl.rpc.pool.close_idle_connections_to`, under
        the pool's lock), so ``on_close`` is not called; nor is the loop waited for: no call is left to fail.

        Args:
            reason: why, for a call that raced the close.

        Returns:
            whether this closed it (``False``: still connecting, calls are in flight, or it was closed already).
        """
        with self._lock:
            state = self._state
            if not isinstance(state, Open) or self._calls or self._submitted:
                return False
            self._state = closed = Closed(reason, ConnectionLost)
        self._closed_from(state, closed, [], wait=False)
        return True

    def _closed_from(
        self,
        state: Connecting | Open,
        closed: Closed,
        submitted: list[tuple[Frame, Call, threading.Event | None]],
        *,
        wait: bool,
    ) -> None:
        """Have the loop finish what a close from ``state`` began (:meth:`_finish`); ``wait`` a while for it."""
        if self._process is not _this_process:
            return  # a forked child: the parent's loop and socket are not its own
        if in_loop_thread():
            self._finish(state, closed, submitted)
            return
        if not wait:
            self._loop.call_soon_threadsafe(self._finish, state, closed, submitted)
            return
        finished = threading.Event()
        self._loop.call_soon_threadsafe(self._finish, state, closed, submitted, finished)
        finished.wait(CLOSE_WAIT)

    # ------------------------------------------------------------------ on the loop: sending

    def _take_submitted(self) -> None:
        try:
            self._write_submitted()
        finally:
            with self._lock:  # _posted stays set until they are written: no call made meanwhile overtakes them
                self._posted = more = bool(self._submitted)
            if more:
                self._loop.call_soon(self._take_submitted)

    def _write_submitted(self) -> None:
        sooner = False
        with self._lock:
            submitted, self._submitted = self._submitted, []
            state = self._state
            if not isinstance(state, Closed):
                for _, call, _ in submitted:
                    self._calls.add(call)
                    sooner |= call.deadline < self._overdue_at
        if not submitted:
            return
        if isinstance(state, Closed):  # closed meanwhile (close() failed what it found)
            self._fail_submitted(submitted, state.error())
            return
        if sooner:
            self._arm_overdue_timer()
        if isinstance(state, Connecting):
            for frame, _, written in submitted:
                if written is not None:  # its caller waits: copy what it may change
                    frame.buffers = [memoryview(b).tobytes() for b in frame.buffers]
                    written.set()
                state.queued.append(frame)
            return
        try:
            self._write(state, [frame for frame, _, _ in submitted])
        finally:
            for _, _, written in submitted:
                if written is not None:
                    written.set()

    def _write(self, state: Open, frames: list[Frame]) -> None:
        """Write ``frames`` (after the releases waiting): small pieces joined, large ones from their memory.

        On the loop, or in the thread making a call on a :class:`~rpcdl.transport.socket_stream.SocketStream`.
        """
        if self._releases or (state.segment is not None and state.segment.releases_waiting):
            frames = [*self._release_frames(state), *frames]
        pieces: list[Any] = []
        joined: list[bytes] = []
        for frame in frames:
            for piece in encode_frame(frame):
                if len(piece) < JOINED_BYTES:
                    joined.append(piece)
                    continue
                if joined:
                    pieces.append(b"".join(joined))
                    joined = []
                pieces.append(piece)
        if joined:
            pieces.append(joined[0] if len(joined) == 1 else b"".join(joined))
        transport = state.transport
        if isinstance(transport, SocketStream):
            transport.writelines(pieces)  # one system call; what the socket does not take now is copied
            return
        for piece in pieces:
            transport.write(piece)  # what the socket does not take now is copied by the transport

    def _release_frames(self, state: Open) -> list[Frame]:
        uids = drain(self._releases)
        frames = [Frame(Kind.RELEASE, payload=encode_release(uids))] if uids else []
        return [*state.segment.release_frames(), *frames] if state.segment is not None else frames

    def _fail_submitted(self, submitted: list[tuple[Frame, Call, threading.Event | None]], error: Exception) -> None:
        for _, call, written in submitted:
            if written is not None:
                written.set()
            call.future.fail(error)

    # ------------------------------------------------------------------ on the loop: connecting

    def _start_dialing(self) -> None:
        with self._lock:
            state = self._state
        if isinstance(state, Connecting):
            state.task = asyncio.get_running_loop().create_task(self._connect(state))

    async def _connect(self, connecting: Connecting) -> None:
        """Dial the worker (retrying as :mod:`rpcdl.rpc.dial` says), then open: CONNECTING -> OPEN."""
        try:
            transport, reader, agreed = await dial_on_loop(
                self.address,
                self.host,
                self.port,
                self._token,
                self._ssl,
                handshake_timeout=self._limits.handshake_timeout,
                grace=self._grace,
                failed=self._connect_failed,
                compression=self._asked_compression,
                shared_memory=self._offers_shm,
            )
        except (AuthenticationError, ProtocolError, UnknownHost, WorkerUnavailable) as exc:
            self.close(str(exc), type(exc))
            return
        except asyncio.CancelledError:
            return  # closed meanwhile
        except Exception as exc:  # nothing waits in silence: the calls fail with it
            self.close(f"connecting to worker {self.address} failed: {exc!r}")
            return
        protocol = FrameProtocol(
            self,
            self._limits,
            decompress=agreed.compression != "off",
            segment=shm.receiver(agreed.segment, self._pins, self._allocate),
            allocate=self._allocate,
            leftover=reader.leftover(),
        )
        with self._lock:
            state = self._state
            if state is connecting:
                self._state = opened = Open(transport, protocol, agreed.segment, agreed.compression)
                self._posted |= bool(connecting.queued)  # they go first: no caller writes before the loop has
        if state is not connecting:  # closed meanwhile: nobody else has seen this transport
            transport.abort()
            return
        worker_serves(self.address)
        transport.set_protocol(protocol)  # the loop reads nothing before this callback returns
        protocol.connection_made(transport)
        self._tick = asyncio.get_running_loop().call_later(TICK, self._on_tick)
        if connecting.queued or self._releases:
            try:
                self._write(opened, connecting.queued)
            finally:
                connecting.queued = []
                self._take_submitted()  # those made since, if any; then callers may write

    def _connect_failed(self, exc: OSError) -> float:
        """Note a failed attempt to connect; fail the calls overdue; return until when calls still want a
        connection.

        Raises:
            WorkerUnavailable: the connection was closed meanwhile.
        """
        with self._lock:
            state = self._state
            latest = self._calls.latest_deadline()
        if not isinstance(state, Connecting):
            raise WorkerUnavailable(state.reason if isinstance(state, Closed) else "connected meanwhile")
        state.attempt_failed(exc)
        self._expire()
        return state.wanted_until(latest)

    # ------------------------------------------------------------------ on the loop: what the protocol hands over

    def frame_received(self, frame: Frame) -> None:
        """An answer completes its call (one that gave up waiting is dropped); a ``LEAVING`` notice is heard."""
        kind = frame.kind
        if kind in ANSWERS:
            with self._lock:
                call = self._calls.pop(frame.call_id)
            if call is not None:
                deliver(self.address, self, frame, call)
            return
        if kind is Kind.LEAVING:
            self._leaving(frame)
            return
        self._close_here(f"worker {self.address} sent an unexpected {kind.name} frame")

    def receiving_failed(self, error: Exception) -> None:
        """The worker's stream broke the protocol (a frame past this side's limits, say): the connection closes."""
        if isinstance(error, FrameTooLarge):  # the worker's limits are higher: that call fails for good
            with self._lock:
                call = self._calls.pop(error.call_id)
            if call is not None:
                call.future.fail(error.as_limit_exceeded(f"worker {self.address} answered {call.what}"))
        self._close_here(f"lost the connection to worker {self.address}: {error or type(error).__name__}")

    def stream_ended(self, error: Exception | None) -> None:
        """The connection was lost (the worker closed it, or it broke)."""
        error = error or ConnectionLost("the peer closed the connection")
        self._close_here(f"lost the connection to worker {self.address}: {error or type(error).__name__}")

    # ------------------------------------------------------------------ on the loop: the rest

    def _leaving(self, frame: Frame) -> None:
        try:
            drain_timeout, reason = decode_leaving(frame.payload)
        except ProtocolError as exc:
            self._close_here(f"lost the connection to worker {self.address}: {exc}")
            return
        with self._lock:
            state = self._state
            told = isinstance(state, Open) and not isinstance(state, Leaving)
            if told:
                self._state = Leaving(state, reason)
        if told:  # the worker drains: no call of ours goes there now
            worker_left(self.address, reason, drain_timeout)

    def _pins(self, call_id: int) -> bool:
        """Whether the answer to ``call_id`` is received into pinned memory."""
        with self._lock:
            call = self._calls.get(call_id)
        return call is not None and call.pin_memory and shm.can_pin()

    def _allocate(self, call_id: int, size: int) -> Any:
        """Memory for a buffer of ``size`` bytes of the answer to ``call_id``, as it is received."""
        if self._pins(call_id):
            return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
        return buffers.for_receiving(size)

    def _leaving_error(self, reason: str, call: Call) -> WorkerLeaving:
        return WorkerLeaving(
            f"worker {self.address} is leaving ({reason}): {call.what} was not sent; make it on another worker",
            self.address,
        )

    def _arm_overdue_timer(self) -> None:
        """Make the loop look for overdue calls at the earliest deadline."""
        with self._lock:
            when = self._calls.check_at
            if when >= self._overdue_at:
                return
            self._overdue_at = when
        if self._overdue_timer is not None:
            self._overdue_timer.cancel()
        delay = max(0.0, when - time.monotonic()) + 0.0005
        self._overdue_timer = asyncio.get_running_loop().call_later(delay, self._on_overdue_timer)

    def _on_overdue_timer(self) -> None:
        # A call adds itself and compares its deadline with _overdue_at under the lock, which posts a sooner
        # timer only when it comes first. Added before _overdue_at becomes inf here, a later one is seen by
        # the look for later calls below, which takes the lock after it; added after, it compares with inf
        # and posts. Either way a timer is armed at or before its deadline.
        self._overdue_timer = None
        with self._lock:
            self._overdue_at = float("inf")
        self._expire()
        with self._lock:
            later = self._calls.check_at != float("inf")
        if later:
            self._arm_overdue_timer()

    def _expire(self) -> None:
        """Fail the calls past their deadline."""
        with self._lock:
            overdue = self._calls.pop_overdue(time.monotonic())
            state = self._state
        if not overdue:
            return
        connect_error = state.last_error if isinstance(state, Connecting) else None
        for call in overdue:
            error = overdue_error(
                self.address, call.subject, call.timeout, not isinstance(state, Connecting), connect_error
            )
            call.future.fail(error)

    def _on_tick(self) -> None:
        """Send the releases waiting; close a connection whose worker stalls in the middle of a frame."""
        with self._lock:
            state = self._state
        if not isinstance(state, Open):
            return
        stalled = state.protocol.stalled_for(time.monotonic())
        if stalled > self._io_timeout:
            self._close_here(
                f"lost the connection to worker {self.address}: the peer sent nothing for "
                f"{self._io_timeout:g}s in the middle of a message"
            )
            return
        if self._releases or (state.segment is not None and state.segment.releases_waiting):
            self._write(state, [])
        self._tick = asyncio.get_running_loop().call_later(TICK, self._on_tick)

    def _close_here(self, reason: str, error_type: type[Exception] = ConnectionLost) -> None:
        """:meth:`close`, on the loop."""
        self.close(reason, error_type)

    def _finish(
        self,
        previous: Connecting | Open,
        closed: Closed,
        submitted: list[tuple[Frame, Call, threading.Event | None]],
        finished: threading.Event | None = None,
    ) -> None:
        """The connection closed: fail its calls, stop its timers and dial, close its transport."""
        try:
            for timer in (self._overdue_timer, self._tick):
                if timer is not None:
                    timer.cancel()
            self._overdue_timer = self._tick = None
            if isinstance(previous, Connecting) and previous.task is not None:
                previous.task.cancel()
            elif isinstance(previous, Open):
                previous.transport.abort()
            error = closed.error()
            self._fail_submitted(submitted, error)
            with self._lock:
                pending = self._calls.clear()
            for call in pending:
                call.future.fail(closed.error())
        finally:
            if finished is not None:
                finished.set()


_this_process = object()  # stands for this process: replaced in a forked child (see the module)


def _after_fork_in_child() -> None:
    global _this_process
    _this_process = object()


in_forked_child(_after_fork_in_child)


def _written_by_caller(state: Connecting | Open | Closed) -> bool:
    """Whether the thread making a call writes its frame itself: an open connection over a plain socket."""
    return isinstance(state, Open) and isinstance(state.transport, SocketStream)


def _for_the_loop(frame: Frame) -> threading.Event | None:
    """Make ``frame``'s buffers safe for the loop to write later: small ones copied (the caller may change them
    once its call returns); return the event to wait on for large ones (written, or copied, by the loop)."""
    size = sum(memoryview(b).nbytes for b in frame.buffers)
    if size < COPY_BYTES or in_loop_thread():
        frame.buffers = [memoryview(b).tobytes() for b in frame.buffers]
        return None
    return threading.Event()
