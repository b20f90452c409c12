"""A worker's counters, as :meth:`rpcdl.server.worker.Worker.stats` reports them.

Threading: one lock guards every counter, for every read and write. The
threads counting are the process loop reading frames (bytes in, calls
received), the threads running calls (busy time, calls served and failed,
batches made) and those sending (bytes out, calls answered); :meth:`Counters.totals`
reads them all at once under the lock, so a call is never seen answered and not received.

A thread running a call knows its worker's counters through a thread-local
(:func:`running_for`, set by :class:`rpcdl.server.call_runner.CallRunner`), so that
the data layer's batch functions count their batches (:func:`count_batches`)
without being handed the worker: each thread owns its own value.
"""

from __future__ import annotations

import threading
from typing import Any


class Counters:
    """A worker's counters (see the module for who changes them).

    Example::

        >>> counters = Counters()
        >>> counters.received(100, call=True)
        >>> counters.outstanding
        1
        >>> counters.sent(40, answers=1)
        >>> counters.totals()["outstanding"], counters.totals()["bytes_out"]
        (0, 40)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls_received = 0
        self._calls_answered = 0
        self._calls_served = 0
        self._calls_failed = 0
        self._bytes_in = 0
        self._bytes_out = 0
        self._busy_seconds = 0.0
        self._batches = 0
        self._rare = {"calls_rejected": 0, "connections_total": 0, "connections_refused": 0}

    def add(self, **deltas: int) -> None:
        """Add each of ``deltas`` to the (rare) counter of that name: ``calls_rejected``,
        ``connections_total`` or ``connections_refused``.

        Raises:
            KeyError: no such counter.
        """
        with self._lock:
            for name, delta in deltas.items():
                self._rare[name] += delta

    def received(self, bytes_in: int, call: bool) -> None:
        """A frame of ``bytes_in`` bytes arrived; a call among them is outstanding until answered."""
        with self._lock:
            self._bytes_in += bytes_in
            self._calls_received += call

    def ran(self, seconds: float, failed: bool) -> None:
        """A call ran for ``seconds``, and raised if it ``failed``."""
        with self._lock:
            self._busy_seconds += seconds
            if failed:
                self._calls_failed += 1
            else:
                self._calls_served += 1

    def made_batches(self, count: int) -> None:
        """A call made ``count`` batches (a loader's batch, or each batch of a chunk)."""
        with self._lock:
            self._batches += count

    def sent(self, bytes_out: int, answers: int) -> None:
        """``bytes_out`` bytes went out, answering ``answers`` calls."""
        with self._lock:
            self._bytes_out += bytes_out
            self._calls_answered += answers

    @property
    def outstanding(self) -> int:
        """Calls received and not answered yet."""
        with self._lock:
            return self._calls_received - self._calls_answered

    def totals(self) -> dict[str, Any]:
        """Every counter; ``outstanding``: calls received and not answered yet."""
        with self._lock:
            return {
                "calls_received": self._calls_received,
                "calls_served": self._calls_served,
                "calls_failed": self._calls_failed,
                "bytes_in": self._bytes_in,
                "bytes_out": self._bytes_out,
                "busy_seconds": self._busy_seconds,
                "batches": self._batches,
                "outstanding": self._calls_received - self._calls_answered,
                **self._rare,
            }


class _RunningFor(threading.local):
    counters: Counters | None = None  #: those of the worker whose call this thread runs, if any


_running_for = _RunningFor()


def running_for(counters: Counters | None) -> Counters | None:
    """Make ``counters`` those the call this thread runs counts into; return the previous ones, to set back.

    Example::

        >>> counters = Counters()
        >>> previous = running_for(counters)
        >>> count_batches(2)
        >>> _ = running_for(previous)
        >>> counters.totals()["batches"]
        2
    """
    previous, _running_for.counters = _running_for.counters, counters
    return previous


def count_batches(count: int = 1) -> None:
    """Count ``count`` batches made by the call this thread runs on its worker; outside a worker's call, nothing."""
    counters = _running_for.counters
    if counters is not None:
        counters.made_batches(count)
