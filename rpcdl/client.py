"""The client side: persistent connections to workers and the calls made over them.

Each process keeps one connection per worker (and per credentials), shared by
all its threads, with many calls in flight, each answered by id in any order.
A connection is opened in the background by its first call and retried until
that call's timeout, so trainers may start before their workers listen. A
process forked from a client never reuses its parent's connections.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import json
import logging
import os
import select
import socket
import ssl
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from . import buffers
from .address import format_address, parse_address
from .checks import check_timeout
from .errors import AuthenticationError, ConnectionLost, FrameTooLarge, ProtocolError, WorkerTimeout, WorkerUnavailable
from .rref import RRef, holding_handle, new_uid
from .security import Token, default_client_tls, resolve_token
from .serialization import dumps, load_exception, loads, peer_context
from .wire import Frame, FrameReader, Kind, Limits, client_handshake, encode_frame, send_pieces, set_io_timeouts

_T = TypeVar("_T")
log = logging.getLogger("rpcdl.client")

_call_ids = itertools.count(1)
_IDLE_TICK = 0.1  # how often a reader with nothing to read looks at deadlines
_RELEASE_TICK = 1.0  # how often queued RRef releases are flushed when idle
_MAX_RETRY_DELAY = 1.0
_CALLER_PATIENCE = 0.1  # answers left to their caller are read by the connection's thread after this long unread
_cuda_available: bool | None = None


def _can_pin() -> bool:
    global _cuda_available
    if _cuda_available is None:
        _cuda_available = torch.cuda.is_available()
    return _cuda_available


class _Future(torch.futures.Future):
    """The future of a call: waiting on it reads answers from the worker meanwhile.

    So a thread blocked in ``wait()`` gets its answer without a thread switch,
    and waiting inside a callback (which runs on whichever thread read the
    answer) cannot starve the connection.
    """

    _connection: Connection | None = None
    _call: Callable[[], _Call | None] = staticmethod(lambda: None)  # a weak reference: no cycle holds the result

    def wait(self) -> Any:
        call = self._call()  # None once answered: the result is there or being set
        if call is not None and not self.done() and self._connection is not None:
            self._connection.wait(call)
        return super().wait()


class _Call:
    __slots__ = (
        "__weakref__", "background", "call_id", "deadline", "future", "pin_memory", "started", "sync", "timeout",
        "transform", "what",
    )  # fmt: skip

    def __init__(
        self, timeout: float, what: str, *, sync: bool, pin_memory: bool = False, transform: Callable | None = None
    ):
        self.call_id = next(_call_ids)
        self.future = _Future()
        self.future._call = weakref.ref(self)
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.timeout = timeout
        self.pin_memory = pin_memory
        self.what = what
        self.transform = transform
        self.sync = sync
        # whether the connection's own thread reads the answer (else a thread waiting for it,
        # or one calling read_answers)
        self.background = not sync and not getattr(_held, "read_here", False)


_ANSWERS = frozenset((Kind.RESULT, Kind.ERROR, Kind.REJECTED, Kind.PONG, Kind.STATS_REPLY))


class _Closed(Exception):
    pass


class Connection:
    """One persistent, multiplexed connection to a worker.

    Use the module functions rather than this class. Reading is a role that
    one thread holds at a time: a thread blocked in :func:`rpc_sync` takes it
    and reads its own answer (no thread switch on the way back), and the
    connection's own thread takes it while asynchronous calls are pending,
    except those made under :func:`answers_read_here`, whose caller reads them
    (unless it leaves them unread for ``_CALLER_PATIENCE``). Whoever reads
    completes the futures of the answers it reads.
    """

    def __init__(self, address: str, token: Token | None, ssl_context: ssl.SSLContext | None, timeout: float):
        self.address = address
        self.host, self.port = parse_address(address)
        self._token = token
        self._ssl = ssl_context
        self._io_timeout = timeout
        self._limits = Limits()
        self._cond = threading.Condition(threading.Lock())
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Call] = {}
        self._async_pending = 0
        self._large_answers = False  # whether the last answer was large
        self._caller_read_at = 0.0  # when a caller last came to read answers (read_if_ready)
        self._reading = False
        self._role_waiters = 0  # threads waiting in _cond for the reading role
        self._queued: list[Frame] = []
        self._releases: collections.deque[int] = collections.deque()
        self._ready = False
        self._closed = False
        self._error = ""
        self._sock: socket.socket | None = None
        self._reader: FrameReader | None = None
        self._connect_deadline = time.monotonic() + timeout
        self._last_connect_error: BaseException | None = None
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name=f"rpcdl-connection-{address}", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def credentials(self) -> dict[str, Any]:
        """The keyword arguments that reach this worker with the same credentials."""
        return {"token": self._token or "", "ssl_context": self._ssl}

    # ------------------------------------------------------------------ calls

    def submit(self, kind: Kind, call: _Call, payload: bytes = b"", buffers: Sequence = (), ref: int = 0) -> None:
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
            if not self._ready:
                self._queued.append(frame)
                return
        held = getattr(_held, "frames", None)
        if held is not None:
            held.setdefault(self, []).append(frame)
            if call.sync:  # after what this thread holds, in the order it made the calls
                _send_held()
            return
        self._send([frame])

    def wait(self, call: _Call) -> None:
        """Wait until ``call`` is answered (or fails), reading answers meanwhile."""
        _send_held()
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

    def read_in_background(self, call: _Call) -> None:
        """Let this connection's thread read the answer to ``call``."""
        with self._cond:
            if call.call_id in self._pending and self._adopt([call]):
                self._cond.notify_all()

    def _adopt(self, calls: Iterable[_Call]) -> int:
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
            frames = [Frame(Kind.RELEASE, payload=struct.pack(f"!{len(uids)}Q", *uids)), *frames]
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
        _forget(self)
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

    def _allocate(self, call_id: int, size: int) -> Any:
        call = self._pending.get(call_id)
        pin = call is not None and call.pin_memory and _can_pin()
        if size >= buffers.MIN_BYTES and not pin:
            return buffers.take(size)
        return torch.empty(size, dtype=torch.uint8, pin_memory=pin).numpy()

    def _deliver(self, frame: Frame, call: _Call) -> None:
        try:
            if frame.kind == Kind.RESULT:
                with peer_context(self.address, None, self):
                    value = loads(frame.payload, frame.buffers)
                result = call.transform(value) if call.transform is not None else value
            elif frame.kind == Kind.STATS_REPLY:
                result = json.loads(frame.payload)
            elif frame.kind == Kind.PONG:
                result = time.monotonic() - call.started
            elif frame.kind == Kind.ERROR:
                call.future.set_exception(load_exception(frame.payload, self.address))
                return
            else:
                reason = bytes(frame.payload).decode("utf-8", "replace") or "the worker is shutting down"
                call.future.set_exception(WorkerUnavailable(f"worker {self.address} did not run {call.what}: {reason}"))
                return
        except Exception as exc:
            exc.add_note(f"while unpickling the answer of worker {self.address} to {call.what}")
            call.future.set_exception(exc)
            return
        call.future.set_result(result)

    # ------------------------------------------------------------------ thread

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
                self._reader = FrameReader(sock, self._limits, stall_timeout=self._io_timeout)
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
                    try:
                        self._cond.wait(_IDLE_TICK if waits_for_role or watches_caller else _RELEASE_TICK)
                    finally:
                        self._role_waiters -= waits_for_role
                if self._closed:
                    return
                now = time.monotonic()
                if watches_caller and now - self._caller_read_at > _CALLER_PATIENCE:
                    self._adopt(self._pending.values())  # left unread too long by their caller
            self._expire(now)  # without the reading role: callbacks may wait for answers
            if self._releases and now - last_flush > _RELEASE_TICK:
                last_flush = now
                self._send([])
            with self._cond:
                take_role = self._async_pending > 0 and not self._reading and not self._closed
                if take_role:
                    self._reading = True
            if take_role:
                self._read_once()

    def _connect(self) -> socket.socket:
        delay = 0.02
        while True:
            sock = None
            try:
                sock = socket.create_connection((self.host, self.port), timeout=self._limits.handshake_timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._ssl is not None:
                    sock = self._ssl.wrap_socket(sock, server_hostname=self.host)
                client_handshake(sock, self._token, self.address)
                set_io_timeouts(sock, receive=_IDLE_TICK, send=self._io_timeout)
                return sock
            except ssl.SSLCertVerificationError as exc:
                _close_quietly(sock)
                raise AuthenticationError(
                    f"TLS: the certificate of worker {self.address} failed verification: {exc.verify_message}"
                ) from None
            except (AuthenticationError, ProtocolError):
                _close_quietly(sock)
                raise
            except OSError as exc:
                _close_quietly(sock)
                self._last_connect_error = exc
                self._expire(time.monotonic())
                with self._cond:
                    deadline = max([self._connect_deadline, *(c.deadline for c in self._pending.values())])
                    if self._closed:
                        raise WorkerUnavailable(self._error) from None
                if time.monotonic() + delay > deadline:
                    raise WorkerUnavailable(
                        f"could not connect to rpcdl worker {self.address} within its timeout: {exc}"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, _MAX_RETRY_DELAY)


def _readable(sock: socket.socket) -> bool:
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _close_quietly(sock: socket.socket | None) -> None:
    if sock is not None:
        sock.close()


# ---------------------------------------------------------------------------- sending together

_held = threading.local()


@contextlib.contextmanager
def sent_together() -> Iterator[None]:
    """Hold back the calls this thread makes in the block and send them together as it ends.

    The calls to one worker then leave in one system call, which costs about
    what sending a single one does, and the worker reads them in one go: worth
    it when a thread sends several calls at once (the data loader does, as it
    fills its prefetch window). Order is kept: waiting for a future in the
    block, or making a synchronous call (:func:`rpcdl.rpc_sync`, :func:`rpcdl.ping`,
    :func:`rpcdl.stats`), first sends what the thread holds. Other threads' calls are
    not held.

    Example::

        >>> with rpcdl.client.sent_together():  # doctest: +SKIP
        ...     futures = [rpcdl.rpc_async(address, pow, (2, n)) for n in range(8)]
        >>> [future.wait() for future in futures]  # doctest: +SKIP
        [1, 2, 4, 8, 16, 32, 64, 128]
    """
    if getattr(_held, "frames", None) is not None:  # nested: the outer block sends
        yield
        return
    _held.frames = {}
    try:
        yield
    finally:
        _send_held()
        _held.frames = None


def _send_held() -> None:
    frames = getattr(_held, "frames", None)
    if frames:
        _held.frames = {}
        for connection, held in frames.items():
            connection._send(held)


@contextlib.contextmanager
def answers_read_here() -> Iterator[None]:
    """Leave the answers to the calls this thread makes in the block to this thread.

    Their connections' own threads do not read them: the thread reads them when
    it waits for their futures or calls :func:`read_answers`, which saves two
    thread switches per answer. Meant for one thread driving many calls, as the
    data loader does. Answers it leaves unread for 0.1 s are read by their
    connections' threads after all, so a worker never blocks sending them; so
    are the answers of a connection whose last answer was large (1 MiB or
    more), which arrive faster read in parallel, one thread per connection.

    Example::

        >>> with rpcdl.client.answers_read_here():  # doctest: +SKIP
        ...     futures = [rpcdl.rpc_async(address, pow, (2, n)) for n in range(8)]
        >>> while not all(future.done() for future in futures):  # doctest: +SKIP
        ...     rpcdl.client.read_answers(futures, timeout=1.0)
    """
    previous = getattr(_held, "read_here", False)
    _held.read_here = True
    try:
        yield
    finally:
        _held.read_here = previous


def read_in_background(futures: Iterable[torch.futures.Future]) -> None:
    """Give the answers of ``futures`` made under :func:`answers_read_here` back to their connections' threads.

    For a thread that stops reading before they are all answered.
    """
    for future in futures:
        call = future._call() if isinstance(future, _Future) else None
        if call is not None and future._connection is not None:
            future._connection.read_in_background(call)


def read_answers(futures: Iterable[torch.futures.Future], timeout: float) -> bool | None:
    """Read, in this thread, the answers arriving for ``futures`` (calls to any workers).

    Waits up to ``timeout`` seconds for the first answer, then reads what is
    there and returns; the futures complete (and their callbacks run) here.

    Returns:
        ``True`` if answers were read; ``False`` if none came within
        ``timeout``; ``None`` if they cannot be read here (another thread is
        reading one of the connections, and completes the futures it reads).
    """
    calls = [future._call() for future in futures if isinstance(future, _Future)]
    connections = {call.future._connection for call in calls if call is not None and not call.background}
    if not connections:
        return None  # no answer for this thread to read: their connections' threads read them
    deadline = time.monotonic() + timeout
    while True:
        read_any = False
        waiting = []
        for connection in connections:
            state = connection.read_if_ready()
            if state is None:
                return None
            read_any |= state
            waiting.append(connection)
        if read_any:
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        poller = select.poll()
        try:
            for connection in waiting:
                if connection._ready:
                    poller.register(connection._sock, select.POLLIN)
        except (OSError, ValueError):  # closed meanwhile: its futures have failed
            return None
        poller.poll(min(remaining, _IDLE_TICK) * 1000)


# ---------------------------------------------------------------------------- pool

_pool: dict[tuple, Connection] = {}
_pool_lock = threading.Lock()


def _key(address: str, token: Token | None, ssl_context: ssl.SSLContext | None) -> tuple:
    return (address, token.secret if token is not None else None, ssl_context)


def connection_to(
    address: str,
    timeout: float = 120.0,
    token: str | bytes | Token | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> Connection:
    """Return this process's connection to ``address``, opening one if needed."""
    token = resolve_token(token)
    if ssl_context is None:
        ssl_context = default_client_tls()
    key = _key(address, token, ssl_context)
    with _pool_lock:
        connection = _pool.get(key)
        if connection is None or connection.closed:
            connection = Connection(address, token, ssl_context, timeout)
            _pool[key] = connection
    return connection


def _forget(connection: Connection) -> None:
    with _pool_lock:
        for key, value in list(_pool.items()):
            if value is connection:
                del _pool[key]


def _after_fork_in_child() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def shutdown() -> None:
    """Close every connection of this process; calls in flight fail with ConnectionLost.

    Later calls open new connections, so this is safe to call at any time.
    """
    with _pool_lock:
        connections = list(_pool.values())
        _pool.clear()
    for connection in connections:
        connection.close()
    for connection in connections:
        if connection._thread is not threading.current_thread():
            connection._thread.join(timeout=1.0)


# Threads still completing futures while the interpreter finalizes abort the
# process (torch's C++ futures), so connections close before that.
atexit.register(shutdown)


# ---------------------------------------------------------------------------- calls


def _check_address(host: Any) -> str:
    return format_address(*parse_address(host))


def _describe(func: Callable) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__name__
    return f"{name}()"


def _submit(
    kind: Kind,
    host: str,
    timeout: float,
    what: str,
    payload: bytes = b"",
    buffers: Sequence = (),
    *,
    sync: bool = False,
    ref: int = 0,
    pin_memory: bool = False,
    transform: Callable | None = None,
    token: Any = None,
    ssl_context: ssl.SSLContext | None = None,
    on_connection: Callable[[Connection], Any] | None = None,
) -> _Call:
    call = _Call(timeout, what, sync=sync, pin_memory=pin_memory, transform=transform)
    for _ in range(3):
        connection = connection_to(host, timeout, token, ssl_context)
        if on_connection is not None:
            on_connection(connection)
        try:
            connection.submit(kind, call, payload, buffers, ref)
            return call
        except _Closed:
            continue
    raise WorkerUnavailable(f"could not keep a connection to worker {host} open")


def _serialize_call(host: str, func: Callable, args: Any, kwargs: Any) -> tuple[bytes, list]:
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__}: {func!r}")
    if args is None:
        args = ()
    elif not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list of positional arguments, got {type(args).__name__}")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a dict of keyword arguments, got {type(kwargs).__name__}")
    try:
        with peer_context(host):
            payload, buffers = dumps((func, tuple(args), dict(kwargs)))
    except Exception as exc:
        raise TypeError(f"cannot send {_describe(func)} and its arguments to worker {host}: {exc}") from exc
    Limits().check_outgoing(len(payload), [b.nbytes for b in buffers], f"the call of {_describe(func)}")
    return payload, buffers


def _call(
    host: str,
    func: Callable,
    args: Any,
    kwargs: Any,
    *,
    sync: bool,
    pin_memory: bool = False,
    rref: bool = False,
    timeout: float = 120.0,
    token: str | bytes | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> _Call:
    address = _check_address(host)
    timeout = check_timeout(timeout)
    payload, buffers = _serialize_call(address, func, args, kwargs)
    options: dict[str, Any] = {"sync": sync, "pin_memory": pin_memory, "token": token, "ssl_context": ssl_context}
    if rref:
        uid = new_uid()
        handles: list = []
        options.update(
            ref=uid,
            transform=lambda _: RRef._from_handle(handles[-1]),
            on_connection=lambda connection: handles.append(holding_handle(address, uid, connection)),
        )
    return _submit(Kind.CALL, address, timeout, _describe(func), payload, buffers, **options)


def rpc_async(
    host: str,
    func: Callable[..., _T],
    args: Sequence | None = None,
    kwargs: Mapping[str, Any] | None = None,
    pin_memory: bool = False,
    rref: bool = False,
    timeout: float = 120.0,
    *,
    token: str | bytes | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> torch.futures.Future[_T]:
    """Run ``func(*args, **kwargs)`` on a worker; return a future of the result.

    The call is sent at once over this process's connection to the worker and
    the future completes when the answer arrives. Functions and arguments go
    through cloudpickle, so lambdas and closures work; tensors travel without
    extra copies. An exception raised by ``func`` is raised by
    ``future.wait()`` with its own type, the remote traceback and the worker's
    address (see :mod:`rpcdl.errors`).

    Args:
        host: the worker, ``"host:port"``.
        func: the callable to run.
        args: positional arguments (tuple or list).
        kwargs: keyword arguments.
        pin_memory: receive tensors into pinned memory (when CUDA is available),
            ready for fast ``.cuda(non_blocking=True)`` copies.
        rref: keep the result on the worker and complete the future with an
            :class:`~rpcdl.RRef` to it.
        timeout: seconds to wait for the answer, connecting included.
        token: the shared secret; defaults to ``RPCDL_TOKEN`` / ``RPCDL_TOKEN_FILE``.
        ssl_context: TLS context to verify the worker with; defaults to one from
            ``RPCDL_TLS_CA`` when set.

    Returns:
        A :class:`torch.futures.Future` of the result.

    Example::

        >>> fut = rpcdl.rpc_async("127.0.0.1:6543", torch.add, (torch.ones(2), 1))  # doctest: +SKIP
        >>> fut.wait()  # doctest: +SKIP
        tensor([2., 2.])
    """
    return _call(
        host, func, args, kwargs, sync=False, pin_memory=pin_memory, rref=rref, timeout=timeout,
        token=token, ssl_context=ssl_context,
    ).future  # fmt: skip


def rpc_sync(
    host: str,
    func: Callable[..., _T],
    args: Sequence | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    **options: Any,
) -> _T:
    """Run ``func(*args, **kwargs)`` on a worker and return its result.

    The blocking form of :func:`rpc_async`, which documents the arguments
    (``pin_memory``, ``rref``, ``token`` and ``ssl_context`` are accepted as
    keywords). The calling thread reads the answer itself, which saves a
    thread switch.

    Example::

        >>> rpcdl.rpc_sync("127.0.0.1:6543", min, (1, 2))  # doctest: +SKIP
        1
    """
    return _call(host, func, args, kwargs, sync=True, timeout=timeout, **options).future.wait()


def remote(
    host: str,
    func: Callable[..., _T],
    args: Sequence | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    **options: Any,
) -> RRef[_T]:
    """Run ``func`` on a worker, keep its result there and return an RRef to it at once.

    Calls made afterwards from this process that pass the RRef to the same
    worker wait for the result and receive the object itself. An exception
    raised by ``func`` is raised by :meth:`RRef.to_here` and by those calls.

    Example::

        >>> rref = rpcdl.remote("127.0.0.1:6543", torch.add, (torch.ones(2), 3))  # doctest: +SKIP
        >>> rref.to_here()  # doctest: +SKIP
        tensor([4., 4.])
    """
    return _call(host, func, args, kwargs, sync=False, rref=True, timeout=timeout, **options).transform(None)


def ping_async(host: str, timeout: float = 10.0, **options: Any) -> torch.futures.Future[float]:
    """:func:`ping` without waiting: a future of the round-trip time."""
    return _submit(Kind.PING, _check_address(host), check_timeout(timeout), "a ping", **options).future


def ping(host: str, timeout: float = 10.0, **options: Any) -> float:
    """Return the round-trip time to a worker in seconds; raise if it does not answer.

    The worker answers pings without queueing them behind running calls.

    Raises:
        WorkerUnavailable: the worker cannot be reached within ``timeout``.
        WorkerTimeout: it was reached but did not answer within ``timeout``.
    """
    return _submit(
        Kind.PING, _check_address(host), check_timeout(timeout), "a ping", sync=True, **options
    ).future.wait()


def stats(host: str, timeout: float = 10.0, **options: Any) -> dict[str, Any]:
    """Return a worker's counters: calls served and failed, bytes in and out, busy time, clients...

    Example::

        >>> rpcdl.stats("127.0.0.1:6543")["calls_served"]  # doctest: +SKIP
        42
    """
    call = _submit(Kind.STATS, _check_address(host), check_timeout(timeout), "a stats request", sync=True, **options)
    return call.future.wait()
