"""The handshake that opens every connection, before any frame. Nothing here unpickles.

::

    client -> worker   hello    magic, version, flags, client nonce
    worker -> client   welcome  magic, version, flags, worker nonce, worker proof
    client -> worker   proof    HMAC(token, "rpcdl-client" + worker nonce + client nonce)
    worker -> client   verdict  status byte, message

and then, only where the hello offered shared memory and the welcome took the
offer (see :mod:`rpcdl.transport.shm`), inside the authenticated handshake::

    client -> worker   identity  32 bytes: the client's host identity
    worker -> client   segment   pid u32, fd u32, size u64, nonce (size 0: no segment for this client)
    client -> worker   confirm   1 if the client mapped that segment and found the nonce, else 0 (after a segment)
    worker -> client   ready     1 (after a confirm): the worker's side of the handshake is over too

The ready byte makes the two sides agree on the end: without it the client
would be done once its confirm left, while the worker still waited to read it,
and a client held up past the worker's deadline (a starved process) would send
calls down a connection the worker was closing. With it, such a client reads
the end of the stream instead, and dials again with its calls still queued.

The flags byte of the hello says whether the client has a token, whether it can
decode lz4, which compression mode it wants and whether it only observes
(``rpcdl status``: it asks for counters and is not counted among the worker's
clients); that of the welcome says whether the worker has a token and the compression mode the connection uses (see
:mod:`rpcdl.transport.compression`). A peer that predates compression leaves those bits
zero, which means off; one that predates shared memory never sets its bit,
so the connection keeps to the socket.

Proofs are HMAC-SHA256 on the shared token, so each side learns whether the other
holds it without the token ever crossing the wire; without a token they are zeros.
A peer that answers the hello with anything else is named for what it seems to be
(an HTTP server, a TLS endpoint, silence) instead of being retried.

The verdict's status is 0 when the worker takes the connection, 1 when the
client failed (its token, its version), and 2 when the client proved its
token but the worker serves as many clients as it takes (its ``max_sessions``):
the client raises :class:`~rpcdl.errors.SessionsFull`, and its loader goes to
other workers. Only a client that proved the token learns that.

A worker full of connections in their handshake may answer a new one, instead
of a welcome, with a refusal and close it::

    worker -> client   refusal  magic, version 0, handshakes pending u32, the worker's limit u32

A client tells it apart by the version (0: no version of rpcdl speaks it) and
raises :class:`~rpcdl.errors.WorkerFull`, which is retried. A client that predates refusals
reads the start of a welcome cut short: the connection lost, which it retries too.
A worker with TLS refuses before any TLS byte: it answers the client's TLS hello
with a fatal ``user_canceled`` alert (no TLS server sends that during a
handshake otherwise), which ``tls_refusal`` recognizes.

The worker bounds its whole side of the handshake by one ``Deadline``
counted from the accept (TLS included): each read and send waits at most for
the time left, so a peer that drips a byte at a time is cut when it passes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import ssl
import struct
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import AuthenticationError, HelloUnanswered, ProtocolError, SessionsFull, WorkerFull
from .compression import lz4_available, negotiate, resolve_mode
from .security import Token

if TYPE_CHECKING:
    from .shm import ClientSegment, WorkerSegment

log = logging.getLogger("rpcdl.shm")

MAGIC = b"RPCDL\x00"
VERSION = 2  #: the protocol both sides must speak (2: a shared-memory handshake ends with the worker's ready byte)
READY = b"\x01"  #: the worker's last byte of a handshake with a segment offered

# The messages' layouts and bits, shared by the blocking sides here and the loop's
# (rpcdl.transport.handshake_client, rpcdl.transport.handshake_server).
NONCE_BYTES = 32  #: bytes of each side's nonce
HELLO = struct.Struct("!6sHB32s")  #: magic, version, flags, client nonce
WELCOME = struct.Struct("!6sHB32s32s")  #: magic, version, flags, worker nonce, worker proof
VERDICT = struct.Struct("!BH")  #: status, length of the message that follows
MAX_VERDICT_MESSAGE = 1024  #: bytes of a verdict's message, at most
REFUSED_VERDICT = 1  #: the verdict's status: the client did not prove the token, or speaks another version
FULL = 2  #: the verdict's status: the worker serves as many clients as it takes (SessionsFull)
HAS_TOKEN = 1  #: hello and welcome: the side has a token
DECODES_LZ4 = 2  #: hello: the client can decompress lz4
MODE_SHIFT = 2  #: hello: the mode the client wants; welcome: the mode the connection uses
MODE_BITS = {"off": 0, "on": 1, "auto": 2}  #: the bits of each compression mode
_MODE_NAMES = {bits: name for name, bits in MODE_BITS.items()}
SHARED_MEMORY = 16  #: hello: the client offers shared memory; welcome: the worker takes the offer
SEGMENT = struct.Struct("!IIQ32s")  #: pid, fd, size, nonce of the segment offered
REFUSED = 0  #: the version field of a refusal
REFUSAL = struct.Struct("!6sHII")  #: magic, version 0, handshakes pending, the worker's limit
VERSIONED = struct.calcsize("!6sH")  #: the bytes that tell a welcome from a refusal
# A TLS record: alert (21), TLS 1.2 (3, 3), 2 bytes long: fatal (2), user_canceled (90).
_TLS_USER_CANCELED = bytes([21, 3, 3, 0, 2, 2, 90])


class Deadline:
    """One deadline for a whole handshake: each read and send waits at most for the time left.

    Not a timeout per read, which a peer sending one byte at a time would renew forever.

    Args:
        seconds: how long the whole handshake may take.
        start: when it began (``time.monotonic()``, at the accept); default now.

    Example::

        >>> deadline = Deadline(10.0)
        >>> 0 < deadline.remaining() <= 10.0
        True
    """

    def __init__(self, seconds: float, start: float | None = None):
        self.seconds = seconds
        self.expires_at = (time.monotonic() if start is None else start) + seconds

    def remaining(self) -> float:
        """Seconds left; 0 or less once it passed."""
        return self.expires_at - time.monotonic()


OBSERVER = 32  #: hello: the client only asks for counters (rpcdl status); not one of the worker's clients


@dataclass(frozen=True)
class Agreement:
    """What one connection's handshake settled.

    Attributes:
        compression: the compression mode, ``"off"``, ``"on"`` or ``"auto"``.
        segment: the shared-memory segment this side uses for answers
            (a :class:`~rpcdl.transport.shm.WorkerSegment` on the worker, a
            :class:`~rpcdl.transport.shm.ClientSegment` on the client), or ``None``: the socket.
        observer: the client said it only asks for counters (``rpcdl status``).
    """

    compression: str
    segment: WorkerSegment | ClientSegment | None = None
    observer: bool = False


def mode_of(flags: int) -> str:
    """The compression mode that a hello's or welcome's ``flags`` name (``"off"`` when none)."""
    return _MODE_NAMES.get((flags >> MODE_SHIFT) & 3, "off")


def proof(token: Token | None, label: bytes, first: bytes, second: bytes) -> bytes:
    """HMAC-SHA256 of ``label + first + second`` on ``token``: one side's proof (zeros without a token)."""
    if token is None:
        return bytes(32)
    return hmac.new(token.secret, label + first + second, hashlib.sha256).digest()


def describe_answer(first: bytes) -> str:
    """What the first bytes a peer answered the hello with say it is (an HTTP server, a TLS endpoint...)."""
    if first.startswith(b"HTTP/"):
        status_line = first.split(b"\r\n", 1)[0].decode("ascii", "replace")
        return f"it answered {status_line!r}: an HTTP server"
    if len(first) >= 2 and first[0] in (0x15, 0x16) and first[1] == 0x03:
        return (
            "it answered with a TLS record: it expects TLS; set RPCDL_TLS_CA (or pass ssl_context=) to connect with TLS"
        )
    return f"it answered {first[:16]!r}, not rpcdl's magic bytes {MAGIC!r}"


@dataclass(frozen=True)
class Read:
    """A step of a handshake: it needs the next ``size`` bytes from the peer (``what``, for messages)."""

    size: int
    what: str


@dataclass(frozen=True)
class Write:
    """A step of a handshake: send ``data`` to the peer."""

    data: bytes


ServerSteps = Generator["Read | Write", "bytes | None", Agreement]


@dataclass(frozen=True)
class FirstAnswer:
    """A step of the client's handshake: the first bytes the worker answers the hello with, up to ``size``.

    The driver sends back what came (``b""`` if the peer closed the connection
    first), or ``None`` if nothing came within ``timeout`` seconds (``None``:
    the driver's own limit).
    """

    size: int
    timeout: float | None


ClientSteps = Generator["FirstAnswer | Read | Write", "bytes | None", Agreement]


def client_steps(
    token: Token | None,
    peer: str,
    answer_timeout: float | None = None,
    compression: str | None = None,
    shared_memory: bool = False,
    observer: bool = False,
) -> ClientSteps:
    """The client's side of the handshake without its I/O: a generator of steps.

    It yields :class:`Write` (send it ``None`` once written), :class:`FirstAnswer`
    and :class:`Read` (send it the bytes read), and returns the
    :class:`Agreement`. The process loop's driver does the I/O
    (:func:`rpcdl.transport.handshake_client.negotiate`).

    Args:
        token: the shared secret, or ``None``.
        peer: ``"host:port"`` of the worker, for messages.
        answer_timeout: seconds the peer may take to start answering the hello
            (rpcdl workers answer at once); ``None``: the driver's own limit.
        compression: the mode this client asks for (``None``: ``RPCDL_COMPRESSION``,
            else ``"auto"``; see :mod:`rpcdl.transport.compression`).
        shared_memory: offer to take answers through a shared segment, used
            only if the worker is on this host and this process can map it.
        observer: say that this connection only asks for counters, so the
            worker does not count it among its clients (``rpcdl status``).

    Raises (out of the generator):
        ProtocolError: ``peer`` is not an rpcdl worker (it answered other bytes,
            or nothing within ``answer_timeout``), or speaks another version.
        HelloUnanswered: ``peer`` closed the connection after the hello without a byte.
        WorkerFull: the worker refused the connection for now (see :class:`WorkerFull`).
        SessionsFull: the worker serves as many clients as it takes.
        AuthenticationError: the tokens differ, or only one side has one.

    Example::

        >>> steps = client_steps(None, "10.0.0.7:6543", answer_timeout=5.0)
        >>> type(next(steps)).__name__
        'Write'
        >>> steps.send(None)
        FirstAnswer(size=73, timeout=5.0)
    """
    client_nonce = os.urandom(NONCE_BYTES)
    flags = HAS_TOKEN if token is not None else 0
    flags |= (DECODES_LZ4 if lz4_available() else 0) | MODE_BITS[resolve_mode(compression)] << MODE_SHIFT
    flags |= SHARED_MEMORY if shared_memory else 0
    flags |= OBSERVER if observer else 0
    yield Write(HELLO.pack(MAGIC, VERSION, flags, client_nonce))
    first = yield FirstAnswer(WELCOME.size, answer_timeout)
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
        first += yield Read(VERSIONED - len(first), "welcome")
    if struct.unpack_from("!H", first, len(MAGIC))[0] == REFUSED:
        refusal = first[: REFUSAL.size] + (yield Read(max(0, REFUSAL.size - len(first)), "refusal"))
        magic, _, pending, limit = REFUSAL.unpack(refusal)
        if magic != MAGIC:
            raise ProtocolError(f"{peer} is not an rpcdl worker ({describe_answer(refusal)})")
        raise WorkerFull(peer, pending, limit)
    welcome = first + (yield Read(WELCOME.size - len(first), "welcome"))
    magic, version, worker_flags, worker_nonce, worker_proof = WELCOME.unpack(welcome)
    if magic != MAGIC:
        raise ProtocolError(f"{peer} is not an rpcdl worker ({describe_answer(welcome)})")
    if version != VERSION:
        raise ProtocolError(
            f"{peer} speaks rpcdl protocol version {version}, this client speaks {VERSION}: "
            "install the same rpcdl version on both sides"
        )
    yield Write(proof(token, b"rpcdl-client", worker_nonce, client_nonce))
    status, length = VERDICT.unpack((yield Read(VERDICT.size, "verdict")))
    message = (yield Read(min(length, MAX_VERDICT_MESSAGE), "verdict")).decode("utf-8", "replace")
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

    yield Write(host_identity())
    pid, fd, size, nonce = SEGMENT.unpack((yield Read(SEGMENT.size, "shared-memory segment")))
    segment = ClientSegment.open(Offer(pid, fd, size, nonce)) if size >= HEADER_BYTES else None
    if size:
        yield Write(b"\x01" if segment is not None else b"\x00")
        if (yield Read(1, "shared-memory ready")) != READY:
            raise ProtocolError(f"{peer} ended the handshake with another byte than rpcdl's")
    return Agreement(mode, segment)


def server_steps(
    token: Token | None,
    peer: str,
    compression: str = "off",
    shared_memory: int = 0,
    admit: Callable[[bool], str] | None = None,
) -> ServerSteps:
    """The worker's side of the handshake without its I/O: a generator of steps.

    It yields :class:`Read` (send it the bytes read) and :class:`Write` (send it
    ``None`` once written) and returns the :class:`Agreement`. The process
    loop's driver does the I/O (:mod:`rpcdl.transport.handshake_server`). A
    driver whose I/O fails throws the error into the generator, which cleans up
    (a segment offered is closed) and raises it again.

    Args:
        token: the shared secret, or ``None``.
        peer: ``"host:port"`` of the client, for messages.
        compression: the worker's compression mode, resolved (see
            :func:`rpcdl.transport.compression.resolve_mode`).
        shared_memory: bytes of the segment to offer a client on this host; 0: none.
        admit: asked, once the client proved its token, whether the worker takes it (called with whether it
            only observes); it returns ``""`` to take it, else why it is full, which the verdict tells the
            client (:class:`~rpcdl.errors.SessionsFull` there).

    The verdict is sent to the client before an error is raised, so both
    sides know why a connection was refused. The errors' messages say why, not
    who: the worker's log line names the peer once (``refused connection from
    PEER: WHY``).

    Raises (out of the generator):
        ProtocolError: the peer is not an rpcdl client or speaks another version.
        AuthenticationError: the peer does not prove it holds the worker's token.
        SessionsFull: ``admit`` refused the client (the verdict told it so).

    Example::

        >>> steps = server_steps(None, "10.0.0.7:51234")
        >>> next(steps)
        Read(size=6, what='hello')
    """
    magic = yield Read(len(MAGIC), "hello")  # alone first: a stranger's short request is refused at once
    if magic != MAGIC:
        raise ProtocolError("not an rpcdl client (bad magic bytes)")
    rest = yield Read(HELLO.size - len(MAGIC), "hello")
    _, version, client_flags, client_nonce = HELLO.unpack(magic + rest)
    worker_nonce = os.urandom(NONCE_BYTES)
    mode = negotiate(mode_of(client_flags), bool(client_flags & DECODES_LZ4), compression)
    flags = (HAS_TOKEN if token is not None else 0) | MODE_BITS[mode] << MODE_SHIFT
    # compression forced on is meant to compress this connection's answers: they stay on the socket
    flags |= SHARED_MEMORY if shared_memory and client_flags & SHARED_MEMORY and mode != "on" else 0
    welcome_proof = proof(token, b"rpcdl-worker", client_nonce, worker_nonce)
    yield Write(WELCOME.pack(MAGIC, VERSION, flags, worker_nonce, welcome_proof))
    if version != VERSION:
        reason = f"the client speaks rpcdl protocol version {version}, this worker speaks {VERSION}"
        yield Write(_verdict(reason))
        raise ProtocolError(reason)
    client_proof = yield Read(32, "proof")
    client_has_token = bool(client_flags & HAS_TOKEN)
    reason = ""
    if token is not None and not client_has_token:
        reason = "this worker requires a token (RPCDL_TOKEN) and the client sent none"
    elif token is None and client_has_token:
        reason = "this worker has no token but the client sent one"
    elif not hmac.compare_digest(client_proof, proof(token, b"rpcdl-client", worker_nonce, client_nonce)):
        reason = "token mismatch: the client holds a different token"
    observer = bool(client_flags & OBSERVER)
    full = admit(observer) if admit is not None and not reason else ""
    yield Write(_verdict(reason or full, FULL if full else REFUSED_VERDICT))
    if reason:
        raise AuthenticationError(reason)
    if full:
        raise SessionsFull(full)
    if not flags & SHARED_MEMORY:
        return Agreement(mode, observer=observer)
    segment = yield from _offer_segment(peer, shared_memory)
    return Agreement(mode, segment, observer)


def send_refusal(sock: socket.socket, pending: int, limit: int, tls: bool = False) -> None:
    """Refuse an accepted connection, without waiting: tell the client the worker is full, then close.

    The refusal fits any socket buffer: it is sent at once or not at all (the
    client then sees the connection closed, and retries as well).

    Args:
        sock: the accepted socket, before any handshake.
        pending: the connections in their handshake the worker holds.
        limit: the most it admits at once.
        tls: the worker serves TLS: refuse with a TLS alert (which carries no numbers).

    Example::

        >>> send_refusal(listener.accept()[0], pending=256, limit=256)  # doctest: +SKIP
    """
    try:
        sock.setblocking(False)
        sock.send(_TLS_USER_CANCELED if tls else REFUSAL.pack(MAGIC, REFUSED, pending, limit))
        sock.shutdown(socket.SHUT_WR)  # the end of the stream follows the refusal
        while sock.recv(4096):  # the hello, if here: a socket closed with unread bytes resets the connection
            pass
    except OSError:
        pass
    sock.close()


def tls_refusal(error: BaseException, peer: str) -> WorkerFull | None:
    """The refusal of a full worker with TLS, if ``error`` (from the client's TLS handshake) is one.

    Args:
        error: what the TLS handshake raised.
        peer: ``"host:port"`` of the worker, for the message.

    Returns:
        a :class:`WorkerFull` to retry, or ``None``: ``error`` means something else.

    Example::

        >>> tls_refusal(ConnectionResetError(), "10.0.0.7:6543") is None
        True
    """
    if isinstance(error, ssl.SSLError) and error.reason == "TLSV1_ALERT_USER_CANCELLED":
        return WorkerFull(peer)
    return None


def _offer_segment(peer: str, size: int) -> Generator[Read | Write, bytes | None, WorkerSegment | None]:
    """Offer a client on this host a segment of ``size`` bytes; return it if the client maps it."""
    from .shm import WorkerSegment, host_identity  # here: numpy only where segments are (rpcdl status has none)

    segment = None
    identity = yield Read(32, "host identity")
    if hmac.compare_digest(identity, host_identity()):
        try:
            segment = WorkerSegment(size)
        except OSError as exc:
            log.debug("no shared memory for %s: cannot make a segment: %s", peer, exc)
    else:
        log.debug("no shared memory for %s: another host or namespace", peer)
    if segment is None:
        yield Write(SEGMENT.pack(0, 0, 0, bytes(32)))
        return None
    try:
        offer = segment.offer()
        yield Write(SEGMENT.pack(offer.pid, offer.fd, offer.size, offer.nonce))
        confirmed = (yield Read(1, "shared-memory confirmation")) == b"\x01"
        yield Write(READY)
    except BaseException:
        segment.close()
        raise
    if not confirmed:
        log.debug("no shared memory for %s: it could not map the segment", peer)
        segment.close()
        return None
    return segment


def _verdict(reason: str, status: int = REFUSED_VERDICT) -> bytes:
    message = reason.encode()[:MAX_VERDICT_MESSAGE]
    return VERDICT.pack(status if reason else 0, len(message)) + message
