"""A blocking socket that speaks rpcdl's protocol: what tests use as a raw or hostile client, or a fake worker.

rpcdl itself owns every socket on its event loop; a test that must send bytes
a well-behaved client never sends, stop in the middle of a frame, or play an
old worker drives a plain blocking socket with these instead. Nothing here
parses or checks on its own: the handshake's messages are the package's
(:func:`rpcdl.transport.handshake.client_steps` and ``server_steps``), frames
are encoded by :func:`rpcdl.transport.wire.encode_frame` and received by the
package's one frame receiver, :class:`rpcdl.transport.frame_protocol.FrameProtocol`,
fed from ``recv_into`` as the loop would feed it. Benchmarks that need a
floor without the loop import this module too.

Threading model: a :class:`FrameReader` belongs to the one thread that reads
its socket; another thread may send on the same socket meanwhile.
"""

from __future__ import annotations

import collections
import select
import socket
import ssl
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from rpcdl.errors import ConnectionLost
from rpcdl.transport.frame_protocol import FrameProtocol
from rpcdl.transport.handshake import Agreement, Deadline, FirstAnswer, Read, client_steps, server_steps
from rpcdl.transport.security import Token
from rpcdl.transport.wire import Frame, Limits, encode_frame

_IOV_MAX = 1024


# ---------------------------------------------------------------------------- the handshake


def _arm(sock: socket.socket, deadline: Deadline | None) -> None:
    if deadline is None:
        return
    left = deadline.remaining()
    if left <= 0:
        raise TimeoutError(f"the handshake did not finish within {deadline.seconds:g}s")
    sock.settimeout(left)


def _recv_exact(sock: socket.socket, size: int, what: str, deadline: Deadline | None = None) -> bytes:
    data = bytearray()
    while len(data) < size:
        _arm(sock, deadline)
        try:
            chunk = sock.recv(size - len(data))
        except TimeoutError:
            if deadline is None:
                raise
            raise TimeoutError(f"the handshake did not finish within {deadline.seconds:g}s ({what})") from None
        if not chunk:
            raise ConnectionLost(f"peer closed the connection during the handshake ({what})")
        data += chunk
    return bytes(data)


def _first_answer(sock: socket.socket, step: FirstAnswer) -> bytes | None:
    """The first bytes the peer sends after the hello: ``b""`` if it closed, ``None`` past the step's timeout."""
    previous = sock.gettimeout()
    if step.timeout is not None:
        sock.settimeout(step.timeout)
    try:
        return sock.recv(step.size)
    except TimeoutError:
        return None
    except ConnectionResetError:
        return b""
    finally:
        sock.settimeout(previous)


def client_negotiate(
    sock: socket.socket,
    token: Token | None,
    peer: str,
    answer_timeout: float | None = None,
    compression: str | None = None,
    shared_memory: bool = False,
    observer: bool = False,
) -> Agreement:
    """Run the client side of the handshake on a connected blocking socket (its timeout bounds each read).

    The arguments, result and errors are those of
    :func:`rpcdl.transport.handshake_client.negotiate`, the loop's form.
    """
    steps = client_steps(token, peer, answer_timeout, compression, shared_memory, observer)
    reply: bytes | None = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as done:
            return done.value
        if isinstance(step, FirstAnswer):
            reply = _first_answer(sock, step)
        elif isinstance(step, Read):
            reply = _recv_exact(sock, step.size, step.what)
        else:
            sock.sendall(step.data)
            reply = None


def server_negotiate(
    sock: socket.socket,
    token: Token | None,
    peer: str,
    compression: str = "off",
    shared_memory: int = 0,
    deadline: Deadline | None = None,
    admit: Callable[[bool], str] | None = None,
) -> Agreement:
    """Run the worker side of the handshake on an accepted blocking socket: a fake (or old) worker.

    The arguments, result and errors are those of
    :func:`rpcdl.transport.handshake_server.accept_handshake`, the loop's form; without ``deadline`` the
    socket's timeout bounds each read.
    """
    steps = server_steps(token, peer, compression, shared_memory, admit)
    reply: bytes | None = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as done:
            return done.value
        try:
            if isinstance(step, Read):
                reply = _recv_exact(sock, step.size, step.what, deadline)
            else:
                _arm(sock, deadline)
                sock.sendall(step.data)
                reply = None
        except BaseException as exc:
            steps.throw(exc)
            raise


# ---------------------------------------------------------------------------- frames


class Stream:
    """A connected socket, handshake done, with a receive timeout of its own (see :func:`io_stream`).

    Everything but :attr:`receive_timeout`, :attr:`kernel_timeouts` and :attr:`raw` is the socket's.
    """

    def __init__(self, sock: socket.socket, receive: float | None, kernel_timeouts: bool) -> None:
        self.raw = sock
        self.receive_timeout = receive
        self.kernel_timeouts = kernel_timeouts  #: a blocking plain socket: its waits are SO_RCVTIMEO/SO_SNDTIMEO

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def _timeval(seconds: float | None) -> bytes:
    if seconds is None:
        return struct.pack("ll", 0, 0)  # no timeout
    micros = max(1, round(seconds * 1e6))  # 0 would mean no timeout
    return struct.pack("ll", micros // 1_000_000, micros % 1_000_000)


def io_stream(sock: socket.socket, receive: float | None, send: float | None) -> Stream:
    """``sock`` ready for frames: a :class:`FrameReader` finds it idle after ``receive`` seconds without a frame
    (``None``: never), and a send gives up after ``send`` seconds without room.

    A plain socket stays blocking with kernel timeouts, so a receive is one system call (a Python timeout
    polls before each); a TLS socket gets Python's timeout for its sends.
    """
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(send)
        return Stream(sock, receive, kernel_timeouts=False)
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send))
    return Stream(sock, receive, kernel_timeouts=True)


def send_pieces(sock: socket.socket | Stream, pieces: Sequence[bytes | memoryview]) -> int:
    """Send ``pieces`` in order; return the bytes sent."""
    raw = sock.raw if isinstance(sock, Stream) else sock
    views = [view for view in (memoryview(piece).cast("B") for piece in pieces) if view.nbytes]
    if isinstance(raw, ssl.SSLSocket) or not hasattr(raw, "sendmsg"):
        for view in views:
            raw.sendall(view)
        return sum(view.nbytes for view in views)
    total, first = 0, 0
    while first < len(views):
        sent = raw.sendmsg(views[first : first + _IOV_MAX])
        total += sent
        while sent:
            size = views[first].nbytes
            if sent >= size:
                sent -= size
                first += 1
            else:
                views[first] = views[first][sent:]
                sent = 0
    return total


def send_frame(sock: socket.socket | Stream, frame: Frame) -> int:
    """Encode and send one frame; return the bytes sent."""
    return send_pieces(sock, encode_frame(frame))


def _bytearray(call_id: int, size: int) -> bytearray:
    return bytearray(size)


class FrameReader:
    """Frames read from a blocking socket by the package's :class:`~rpcdl.transport.frame_protocol.FrameProtocol`.

    Args:
        sock: a connected socket after the handshake, or the :class:`Stream` of :func:`io_stream`, whose
            receive timeout is how long :meth:`read_frame` waits for a frame to start (a plain socket: its
            own timeout).
        limits: the bounds checked before allocating.
        stall_timeout: seconds the peer may go without sending a byte in the middle of a frame.
        chunk_size: accepted for the callers' sake; the protocol receives into its own staging buffer.
        decompress: whether compressed frames are accepted.
        segment: the memory of buffers in a shared segment, as for the protocol.
    """

    def __init__(
        self,
        sock: socket.socket | Stream,
        limits: Limits,
        stall_timeout: float,
        chunk_size: int = 0,
        decompress: bool = False,
        segment: Callable[[int, int, int], Any] | None = None,
    ) -> None:
        self._sock = sock.raw if isinstance(sock, Stream) else sock
        self._idle_timeout = sock.receive_timeout if isinstance(sock, Stream) else sock.gettimeout()
        self._kernel_timeouts = isinstance(sock, Stream) and sock.kernel_timeouts
        self._armed = self._idle_timeout  # the SO_RCVTIMEO set now
        if self._kernel_timeouts:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self._armed))
        self._stall_timeout = stall_timeout
        self._frames: collections.deque[Frame] = collections.deque()
        self._error: BaseException | None = None
        self._allocate: Callable[[int, int], Any] = _bytearray
        self._protocol = FrameProtocol(
            self,
            limits,
            decompress=decompress,
            segment=segment,
            allocate=lambda call_id, size: self._allocate(call_id, size),
        )
        self._protocol.get_buffer(0)  # the staging buffer of this thread, made now rather than in a read
        self.bytes_read = 0

    # the protocol's sink
    def frame_received(self, frame: Frame) -> None:
        self._frames.append(frame)

    def receiving_failed(self, error: Exception) -> None:
        self._error = self._error or error

    def stream_ended(self, error: Exception | None) -> None:
        self._error = self._error or error or ConnectionLost("the peer closed the connection")

    @property
    def buffered(self) -> bool:
        """Whether a frame, or the start of one, was received and not returned yet."""
        return bool(self._frames) or not self._protocol.idle

    @property
    def holds_frame(self) -> bool:
        """Whether a whole frame waits to be returned."""
        return bool(self._frames)

    def read_frame(self, allocate: Callable[[int, int], Any] = _bytearray) -> Frame | None:
        """The next whole frame, or ``None`` if none started within the receive timeout.

        Raises:
            ConnectionLost: the peer closed the connection.
            FrameTooLarge: the frame announces more than the limits.
            ProtocolError: the frame breaks the protocol.
            TimeoutError: the peer stalled in the middle of a frame.
        """
        self._allocate = allocate
        while not self._frames:
            if self._error is not None:
                raise self._error
            idle = self._protocol.idle
            try:
                received = self._receive(self._idle_timeout if idle else self._stall_timeout)
            except ConnectionResetError as exc:
                self._protocol.connection_lost(ConnectionLost(f"the peer reset the connection ({exc})"))
                continue
            if received is None:
                if idle:
                    return None
                raise TimeoutError(f"the peer sent nothing for {self._stall_timeout:g}s in the middle of a message")
            if not received:
                self._protocol.eof_received()
                self._protocol.connection_lost(None)
                continue
            self.bytes_read += received
            self._protocol.buffer_updated(received)
        return self._frames.popleft()

    def _receive(self, wait: float | None) -> int | None:
        """Receive into the protocol's buffer within ``wait`` seconds: the bytes received, or ``None``."""
        if self._kernel_timeouts:
            if wait != self._armed:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(wait))
                self._armed = wait
            try:
                return self._sock.recv_into(self._protocol.get_buffer(-1))
            except BlockingIOError:  # SO_RCVTIMEO passed
                return None
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._readable(left):
                return None
            try:
                return self._sock.recv_into(self._protocol.get_buffer(-1))
            except (BlockingIOError, ssl.SSLWantReadError):
                continue

    def _readable(self, timeout: float | None) -> bool:
        if isinstance(self._sock, ssl.SSLSocket) and self._sock.pending():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self._sock], [], [], left)
            if readable:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
