"""The worker's side of one client connection: a session, its read turn and its answers.

Threading: a session has two service threads (``rpcdl-service-PEER``) and one
read turn (:class:`Turn`). The thread holding the turn reads frames and hands
each to the worker (:meth:`rpcdl.server.worker.Worker.dispatch`). When the
worker gives it a slot for a call, it *lends* the turn and runs the call
itself, so a call costs no thread switch. Nobody reads while the turn is lent;
it is *offered* to the other thread, the standby, at once when the worker has
slots left for more calls, else by the worker's promoter once the call has run
for a while (:data:`PROMOTE_AFTER`), so that pings, releases and calls for the
queue are read during long calls. The lender takes the turn back if nobody took
it, else becomes the standby. The reader runs a call inline only while the
standby waits, so one thread can always take the turn.

Answers are sent under the send lock by the thread that ran the call; it
compresses its answer's large buffers first, outside the lock, when the
connection's :class:`~rpcdl.transport.compression.Compressor` says so, or
places them in the connection's shared segment (:mod:`rpcdl.transport.shm`)
when it has one, so that only their offsets cross the socket. The
reader running a quick call inline while the next call already waits in its
receive buffer holds the (small) answer back in the session's outbox, and
sends the outbox in one go once nothing more waits, after a slower call or
after :data:`_OUTBOX_ANSWERS` answers: one system call for a burst of answers.
Once it has answered a call marked awaited (an ``rpc_sync``), the reader
polls for that caller's next call before it blocks, while the worker runs
nothing else (:mod:`rpcdl.transport.polling`).
"""

from __future__ import annotations

import enum
import logging
import socket
import threading
import time
from typing import Any

import torch

from ..errors import ConnectionLost, ProtocolError
from ..rpc.rref import StoreView
from ..transport.compression import Compressor
from ..transport.control import decode_span_release
from ..transport.polling import Poller
from ..transport.shm import WorkerSegment
from ..transport.wire import AWAITED, COMPRESSED, Frame, FrameReader, Kind, encode_frame, send_pieces

log = logging.getLogger("rpcdl.worker")

PROMOTE_AFTER = 0.02  #: seconds a call runs inline before the standby thread reads in its place
_OUTBOX_ANSWERS = 32  # answers held back at most
_QUICK_CALL = 0.0005  # seconds: the answer of a call that ran longer is not held back


class Turn(enum.Enum):
    """Who reads the connection."""

    OFFERED = "offered"  #: free: the standby takes it
    READING = "reading"  #: a service thread holds it and reads
    LENT = "lent"  #: its holder runs a call; nobody reads until it is offered or taken back
    CLOSED = "closed"  #: the connection is closed: no one reads again


# The turns as module constants: the hot path reads them on every call, and an enum member's
# lookup through its class costs ~0.1 us in Python 3.11.
_OFFERED, _READING, _LENT, _CLOSED = Turn.OFFERED, Turn.READING, Turn.LENT, Turn.CLOSED
_RESULT = Kind.RESULT


class ClientConnection:
    """The worker's side of one client connection (see the module for its threads).

    Args:
        worker: the worker serving it (its ``dispatch``, ``slots``, ``forget``,
            ``counters``, ``store``, ``limits``, ``timeout`` and ``poll_window``).
        sock: the connection, handshake done, set up by :func:`~rpcdl.transport.wire.io_stream`.
        peer: the client's address, for messages.
        compressor: what compresses answers on this connection (default: none).
        segment: the shared segment agreed with a client on this host (default: none).
    """

    def __init__(
        self,
        worker: Any,
        sock: socket.socket,
        peer: str,
        compressor: Compressor | None = None,
        segment: WorkerSegment | None = None,
    ):
        self.worker = worker
        self.segment = segment
        self.sock = sock
        self.peer = peer
        self.compressor = compressor or Compressor("off")
        self.store_view = StoreView(worker.store, self, worker.timeout)
        #: the context its calls run in (see rpcdl.transport.context): (un)pickled for the peer, answers in the segment
        self.call_context = (peer, self.store_view, None, segment)
        self.reader = FrameReader(sock, worker.limits, stall_timeout=worker.timeout)
        self.poller = Poller(sock, worker.poll_window)  # for the next call of a caller that awaits each answer
        self._turn = _OFFERED
        self._lent_at = 0.0
        #: whether a service thread waits for the turn (read by the thread holding it, when no other can change it)
        self.has_standby = False
        self._lock = threading.Lock()  # alone where nobody waits: cheaper than the condition's with
        self._condition = threading.Condition(self._lock)
        self._send_lock = threading.Lock()
        self._outbox: list[bytes | memoryview] = []  # answers held back, encoded; under the lock
        self._outbox_answers = 0
        self._holding_back = 0  # the thread id of the reader while it holds answers back, else 0
        self._counted = 0
        self._threads = [
            threading.Thread(target=self._serve, name=f"rpcdl-service-{peer}", daemon=True) for _ in range(2)
        ]

    @property
    def closed(self) -> bool:
        """Whether the connection is closed."""
        return self._turn is _CLOSED

    def start(self) -> None:
        """Start the service threads."""
        for thread in self._threads:
            thread.start()

    def send(self, frame: Frame, answers_call: bool = False) -> None:
        """Send ``frame`` (counting its call as done if it ``answers_call``); a connection
        that cannot take it is closed."""
        if self._turn is _CLOSED:
            self.worker.counters.sent(0, int(answers_call))
            return
        if frame.buffers:
            in_segment = self.segment is not None and frame.kind is _RESULT and self.segment.place(frame)
            if frame.kind is _RESULT and not in_segment:
                frame.buffers, frame.decoded_sizes = self.compressor.prepare(frame.buffers)
                frame.flags |= COMPRESSED if frame.decoded_sizes else 0
        elif self._holding_back and self._holding_back == threading.get_ident():  # nobody holding back: no id to ask
            pieces = encode_frame(frame)
            with self._lock:
                self._outbox += pieces
                self._outbox_answers += answers_call
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
            log.warning("could not answer client %s: %s", self.peer, exc or type(exc).__name__)
            self.close()
        finally:
            self.worker.counters.sent(sent, answers)

    def _flush(self) -> None:
        """Send the answers held back, in one go."""
        with self._lock:
            pieces, answers = self._outbox, self._outbox_answers
            self._outbox, self._outbox_answers = [], 0
        if pieces:
            if len(pieces) > 1 and all(type(piece) is bytes for piece in pieces):
                pieces = [b"".join(pieces)]
            if self.closed:
                self.worker.counters.sent(0, answers)
            else:
                self._send_pieces(pieces, answers)

    def close(self) -> None:
        """Close the connection (once) and have the worker forget it and the RRefs it held."""
        with self._condition:  # never held during a send, which may block for the whole timeout
            if self._turn is _CLOSED:
                return
            self._turn = _CLOSED
            self._condition.notify_all()
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
        if self._turn is not _LENT or self._lent_at > moment:  # the usual case, decided without the lock
            return
        with self._condition:
            if self._turn is _LENT and self._lent_at <= moment:
                self._turn = _OFFERED
                self._condition.notify()

    # ------------------------------------------------------------------ the read turn

    def _serve(self) -> None:
        try:
            while self._wait_for_turn():
                self._read_while_holding()
                self._flush()  # answers held back go out, or are counted if the connection closed
        finally:
            self.worker.counters.retire()

    def _wait_for_turn(self) -> bool:
        """Wait as the standby until the turn is offered, and take it; ``False`` once the connection is closed."""
        with self._condition:
            self.has_standby = True
            while self._turn is not _OFFERED and self._turn is not _CLOSED:
                self._condition.wait()
            self.has_standby = False
            if self._turn is _CLOSED:
                return False
            self._turn = _READING
            return True

    def _read_while_holding(self) -> None:
        """Read and dispatch frames until the turn goes to the other thread or the connection closes."""
        worker, reader, slots, poller = self.worker, self.reader, self.worker.slots, self.poller
        waiting = reader.holds_frame  # a frame waits in the receive buffer: the next read does not wait
        awaited = False  # the call run last was awaited by its caller, and answered
        while True:
            if self._outbox and not waiting:  # the read may wait: no answer waits with it
                self._flush()
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
            try:
                run_here = worker.dispatch(self, frame, bytes_in)
            except ProtocolError as exc:
                log.warning("closed connection from %s: %s", self.peer, exc)
                self.close()
                return
            waiting = reader.holds_frame
            if not run_here:
                continue
            self._lend(offer=slots.has_free)
            if waiting and self._outbox_answers < _OUTBOX_ANSWERS:
                self._run_holding_back(frame)
            else:
                slots.run(self, frame)
            if not self._take_back():
                self._flush()
                return
            awaited = frame.flags & AWAITED

    def _run_holding_back(self, frame: Frame) -> None:
        """Run a call inline, its answer held back in the outbox; send the outbox after a slow call or when full."""
        started = time.perf_counter()
        self._holding_back = threading.get_ident()
        try:
            self.worker.slots.run(self, frame)
        finally:
            self._holding_back = 0
        if time.perf_counter() - started > _QUICK_CALL or self._outbox_answers >= _OUTBOX_ANSWERS:
            self._flush()

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

    def _lend(self, offer: bool) -> None:
        with self._lock:
            if self._turn is not _READING:
                return
            if offer:
                self._turn = _OFFERED
                self._condition.notify()
            else:
                self._turn = _LENT
                self._lent_at = time.monotonic()

    def _take_back(self) -> bool:
        """Take the turn back after a call if nobody took it; ``False``: the other thread reads (or closed)."""
        with self._lock:
            if self._turn is _LENT or self._turn is _OFFERED:
                self._turn = _READING
                return True
            return False


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
