"""The client side of the handshake, on the event loop: connect, TLS through asyncio, then rpcdl's messages.

The messages, proofs and the names given to peers that are not rpcdl workers
are :mod:`rpcdl.transport.handshake`'s (its :func:`~rpcdl.transport.handshake.client_steps`);
this module does that exchange's I/O as coroutines, so that opening any
number of connections takes no thread of its own. Three steps, which the caller tells apart to judge a
failure (see :mod:`rpcdl.rpc.dial`):

1. :func:`connect_socket`: resolve the name and connect a non-blocking socket;
2. :func:`attach`: hand the socket to the loop: a TLS transport, TLS handshake
   included, when a context is given (asyncio's own ``ssl=``), else a
   :class:`~rpcdl.transport.socket_stream.SocketStream` (plain TCP, which the
   threads making calls write themselves);
3. :func:`negotiate`: hello, welcome, proof, verdict, and the shared segment.

What the worker sends after the handshake (a ``LEAVING`` notice, say) may
arrive with its last message: :meth:`HandshakeReader.leftover` gives those bytes
to the frame receiver that takes the transport over
(:class:`~rpcdl.transport.frame_protocol.FrameProtocol`).

Threading model: everything here runs on the loop's thread (``rpcdl-loop``);
a :class:`HandshakeReader` is that thread's, as its transport is. A host name
(not an address) is resolved by a small pool of threads, ``rpcdl-resolve``
(at most :data:`RESOLVERS`, whatever the number of workers), since the
system's resolver blocks; ``_lock`` guards the one pool of the process, which a
forked child makes anew.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import ipaddress
import socket
import ssl
import threading

from .._lifecycle import in_forked_child
from ..errors import ConnectionLost
from .handshake import Agreement, FirstAnswer, Read, client_steps
from .security import Token
from .socket_stream import SocketStream

RESOLVERS = 2  #: threads that resolve host names, at most

_lock = threading.Lock()
_resolvers: concurrent.futures.ThreadPoolExecutor | None = None


def _resolver_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _resolvers
    with _lock:
        if _resolvers is None:
            _resolvers = concurrent.futures.ThreadPoolExecutor(RESOLVERS, thread_name_prefix="rpcdl-resolve")
        return _resolvers


def _forget_parents_resolvers() -> None:
    global _resolvers, _lock
    _resolvers, _lock = None, threading.Lock()


in_forked_child(_forget_parents_resolvers)


async def _resolve(host: str, port: int) -> list:
    """The addresses of ``host``: at once for an address, else asked of the system's resolver in a thread."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        resolve = functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
        return await asyncio.get_running_loop().run_in_executor(_resolver_pool(), resolve)
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)


class HandshakeReader(asyncio.Protocol):
    """The bytes a worker sends during the handshake, read by the coroutine that runs it.

    Example::

        >>> transport, reader = await attach(sock, None, "127.0.0.1", 10.0)  # doctest: +SKIP
        >>> welcome = await reader.read(WELCOME.size, "welcome", deadline)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._data = bytearray()
        self._ended: Exception | None = None  # why no more bytes come (the end of the stream, or an error)
        self._waiter: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._data += data
        self._wake()

    def eof_received(self) -> bool:
        self._end(ConnectionLost("the peer closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc or ConnectionLost("the peer closed the connection"))

    async def read(self, size: int, what: str, deadline: float) -> bytes:
        """Exactly ``size`` bytes, by ``deadline`` (the loop's clock).

        Raises:
            ConnectionLost: the peer closed the connection first.
            TimeoutError: the deadline passed first.
        """
        while len(self._data) < size:
            if self._ended is not None:
                raise ConnectionLost(f"peer closed the connection during the handshake ({what})")
            if not await self._wait(deadline):
                raise TimeoutError(f"the handshake did not finish in time ({what})")
        data = bytes(self._data[:size])
        del self._data[:size]
        return data

    async def read_some(self, size: int, deadline: float) -> bytes | None:
        """Up to ``size`` bytes, as soon as any came; ``b""`` if the stream ended first, ``None`` past ``deadline``."""
        while not self._data:
            if self._ended is not None:
                return b""
            if not await self._wait(deadline):
                return None
        data = bytes(self._data[:size])
        del self._data[:size]
        return data

    def leftover(self) -> bytes:
        """What arrived after the handshake's last message: the start of the first frames."""
        data, self._data = bytes(self._data), bytearray()
        return data

    async def _wait(self, deadline: float) -> bool:
        loop = asyncio.get_running_loop()
        left = deadline - loop.time()
        if left <= 0:
            return False
        self._waiter = waiter = loop.create_future()
        handle = loop.call_later(left, self._wake)
        try:
            await waiter
        finally:
            handle.cancel()
            self._waiter = None
        return loop.time() < deadline or bool(self._data) or self._ended is not None

    def _end(self, error: Exception) -> None:
        if self._ended is None:
            self._ended = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


async def connect_socket(host: str, port: int, timeout: float) -> socket.socket:
    """A non-blocking socket connected to ``host:port``, each address the name resolves to tried in turn.

    Args:
        host: a name or an address.
        port: the port.
        timeout: seconds each attempt to connect may take.

    Returns:
        the connected socket, with ``TCP_NODELAY``.

    Raises:
        socket.gaierror: the name does not resolve.
        OSError: no address took the connection (the last attempt's error: refused, unreachable...).

    Example::

        >>> sock = await connect_socket("127.0.0.1", 6543, 10.0)  # doctest: +SKIP
    """
    loop = asyncio.get_running_loop()
    infos = await _resolve(host, port)
    error: OSError | None = None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, address), timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            sock.close()
            error = exc if isinstance(exc, OSError) else TimeoutError(f"connecting took more than {timeout:g}s")
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise error or OSError(f"{host} resolves to no address")


async def attach(
    sock: socket.socket, ssl_context: ssl.SSLContext | None, host: str, timeout: float
) -> tuple[asyncio.Transport | SocketStream, HandshakeReader]:
    """Give the connected ``sock`` to the loop: a TLS transport after a TLS handshake when ``ssl_context`` is
    given, else a :class:`~rpcdl.transport.socket_stream.SocketStream` (which any thread may write).

    Args:
        sock: what :func:`connect_socket` returned; the transport owns it from now on (closed on failure).
        ssl_context: the TLS context, or ``None`` for plain TCP.
        host: the name the worker's certificate must bear.
        timeout: seconds the TLS handshake may take.

    Returns:
        the transport (or stream) and the reader of the handshake's bytes.

    Raises:
        ssl.SSLError: the TLS handshake failed (``ssl.SSLCertVerificationError``: the certificate).
        ConnectionError: the peer closed the connection, or the TLS handshake took too long.

    Example::

        >>> transport, reader = await attach(sock, context, "worker-0", 10.0)  # doctest: +SKIP
    """
    reader = HandshakeReader()
    if ssl_context is None:  # any thread may write a plain socket: see rpcdl.transport.socket_stream
        return SocketStream(sock, reader), reader
    loop = asyncio.get_running_loop()
    tls = {"ssl": ssl_context, "server_hostname": host, "ssl_handshake_timeout": timeout}
    try:
        transport, _ = await loop.create_connection(lambda: reader, sock=sock, **tls)
    except BaseException:
        sock.close()
        raise
    return transport, reader  # type: ignore[return-value]


async def negotiate(
    transport: asyncio.Transport,
    reader: HandshakeReader,
    token: Token | None,
    peer: str,
    *,
    deadline: float,
    answer_timeout: float,
    compression: str | None = None,
    shared_memory: bool = False,
    observer: bool = False,
) -> Agreement:
    """Run rpcdl's client side of the handshake (:func:`rpcdl.transport.handshake.client_steps`) on the loop.

    Args:
        transport: the connection (after TLS, if any).
        reader: its handshake reader.
        token: the shared secret, or ``None``.
        peer: ``"host:port"`` of the worker, for messages.
        deadline: when the whole exchange must be over (the loop's clock).
        answer_timeout: seconds the peer may take to start answering the hello.
        compression: the mode asked for (``None``: ``RPCDL_COMPRESSION``).
        shared_memory: offer to take answers through a shared segment.
        observer: this connection only asks for counters.

    Returns:
        what the worker chose: the compression mode and the segment, if any.

    Raises:
        ProtocolError: ``peer`` is not an rpcdl worker, or speaks another version.
        HelloUnanswered: ``peer`` closed the connection after the hello without a byte.
        WorkerFull: the worker refused the connection for now.
        SessionsFull: the worker serves as many clients as it takes.
        AuthenticationError: the tokens differ, or only one side has one.
        TimeoutError: ``deadline`` passed.

    Example::

        >>> agreed = await negotiate(transport, reader, None, "h:1", deadline=d, answer_timeout=5)  # doctest: +SKIP
    """
    loop = asyncio.get_running_loop()
    steps = client_steps(token, peer, answer_timeout, compression, shared_memory, observer)
    reply: bytes | None = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as done:
            return done.value
        if isinstance(step, FirstAnswer):
            reply = await reader.read_some(step.size, min(deadline, loop.time() + answer_timeout))
        elif isinstance(step, Read):
            reply = await reader.read(step.size, step.what, deadline)
        else:
            transport.write(step.data)
            reply = None
