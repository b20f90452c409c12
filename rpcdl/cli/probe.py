"""Asking workers for their counters without torch: the client side of ``rpcdl status``.

One connection per question, on this process's event loop
(:mod:`rpcdl.transport.event_loop`), through the pieces a trainer's connection
uses: the connect and the handshake of :mod:`rpcdl.transport.handshake_client`
(as an *observer*, so the worker does not count it among its clients), then
one ``STATS`` frame, whose ``STATS_REPLY`` the loop receives with
:class:`~rpcdl.transport.frame_protocol.FrameProtocol`. Only the transport
layer is used (no pickle, no torch), so ``rpcdl status`` starts in a fraction
of a second; nothing here retries: a refused port is reported at once, as a
status probe should.

Threading model: the questions run as coroutines on the loop's thread
(``rpcdl-loop``), all at once, so asking many workers takes no thread per
worker; the thread that calls :func:`ask_many` (or :func:`ask_stats`) only
waits for their answers and never reads a socket. An :class:`_AnswerSink` and
its connection are the loop's alone.
"""

from __future__ import annotations

import asyncio
import enum
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..address import parse_address
from ..errors import AuthenticationError, ConnectionLost, ProtocolError
from ..transport.control import decode_stats
from ..transport.event_loop import run_coroutine
from ..transport.frame_protocol import FrameProtocol
from ..transport.handshake_client import attach, connect_socket, negotiate
from ..transport.security import Token
from ..transport.wire import Frame, Kind, Limits, encode_frame

_STATS_CALL_ID = 1
_STEPS = 3  # the connect, the handshake and the answer each get the timeout


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
        timeout: seconds for the connect, and again for the handshake and for the answer.

    Returns:
        an :class:`Answer`: the counters, or how the worker could not be asked.

    Example::

        >>> ask_stats("127.0.0.1:1", None, timeout=1.0).reach  # doctest: +SKIP
        <Reach.REFUSED: 'refused'>
    """
    (answer,) = ask_many([address], token, ssl_context, timeout)
    return answer


def ask_many(
    addresses: Sequence[str], token: Token | None, ssl_context: ssl.SSLContext | None = None, timeout: float = 5.0
) -> list[Answer]:
    """Ask every worker in ``addresses`` for its counters at once, on the event loop (no thread per worker).

    Args:
        addresses: ``"host:port"`` of each worker.
        token: the shared secret, or ``None``.
        ssl_context: a client TLS context, or ``None`` for plain TCP.
        timeout: seconds each worker gets for the connect, and again for the handshake and for the answer.

    Returns:
        one :class:`Answer` per address, in the order given; one silent worker costs its timeout once.

    Raises:
        ValueError: ``timeout`` is not a positive number of seconds, or an address is not ``"host:port"``.

    Example::

        >>> [a.reach.value for a in ask_many(["127.0.0.1:1", "127.0.0.1:2"], None, timeout=1.0)]  # doctest: +SKIP
        ['refused', 'refused']
    """
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not addresses:
        return []
    places = [(address, *parse_address(address)) for address in addresses]  # a malformed one raises here

    async def ask_all() -> list[Answer]:
        return list(await asyncio.gather(*(_ask(*place, token, ssl_context, timeout) for place in places)))

    # each question bounds its own steps; this bound only guards against a loop that stopped turning
    return run_coroutine(ask_all(), timeout=_STEPS * timeout + 10.0)


class _AnswerSink:
    """The frame sink of a probe's connection: the first frame, or how the stream ended, settles ``answer``."""

    def __init__(self, answer: asyncio.Future[Frame]) -> None:
        self.answer = answer

    def frame_received(self, frame: Frame) -> None:
        if not self.answer.done():
            self.answer.set_result(frame)

    def receiving_failed(self, error: Exception) -> None:
        if not self.answer.done():
            self.answer.set_exception(error)

    def stream_ended(self, error: Exception | None) -> None:
        if not self.answer.done():
            self.answer.set_exception(error or ConnectionLost("the worker closed the connection before answering"))


async def _ask(
    address: str, host: str, port: int, token: Token | None, ssl_context: ssl.SSLContext | None, timeout: float
) -> Answer:
    """One worker's answer (on the loop): its counters, or how it could not be asked."""
    loop = asyncio.get_running_loop()
    transport: Any = None
    try:
        sock = await connect_socket(host, port, timeout)
        transport, reader = await attach(sock, ssl_context, host, timeout)
        await negotiate(
            transport,
            reader,
            token,
            address,
            deadline=loop.time() + timeout,
            answer_timeout=timeout,
            compression="off",
            observer=True,
        )
        answered: asyncio.Future[Frame] = loop.create_future()
        protocol = FrameProtocol(_AnswerSink(answered), Limits(), leftover=reader.leftover())
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        transport.write(b"".join(encode_frame(Frame(Kind.STATS, _STATS_CALL_ID))))
        frame = await asyncio.wait_for(answered, timeout)
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
        if transport is not None:
            transport.abort()
