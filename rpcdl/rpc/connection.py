"""One persistent, multiplexed connection to a worker, and the calls in flight on it.

Threading model: each :class:`Connection` has one thread of its own,
``rpcdl-connection-HOST:PORT``, which opens the connection (see
:mod:`rpcdl.rpc.dial`), then reads answers for asynchronous calls, fails overdue
calls and flushes RRef releases. Any thread may send (under ``_send_lock``).
Reading is a role that one thread holds at a time (``_reading``, under
``_cond``): a thread blocked in :meth:`Connection.wait` takes it and reads its
own answer; a thread in :func:`rpcdl.rpc.client.read_answers` takes it for calls made
under :func:`rpcdl.rpc.held.answers_read_here`; the connection's thread takes it for the
rest. Whoever reads an answer completes its future, so callbacks run on that
thread. Before a thread waits for answers it sends the calls it holds back
(see :mod:`rpcdl.rpc.held` for why stages compose).
"""

from __future__ import annotations

import collections
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .._lifecycle import in_forked_child
from ..address import parse_address
from ..errors import (
    AuthenticationError,
    ConnectionLost,
    FrameTooLarge,
    ProtocolError,
    WorkerTimeout,
    WorkerUnavailable,
)
from ..serialization.pickling import load_exception, loads, peer_context
from ..transport import buffers, shm
from ..transport.compression import resolve_mode
from ..transport.control import decode_rejected, decode_stats, encode_release
from ..transport.security import Token
from ..transport.tls_stream import TLSStream
from ..transport.wire import Frame, FrameReader, Kind, Limits, encode_frame, io_stream, send_pieces
from . import held
from .calls import Call
from .dial import dial

_IDLE_TICK = 0.1  # how often a reader with nothing to read looks at deadlines
_RELEASE_TICK = 1.0  # how often queued RRef releases are flushed when idle
_CALLER_PATIENCE = 0.1  # answers left to their caller are read by the connection's thread after this long unread


# The threads of connections, open or closing, until they end: at exit they are joined (see
# join_connection_threads), closed ones included, since one may still be completing a call.
_live_threads: set[threading.Thread] = set()
_live_lock = threading.Lock()


def join_connection_threads(timeout: float) -> list[str]:
    """Wait up to ``timeout`` seconds in all for the threads of this process's connections to end.

    Returns:
        the names of those still running then.
    """
    deadline = time.monotonic() + timeout
    with _live_lock:
        threads = [thread for thread in _live_threads if thread is not threading.current_thread()]
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    return [thread.name for thread in threads if thread.is_alive()]


def _forget_parents_threads() -> None:
    global _live_threads, _live_lock
    _live_threads, _live_lock = set(), threading.Lock()


in_forked_child(_forget_parents_threads)


_ANSWERS = frozenset((Kind.RESULT, Kind.ERROR, Kind.REJECTED, Kind.PONG, Kind.STATS_REPLY))


class _Closed(Exception):
    pass


class Connection:
    """One persistent, multiplexed connection to a worker.

    Use the functions of :mod:`rpcdl.rpc.client` rather than this class. Reading is
    a role that one thread holds at a time: a thread blocked in
    :func:`rpcdl.rpc_sync` takes it and reads its own answer (no thread switch
    on the way back), and the connection's own thread takes it while
    asynchronous calls are pending, except those made under
    :func:`rpcdl.rpc.client.answers_read_here`, whose caller reads them (unless it
    leaves them unread for ``_CALLER_PATIENCE``). Whoever reads completes the
    futures of the answers it reads.

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
        self._segment: shm.ClientSegment | None = None  # once connected: the worker's, if this process mapped it
        self._cond = threading.Condition(threading.Lock())
        self._send_lock = threading.Lock()
        self._pending: dict[int, Call] = {}
        self._async_pending = 0
        self._large_answers = False  # whether the last answer was large
        self._caller_read_at = 0.0  # when a caller last came to read answers (read_if_ready)
        self._reading = False
        self._wakes_at = 0.0  # when the connection's thread, asleep in _serve_async_calls, looks again
        self._role_waiters = 0  # threads waiting in _cond for the reading role
        self._queued: list[Frame] = []
        self._releases: collections.deque[int] = collections.deque()
        self._ready = False
        self._closed = False
        self._error = ""
        self._sock: socket.socket | None = None
        self._reader: FrameReader | None = None
        self._connect_deadline = time.monotonic() + timeout
        self._grace = grace
        self._on_close = on_close
        self._last_connect_error: BaseException | None = None
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run_to_end, name=f"rpcdl-connection-{address}", daemon=True)
        with _live_lock:
            _live_threads.add(self._thread)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def credentials(self) -> dict[str, Any]:
        """The keyword arguments that reach this worker with the same credentials."""
        return {"token": self._token or "", "ssl_context": self._ssl}

    # ------------------------------------------------------------------ calls

    def submit(self, kind: Kind, call: Call, payload: bytes = b"", buffers: Sequence = (), ref: int = 0) -> None:
        frame = Frame(kind, call.call_id, ref, payload, list(buffers))
        call.future._connection = self
        with self._cond:
            if self._closed:
                raise _Closed(self._error)
            self._pending[call.call_id] = call
            if self._large_answers and not call.sync:
                call.background = True  # large answers arrive faster read in parallel by each connection's thread
            elif not call.background and not call.sync:
                self._caller_read_at = time.monotonic()  # its caller is here, and will read
            if call.background:
                self._async_pending += 1
                self._cond.notify_all()
            elif not call.sync and call.deadline < self._wakes_at:
                self._cond.notify_all()  # the connection's thread sleeps past this call's deadline
            if not self._ready:
                self._queued.append(frame)
                return
        if held.hold(self, frame):
            if call.sync:  # after what this thread holds, in the order it made the calls
                held.send_held()
            return
        self._send([frame])

    def wait(self, call: Call) -> None:
        """Wait until ``call`` is answered (or fails), reading answers meanwhile."""
        held.send_held()
        future = call.future
        while not future.done():
            with self._cond:
                while (
                    call.call_id in self._pending
                    and (self._reading or not self._ready)
                    and time.monotonic() < call.deadline
                ):
                    self._role_waiters += 1
                    try:
                        self._cond.wait(min(call.deadline - time.monotonic(), _RELEASE_TICK))
                    finally:
                        self._role_waiters -= 1
                if call.call_id not in self._pending:
                    break  # answered or failed: whoever took it from _pending completes the future
                overdue = time.monotonic() >= call.deadline
                if not overdue:
                    self._reading = True
            if overdue:
                self._expire(time.monotonic())
            else:
                self._read_once()

    def read_if_ready(self) -> bool | None:
        """Read and deliver one frame in this thread if one is arriving and no other thread reads.

        Returns:
            ``True`` if a frame was read, ``False`` if none is arriving yet,
            ``None`` if another thread is reading (it delivers what comes) or
            the connection is closed.
        """
        with self._cond:
            self._caller_read_at = time.monotonic()
            if self._reading or self._closed:
                return None
            if not self._ready or not (self._reader.buffered or _readable(self._sock)):
                return False
            self._reading = True
        self._read_once()
        return True

    def read_in_background(self, call: Call) -> None:
        """Let this connection's thread read the answer to ``call``."""
        with self._cond:
            if call.call_id in self._pending and self._adopt([call]):
                self._cond.notify_all()

    def _adopt(self, calls: Iterable[Call]) -> int:
        """Hand the answers of ``calls`` left to their caller to this connection's thread; the caller
        holds ``_cond``. Returns how many were handed over."""
        adopted = 0
        for call in calls:
            if not call.background and not call.sync:
                call.background = True
                adopted += 1
        self._async_pending += adopted
        return adopted

    def release(self, uid: int) -> None:
        """Queue ``uid`` to be freed on the worker (safe to call from a finalizer)."""
        if not self._closed and os.getpid() == self._pid:
            self._releases.append(uid)

    def close(self, reason: str = "the connection was closed by rpcdl.shutdown()") -> None:
        self._fail(reason)

    def _send(self, frames: list[Frame]) -> None:
        uids = []
        while self._releases:
            try:
                uids.append(self._releases.popleft())
            except IndexError:
                break
        if uids:
            frames = [Frame(Kind.RELEASE, payload=encode_release(uids)), *frames]
        frames = [*self._segment.release_frames(), *frames] if self._segment else frames
        if not frames:
            return
        pieces = [piece for frame in frames for piece in encode_frame(frame)]
        try:
            with self._send_lock:
                send_pieces(self._sock, pieces)
        except OSError as exc:
            self._fail(f"lost the connection to worker {self.address} while sending: {exc or type(exc).__name__}")

    def _expire(self, now: float) -> None:
        """Fail the calls past their deadline."""
        with self._cond:
            overdue = [call for call in self._pending.values() if call.deadline <= now]
            for call in overdue:
                del self._pending[call.call_id]
                self._async_pending -= call.background
            if overdue:
                self._cond.notify_all()
        for call in overdue:  # outside the lock: callbacks may make calls
            if self._ready:
                error: Exception = WorkerTimeout(
                    f"worker {self.address} did not answer {call.what} within {call.timeout:g}s"
                )
            else:
                error = WorkerUnavailable(
                    f"could not connect to rpcdl worker {self.address} within {call.timeout:g}s "
                    f"(last error: {self._last_connect_error or 'still connecting'})"
                )
            call.future.set_exception(error)

    def _fail(self, reason: str, error_type: type[Exception] = ConnectionLost) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._error = reason
            pending, self._pending = self._pending, {}
            self._async_pending = 0
            sock = self._sock
            self._cond.notify_all()
        self._on_close(self)
        if sock is not None and os.getpid() == self._pid:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for call in pending.values():
            call.future.set_exception(error_type(reason))

    # ------------------------------------------------------------------ reading

    def _read_once(self) -> None:
        """Read and deliver at most one frame; the caller holds the reading role."""
        frame = call = None
        try:
            frame = self._reader.read_frame(self._allocate)
        except FrameTooLarge as exc:  # the worker's limits are higher: that call fails for good, the others retry
            with self._cond:
                call = self._pending.pop(exc.call_id, None)
            if call is not None:
                call.future.set_exception(exc.as_limit_exceeded(f"worker {self.address} answered {call.what}"))
            self._fail(f"lost the connection to worker {self.address}: {exc}")
        except (OSError, ProtocolError) as exc:
            self._fail(f"lost the connection to worker {self.address}: {exc or type(exc).__name__}")
        finally:
            with self._cond:
                self._reading = False
                if frame is not None:
                    # taken while still reading: a thread waiting for this call must not take
                    # the role to read an answer that is already here
                    call = self._pending.pop(frame.call_id, None)
                    if call is not None:
                        self._async_pending -= call.background
                if self._role_waiters:  # waking the idle connection thread for nothing costs a thread switch
                    self._cond.notify_all()
        if frame is None:
            return
        self._large_answers = len(frame.payload) + sum(memoryview(b).nbytes for b in frame.buffers) >= buffers.MIN_BYTES
        if frame.kind not in _ANSWERS:
            self._fail(f"worker {self.address} sent an unexpected {frame.kind.name} frame")
        elif call is not None:  # otherwise its caller gave up waiting
            self._deliver(frame, call)

    def _pins(self, call_id: int) -> bool:
        return getattr(self._pending.get(call_id), "pin_memory", False) and shm.can_pin()

    def _allocate(self, call_id: int, size: int) -> Any:
        pin = self._pins(call_id)
        if size >= buffers.MIN_BYTES and not pin:
            return buffers.take(size)
        return torch.empty(size, dtype=torch.uint8, pin_memory=pin).numpy()

    def _deliver(self, frame: Frame, call: Call) -> None:
        try:
            if frame.kind == Kind.RESULT:
                with peer_context(self.address, None, self):
                    value = loads(frame.payload, frame.buffers)
                result = call.transform(value) if call.transform is not None else value
            elif frame.kind == Kind.STATS_REPLY:
                result = decode_stats(frame.payload)
            elif frame.kind == Kind.PONG:
                result = time.monotonic() - call.started
            elif frame.kind == Kind.ERROR:
                call.future.set_exception(load_exception(frame.payload, self.address))
                return
            else:
                reason = decode_rejected(frame.payload)
                call.future.set_exception(WorkerUnavailable(f"worker {self.address} did not run {call.what}: {reason}"))
                return
        except Exception as exc:
            exc.add_note(f"while unpickling the answer of worker {self.address} to {call.what}")
            call.future.set_exception(exc)
            return
        call.future.set_result(result)

    # ------------------------------------------------------------------ thread

    def _run_to_end(self) -> None:
        try:
            self._run()
        finally:
            with _live_lock:
                _live_threads.discard(threading.current_thread())

    def _run(self) -> None:
        try:
            sock = self._connect()
        except (AuthenticationError, ProtocolError) as exc:
            self._fail(str(exc), type(exc))
            return
        except WorkerUnavailable as exc:
            self._fail(str(exc), WorkerUnavailable)
            return
        with self._send_lock:
            with self._cond:
                if self._closed:
                    sock.close()
                    return
                self._sock = sock
                self._reader = FrameReader(
                    sock, self._limits, self._io_timeout, decompress=self.compression != "off",
                    segment=shm.receiver(self._segment, self._pins, self._allocate),
                )  # fmt: skip
                self._ready = True
                queued, self._queued = self._queued, []
                self._cond.notify_all()
            pieces = [piece for frame in queued for piece in encode_frame(frame)]
            try:
                send_pieces(sock, pieces)
            except OSError as exc:
                queued = exc
        if isinstance(queued, OSError):
            self._fail(f"lost the connection to worker {self.address} while sending: {queued}")
            return
        self._serve_async_calls()

    def _until_next_deadline(self) -> float:
        """Seconds until the first pending call is overdue, at most the release tick (under ``_cond``)."""
        if not self._pending:
            return _RELEASE_TICK
        first = min(call.deadline for call in self._pending.values())
        return min(max(first - time.monotonic(), 0.0) + 0.001, _RELEASE_TICK)

    def _serve_async_calls(self) -> None:
        """Until closed: read for asynchronous calls (nobody waits in :meth:`wait` for them),
        fail overdue calls, flush RRef releases."""
        last_flush = time.monotonic()
        while True:
            with self._cond:
                watches_caller = False
                if not self._closed and (self._async_pending == 0 or self._reading):
                    waits_for_role = self._async_pending > 0
                    watches_caller = any(not call.background and not call.sync for call in self._pending.values())
                    self._role_waiters += waits_for_role
                    tick = _IDLE_TICK if waits_for_role or watches_caller else self._until_next_deadline()
                    self._wakes_at = time.monotonic() + tick
                    try:
                        self._cond.wait(tick)
                    finally:
                        self._role_waiters -= waits_for_role
                        self._wakes_at = 0.0
                if self._closed:
                    return
                now = time.monotonic()
                if watches_caller and now - self._caller_read_at > _CALLER_PATIENCE:
                    self._adopt(self._pending.values())  # left unread too long by their caller
            self._expire(now)  # without the reading role: callbacks may wait for answers
            if (self._releases or getattr(self._segment, "releases_waiting", 0)) and now - last_flush > _RELEASE_TICK:
                last_flush = now
                self._send([])
            with self._cond:
                take_role = self._async_pending > 0 and not self._reading and not self._closed
                if take_role:
                    self._reading = True
            if take_role:
                self._read_once()

    def _connect(self) -> socket.socket:
        sock, agreed = dial(
            self.address, self.host, self.port, self._token, self._ssl,
            handshake_timeout=self._limits.handshake_timeout, grace=self._grace, failed=self._connect_failed,
            pause=self._pause, compression=self.compression, shared_memory=self._offers_shm,
        )  # fmt: skip
        self.compression, self._segment = agreed.compression, agreed.segment
        return io_stream(sock, receive=_IDLE_TICK, send=self._io_timeout)

    def _pause(self, seconds: float) -> None:
        """Wait between two attempts to connect; a close ends the wait."""
        with self._cond:
            if not self._closed:
                self._cond.wait(seconds)

    def _connect_failed(self, exc: OSError) -> float:
        """Note a failed attempt to connect; return until when calls still want a connection."""
        self._last_connect_error = exc
        self._expire(time.monotonic())
        with self._cond:
            if self._closed:
                raise WorkerUnavailable(self._error)
            return max([self._connect_deadline, *(c.deadline for c in self._pending.values())])


def _readable(sock: socket.socket) -> bool:
    if isinstance(sock, TLSStream) and sock.pending():
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
