"""Opening a connection to a worker: waiting a while for one not yet there, and naming what else answers.

Threading model: :func:`dial_on_loop` runs on this process's event loop
(``rpcdl-loop``) as a coroutine of the connection it opens, so dialing any
number of workers blocks no thread; the callers wait for their calls
meanwhile, each up to its own timeout. The state shared by the dials is all
guarded by ``_lock``: two sets of addresses, the workers already warned about,
``_warned``, and those that completed a handshake with this process,
``_served``; and one mapping, ``_refusing``: why each worker refused its
latest connection, until it accepts one.

What happens to each kind of failure:

* **A host name that does not resolve** (no such name): raises
  :class:`~rpcdl.errors.UnknownHost` at once, saying so: a call to that one
  worker waits for nothing. It may be a typo, or the name of a worker not made
  yet (a Pending pod has no DNS record): a dataset that waits for its workers
  at start, and a loader reviving a worker, retry it like a refusal (see
  :mod:`rpcdl.data.dataset`). (A name the resolver cannot answer for now,
  ``EAI_AGAIN``, is retried as a refusal.)
* **Refused** (connection refused, no route to the host, a name the resolver
  cannot answer for now): a worker this process never reached may simply not be
  started yet, so the attempt is retried for a grace period,
  ``RPCDL_CONNECT_GRACE`` seconds (default :data:`DEFAULT_CONNECT_GRACE`). A
  worker that served this process before (:func:`served_before`), or said it
  was leaving (:func:`~rpcdl.rpc.leaving.is_leaving`), and now refuses has
  stopped or died: it gets no grace, so its calls fail at once and the data
  layer routes them elsewhere and probes it until it is back.
  After :data:`WARN_AFTER` seconds of waiting, a warning on
  the ``rpcdl.rpc.client`` logger says which worker is awaited and why (it reaches
  stderr even when the program configured no logging; once per worker until it
  accepts a connection, so revival probes repeat nothing); it names no
  deadline, since the caller may wait longer than one connection's grace (a
  dataset at start waits up to ``RPCDL_START_TIMEOUT``, trying again). When
  the grace is over, :class:`~rpcdl.errors.WorkerUnavailable` names the
  address, the grace, how to raise it and the last error. Why a worker refused
  its latest connection is kept until it accepts one (:func:`refusing`), so
  that a wait for many workers can name those that do not answer.
* **Not an rpcdl worker**: a peer that answers the hello with other bytes (an
  HTTP server, a TLS server), that says nothing for :data:`HELLO_ANSWER_TIMEOUT`
  seconds, or that closes the connection after the hello three times in a
  row (an rpcdataloader worker) raises :class:`~rpcdl.errors.ProtocolError`:
  it is never retried. So does a TLS handshake that fails (or is cut three
  times in a row: a worker without TLS) and another protocol version; a token
  mismatch or a certificate that fails verification raises
  :class:`~rpcdl.errors.AuthenticationError`.
* **Full**: a worker that holds as many connections in their handshake as it
  admits (a flood, say) refuses new ones with a refusal of its own, or a TLS
  ``user_canceled`` alert (see :mod:`rpcdl.transport.handshake`):
  :class:`~rpcdl.errors.WorkerFull` says so, once on the logger,
  and the attempt is retried like a reset.
* **Full of clients**: a worker that serves as many sessions as it takes
  (``max_sessions``) says so in the handshake's verdict:
  :class:`~rpcdl.errors.SessionsFull` is raised at once, not retried here
  (sessions last): the data layer sends its calls to other workers and probes
  this one later.
* Anything else (a reset, a connect timeout) is retried until the calls
  waiting for the connection time out. Once connected, calls keep their full
  timeout: :data:`HELLO_ANSWER_TIMEOUT` bounds the handshake only.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable

from .._lifecycle import in_forked_child
from ..checks import environment_number
from ..errors import (
    AuthenticationError,
    HelloUnanswered,
    ProtocolError,
    SessionsFull,
    UnknownHost,
    WorkerFull,
    WorkerUnavailable,
)
from ..open_files import raise_open_file_limit
from ..transport.handshake import Agreement, tls_refusal
from ..transport.handshake_client import HandshakeReader, attach, connect_socket, negotiate
from ..transport.security import Token
from .leaving import is_leaving

log = logging.getLogger("rpcdl.client")

CONNECT_GRACE_ENV = "RPCDL_CONNECT_GRACE"
#: Seconds a worker may refuse connections before calls to it fail (``RPCDL_CONNECT_GRACE`` overrides).
DEFAULT_CONNECT_GRACE = 20.0
#: Seconds of refused connections after which a warning says which worker is awaited.
WARN_AFTER = 3.0
#: Seconds a peer may take to start answering the hello; rpcdl workers answer at once.
HELLO_ANSWER_TIMEOUT = 5.0
_MAX_UNANSWERED = 3
_MAX_RETRY_DELAY = 1.0
_lock = threading.Lock()
_warned: set[str] = set()  # addresses awaited with a warning since they last accepted (revival probes repeat)
_served: set[str] = set()  # addresses that completed a handshake with this process (and its parent, if forked)
_refusing: dict[str, str] = {}  # why each address refused its latest connection, until it accepts one
_NO_SUCH_NAME = {getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, name)}
_REFUSALS = (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN)


def connect_grace() -> float:
    """Seconds to keep retrying a worker that refuses connections: ``RPCDL_CONNECT_GRACE``, else 20.

    Raises:
        ValueError: ``RPCDL_CONNECT_GRACE`` is not a number of seconds >= 0.
    """
    return environment_number(
        CONNECT_GRACE_ENV,
        DEFAULT_CONNECT_GRACE,
        float,
        "a number of seconds >= 0 (how long to wait for a worker that refuses connections)",
        lambda grace: grace >= 0,
    )


def served_before(address: str) -> bool:
    """Whether a worker at ``address`` completed a handshake with this process (or with its parent, before a fork).

    Such a worker that refuses connections later has stopped or died: it is not
    waited for as one not started yet.

    Args:
        address: the worker, ``"host:port"`` as calls name it.

    Returns:
        ``True`` once a connection to ``address`` completed its handshake.

    Example::

        >>> served_before("127.0.0.1:1")
        False
    """
    with _lock:
        return address in _served


def refusing(address: str) -> str | None:
    """Why the worker at ``address`` refused this process's latest attempt to connect, or ``None``.

    A worker that accepts a connection is forgotten here. A wait that covers
    many workers (a dataset's start) names with it the workers that do not
    answer yet, while their connections are still retried.

    Args:
        address: the worker, ``"host:port"`` as calls name it.

    Returns:
        A few words (``"connection refused"``, ``"its host name does not
        resolve (...)"``), or ``None`` when its latest attempt was not refused.

    Example::

        >>> refusing("127.0.0.1:1") is None  # never dialled
        True
    """
    with _lock:
        return _refusing.get(address)


def refusal(exc: BaseException) -> str | None:
    """Why ``exc`` means the worker is not there (yet), or ``None`` if it means something else."""
    if isinstance(exc, socket.gaierror):
        return f"its host name does not resolve ({exc.strerror or exc})"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, OSError) and exc.errno in _REFUSALS:
        return os.strerror(exc.errno).lower()
    return None


async def dial_on_loop(
    address: str,
    host: str,
    port: int,
    token: Token | None,
    ssl_context: ssl.SSLContext | None,
    *,
    handshake_timeout: float,
    grace: float,
    failed: Callable[[OSError], float],
    compression: str | None = None,
    shared_memory: bool = False,
) -> tuple[asyncio.Transport, HandshakeReader, Agreement]:
    """Connect to the worker at ``address`` and run the handshake, retrying as the module docstring says; a
    coroutine on the event loop, so no thread is blocked meanwhile.

    Args:
        address: ``"host:port"``, for messages.
        host: the host to connect to.
        port: its port.
        token: the shared secret, or ``None``.
        ssl_context: TLS context, or ``None`` for plain TCP (TLS through asyncio).
        handshake_timeout: seconds the connect, the TLS handshake and rpcdl's handshake may take.
        grace: seconds to keep retrying a worker never reached that refuses connections.
        failed: called with the error of each failed attempt; returns the
            time (``time.monotonic()``) until which retrying is still wanted,
            or raises to stop. Cancelling the coroutine stops the retries too.
        compression: the compression mode to ask for.
        shared_memory: offer to take answers through shared memory.

    Returns:
        the transport (handshake done), its handshake reader (the bytes that came after it) and what the
        handshake settled.

    Raises:
        WorkerUnavailable: refused for ``grace`` seconds, or unreachable until
            the time ``failed`` allows.
        ProtocolError: the peer is not an rpcdl worker, or speaks another version.
        AuthenticationError: the tokens differ, or the TLS certificate fails verification.
        UnknownHost: the host name does not resolve.
        SessionsFull: the worker serves as many clients as it takes.

    Example::

        >>> transport, reader, agreed = await dial_on_loop(  # doctest: +SKIP
        ...     "127.0.0.1:6543", "127.0.0.1", 6543, None, None, handshake_timeout=10, grace=20, failed=lambda e: 0)
    """
    raise_open_file_limit()
    loop = asyncio.get_running_loop()
    attempts = _Attempts(address, grace, failed)
    while True:
        transport = None
        in_tls_handshake = False
        try:
            sock = await connect_socket(host, port, handshake_timeout)
            in_tls_handshake = ssl_context is not None
            transport, reader = await attach(sock, ssl_context, host, handshake_timeout)
            in_tls_handshake = False
            answer_timeout = min(HELLO_ANSWER_TIMEOUT, handshake_timeout)
            agreed = await negotiate(
                transport,
                reader,
                token,
                address,
                deadline=loop.time() + handshake_timeout,
                answer_timeout=answer_timeout,
                compression=compression,
                shared_memory=shared_memory,
            )
            _accepted(address)
            return transport, reader, agreed
        except ssl.SSLCertVerificationError as exc:
            raise _verification_failed(address, exc) from None
        except (AuthenticationError, ProtocolError, SessionsFull):
            _abort_quietly(transport)
            raise
        except OSError as exc:
            _abort_quietly(transport)
            await asyncio.sleep(attempts.failed(exc, in_tls_handshake))
        except BaseException:
            _abort_quietly(transport)
            raise


class _Attempts:
    """The failed attempts of one dial: each judged as the module docstring says.

    Args:
        address: the worker, for messages.
        grace: seconds a worker never reached may refuse connections.
        failed: the dial's ``failed`` callback.
    """

    def __init__(self, address: str, grace: float, failed: Callable[[OSError], float]) -> None:
        self._address = address
        self._grace = grace
        self._failed = failed
        self._started = time.monotonic()
        self._delay = 0.02
        self._unanswered = 0

    def failed(self, exc: OSError, in_tls_handshake: bool) -> float:
        """An attempt failed with ``exc`` (during the TLS handshake, if ``in_tls_handshake``): return the seconds
        to pause before the next, or raise what the dial raises."""
        address, grace, started = self._address, self._grace, self._started
        refused = tls_refusal(exc, address) if in_tls_handshake else None
        error = refused or exc
        in_tls_handshake = in_tls_handshake and refused is None  # a refusal is no failed TLS handshake
        if isinstance(error, WorkerFull) and _first_warning(address):
            log.warning("%s", error)
        closed_early = isinstance(error, HelloUnanswered) or (
            in_tls_handshake
            and isinstance(
                error, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionResetError, ConnectionAbortedError)
            )
        )
        if in_tls_handshake and isinstance(error, ssl.SSLError) and not closed_early:
            raise ProtocolError(
                f"{address} did not complete a TLS handshake ({error.reason or error}): it is not an rpcdl "
                "worker with TLS; if it runs without TLS, unset RPCDL_TLS_CA (or pass no ssl_context)"
            )
        self._unanswered = unanswered = self._unanswered + 1 if closed_early else 0
        if unanswered >= _MAX_UNANSWERED:
            if in_tls_handshake:
                raise ProtocolError(
                    f"{address} is not an rpcdl worker with TLS (it closed the connection during the TLS "
                    f"handshake, {unanswered} times in a row; an rpcdl worker without TLS does that): if it runs "
                    "without TLS, unset RPCDL_TLS_CA (or pass no ssl_context)"
                )
            raise ProtocolError(
                f"{address} is not an rpcdl worker (it closed the connection after rpcdl's hello without "
                f"answering, {unanswered} times in a row: an rpcdataloader worker does that, and an rpcdl worker "
                "with TLS when the client has none (then set RPCDL_TLS_CA))"
            )
        why = refusal(error)
        if why is not None:
            with _lock:
                _refusing[address] = why
        if isinstance(error, socket.gaierror) and error.errno in _NO_SUCH_NAME:
            raise UnknownHost(
                f"the host name of rpcdl worker {address} does not resolve ({error.strerror or error}): check "
                "the name (a Kubernetes Service's workers: dns://SERVICE:PORT waits until its name resolves)"
            ) from None
        deadline = self._failed(error)
        now = time.monotonic()
        said = _why_not_awaited(address) if why is not None else None
        if said is not None:
            raise WorkerUnavailable(
                f"rpcdl worker {address} is not reachable: {why}; it {said}, so it is not awaited as a worker "
                f"not started yet: it stopped or died (last error: {error})"
            )
        if why is not None and now - started >= grace:
            raise WorkerUnavailable(
                f"rpcdl worker {address} is not reachable: {why} for {grace:g}s, the grace for workers that "
                f"start after their trainer; set {CONNECT_GRACE_ENV} to a number of seconds to wait longer "
                f"(last error: {error})"
            )
        if why is not None and now - started >= WARN_AFTER and _first_warning(address):
            log.warning("waiting for rpcdl worker %s: %s (for %.0fs)", address, why, now - started)
        delay = self._delay
        if now + delay > deadline:
            raise WorkerUnavailable(
                f"could not connect to rpcdl worker {address} within the timeout of its calls "
                f"({max(0.0, deadline - started):.0f}s): {error}"
            ) from None
        self._delay = min(delay * 2, _MAX_RETRY_DELAY)
        return max(0.0, min(delay, started + grace - now)) if why is not None else delay


def _accepted(address: str) -> None:
    """A connection to ``address`` completed its handshake."""
    with _lock:
        _warned.discard(address)
        _refusing.pop(address, None)
        _served.add(address)


def _verification_failed(address: str, exc: ssl.SSLCertVerificationError) -> AuthenticationError:
    return AuthenticationError(f"TLS: the certificate of worker {address} failed verification: {exc.verify_message}")


def _abort_quietly(transport: asyncio.BaseTransport | None) -> None:
    if transport is not None:
        transport.abort()


def _why_not_awaited(address: str) -> str | None:
    """What the worker at ``address`` did that says it stopped or died when it refuses, or ``None`` if it may
    not be started yet."""
    if is_leaving(address):
        return "said it was leaving"
    if served_before(address):
        return "served this process before"
    return None


def _first_warning(address: str) -> bool:
    """Whether ``address`` was not warned about since it last accepted; it is from now on."""
    with _lock:
        first = address not in _warned
        _warned.add(address)
    return first


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork


in_forked_child(_after_fork_in_child)
