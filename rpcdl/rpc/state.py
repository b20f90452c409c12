"""The state of one connection to a worker, as objects whose methods are its transitions.

Threading model: nothing here locks. Every method is called by a
:class:`~rpcdl.rpc.connection.Connection` under its lock, so each object
changes from one consistent state to the next; there is no I/O here, which
keeps these transitions testable without sockets.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from .calls import Call, ReadBy


class ConnectionState(enum.Enum):
    """Where a connection is in its life: only ever forward, CONNECTING -> OPEN -> CLOSED (or straight to CLOSED)."""

    CONNECTING = "connecting"  #: its thread dials the worker; calls made meanwhile queue their frames
    OPEN = "open"  #: frames go to the socket; answers are read
    CLOSED = "closed"  #: for good; every call pending then failed


class Reader(enum.Enum):
    """Who holds a connection's reading role: at most one thread reads its socket at a time."""

    NOBODY = "nobody"
    CALLER = "caller"  #: a thread waiting for a call's answer, or in read_answers
    BACKGROUND = "background"  #: the connection's own thread


# read on every call: an enum member's lookup through its class costs ~0.05 us (3.11)
_NOBODY, _CALLER = Reader.NOBODY, Reader.CALLER


class ReadingRole:
    """Who reads the socket now, how many callers wait to, and when the connection's thread may read.

    Callers come first: a thread waiting for an answer reads every frame that
    arrives, background answers included, so while one reads or waits
    (:attr:`callers_present`), the connection's thread does not compete with it
    for the role (nor for the GIL). It takes the role only once no caller has
    been here for ``background_delay`` seconds (:meth:`background_turn`): a
    caller that reads answer after answer gives the role back between two, and
    comes back within microseconds.

    Args:
        background_delay: seconds after the last caller left before the
            connection's thread may read.
    """

    __slots__ = ("_caller_left_at", "_delay", "_waiters", "holder")

    def __init__(self, background_delay: float = 0.001) -> None:
        self.holder = _NOBODY  #: who reads now
        self._waiters = 0
        self._caller_left_at = float("-inf")
        self._delay = background_delay

    @property
    def free(self) -> bool:
        """Whether nobody reads."""
        return self.holder is _NOBODY

    @property
    def waiters(self) -> int:
        """Callers blocked until the role is free or their call is answered (woken when it is given back)."""
        return self._waiters

    @property
    def callers_present(self) -> bool:
        """Whether a caller reads or waits to."""
        return self.holder is _CALLER or self._waiters > 0

    def take(self, reader: Reader) -> bool:
        """Take the role for ``reader`` if nobody holds it; return whether it did."""
        if self.holder is not _NOBODY:
            return False
        self.holder = reader
        return True

    def give_back(self, now: float) -> None:
        """Free the role at ``now`` (its holder read what it came for)."""
        if self.holder is _CALLER:
            self._caller_left_at = now
        self.holder = _NOBODY

    def begin_waiting(self) -> None:
        """A caller blocks until the role is free or its call is answered."""
        self._waiters += 1

    def end_waiting(self, now: float) -> None:
        """A caller stops waiting at ``now`` (it takes the role next, or goes)."""
        self._waiters -= 1
        self._caller_left_at = now

    def background_turn(self) -> float:
        """From when the connection's thread may take the role: ``inf`` while a caller is present."""
        if self.holder is _CALLER or self._waiters > 0:
            return float("inf")
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
        self._check_at = float("inf")  # no call is overdue before then
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
        return max((call.deadline for call in self._calls.values()), default=float("-inf"))

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
            read_by = call.read_by
            if read_by is ReadBy.BACKGROUND:
                self._background -= 1
            elif read_by is ReadBy.CALLER:
                self._callers -= 1
        return call

    def caller_came(self, now: float) -> None:
        """A caller came to read the answers left to it."""
        self._caller_came_at = now

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
        self._check_at = min((call.deadline for call in self._calls.values()), default=float("inf"))
        return overdue

    def clear(self) -> list[Call]:
        """Remove and return every pending call (the connection closed)."""
        calls = list(self._calls.values())
        self._calls.clear()
        self._background = self._callers = 0
        self._check_at = float("inf")
        return calls

    def _count(self, call: Call, delta: int) -> None:
        if call.read_by is ReadBy.BACKGROUND:
            self._background += delta
        elif call.read_by is ReadBy.CALLER:
            self._callers += delta
