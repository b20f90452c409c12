"""The process around a worker: stop signals, the parent it follows, the address file.

Threading: :class:`StopSignals` handlers run in the main thread and only note
when each signal came, which the main thread polls; nothing here starts a thread.
"""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time
from typing import Any


class StopSignals:
    """SIGTERM and SIGINT counted, for the main thread to poll: the first drains, a second stops at once.

    The handlers only set attributes: a handler that takes a lock (``Event.set()``)
    deadlocks when the signal lands while the main thread holds that lock itself.
    Outside the main thread nothing is installed and :meth:`wait` just sleeps.
    """

    def __init__(self):
        self.times: list[float] = []  #: when each signal came (``time.monotonic()``), appended by the handler
        self.last: int | None = None  #: the number of the last signal received
        self._previous: dict[int, Any] = {}

    @property
    def received(self) -> bool:
        """Whether a signal came."""
        return bool(self.times)

    def again(self, window: float) -> bool:
        """Whether a second signal came ``window`` seconds or more after the first (sooner, it is the same
        notice by two routes: a process group and a supervisor, say)."""
        times = self.times
        return len(times) > 1 and times[-1] - times[0] >= window

    def describe(self) -> str:
        """The last signal's name (``"SIGTERM"``), or ``""`` if none came."""
        return signal.Signals(self.last).name if self.last is not None else ""

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.times.append(time.monotonic())
        self.last = signum

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, less if a signal comes; return whether one came."""
        deadline = time.monotonic() + timeout
        while not self.received and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return self.received

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def process_exists(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def append_address(path: str | os.PathLike, address: str) -> None:
    """Append ``address`` as one line to the file ``path``, under an exclusive lock.

    Many workers may share one file (a Slurm job step, say): the lock keeps
    their lines whole.
    """
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            handle.write(address + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
