"""The worker's side of the handshake, run on the process loop: no thread per connection.

The steps (messages, proofs and errors) are
:func:`rpcdl.transport.handshake.server_steps`'s; here a coroutine does their
I/O on a non-blocking socket, waking when it is readable or writable, and TLS
first where the worker serves it: the TLS handshake of the standard library's
:class:`ssl.SSLSocket`, driven without blocking. What comes out is that same
socket, ready for a session, which the loop goes on reading and writing itself
(so an answer's buffers leave with one ``sendmsg``, never copied into a
transport's buffer). One deadline, from the accept, bounds the whole
handshake, TLS included.

Threading: every coroutine here runs on the loop's thread (``rpcdl-loop``,
:mod:`rpcdl.transport.event_loop`), which owns the socket while it runs.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable

from ..errors import ConnectionLost
from .handshake import Agreement, Deadline, Read, server_steps
from .security import Token

_WOULD_READ = (BlockingIOError, InterruptedError, ssl.SSLWantReadError)
_WOULD_WRITE = (ssl.SSLWantWriteError,)


async def _ready(sock: socket.socket, deadline: Deadline, what: str, writable: bool = False) -> None:
    """Wait until ``sock`` is readable (or ``writable``), or raise :class:`TimeoutError` at the deadline."""
    loop = asyncio.get_running_loop()
    left = deadline.remaining()
    if left <= 0:
        raise TimeoutError(f"the handshake did not finish within {deadline.seconds:g}s ({what})")
    woken = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not woken.done():
            woken.set_result(None)

    (loop.add_writer if writable else loop.add_reader)(fd, wake)
    try:
        await asyncio.wait_for(woken, left)
    except asyncio.TimeoutError:
        raise TimeoutError(f"the handshake did not finish within {deadline.seconds:g}s ({what})") from None
    finally:
        (loop.remove_writer if writable else loop.remove_reader)(fd)


async def _recv_exact(sock: socket.socket, size: int, what: str, deadline: Deadline) -> bytes:
    data = bytearray()
    while len(data) < size:
        try:
            chunk = sock.recv(size - len(data))
        except _WOULD_READ:
            await _ready(sock, deadline, what)
            continue
        except _WOULD_WRITE:
            await _ready(sock, deadline, what, writable=True)
            continue
        if not chunk:
            raise ConnectionLost(f"peer closed the connection during the handshake ({what})")
        data += chunk
    return bytes(data)


async def _send(sock: socket.socket, data: bytes, deadline: Deadline) -> None:
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
            await _ready(sock, deadline, "sending", writable=True)
            continue
        except ssl.SSLWantReadError:
            await _ready(sock, deadline, "sending")
            continue
        view = view[sent:]


async def _tls_handshake(sock: ssl.SSLSocket, deadline: Deadline) -> None:
    while True:
        try:
            sock.do_handshake()
            return
        except ssl.SSLWantReadError:
            await _ready(sock, deadline, "TLS")
        except ssl.SSLWantWriteError:
            await _ready(sock, deadline, "TLS", writable=True)


async def accept_handshake(
    sock: socket.socket,
    token: Token | None,
    peer: str,
    deadline: Deadline,
    *,
    tls: ssl.SSLContext | None = None,
    compression: str = "off",
    shared_memory: int = 0,
    admit: Callable[[bool], str] | None = None,
    wrapped: Callable[[socket.socket], bool] | None = None,
) -> tuple[socket.socket, Agreement]:
    """Run the worker's side of the handshake, TLS first with ``tls``, on the loop, within ``deadline``.

    Args:
        sock: the socket just accepted (made non-blocking here).
        token: the shared secret, or ``None``.
        peer: ``"host:port"`` of the client, for messages.
        deadline: when the whole handshake must be over (counted from the accept).
        tls: serve TLS with this context; ``None``: plain.
        compression, shared_memory, admit: as for :func:`~rpcdl.transport.handshake.server_steps`.
        wrapped: told the TLS socket that replaces ``sock`` before its TLS
            handshake; returning ``False`` stops the handshake (the connection
            was dropped meanwhile: :class:`ConnectionAbortedError`).

    Returns:
        the socket to serve (``sock``, or its TLS socket) and what the handshake settled.

    Raises:
        what :func:`~rpcdl.transport.handshake.server_steps` raises, :class:`TimeoutError` past the deadline, and
        :class:`ssl.SSLError` for a failed TLS handshake. The socket is left to
        the caller to close.

    Example::

        >>> sock, agreed = await accept_handshake(accepted, None, "10.0.0.7:51234", Deadline(10.0))  # doctest: +SKIP
    """
    sock.setblocking(False)
    if tls is not None:
        sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        if wrapped is not None and not wrapped(sock):
            raise ConnectionAbortedError("evicted")
        await _tls_handshake(sock, deadline)
    steps = server_steps(token, peer, compression, shared_memory, admit)
    reply: bytes | None = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as done:
            return sock, done.value
        try:
            if isinstance(step, Read):
                reply = await _recv_exact(sock, step.size, step.what, deadline)
            else:
                await _send(sock, step.data, deadline)
                reply = None
        except BaseException as exc:
            steps.throw(exc)
            raise
