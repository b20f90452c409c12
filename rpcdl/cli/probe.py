"""Asking a worker for its counters without torch: the client side of ``rpcdl status``.

One connection per question: a TCP connect, the handshake (as an *observer*,
so the worker does not count it among its clients), one ``STATS`` frame and its
``STATS_REPLY``. Only the transport layer is used (no pickle, no torch), so
``rpcdl status`` starts in a fraction of a second; nothing here retries: a
refused port is reported at once, as a status probe should.
"""

from __future__ import annotations

import enum
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

from ..address import parse_address
from ..errors import AuthenticationError, ConnectionLost, ProtocolError
from ..transport.control import decode_stats
from ..transport.handshake import client_negotiate
from ..transport.security import Token
from ..transport.wire import Frame, FrameReader, Kind, Limits, io_stream, send_frame

_STATS_CALL_ID = 1


class Reach(enum.Enum):
    """How a worker answered ``rpcdl status``."""

    UP = "up"  #: it answered its counters
    REFUSED = "refused"  #: nothing listens on that port (or the host is down)
    TOKEN = "token mismatch"  #: the tokens differ, or only one side has one
    NOT_RPCDL = "not rpcdl"  #: something else answers there
    TIMEOUT = "timeout"  #: no answer within the timeout
    UNREACHABLE = "unreachable"  #: any other failure (the reason says which)


@dataclass
class Answer:
    """What one worker said: how it was reached, its counters, or why not.

    Attributes:
        address: the worker's ``"host:port"``.
        reach: how it answered.
        counters: its counters (see :func:`rpcdl.stats`) when ``reach`` is ``UP``, else empty.
        reason: why it could not be asked, when ``reach`` is not ``UP``.
        at: ``time.monotonic()`` when the answer came.
    """

    address: str
    reach: Reach
    counters: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    at: float = 0.0


def ask_stats(
    address: str, token: Token | None, ssl_context: ssl.SSLContext | None = None, timeout: float = 5.0
) -> Answer:
    """Ask the worker at ``address`` for its counters, as an observer; never raises for the worker's sake.

    Args:
        address: ``"host:port"``.
        token: the shared secret, or ``None``.
        ssl_context: a client TLS context, or ``None`` for plain TCP.
        timeout: seconds for the connect, and again for each read of the handshake and the answer.

    Returns:
        an :class:`Answer`: the counters, or how the worker could not be asked.

    Example::

        >>> ask_stats("127.0.0.1:1", None, timeout=1.0).reach  # doctest: +SKIP
        <Reach.REFUSED: 'refused'>
    """
    host, port = parse_address(address)
    sock: Any = None
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
        if ssl_context is not None:
            sock = ssl_context.wrap_socket(sock, server_hostname=host)
        client_negotiate(sock, token, address, timeout, compression="off", observer=True)
        sock = io_stream(sock, receive=timeout, send=timeout)
        send_frame(sock, Frame(Kind.STATS, _STATS_CALL_ID))
        frame = FrameReader(sock, Limits(), stall_timeout=timeout).read_frame()
        if frame is None:
            return Answer(address, Reach.TIMEOUT, reason=f"no answer within {timeout:g}s", at=time.monotonic())
        if frame.kind is not Kind.STATS_REPLY:
            raise ProtocolError(f"{address} answered a stats request with a {frame.kind.name} frame")
        return Answer(address, Reach.UP, counters=decode_stats(frame.payload), at=time.monotonic())
    except AuthenticationError as exc:
        return Answer(address, Reach.TOKEN, reason=str(exc), at=time.monotonic())
    except ProtocolError as exc:
        return Answer(address, Reach.NOT_RPCDL, reason=str(exc), at=time.monotonic())
    except ConnectionRefusedError:
        return Answer(address, Reach.REFUSED, reason="connection refused", at=time.monotonic())
    except TimeoutError:
        return Answer(address, Reach.TIMEOUT, reason=f"no answer within {timeout:g}s", at=time.monotonic())
    except (ConnectionLost, OSError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
        return Answer(address, Reach.UNREACHABLE, reason=reason, at=time.monotonic())
    finally:
        if sock is not None:
            sock.close()
