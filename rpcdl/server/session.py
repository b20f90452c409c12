"""The worker's side of one client connection: a session, read and written on the process loop.

Threading: no thread is a session's own. The process loop (``rpcdl-loop``,
:mod:`rpcdl.transport.event_loop`) reads the socket when it is readable into
the frame receiver a client's connection uses too
(:class:`~rpcdl.transport.frame_protocol.FrameProtocol`, for which the session
is the sink; without compression or a segment agreed for what a client sends,
a compressed frame or one with buffers in a segment is a protocol error), and
hands each frame to the worker
(:meth:`rpcdl.server.worker.Worker.dispatch`): a call goes to the slots'
fair queue (:mod:`rpcdl.server.slots`), where an executor thread runs it; a
ping, a release or a request for counters is answered on the loop (they run
no user code). The executor thread that ran a call prepares its answer
(pickled by the call runner; its large buffers compressed when the
connection's :class:`~rpcdl.transport.compression.Compressor` says so, or
placed in the connection's shared segment, :mod:`rpcdl.transport.shm`, so
only their offsets cross the socket). When nothing else waits to be written,
that thread writes the answer itself, without waiting: a plain socket takes
a small answer whole, and the loop is not woken at all. What the socket did
not take, and every answer posted while something waits, goes to the
session's outbox; the loop writes what it holds, a burst of answers in one
system call, and goes back to the socket when it has room again. A TLS
socket is written by the loop alone (one thread per TLS object).

Who owns what:

* the socket's reading side, the frame receiver, the answers the loop writes and whether the
  socket is watched for room (:class:`Room`): the loop's thread, alone;
* the session's :class:`SessionState`, the outbox, the bytes it holds and
  who writes next (:class:`Writer`): the session's lock (``_lock``), for every
  write and every read, except that :attr:`ClientConnection.closed` and
  :attr:`ClientConnection.serving` read the state without it: the state only
  moves forward (SERVING -> DRAINING -> CLOSED), so a state read alone is as
  true as one read under the lock and returned after it is let go; the
  writing side of the socket belongs to the thread holding that lock while
  the writer is ``DIRECT``, to the loop while it is ``LOOP``. A thread
  posting an answer while the outbox holds more than :data:`OUTBOX_BYTES`
  waits on ``_room``, a condition of that lock, for the loop to write it out
  (up to the worker's ``timeout``, then the connection is closed: a client
  that does not read holds no more than that). The loop never waits there.

Any thread may close a session (:meth:`ClientConnection.close`); the socket is
closed on the loop.
"""

from __future__ import annotations

import collections
import enum
import logging
import socket
import ssl
import threading
import time
from typing import Any, Protocol

import torch

from ..errors import ConnectionLost, ProtocolError
from ..rpc.rref import RRefStore, StoreView
from ..transport.compression import Compressor
from ..transport.control import decode_span_release
from ..transport.event_loop import call_soon, in_loop_thread, process_loop
from ..transport.frame_protocol import FrameProtocol
from ..transport.shm import WorkerSegment
from ..transport.wire import COMPRESSED, Frame, Kind, Limits, encode_frame
from .counters import Counters

log = logging.getLogger("rpcdl.worker")

HELD_ANSWERS = 32  #: answers held back at most, to go out with the next (see ClientConnection.send)
OUTBOX_BYTES = 8 << 20  #: bytes of answers a session holds unwritten before a thread posting one waits
_IOV_MAX = 1024
_RECEIVES_PER_TURN = 16  # receives for one session before the loop serves the others
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class SessionState(enum.Enum):
    """Where a session is in its life."""

    SERVING = "serving"  #: calls are run
    DRAINING = "draining"  #: the worker stops: calls arriving are rejected, calls queued or running finish
    CLOSED = "closed"  #: the connection is closed: nothing is read or written again


class Writer(enum.Enum):
    """Who writes the socket next (under the session's lock)."""

    DIRECT = "direct"  #: nothing is left unwritten: the thread posting an answer writes what the socket takes
    LOOP = "loop"  #: the loop writes: answers posted meanwhile join the outbox, in order


class Room(enum.Enum):
    """Whether the loop watches the socket for room to write what is left (the loop's own)."""

    UNWATCHED = "unwatched"  #: nothing is left to write, or it has not tried yet
    WATCHED = "watched"  #: the socket took less than was left: the loop writes the rest once it has room


class Server(Protocol):
    """What a session needs of the worker serving it (:class:`rpcdl.server.worker.Worker`)."""

    store: RRefStore
    counters: Counters
    limits: Limits
    timeout: float  #: seconds a client may stall mid-message; a call may wait for its RRef; an answer for room

    def dispatch(self, connection: ClientConnection, frame: Frame) -> None:
        """Handle a frame just read, on the loop."""
        ...

    def forget(self, connection: ClientConnection) -> None:
        """Drop a closed session, and the RRefs it held."""
        ...


class _Outgoing:
    """An encoded frame being written, on the loop: what is left of it, and what it counts."""

    __slots__ = ("answers", "left", "size", "started")

    def __init__(self, views: list[memoryview], size: int, answers: int):
        self.left = collections.deque(views)
        self.size = size
        self.answers = answers
        self.started = 0.0


class ClientConnection:
    """The worker's side of one client connection (see the module for who runs what).

    Args:
        worker: the worker serving it.
        sock: the connection, handshake done (a plain or a TLS socket).
        peer: the client's address, for messages.
        compressor: what compresses answers on this connection (default: none).
        segment: the shared segment agreed with a client on this host (default: none).
        observer: the client only asks for counters (``rpcdl status``).
    """

    def __init__(
        self,
        worker: Server,
        sock: socket.socket,
        peer: str,
        compressor: Compressor | None = None,
        segment: WorkerSegment | None = None,
        observer: bool = False,
    ):
        self.worker = worker
        self.observer = observer
        self.segment = segment
        self.sock = sock
        self.peer = peer
        self.compressor = compressor or Compressor("off")
        #: the context its calls run in (see rpcdl.transport.context): (un)pickled for the peer, answers in the segment
        self.call_context = (peer, StoreView(worker.store, self, worker.timeout), None, segment)
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._receiver = FrameProtocol(self, worker.limits, allocate=allocate_buffer)  # the loop's
        self._uncounted = 0  # bytes received and not yet counted (the loop's)
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # the outbox has room again (or the session closed)
        self._state = SessionState.SERVING
        self._outbox: list[_Outgoing] = []
        self._outbox_bytes = 0
        self._writer = Writer.DIRECT
        self._held: list[_Outgoing] = []  # answers waiting for the next one of the thread that sends them
        self._writing: collections.deque[_Outgoing] = collections.deque()  # the loop's
        self._room_watch = Room.UNWATCHED  # the loop's

    @property
    def closed(self) -> bool:
        """Whether the connection is closed (for good: a ``True`` stays true)."""
        return self._state is SessionState.CLOSED  # one read of a state that only moves forward: no lock

    @property
    def serving(self) -> bool:
        """Whether calls arriving are run (not draining, not closed; a ``False`` stays false)."""
        return self._state is SessionState.SERVING  # as closed

    def start(self) -> None:
        """Have the loop read the connection (callable from any thread)."""
        call_soon(self._start_reading)

    def _start_reading(self) -> None:
        if self.closed:
            return
        self.sock.setblocking(False)
        process_loop().add_reader(self.sock.fileno(), self._readable)

    def drain(self) -> None:
        """Reject the calls that arrive from now on (the worker stops); calls queued or running finish."""
        with self._lock:
            if self._state is SessionState.SERVING:
                self._state = SessionState.DRAINING

    def announce_leaving(self, payload: bytes) -> None:
        """Tell the client the worker is leaving: a ``LEAVING`` frame (see :mod:`rpcdl.transport.control`).

        Posted after :meth:`drain`; the loop writes it; nothing if the connection is closed meanwhile.
        """
        self.send(Frame(Kind.LEAVING, 0, payload=payload))

    @property
    def unwritten(self) -> int:
        """Bytes posted and not yet handed to the system (a hint)."""
        with self._lock:
            return self._outbox_bytes

    def send(self, frame: Frame, answers_call: bool = False, hold: bool = False) -> None:
        """Post ``frame`` for the loop to write (counting its call as done if it ``answers_call``).

        Its large buffers are compressed, or placed in the shared segment, here,
        in the calling thread. A thread other than the loop's waits while the
        outbox is full (see the module); a connection that takes nothing for the
        worker's ``timeout`` is closed.

        Args:
            frame: what to send.
            answers_call: it answers a call (counted as done once written).
            hold: the caller sends again soon (it runs this client's next call, a
                quick one): the frame waits for that send, and both go out in one
                system call (at most :data:`HELD_ANSWERS` wait so).
        """
        placed = frame.buffers and frame.kind is Kind.RESULT and self.segment is not None and self.segment.place(frame)
        if frame.buffers and frame.kind is Kind.RESULT and not placed:
            frame.buffers, frame.decoded_sizes = self.compressor.prepare(frame.buffers)
            frame.flags |= COMPRESSED if frame.decoded_sizes else 0
        views = [view for view in map(_bytes_view, encode_frame(frame)) if view.nbytes]
        outgoing = _Outgoing(views, sum(view.nbytes for view in views), int(answers_call))
        on_loop = in_loop_thread()
        may_write = not self._tls or on_loop  # a TLS socket is written by the loop alone: one thread per TLS object
        error: OSError | None = None
        unanswered = 0  # answers that will never be written (the connection closed)
        done: list[_Outgoing] = []
        post = False
        with self._lock:
            if self._outbox_bytes > OUTBOX_BYTES and not on_loop:
                self._wait_for_room()
            if self._state is SessionState.CLOSED:
                unanswered = outgoing.answers
            elif hold and self._writer is Writer.DIRECT and len(self._held) < HELD_ANSWERS:
                self._held.append(outgoing)
                return
            else:
                writing = collections.deque(self._held)
                writing.append(outgoing)
                self._held = []
                if self._writer is Writer.DIRECT and may_write:
                    try:
                        self._write_some(writing, done)
                    except OSError as exc:
                        error, unanswered = exc, sum(pending.answers for pending in writing)
                        writing.clear()
                if writing:  # what the socket did not take now: the loop writes it once it has room
                    post = self._writer is Writer.DIRECT
                    self._writer = Writer.LOOP
                    self._outbox.extend(writing)
                    self._outbox_bytes += sum(pending.size for pending in writing)
        for written in done:
            self._done(written)
        if unanswered:  # nobody to answer, but the calls are done
            self.worker.counters.sent(0, unanswered)
        if error is not None:
            log.warning("could not answer client %s: %s", self.peer, error or type(error).__name__)
            self.close()
        elif post:
            call_soon(self._write)

    def _done(self, outgoing: _Outgoing) -> None:
        """Count an answer written whole."""
        self.worker.counters.sent(outgoing.size, outgoing.answers)
        self.compressor.sent(outgoing.size, time.perf_counter() - outgoing.started)

    def _wait_for_room(self) -> None:
        """Wait (holding ``_lock``, through ``_room``) until the outbox has room; close the session if it never
        does within the timeout."""
        deadline = time.monotonic() + self.worker.timeout
        while self._outbox_bytes > OUTBOX_BYTES and self._state is not SessionState.CLOSED:
            left = deadline - time.monotonic()
            if left <= 0:
                self._lock.release()
                try:
                    log.warning("could not answer client %s: it took nothing for %gs", self.peer, self.worker.timeout)
                    self.close()
                finally:
                    self._lock.acquire()
                return
            self._room.wait(left)

    def close(self) -> None:
        """Close the connection (once), on the loop, and have the worker forget it and the RRefs it held."""
        with self._lock:
            if self._state is SessionState.CLOSED:
                return
            self._state = SessionState.CLOSED
            dropped, self._outbox, self._outbox_bytes = self._outbox + self._held, [], 0
            self._held = []
            self._room.notify_all()
        answers = sum(outgoing.answers for outgoing in dropped)
        if answers:
            self.worker.counters.sent(0, answers)
        call_soon(self._close_on_loop)

    def _close_on_loop(self) -> None:
        loop = process_loop()
        try:
            fd = self.sock.fileno()
            if fd >= 0:
                loop.remove_reader(fd)
                loop.remove_writer(fd)
        finally:
            answers = sum(outgoing.answers for outgoing in self._writing)
            self._writing.clear()
            if answers:
                self.worker.counters.sent(0, answers)
            shutdown_socket(self.sock)
            if self.segment is not None:
                self.segment.close()
            self.worker.forget(self)

    def release_spans(self, payload: bytes | bytearray | memoryview) -> None:
        """Free the spans of the shared segment a ``SEGMENT_RELEASE`` frame names.

        Raises:
            ProtocolError: this connection has no segment, or a span is not in use.
        """
        if self.segment is None:
            raise ProtocolError("the client released spans of a shared segment this connection does not have")
        self.segment.release(decode_span_release(payload))

    def transport_state(self) -> dict[str, Any]:
        """How answers cross this connection: ``"shm"`` or ``"socket"``, and the segment's counters."""
        if self.segment is None:
            return {"transport": "socket"}
        return {"transport": "shm", "shared_memory": self.segment.state()}

    # ------------------------------------------------------------------ on the loop

    def _readable(self) -> None:
        if self.closed:
            return
        receiver = self._receiver
        try:
            while True:
                for _ in range(_RECEIVES_PER_TURN):
                    target = receiver.get_buffer(-1)
                    try:
                        received = self.sock.recv_into(target)
                    except _WOULD_BLOCK:
                        break
                    if not received:
                        raise ConnectionLost("the peer closed the connection")
                    self._uncounted += received
                    size, target = len(target), None  # a growing payload's memory cannot grow while viewed
                    receiver.buffer_updated(received)  # whole frames go to frame_received
                    if self.closed:
                        return
                    if received < size:  # it took all there was: the next receive would find nothing
                        break
                if self._uncounted:
                    self.worker.counters.received(self._uncounted, False)
                    self._uncounted = 0
                if not (self._tls and self.sock.pending()):  # a TLS socket may hold decrypted bytes the
                    return  # system does not know of: the loop would not call again for them
        except ConnectionLost:
            log.debug("client %s disconnected", self.peer)
        except OSError as exc:
            if not self.closed:
                log.warning("closed connection from %s: %s", self.peer, exc or type(exc).__name__)
        self.close()

    def frame_received(self, frame: Frame) -> None:
        """A whole frame from the client (on the loop): counted, and handed to the worker.

        Raises:
            ProtocolError: a frame a client may not send (the receiver closes the session through
                :meth:`receiving_failed`).
        """
        self.worker.counters.received(self._uncounted, frame.kind is Kind.CALL)
        self._uncounted = 0
        self.worker.dispatch(self, frame)

    def receiving_failed(self, error: Exception) -> None:
        """The client's stream broke the protocol (a frame past the limits, say): the session closes."""
        if not self.closed:
            log.warning("closed connection from %s: %s", self.peer, error or type(error).__name__)
        self.close()

    def stream_ended(self, error: Exception | None) -> None:
        """The connection ended (``_readable`` learns of it first; here for the receiver's sake)."""
        self.close()

    def stalled(self, now: float) -> bool:
        """Whether the client stopped in the middle of a frame for longer than the timeout (on the loop)."""
        return self._receiver.stalled_for(now) > self.worker.timeout

    def _write(self) -> None:
        if self._room_watch is Room.UNWATCHED:  # else the loop writes once the socket has room
            self._write_ready()

    def _write_ready(self) -> None:
        """Write what the socket takes now, the outbox included; watch the socket for room if something is left."""
        writing = self._writing
        done: list[_Outgoing] = []
        blocked = False
        try:
            while not blocked:
                with self._lock:
                    if self._state is SessionState.CLOSED:
                        return
                    writing.extend(self._outbox)
                    self._outbox = []
                    if not writing:
                        self._writer = Writer.DIRECT
                        break
                blocked = self._write_some(writing, done)
        except OSError as exc:
            if not self.closed:
                log.warning("could not answer client %s: %s", self.peer, exc or type(exc).__name__)
            self._account(done)
            self.close()
            return
        self._account(done)
        loop = process_loop()
        if blocked and self._room_watch is Room.UNWATCHED:
            self._room_watch = Room.WATCHED
            loop.add_writer(self.sock.fileno(), self._room_again)
        elif not blocked and self._room_watch is Room.WATCHED:
            self._room_watch = Room.UNWATCHED
            loop.remove_writer(self.sock.fileno())

    def _write_some(self, writing: collections.deque[_Outgoing], done: list[_Outgoing]) -> bool:
        """One system call's worth of ``writing``; the frames written whole move to ``done``. Return whether
        the socket had no room."""
        views = [view for outgoing in writing for view in outgoing.left][:_IOV_MAX]
        now = time.perf_counter()
        for outgoing in writing:
            if not outgoing.started:
                outgoing.started = now
        try:
            sent = self.sock.send(views[0]) if self._tls or len(views) == 1 else self.sock.sendmsg(views)
        except _WOULD_BLOCK:
            return True
        while writing:
            outgoing = writing[0]
            while sent and outgoing.left:
                head = outgoing.left[0]
                if sent < head.nbytes:
                    outgoing.left[0] = head[sent:]
                    return False
                sent -= head.nbytes
                outgoing.left.popleft()
            if outgoing.left:
                return False
            done.append(writing.popleft())
        return False

    def _room_again(self) -> None:
        if self.closed:
            return
        self._write_ready()

    def _account(self, done: list[_Outgoing]) -> None:
        if not done:
            return
        for outgoing in done:
            self._done(outgoing)
        with self._lock:
            self._outbox_bytes -= sum(outgoing.size for outgoing in done)
            self._room.notify_all()


def _bytes_view(piece: bytes | memoryview) -> memoryview:
    return memoryview(piece).cast("B")


def shutdown_socket(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways (waking a thread blocked on it) and close it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def allocate_buffer(call_id: int, size: int) -> Any:
    """Memory for an out-of-band buffer of a call received: a numpy view of a new uint8 tensor."""
    return torch.empty(size, dtype=torch.uint8).numpy()
