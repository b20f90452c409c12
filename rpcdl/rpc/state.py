"""The state of one connection to a worker, as objects whose methods are its transitions.

Threading model: nothing here locks, and nothing here does I/O. Every object
is a field of one :class:`~rpcdl.rpc.connection.Connection`, which says who
may touch each: the lifecycle state is read and replaced under the
connection's lock (callers read it to refuse a call at once), and so are the
:class:`PendingCalls` (a thread making a call over a plain socket adds it
before it writes the frame; the loop takes it when its answer arrives).

* The lifecycle: a connection holds exactly one of :class:`Connecting`,
  :class:`Open`, :class:`Leaving` and :class:`Closed`, and only ever moves forward
  (CONNECTING -> OPEN [-> LEAVING] -> CLOSED, or straight to CLOSED). A leaving
  connection is open for the calls in flight (it is an :class:`Open`) and takes no new ones. A field that only one
  state has lives only in that state's object.
* :class:`PendingCalls`: the calls waiting for an answer, by id, and when the
  next of them may be overdue.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

from .calls import Call

if TYPE_CHECKING:
    from ..transport.frame_protocol import FrameProtocol
    from ..transport.shm import ClientSegment
    from ..transport.socket_stream import SocketStream
    from ..transport.wire import Frame


# ---------------------------------------------------------------------------- the lifecycle


class Connecting:
    """The loop dials the worker; the frames of calls made meanwhile wait here.

    Args:
        deadline: until when (``time.monotonic()``) the connection tries to open
            for its own sake; calls still pending keep it trying until their deadlines.
    """

    name = "connecting"

    __slots__ = ("deadline", "last_error", "queued", "task")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.queued: list[Frame] = []  #: the frames of calls made while connecting, in order
        self.last_error: BaseException | None = None  #: why the last attempt to connect failed
        self.task: asyncio.Task | None = None  #: the dial, on the loop (cancelled by a close)

    def attempt_failed(self, error: BaseException) -> None:
        """Note that an attempt to connect failed with ``error``."""
        self.last_error = error

    def wanted_until(self, latest_call_deadline: float) -> float:
        """Until when connecting is still wanted: its own deadline, or a pending call's."""
        return max(self.deadline, latest_call_deadline)


class Open:
    """Frames go to the transport and answers come from its protocol.

    Args:
        transport: the connection's stream over a plain socket (any thread writes it), or the loop's TLS
            transport.
        protocol: the frame receiver that reads it.
        segment: the worker's shared segment this process maps, or ``None``.
        compression: the compression mode the worker chose.
    """

    name = "open"

    __slots__ = ("compression", "protocol", "segment", "transport")

    def __init__(
        self,
        transport: asyncio.Transport | SocketStream,
        protocol: FrameProtocol,
        segment: ClientSegment | None,
        compression: str,
    ) -> None:
        self.transport = transport
        self.protocol = protocol
        self.segment = segment
        self.compression = compression


class Leaving(Open):
    """Open for the calls in flight, whose answers still come, but the worker said it is leaving: calls made
    now fail at once with :class:`~rpcdl.errors.WorkerLeaving` (see :mod:`rpcdl.rpc.leaving`).

    Args:
        opened: the open state it follows (its transport and protocol carry on).
        reason: why the worker leaves, as it said.
    """

    name = "leaving"

    __slots__ = ("reason",)

    def __init__(self, opened: Open, reason: str) -> None:
        super().__init__(opened.transport, opened.protocol, opened.segment, opened.compression)
        self.reason = reason


class Closed:
    """For good: every call pending then failed with ``error_type(reason)``, and so does every call made later.

    Args:
        reason: why it closed (the message of the calls' errors).
        error_type: the type of those errors.
    """

    name = "closed"

    __slots__ = ("error_type", "reason")

    def __init__(self, reason: str, error_type: type[Exception]) -> None:
        self.reason = reason
        self.error_type = error_type

    def error(self) -> Exception:
        """The error of a call that this closed connection fails."""
        return self.error_type(self.reason)


# ---------------------------------------------------------------------------- calls


class PendingCalls:
    """The calls in flight on a connection, by id, and the earliest time one may be overdue.

    So the loop's timer scans for overdue calls only then.

    Example::

        >>> calls = PendingCalls()
        >>> calls.check_at
        inf
    """

    def __init__(self) -> None:
        self._calls: dict[int, Call] = {}
        self._check_at = math.inf  # no call is overdue before then

    def __len__(self) -> int:
        return len(self._calls)

    def __contains__(self, call_id: int) -> bool:
        return call_id in self._calls

    @property
    def check_at(self) -> float:
        """No pending call is overdue before this time (``inf`` with none pending)."""
        return self._check_at

    def get(self, call_id: int) -> Call | None:
        """The pending call of that id, if any."""
        return self._calls.get(call_id)

    def latest_deadline(self) -> float:
        """The latest deadline of a pending call (``-inf`` with none pending)."""
        return max((call.deadline for call in self._calls.values()), default=-math.inf)

    def add(self, call: Call) -> None:
        """Add ``call``, and its deadline to :attr:`check_at` when it comes first."""
        self._calls[call.call_id] = call
        if call.deadline < self._check_at:
            self._check_at = call.deadline

    def pop(self, call_id: int) -> Call | None:
        """Remove and return the call of that id (answered), or ``None`` if it is not pending."""
        return self._calls.pop(call_id, None)

    def pop_overdue(self, now: float) -> list[Call]:
        """Remove and return the calls past their deadline at ``now``."""
        if now < self._check_at:
            return []
        overdue = [call for call in self._calls.values() if call.deadline <= now]
        for call in overdue:
            del self._calls[call.call_id]
        self._check_at = min((call.deadline for call in self._calls.values()), default=math.inf)
        return overdue

    def clear(self) -> list[Call]:
        """Remove and return every pending call (the connection closed)."""
        calls = list(self._calls.values())
        self._calls.clear()
        self._check_at = math.inf
        return calls
