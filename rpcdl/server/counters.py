"""A worker's counters, as :meth:`rpcdl.server.worker.Worker.stats` reports them.

Threading: what changes on every frame and every call (bytes in and out, calls
received, answered, served and failed, busy time) each thread counts in its
own :class:`Tally`, which no other thread writes, so counting takes no lock. A
reader sums the tallies under the lock, which also guards the list of tallies
and the rarer counters (:meth:`Counters.add`). A thread that stops counting
folds its tally into the counters of threads gone (:meth:`Counters.retire`).
"""

from __future__ import annotations

import threading
from typing import Any

_SUMMED = ("calls_answered", "calls_received", "calls_served", "calls_failed", "bytes_in", "bytes_out", "busy_seconds")


class Tally:
    """What one thread counted: written by that thread only."""

    __slots__ = _SUMMED

    def __init__(self) -> None:
        self.calls_answered = 0
        self.calls_received = 0
        self.calls_served = 0
        self.calls_failed = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.busy_seconds = 0.0

    def fold(self, other: Tally) -> None:
        """Add ``other``'s counts to this one's."""
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class Counters:
    """A worker's counters (see the module for who changes them)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._own = threading.local()
        self._tallies: list[Tally] = []  # of the threads counting now
        self._gone = Tally()  # of the threads retired
        self.calls_rejected = 0
        self.clients = 0
        self.connections_total = 0
        self.connections_refused = 0

    def _new_tally(self) -> Tally:
        """This thread's tally, made now (this thread counts for the first time)."""
        tally = self._own.tally = Tally()
        with self.lock:
            self._tallies.append(tally)
        return tally

    def add(self, **deltas: float) -> None:
        """Add each of ``deltas`` to the (rare) counter of that name."""
        with self.lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def received(self, bytes_in: int, call: bool) -> None:
        """A frame of ``bytes_in`` bytes arrived; a call among them is outstanding until answered."""
        tally = getattr(self._own, "tally", None) or self._new_tally()
        tally.bytes_in += bytes_in
        tally.calls_received += call

    def ran(self, seconds: float, failed: bool) -> None:
        """A call ran for ``seconds``, and raised if it ``failed``."""
        tally = getattr(self._own, "tally", None) or self._new_tally()
        tally.busy_seconds += seconds
        if failed:
            tally.calls_failed += 1
        else:
            tally.calls_served += 1

    def sent(self, bytes_out: int, answers: int) -> None:
        """``bytes_out`` bytes went out, answering ``answers`` calls."""
        tally = getattr(self._own, "tally", None) or self._new_tally()
        tally.bytes_out += bytes_out
        tally.calls_answered += answers

    def retire(self) -> None:
        """Fold this thread's tally into the counters of threads gone (call it last, as the thread ends)."""
        tally = getattr(self._own, "tally", None)
        if tally is None:
            return
        with self.lock:
            self._tallies.remove(tally)
            self._gone.fold(tally)
        del self._own.tally

    @property
    def outstanding(self) -> int:
        """Calls received and not answered yet."""
        return self.totals()["outstanding"]

    def totals(self) -> dict[str, Any]:
        """Every counter, the tallies summed; ``outstanding``: calls received and not answered yet."""
        with self.lock:
            tallies = [self._gone, *self._tallies]
            # answers first: each call answered by then was received before, so outstanding is never negative
            answered = sum(tally.calls_answered for tally in tallies)
            sums = {name: sum(getattr(tally, name) for tally in tallies) for name in _SUMMED[1:]}
            return {
                **sums,
                "outstanding": sums["calls_received"] - answered,
                "calls_rejected": self.calls_rejected,
                "clients": self.clients,
                "connections_total": self.connections_total,
                "connections_refused": self.connections_refused,
            }
