"""The worker's side of one client connection: a session, its read turn and its answers.

Threading: a session has two service threads (``rpcdl-service-PEER``) and one
read turn (:class:`Turn`). The thread holding the turn reads frames; a call it
may run at once (a slot free, the other thread standing by) it runs itself,
*lending* the turn, so a call costs no thread switch; other calls it queues in
the worker's slots (:mod:`rpcdl.server.slots`), control frames it hands to the
worker (:meth:`rpcdl.server.worker.Worker.handle_control`). Nobody reads while
the turn is lent; it is *offered* to the other thread, the standby, at once
when the worker has slots left for more calls, else by the worker's promoter
(``rpcdl-promoter-ADDRESS``) once the call has run for a while
(:data:`PROMOTE_AFTER`), so that pings, releases and calls for the queue are
read during long calls. The lender takes the turn back if nobody took it, else
becomes the standby. The reader runs a call itself only while the standby
waits, so one thread can always take the turn.

Who owns what:

* the turn, the session's :class:`SessionState`, when the turn was lent and
  whether a standby waits: the session's lock (``_lock``), for every read and
  write; the standby waits on ``_turn_offered``, a condition of that lock. The
  worker's stop drains the session (:meth:`ClientConnection.drain`), the
  promoter offers the turn (:meth:`ClientConnection.offer_if_lent_before`),
  and any thread may close it (:meth:`ClientConnection.close`).
* the frame reader, the poller and the count of bytes read: the thread holding
  the turn (the lock hands them from one thread to the other).
* the answers held back: each service thread its own (:class:`_HeldAnswers`).
  The reader running a quick call itself while the next call already waits in
  its receive buffer holds the (small) answer back, and sends what it holds in
  one go once nothing more waits, after a slower call or after
  :data:`_OUTBOX_ANSWERS` answers: one system call for a burst.
* the socket's sending side: the send lock, taken by whichever thread answers
  (the one that ran the call). It compresses its answer's large buffers first,
  outside the lock, when the connection's
  :class:`~rpcdl.transport.compression.Compressor` says so (that compressor
  has its own lock), or places them in the connection's shared segment
  (:mod:`rpcdl.transport.shm`, its own lock) when it has one, so that only
  their offsets cross the socket.

Once it has answered a call marked awaited (an ``rpc_sync``), the reader polls
for that caller's next call before it blocks, while the worker runs nothing
else (:mod:`rpcdl.transport.polling`).
"""

from __future__ import annotations

import enum
import logging
import socket
import threading
import time
from typing import Any, Protocol

import torch

from ..errors import ConnectionLost, ProtocolError
from ..rpc.rref import RRefStore, StoreView
from ..transport.compression import Compressor
from ..transport.control import decode_span_release, encode_rejected
from ..transport.polling import Poller
from ..transport.shm import WorkerSegment
from ..transport.wire import AWAITED, COMPRESSED, Frame, FrameReader, Kind, Limits, encode_frame, send_pieces
from .counters import Counters
from .slots import Slots

log = logging.getLogger("rpcdl.worker")

PROMOTE_AFTER = 0.02  #: seconds a call runs inline before the standby thread reads in its place
_OUTBOX_ANSWERS = 32  # answers held back at most
_QUICK_CALL = 0.0005  # seconds: the answer of a call that ran longer is not held back


class SessionState(enum.Enum):
    """Where a session is in its life."""

    SERVING = "serving"  #: calls are run
    DRAINING = "draining"  #: the worker stops: calls arriving are rejected, calls running finish
    CLOSED = "closed"  #: the connection is closed: no one reads again


class Turn(enum.Enum):
    """Who reads the connection (while it is not closed)."""

    OFFERED = "offered"  #: free: the standby takes it
    READING = "reading"  #: a service thread holds it and reads
    LENT = "lent"  #: its holder runs a call; nobody reads until it is offered or taken back


class Server(Protocol):
    """What a session needs of the worker serving it (:class:`rpcdl.server.worker.Worker`)."""

    store: RRefStore
    counters: Counters
    slots: Slots
    limits: Limits
    timeout: float  #: seconds a client may stall mid-message; a call may wait for its RRef
    poll_window: float  #: seconds to poll for an awaited caller's next call

    def handle_control(self, connection: ClientConnection, frame: Frame) -> None:
        """Handle a frame that is not a call."""
        ...

    def forget(self, connection: ClientConnection) -> None:
        """Drop a closed session, and the RRefs it held."""
        ...


class _HeldAnswers:
    """The answers one service thread holds back, encoded: made, changed and sent by that thread only."""

    __slots__ = ("answers", "holding", "pieces")

    def __init__(self) -> None:
        self.holding = False  # while this thread runs a call whose answer it holds back
        self.pieces: list[bytes | memoryview] = []
        self.answers = 0


class ClientConnection:
    """The worker's side of one client connection (see the module for its threads).

    Args:
        worker: the worker serving it.
        sock: the connection, handshake done, set up by :func:`~rpcdl.transport.wire.io_stream`.
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
        self.reader = FrameReader(sock, worker.limits, stall_timeout=worker.timeout)
        self.poller = Poller(sock, worker.poll_window)  # for the next call of a caller that awaits each answer
        # the lock alone where nobody waits: a Condition's ``with`` is a Python call more on every call
        self._lock = threading.Lock()
        self._turn_offered = threading.Condition(self._lock)  # or the session closed
        self._state = SessionState.SERVING
        self._turn = Turn.OFFERED
        self._lent_at = 0.0
        self._standby_waits = False
        self._own = threading.local()  # .held: the _HeldAnswers of the service thread that reads it
        self._send_lock = threading.Lock()
        self._counted = 0
        self._threads = [
            threading.Thread(target=self._serve, name=f"rpcdl-service-{peer}", daemon=True) for _ in range(2)
        ]

    @property
    def closed(self) -> bool:
        """Whether the connection is closed."""
        with self._lock:
            return self._state is SessionState.CLOSED

    def start(self) -> None:
        """Start the service threads."""
        for thread in self._threads:
            thread.start()

    def drain(self) -> None:
        """Reject the calls that arrive from now on (the worker stops); calls running finish."""
        with self._lock:
            if self._state is SessionState.SERVING:
                self._state = SessionState.DRAINING

    def announce_leaving(self, payload: bytes) -> None:
        """Tell the client the worker is leaving: a ``LEAVING`` frame (see :mod:`rpcdl.transport.control`).

        Sent by the thread announcing the worker's drain, after :meth:`drain`;
        nothing if the connection is closed meanwhile.
        """
        if not self.closed:
            self.send(Frame(Kind.LEAVING, 0, payload=payload))

    def send(self, frame: Frame, answers_call: bool = False) -> None:
        """Send ``frame`` (counting its call as done if it ``answers_call``); a connection
        that cannot take it is closed."""
        is_result = frame.kind is Kind.RESULT
        if frame.buffers:
            in_segment = is_result and self.segment is not None and self.segment.place(frame)
            if is_result and not in_segment:
                frame.buffers, frame.decoded_sizes = self.compressor.prepare(frame.buffers)
                frame.flags |= COMPRESSED if frame.decoded_sizes else 0
        else:
            held = getattr(self._own, "held", None)  # None: not a service thread of this session
            if held is not None and held.holding:  # the reader runs quick calls itself: it sends them later
                held.pieces += encode_frame(frame)
                held.answers += answers_call
                return
        self._send_pieces(encode_frame(frame), int(answers_call))  # an answer's buffers go out here

    def _send_pieces(self, pieces: list[bytes | memoryview], answers: int) -> None:
        sent = 0
        try:
            with self._send_lock:
                if self.compressor.mode != "auto":  # nothing to decide from the time a send takes
                    sent = send_pieces(self.sock, pieces)
                else:
                    started = time.perf_counter()
                    sent = send_pieces(self.sock, pieces)
                    self.compressor.sent(sent, time.perf_counter() - started)
        except OSError as exc:
            if not self.closed:
                log.warning("could not answer client %s: %s", self.peer, exc or type(exc).__name__)
                self.close()
        finally:
            self.worker.counters.sent(sent, answers)

    def _flush(self, held: _HeldAnswers) -> None:
        """Send the answers this thread held back, in one go."""
        pieces, answers = held.pieces, held.answers
        if not pieces:
            return
        held.pieces, held.answers = [], 0
        if len(pieces) > 1 and all(type(piece) is bytes for piece in pieces):
            pieces = [b"".join(pieces)]
        self._send_pieces(pieces, answers)

    def close(self) -> None:
        """Close the connection (once) and have the worker forget it and the RRefs it held."""
        with self._lock:  # never held during a send, which may block for the whole timeout
            if self._state is SessionState.CLOSED:
                return
            self._state = SessionState.CLOSED
            self._turn_offered.notify_all()
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

    def offer_if_lent_before(self, moment: float) -> None:
        """Offer the turn to the standby if it was lent before ``moment`` (``time.monotonic()``)."""
        with self._lock:
            if self._turn is Turn.LENT and self._lent_at <= moment and self._state is not SessionState.CLOSED:
                self._turn = Turn.OFFERED
                self._turn_offered.notify()

    # ------------------------------------------------------------------ the read turn

    def _serve(self) -> None:
        held = self._own.held = _HeldAnswers()
        while self._wait_for_turn():
            self._read_while_holding(held)
            self._flush(held)  # the answers this thread held back go out (or fail, if the connection closed)

    def _wait_for_turn(self) -> bool:
        """Wait as the standby until the turn is offered, and take it; ``False`` once the connection is closed."""
        with self._lock:
            self._standby_waits = True
            while self._turn is not Turn.OFFERED and self._state is not SessionState.CLOSED:
                self._turn_offered.wait()
            self._standby_waits = False
            if self._state is SessionState.CLOSED:
                return False
            self._turn = Turn.READING
            return True

    def _read_while_holding(self, held: _HeldAnswers) -> None:
        """Read and handle frames until the turn goes to the other thread or the connection closes."""
        worker, reader, slots, poller = self.worker, self.reader, self.worker.slots, self.poller
        waiting = reader.holds_frame  # a frame waits in the receive buffer: the next read does not wait
        awaited = False  # the call run last was awaited by its caller, and answered
        while True:
            if held.pieces and not waiting:  # the read may wait: no answer waits with it
                self._flush(held)
            polled = awaited and not waiting and slots.idle  # its caller's next call is microseconds away
            if polled:
                poller.wait()
            frame = self._read_frame()
            if polled:
                poller.arrived()
            awaited = False
            if frame is None:
                if self.closed:
                    return
                waiting = reader.holds_frame
                continue
            bytes_in, self._counted = reader.bytes_read - self._counted, reader.bytes_read
            is_call = frame.kind is Kind.CALL
            worker.counters.received(bytes_in, is_call)
            try:
                if is_call:
                    run_here = self._admit(frame)
                else:
                    worker.handle_control(self, frame)
                    run_here = False
            except ProtocolError as exc:
                log.warning("closed connection from %s: %s", self.peer, exc)
                self.close()
                return
            waiting = reader.holds_frame
            if not run_here:
                continue
            if waiting and held.answers < _OUTBOX_ANSWERS:
                self._run_holding_back(held, frame)
            else:
                slots.run(self, frame)
            if not self._take_back():
                return
            awaited = frame.flags & AWAITED

    def _admit(self, frame: Frame) -> bool:
        """Decide the fate of a call just read; return whether this thread runs it now.

        Draining: it is rejected. A slot free and the standby waiting: it runs
        here, in a slot taken for it, and the turn is lent (offered at once if
        slots are left for more calls). Else it waits in the slots' queue.
        """
        worker = self.worker
        with self._lock:
            serving = self._state is SessionState.SERVING
            if serving:
                if frame.ref:  # before the turn is lent: a call using the RRef, read next, waits for this one
                    worker.store.expect(frame.ref, self)
                free_after = worker.slots.take() if self._standby_waits else None
                if free_after is not None:
                    if free_after:
                        self._turn = Turn.OFFERED
                        self._turn_offered.notify()
                    else:
                        self._turn, self._lent_at = Turn.LENT, time.monotonic()
        if not serving:
            worker.counters.add(calls_rejected=1)
            self.send(Frame(Kind.REJECTED, frame.call_id, payload=encode_rejected()), answers_call=True)
            return False
        if free_after is None:
            worker.slots.enqueue(self, frame)
            return False
        return True

    def _run_holding_back(self, held: _HeldAnswers, frame: Frame) -> None:
        """Run a call inline, its answer held back; send what is held after a slow call or when full."""
        started = time.perf_counter()
        held.holding = True
        try:
            self.worker.slots.run(self, frame, before_queued=lambda: self._stop_holding(held))
        finally:
            held.holding = False
        if time.perf_counter() - started > _QUICK_CALL or held.answers >= _OUTBOX_ANSWERS:
            self._flush(held)

    def _stop_holding(self, held: _HeldAnswers) -> None:
        """This thread goes on with queued calls (maybe other clients', maybe long): send what it held back."""
        held.holding = False
        self._flush(held)

    def _read_frame(self) -> Frame | None:
        """The next frame, or ``None`` if none came within the idle tick or the connection closed."""
        try:
            return self.reader.read_frame(allocate_buffer)
        except ConnectionLost:
            log.debug("client %s disconnected", self.peer)
        except (OSError, ProtocolError) as exc:
            if not self.closed:
                log.warning("closed connection from %s: %s", self.peer, exc or type(exc).__name__)
        self.close()
        return None

    def _take_back(self) -> bool:
        """Take the turn back after a call if nobody took it; ``False``: the other thread reads (or closed)."""
        with self._lock:
            if self._state is SessionState.CLOSED or self._turn is Turn.READING:
                return False
            self._turn = Turn.READING
            return True


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
