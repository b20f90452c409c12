"""The state of one connection to a worker, as objects whose methods are its transitions.

Threading model: nothing here locks, and nothing here does I/O. Every object
is a field of one :class:`~rpcdl.rpc.connection.Connection`, and the
connection's lock guards every access to it (the connection calls these
methods only while holding it), so each object moves from one consistent
state to the next and is testable without sockets.

* The lifecycle: a connection holds exactly one of :class:`Connecting`,
  :class:`Open`, :class:`Leaving` and :class:`Closed`, and only ever moves forward
  (CONNECTING -> OPEN [-> LEAVING] -> CLOSED, or straight to CLOSED). A leaving
  connection is open for the calls in flight (it is an :class:`Open`) and takes no new ones. A field that only one
  state has lives only in that state's object.
* :class:`ReadingRole`: who reads the socket now (one thread at a time).
* :class:`PendingCalls`: the calls waiting for an answer, and who reads each.
* :class:`Alarm`: when the connection's own thread, asleep, looks again.
"""

from __future__ import annotations

import enum
import math
import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..transport.wire import Frame
from .calls import Call, ReadBy

if TYPE_CHECKING:
    from ..transport.shm import ClientSegment
    from .reading import Receiver
    from .sending import Sending


# ---------------------------------------------------------------------------- the lifecycle


class Connecting:
    """Its thread dials the worker; the frames of calls made meanwhile wait here.

    Args:
        deadline: until when (``time.monotonic()``) the connection tries to open
            for its own sake; calls still pending keep it trying until their deadlines.
    """

    name = "connecting"

    __slots__ = ("deadline", "last_error", "queued")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.queued: list[Frame] = []  #: the frames of calls made while connecting, in order
        self.last_error: BaseException | None = None  #: why the last attempt to connect failed

    def attempt_failed(self, error: BaseException) -> None:
        """Note that an attempt to connect failed with ``error``."""
        self.last_error = error

    def wanted_until(self, latest_call_deadline: float) -> float:
        """Until when connecting is still wanted: its own deadline, or a pending call's."""
        return max(self.deadline, latest_call_deadline)


class Open:
    """Frames go to the socket and answers are read from it.

    Args:
        sock: the connected socket (or TLS stream): the holder of the reading
            role reads it, any thread writes it through ``sending``.
        receiver: what reads frames, for the holder of the reading role.
        sending: what sends frames, for any thread.
        segment: the worker's shared segment this process maps, or ``None``.
        compression: the compression mode the worker chose.
    """

    name = "open"

    __slots__ = ("compression", "receiver", "segment", "sending", "sock")

    def __init__(
        self,
        sock: socket.socket,
        receiver: Receiver,
        sending: Sending,
        segment: ClientSegment | None,
        compression: str,
    ) -> None:
        self.sock = sock
        self.receiver = receiver
        self.sending = sending
        self.segment = segment
        self.compression = compression


class Leaving(Open):
    """Open for the calls in flight, whose answers still come, but the worker said it is leaving: calls made
    now fail at once with :class:`~rpcdl.errors.WorkerLeaving` (see :mod:`rpcdl.rpc.leaving`).

    Args:
        opened: the open state it follows (its socket, reader and sender carry on).
        reason: why the worker leaves, as it said.
    """

    name = "leaving"

    __slots__ = ("reason",)

    def __init__(self, opened: Open, reason: str) -> None:
        super().__init__(opened.sock, opened.receiver, opened.sending, opened.segment, opened.compression)
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


# ---------------------------------------------------------------------------- reading


class Reader(enum.Enum):
    """Who holds a connection's reading role: at most one thread reads its socket at a time."""

    NOBODY = "nobody"
    CALLER = "caller"  #: a thread waiting for a call's answer, or in read_answers
    BACKGROUND = "background"  #: the connection's own thread


class ReadingRole:
    """Who reads the socket now, how many callers wait to, and when the connection's thread may read.

    Callers come first: a thread waiting for an answer reads every frame that
    arrives, background answers included, so while one reads or waits, the
    connection's thread does not compete with it for the role (nor for the
    GIL). It takes the role only once no caller has been here for
    ``background_delay`` seconds (:meth:`background_turn`): a caller that reads
    answer after answer gives the role back between two, and comes back within
    microseconds.

    Args:
        background_delay: seconds after the last caller left before the
            connection's thread may read.

    Example::

        >>> role = ReadingRole(background_delay=0.001)
        >>> role.take(Reader.CALLER), role.take(Reader.BACKGROUND)
        (True, False)
        >>> role.give_back(now=5.0)
        >>> role.background_turn()
        5.001
    """

    __slots__ = ("_caller_left_at", "_delay", "_waiters", "holder")

    def __init__(self, background_delay: float = 0.001) -> None:
        self.holder = Reader.NOBODY  #: who reads now
        self._waiters = 0
        self._caller_left_at = -math.inf
        self._delay = background_delay

    @property
    def free(self) -> bool:
        """Whether nobody reads."""
        return self.holder is Reader.NOBODY

    @property
    def waiters(self) -> int:
        """Callers blocked until the role is free or their call is answered (woken when it is given back)."""
        return self._waiters

    def take(self, reader: Reader) -> bool:
        """Take the role for ``reader`` if nobody holds it; return whether it did."""
        if self.holder is not Reader.NOBODY:
            return False
        self.holder = reader
        return True

    def give_back(self, now: float) -> None:
        """Free the role at ``now`` (its holder read what it came for)."""
        if self.holder is Reader.CALLER:
            self._caller_left_at = now
        self.holder = Reader.NOBODY

    def begin_waiting(self) -> None:
        """A caller blocks until the role is free or its call is answered."""
        self._waiters += 1

    def end_waiting(self, now: float) -> None:
        """A caller stops waiting at ``now`` (it takes the role next, or goes)."""
        self._waiters -= 1
        self._caller_left_at = now

    def background_turn(self) -> float:
        """From when the connection's thread may take the role: ``inf`` while a caller reads or waits to."""
        if self.holder is Reader.CALLER or self._waiters > 0:
            return math.inf
        return self._caller_left_at + self._delay


class PendingCalls:
    """The calls in flight on a connection, by id, and who reads each answer.

    It knows by itself how many answers are for the connection's thread
    (:attr:`background`), when a caller last came to read the answers left to it,
    and the earliest time a call may be overdue, so the connection's thread
    scans for overdue calls only then.

    Args:
        patience: seconds answers left to their caller (:attr:`ReadBy.CALLER`)
            may stay unread before the connection's thread reads them
            (:meth:`adopt_unread`), so a worker never blocks sending them.
    """

    def __init__(self, patience: float) -> None:
        self._calls: dict[int, Call] = {}
        self._patience = patience
        self._background = 0
        self._callers = 0
        self._caller_came_at = 0.0
        self._check_at = math.inf  # no call is overdue before then
        self.answers_are_large = False  #: whether the last answer was large: new calls go to the background

    def __len__(self) -> int:
        return len(self._calls)

    def __contains__(self, call_id: int) -> bool:
        return call_id in self._calls

    @property
    def background(self) -> int:
        """How many pending answers the connection's thread reads."""
        return self._background

    @property
    def left_to_callers(self) -> int:
        """How many pending answers their callers read (made under ``answers_read_here``)."""
        return self._callers

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

    def add(self, call: Call, now: float) -> None:
        """Add ``call``; the answers of a connection whose last answer was large go to its thread."""
        if call.read_by is ReadBy.CALLER:
            if self.answers_are_large:
                call.read_by = ReadBy.BACKGROUND  # large answers arrive faster read in parallel, one thread each
            else:
                self._caller_came_at = now  # its caller is here, and will read
        self._calls[call.call_id] = call
        self._count(call, 1)
        if call.deadline < self._check_at:
            self._check_at = call.deadline

    def pop(self, call_id: int) -> Call | None:
        """Remove and return the call of that id (answered), or ``None`` if it is not pending."""
        call = self._calls.pop(call_id, None)
        if call is not None:
            self._count(call, -1)
        return call

    def caller_came(self, now: float) -> None:
        """A caller came to read the answers left to it."""
        self._caller_came_at = now

    def left_to_caller(self, calls: Iterable[Call]) -> bool:
        """Whether any of ``calls`` is pending with its answer left to its caller."""
        return any(call.read_by is ReadBy.CALLER and call.call_id in self._calls for call in calls)

    def adopt(self, calls: Iterable[Call]) -> int:
        """Give the answers of ``calls`` left to their caller to the connection's thread; return how many."""
        adopted = 0
        for call in calls:
            if call.read_by is ReadBy.CALLER and call.call_id in self._calls:
                self._count(call, -1)
                call.read_by = ReadBy.BACKGROUND
                self._count(call, 1)
                adopted += 1
        return adopted

    def adopt_unread(self, now: float) -> int:
        """Adopt every answer left to a caller who has not come to read for ``patience`` seconds."""
        if self._callers and now - self._caller_came_at > self._patience:
            return self.adopt(list(self._calls.values()))
        return 0

    def pop_overdue(self, now: float) -> list[Call]:
        """Remove and return the calls past their deadline at ``now``."""
        if now < self._check_at:
            return []
        overdue = [call for call in self._calls.values() if call.deadline <= now]
        for call in overdue:
            self.pop(call.call_id)
        self._check_at = min((call.deadline for call in self._calls.values()), default=math.inf)
        return overdue

    def clear(self) -> list[Call]:
        """Remove and return every pending call (the connection closed)."""
        calls = list(self._calls.values())
        self._calls.clear()
        self._background = self._callers = 0
        self._check_at = math.inf
        return calls

    def _count(self, call: Call, delta: int) -> None:
        if call.read_by is ReadBy.BACKGROUND:
            self._background += delta
        elif call.read_by is ReadBy.CALLER:
            self._callers += delta


# ---------------------------------------------------------------------------- the connection's thread


class Alarm:
    """When the connection's own thread, asleep, looks again; whether another thread must wake it sooner.

    The thread looks at everything due before it sleeps again, so a thread
    that makes something due while it is awake need not wake it.

    Example::

        >>> alarm = Alarm()
        >>> alarm.wake_by(1.0)  # awake: it will see
        False
        >>> alarm.sleep_until(10.0)
        >>> alarm.wake_by(20.0), alarm.wake_by(5.0), alarm.wake_by(4.0)
        (False, True, False)
    """

    __slots__ = ("_asleep", "_until")

    def __init__(self) -> None:
        self._asleep = False
        self._until = math.inf

    @property
    def asleep(self) -> bool:
        """Whether the thread sleeps (it may have to be woken)."""
        return self._asleep

    def sleep_until(self, until: float) -> None:
        """The thread goes to sleep until ``until`` (or until woken)."""
        self._asleep, self._until = True, until

    def woke(self) -> None:
        """The thread is awake again."""
        self._asleep = False

    def wake_by(self, when: float) -> bool:
        """Whether the thread must be woken now to look again by ``when``; it counts as awake from then on."""
        if self._asleep and self._until > when:
            self._asleep = False
            return True
        return False
