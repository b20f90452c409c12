"""A plain TCP connection's socket: the loop reads it, whichever thread sends writes it.

:class:`SocketStream` stands where an asyncio transport would for a plain
(not TLS) client connection, with the few methods rpcdl uses of one
(``write``, ``writelines``, ``set_protocol``, ``abort``), and one difference
that matters for latency: ``write`` may be called from any thread, and while
nothing waits to be written it sends the bytes itself, at once: a small
frame costs its caller one ``send`` and the loop is not woken. What the
socket does not take is copied into the outbox (the caller may change its
memory once ``write`` returns), and the loop writes the outbox when the
socket has room; frames written meanwhile join the outbox behind it, so bytes
go out in the order ``write`` was called. The worker's sessions write their
answers the same way (:mod:`rpcdl.server.session`). TLS connections keep
asyncio's transport, written by the loop alone (one thread per TLS object).

Receiving: the loop calls the protocol set (:meth:`SocketStream.set_protocol`)
as asyncio's transports do: a :class:`asyncio.BufferedProtocol` (the frame
receiver, :class:`~rpcdl.transport.frame_protocol.FrameProtocol`) receives
into the memory it hands out, any other protocol (the handshake's reader) gets
``data_received``; the end of the stream is ``eof_received`` then
``connection_lost``. While the frame receiver is in the middle of a large
payload or buffer, the socket's low-water mark
(:class:`~rpcdl.transport.low_water.LowWater`) keeps the loop from waking
for every segment: such a part lands in a few receives of megabytes.

Who owns what:

* the reading side, the protocol, the low-water mark and whether the socket is
  watched for room (:class:`Room`): the loop's thread (``rpcdl-loop``,
  :mod:`rpcdl.transport.event_loop`), alone;
* the :class:`StreamState`, the outbox and who writes next (:class:`Writer`):
  ``_lock``, for every read and write; the writing side of the socket belongs
  to the thread holding that lock.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import socket
import threading
from collections.abc import Iterable

from .event_loop import call_soon, process_loop
from .frame_protocol import FrameProtocol
from .low_water import LowWater

_IOV_MAX = 1024  # pieces in one sendmsg
_RECEIVES_PER_TURN = 16  # receives for one stream before the loop serves the others
_RECEIVE_BYTES = 64 * 1024  # what one receive takes for a protocol that is not buffered
_WOULD_BLOCK = (BlockingIOError, InterruptedError)


class StreamState(enum.Enum):
    """Whether the stream is usable."""

    OPEN = "open"
    CLOSED = "closed"  #: aborted, or lost: nothing is read or written again


class Writer(enum.Enum):
    """Who writes the socket next (under the stream's lock)."""

    DIRECT = "direct"  #: the outbox is empty: the thread calling ``write`` sends what the socket takes
    LOOP = "loop"  #: the loop writes the outbox; writes meanwhile join it, in order


class Room(enum.Enum):
    """Whether the loop watches the socket for room to write the outbox (the loop's own)."""

    UNWATCHED = "unwatched"
    WATCHED = "watched"


class SocketStream:
    """A connected plain TCP socket, read on the loop and written by any thread (see the module).

    Made on the loop's thread, which reads the socket from then on.

    Args:
        sock: the connected socket; the stream owns it from now on (made non-blocking).
        protocol: gets what is received (``connection_made`` is called with the stream).

    Example::

        >>> stream = SocketStream(sock, HandshakeReader())  # doctest: +SKIP
        >>> stream.write(b"hello")  # doctest: +SKIP
    """

    def __init__(self, sock: socket.socket, protocol: asyncio.BaseProtocol) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = process_loop()
        self._protocol = protocol
        self._lock = threading.Lock()
        self._state = StreamState.OPEN
        self._writer = Writer.DIRECT
        self._outbox: collections.deque[memoryview] = collections.deque()
        self._room = Room.UNWATCHED  # the loop's
        self._low_water = LowWater(sock, self._loop)  # the loop's
        self._loop.add_reader(self._fd, self._readable)
        protocol.connection_made(self)  # type: ignore[arg-type]

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        """Hand what is received from now on to ``protocol`` (on the loop's thread)."""
        self._protocol = protocol

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` after everything written before; callable from any thread (see the module)."""
        self.writelines((data,))

    def writelines(self, pieces: Iterable[bytes | bytearray | memoryview]) -> None:
        """Send ``pieces`` in order, after everything written before; callable from any thread.

        What the socket does not take at once is copied, so the caller may change
        its memory when this returns. A write on a closed stream is dropped (its
        protocol learns of the end from the loop).
        """
        views = [view for view in (memoryview(piece).cast("B") for piece in pieces) if view.nbytes]
        if not views:
            return
        error: OSError | None = None
        with self._lock:
            if self._state is StreamState.CLOSED:
                return
            left: collections.deque[memoryview] = collections.deque(views)
            if self._writer is Writer.DIRECT:
                try:
                    self._send(left)
                except OSError as exc:
                    error = exc
                    left.clear()
                if not left:
                    post = False
                else:
                    post, self._writer = True, Writer.LOOP
            else:
                post = False
            self._outbox.extend(memoryview(bytes(view)) for view in left)  # the caller may change its memory
        if error is not None:
            call_soon(self._lost, error)
        elif post:
            call_soon(self._write_outbox)

    def abort(self) -> None:
        """Close the socket now, dropping what is unwritten; the protocol's ``connection_lost`` follows (on the
        loop's thread, which calls this)."""
        if self._close():
            self._loop.call_soon(self._protocol.connection_lost, None)

    # ------------------------------------------------------------------ writing

    def _send(self, left: collections.deque[memoryview]) -> None:
        """Send what the socket takes of ``left`` (holding ``_lock``); what it took leaves ``left``."""
        while left:
            try:
                sent = self._sock.send(left[0]) if len(left) == 1 else self._sock.sendmsg(list(left)[:_IOV_MAX])
            except _WOULD_BLOCK:
                return
            while sent:
                head = left[0]
                if sent < head.nbytes:
                    left[0] = head[sent:]
                    return  # the socket took less than it was given: it is full now
                sent -= head.nbytes
                left.popleft()

    def _write_outbox(self) -> None:
        """On the loop: write the outbox; watch the socket for room while some is left."""
        with self._lock:
            if self._state is StreamState.CLOSED:
                return
            try:
                self._send(self._outbox)
            except OSError as exc:
                error: OSError | None = exc
            else:
                error = None
                if not self._outbox:
                    self._writer = Writer.DIRECT
            writer = self._writer
        if error is not None:
            self._lost(error)
        elif writer is Writer.LOOP and self._room is Room.UNWATCHED:
            self._room = Room.WATCHED
            self._loop.add_writer(self._fd, self._write_outbox)
        elif writer is Writer.DIRECT and self._room is Room.WATCHED:
            self._room = Room.UNWATCHED
            self._loop.remove_writer(self._fd)

    # ------------------------------------------------------------------ reading

    def _readable(self) -> None:
        protocol = self._protocol
        if self._receive(protocol) and isinstance(protocol, FrameProtocol) and self._protocol is protocol:
            self._low_water.expect(protocol.bytes_due)  # the next wakeup waits for much of a large part

    def _receive(self, protocol: asyncio.BaseProtocol) -> bool:
        """Receive for ``protocol`` until the socket is drained or the turn is over; whether the stream is open."""
        buffered = isinstance(protocol, asyncio.BufferedProtocol)
        for _ in range(_RECEIVES_PER_TURN):
            try:
                if buffered:
                    target = protocol.get_buffer(-1)
                    received = self._sock.recv_into(target)
                    size, target = len(target), None  # a growing payload's memory cannot grow while viewed
                else:
                    data = self._sock.recv(_RECEIVE_BYTES)
                    received, size = len(data), _RECEIVE_BYTES
            except _WOULD_BLOCK:
                return True
            except OSError as exc:
                self._lost(exc)
                return False
            if not received:
                protocol.eof_received()
                self._lost(None)
                return False
            if buffered:
                protocol.buffer_updated(received)
            else:
                protocol.data_received(data)  # type: ignore[attr-defined]
            if received < size or self._protocol is not protocol or self.closed:
                break  # it took all there was, or the stream changed hands
        return not self.closed

    @property
    def unwritten(self) -> int:
        """Bytes written and not yet taken by the socket (a moment old)."""
        with self._lock:
            return sum(view.nbytes for view in self._outbox)

    @property
    def closed(self) -> bool:
        """Whether the stream was aborted or lost."""
        with self._lock:
            return self._state is StreamState.CLOSED

    def _lost(self, error: Exception | None) -> None:
        """On the loop: the connection broke (``error``) or ended (``None``): close it and tell the protocol."""
        if self._close():
            self._protocol.connection_lost(error)

    def _close(self) -> bool:
        """On the loop: close the socket, dropping what is unwritten; whether it was open until now."""
        with self._lock:
            if self._state is StreamState.CLOSED:
                return False
            self._state = StreamState.CLOSED
            self._outbox.clear()
        self._stop_watching()
        self._low_water.close()
        self._sock.close()
        return True

    def _stop_watching(self) -> None:
        self._loop.remove_reader(self._fd)
        if self._room is Room.WATCHED:
            self._room = Room.UNWATCHED
            self._loop.remove_writer(self._fd)
