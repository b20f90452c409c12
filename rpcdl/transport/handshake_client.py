"""The client side of the handshake, on the event loop: connect, TLS through asyncio, then rpcdl's messages.

The messages, proofs and the names given to peers that are not rpcdl workers
are :mod:`rpcdl.transport.handshake`'s; this module runs the client's side of
that exchange as coroutines, so that opening any number of connections takes
no thread of its own. Three steps, which the caller tells apart to judge a
failure (see :mod:`rpcdl.rpc.dial`):

1. :func:`connect_socket`: resolve the name and connect a non-blocking socket;
2. :func:`attach`: hand the socket to the loop as a transport, TLS handshake
   included when a context is given (asyncio's own ``ssl=``);
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
import hmac
import ipaddress
import os
import socket
import ssl
import struct
import threading

from .._lifecycle import in_forked_child
from ..errors import AuthenticationError, ConnectionLost, HelloUnanswered, ProtocolError, SessionsFull, WorkerFull
from .compression import lz4_available, resolve_mode
from .handshake import (
    DECODES_LZ4,
    FULL,
    HAS_TOKEN,
    HELLO,
    MAGIC,
    MAX_VERDICT_MESSAGE,
    MODE_BITS,
    MODE_SHIFT,
    NONCE_BYTES,
    OBSERVER,
    REFUSAL,
    REFUSED,
    SEGMENT,
    SHARED_MEMORY,
    VERDICT,
    VERSION,
    VERSIONED,
    WELCOME,
    Agreement,
    describe_answer,
    mode_of,
    proof,
)
from .security import Token

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
) -> tuple[asyncio.Transport, HandshakeReader]:
    """Give the connected ``sock`` to the loop, with a TLS handshake when ``ssl_context`` is given.

    Args:
        sock: what :func:`connect_socket` returned; the transport owns it from now on (closed on failure).
        ssl_context: the TLS context, or ``None`` for plain TCP.
        host: the name the worker's certificate must bear.
        timeout: seconds the TLS handshake may take.

    Returns:
        the transport and the reader of the handshake's bytes.

    Raises:
        ssl.SSLError: the TLS handshake failed (``ssl.SSLCertVerificationError``: the certificate).
        ConnectionError: the peer closed the connection, or the TLS handshake took too long.

    Example::

        >>> transport, reader = await attach(sock, context, "worker-0", 10.0)  # doctest: +SKIP
    """
    loop = asyncio.get_running_loop()
    reader = HandshakeReader()
    tls = {"ssl": ssl_context, "server_hostname": host, "ssl_handshake_timeout": timeout} if ssl_context else {}
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
    """Run rpcdl's client side of the handshake (:func:`rpcdl.transport.handshake.client_negotiate` on the loop).

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
    client_nonce = os.urandom(NONCE_BYTES)
    flags = HAS_TOKEN if token is not None else 0
    flags |= (DECODES_LZ4 if lz4_available() else 0) | MODE_BITS[resolve_mode(compression)] << MODE_SHIFT
    flags |= SHARED_MEMORY if shared_memory else 0
    flags |= OBSERVER if observer else 0
    transport.write(HELLO.pack(MAGIC, VERSION, flags, client_nonce))
    first = await reader.read_some(WELCOME.size, min(deadline, loop.time() + answer_timeout))
    if first is None:
        raise ProtocolError(
            f"{peer} is not an rpcdl worker (it accepted the connection but did not answer rpcdl's hello "
            f"within {answer_timeout:g}s; rpcdl workers answer at once)"
        )
    if not first:
        raise HelloUnanswered(f"{peer} closed the connection after rpcdl's hello without answering")
    if not MAGIC.startswith(first[: len(MAGIC)]):
        raise ProtocolError(f"{peer} is not an rpcdl worker ({describe_answer(first)})")
    if len(first) < VERSIONED:
        first += await reader.read(VERSIONED - len(first), "welcome", deadline)
    if struct.unpack_from("!H", first, len(MAGIC))[0] == REFUSED:
        refusal = first[: REFUSAL.size] + await reader.read(max(0, REFUSAL.size - len(first)), "refusal", deadline)
        magic, _, pending, limit = REFUSAL.unpack(refusal)
        if magic != MAGIC:
            raise ProtocolError(f"{peer} is not an rpcdl worker ({describe_answer(refusal)})")
        raise WorkerFull(peer, pending, limit)
    welcome = first + await reader.read(WELCOME.size - len(first), "welcome", deadline)
    magic, version, worker_flags, worker_nonce, worker_proof = WELCOME.unpack(welcome)
    if magic != MAGIC:
        raise ProtocolError(f"{peer} is not an rpcdl worker ({describe_answer(welcome)})")
    if version != VERSION:
        raise ProtocolError(
            f"{peer} speaks rpcdl protocol version {version}, this client speaks {VERSION}: "
            "install the same rpcdl version on both sides"
        )
    transport.write(proof(token, b"rpcdl-client", worker_nonce, client_nonce))
    status, length = VERDICT.unpack(await reader.read(VERDICT.size, "verdict", deadline))
    message = (await reader.read(min(length, MAX_VERDICT_MESSAGE), "verdict", deadline)).decode("utf-8", "replace")
    worker_has_token = bool(worker_flags & HAS_TOKEN)
    if worker_has_token and token is None:
        raise AuthenticationError(
            f"worker {peer} requires a token: set RPCDL_TOKEN or RPCDL_TOKEN_FILE, or pass token=, "
            "to the token the worker was started with"
        )
    if token is not None and not worker_has_token:
        raise AuthenticationError(
            f"worker {peer} runs without a token but this client has one: refusing to trust an "
            "unauthenticated worker; start it with the same RPCDL_TOKEN, or unset the client's token"
        )
    if not hmac.compare_digest(worker_proof, proof(token, b"rpcdl-worker", client_nonce, worker_nonce)):
        raise AuthenticationError(f"token mismatch: worker {peer} holds a different token than this client")
    if status == FULL:
        raise SessionsFull(f"rpcdl worker {peer} is full: {message}")
    if status != 0:
        raise AuthenticationError(f"worker {peer} refused the connection: {message}")
    mode = mode_of(worker_flags) if flags & DECODES_LZ4 else "off"
    if not (shared_memory and worker_flags & SHARED_MEMORY):
        return Agreement(mode)
    from .shm import HEADER_BYTES, ClientSegment, Offer, host_identity  # here: numpy only where segments are

    transport.write(host_identity())
    pid, fd, size, nonce = SEGMENT.unpack(await reader.read(SEGMENT.size, "shared-memory segment", deadline))
    segment = ClientSegment.open(Offer(pid, fd, size, nonce)) if size >= HEADER_BYTES else None
    if size:
        transport.write(b"\x01" if segment is not None else b"\x00")
    return Agreement(mode, segment)
