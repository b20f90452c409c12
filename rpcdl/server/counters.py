"""A worker's counters, as :meth:`rpcdl.server.worker.Worker.stats` reports them.

Threading: any thread changes them, each change under the one lock.
"""

from __future__ import annotations

import threading


class Counters:
    """A worker's counters, changed under one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls_served = 0
        self.calls_failed = 0
        self.calls_rejected = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.busy_seconds = 0.0
        self.clients = 0
        self.connections_total = 0
        self.connections_refused = 0
        self.outstanding = 0  #: calls received and not answered yet

    def add(self, **deltas: float) -> None:
        """Add each of ``deltas`` to the counter of that name."""
        with self.lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def received(self, bytes_in: int, call: bool) -> None:
        """A frame of ``bytes_in`` bytes arrived; a call among them is outstanding until answered."""
        with self.lock:
            self.bytes_in += bytes_in
            self.outstanding += call

    def ran(self, seconds: float, failed: bool) -> None:
        """A call ran for ``seconds``, and raised if it ``failed``."""
        with self.lock:
            self.busy_seconds += seconds
            if failed:
                self.calls_failed += 1
            else:
                self.calls_served += 1

    def sent(self, bytes_out: int, answers: int) -> None:
        """``bytes_out`` bytes went out, answering ``answers`` calls."""
        with self.lock:
            self.bytes_out += bytes_out
            self.outstanding -= answers
