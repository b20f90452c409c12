"""The process around a worker: stop signals, the parent it follows, its line in the address file.

Threading: :class:`StopSignals` handlers run in the main thread and only note
when each signal came, which the main thread waits for (woken by the signal
itself, through a wakeup pipe); nothing here starts a thread.
An address file is shared by processes: every change takes an exclusive lock
on it (``flock``), which any thread may take (:func:`add_address`, :func:`remove_address`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import stat
import tempfile
import threading
import time
from typing import Any

#: What :func:`remove_address` leaves in a file once no address is left: a whole file that lists no worker.
NO_WORKER_LINE = "# no rpcdl worker is listed: the last one left"


class StopSignals:
    """SIGTERM and SIGINT counted, for the main thread to poll: the first drains, a second stops at once.

    The handlers only set attributes: a handler that takes a lock (``Event.set()``)
    deadlocks when the signal lands while the main thread holds that lock itself.
    :meth:`wait` sleeps in ``select`` on a pipe that the interpreter writes to
    when a signal comes (``signal.set_wakeup_fd``), so an idle worker's main
    thread wakes for a signal or its timeout, not every few milliseconds.
    Outside the main thread nothing is installed and :meth:`wait` just sleeps.
    """

    def __init__(self):
        self.times: list[float] = []  #: when each signal came (``time.monotonic()``), appended by the handler
        self.last: int | None = None  #: the number of the last signal received
        self._previous: dict[int, Any] = {}
        self._sleeper: _Sleeper | _WakeupPipe = _Sleeper()  # how wait() sleeps: a pipe once installed

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
            self._sleeper = _WakeupPipe()
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.times.append(time.monotonic())
        self.last = signum

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, less if a signal comes; return whether one came."""
        deadline = time.monotonic() + timeout
        while not self.received:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._sleeper.sleep(left)
        return self.received

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        self._sleeper.close()
        self._sleeper = _Sleeper()


class _Sleeper:
    """How :meth:`StopSignals.wait` sleeps where it installed nothing (not the main thread): no signal can be
    noted, so it sleeps the whole time."""

    def sleep(self, most: float) -> None:
        time.sleep(most)

    def close(self) -> None:
        pass


class _WakeupPipe:
    """How :meth:`StopSignals.wait` sleeps in the main thread: in ``select`` on a pipe the interpreter writes
    a byte to as a signal comes (``signal.set_wakeup_fd``), before it runs the handler."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)

    def sleep(self, most: float) -> None:
        readable, _, _ = select.select([self._read], [], [], most)
        if readable:
            with contextlib.suppress(BlockingIOError):
                os.read(self._read, 512)  # the signals' numbers: the handler notes them itself

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous)
        os.close(self._read)
        os.close(self._write)


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


def add_address(path: str | os.PathLike, address: str) -> bool:
    """Add ``address`` as one line of the file ``path`` unless a line lists it already; return whether it was added.

    The file (``rpcdl worker --address-file``) holds one line per live worker;
    a worker restarted on its port after a kill, whose line is still there, is
    not listed twice. Many workers may share one file (a Slurm job step, say):
    every change happens under an exclusive lock on the file and rewrites it
    whole, to a temporary file in the same folder renamed over it, so that a
    trainer watching it (:class:`~rpcdl.data.sources.FileSource`) reads the old
    list or the new one, never half of one. A writer that waited for the lock
    while another renamed a new file in place locks the new one. Other lines
    (comments, other workers) are kept as they are, but for the
    :data:`NO_WORKER_LINE` that :func:`remove_address` left.

    Args:
        path: the file (created when missing).
        address: the worker's ``"host:port"``.

    Returns:
        ``True`` when the line was added, ``False`` when the address was listed already.

    Example::

        >>> add_address("workers.txt", "10.0.0.5:6543")  # doctest: +SKIP
        True
    """
    with _LockedFile(path) as locked:
        lines = locked.lines()
        if any(_listed(line) == address for line in lines):
            return False
        locked.replace([*(line for line in lines if line != NO_WORKER_LINE), address])
    return True


def remove_address(path: str | os.PathLike, address: str) -> bool:
    """Remove the lines of ``path`` that list ``address``; return whether there was one.

    A worker calls it as it drains; ``rpcdl worker --procs`` calls it for a
    child that died. A missing file lists nothing (it is not created). The
    change is made as :func:`add_address` makes one. The last address
    removed leaves a comment line: an empty file is one being rewritten, a
    failed read for the trainers (see :class:`~rpcdl.data.sources.FileSource`),
    while a file of comments lists no worker.

    Args:
        path: the file.
        address: the worker's ``"host:port"``.

    Returns:
        ``True`` when a line was removed.

    Example::

        >>> remove_address("workers.txt", "10.0.0.5:6543")  # doctest: +SKIP
        True
    """
    if not os.path.exists(path):
        return False
    with _LockedFile(path) as locked:
        lines = locked.lines()
        kept = [line for line in lines if _listed(line) != address]
        if len(kept) == len(lines):
            return False
        locked.replace(kept or [NO_WORKER_LINE])
    return True


def _listed(line: str) -> str:
    """The address a line of an address file lists (``""`` for a blank line or a comment)."""
    return line.split("#", 1)[0].strip()


class _LockedFile:
    """The file at ``path`` (created if missing), opened and locked exclusively for one change."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._fd = -1

    def __enter__(self) -> _LockedFile:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                held, now = os.fstat(fd), os.stat(self.path)
            except FileNotFoundError:  # removed while we waited: open it again
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                self._fd = fd
                return self
            os.close(fd)  # another writer renamed a new file in place while we waited: lock that one

    def __exit__(self, *exc_info: Any) -> None:
        os.close(self._fd)  # closing the last descriptor lets go of the lock

    def lines(self) -> list[str]:
        """The file's lines, without their ends."""
        with os.fdopen(os.dup(self._fd), encoding="utf-8") as handle:
            handle.seek(0)
            return handle.read().splitlines()

    def replace(self, lines: list[str]) -> None:
        """Write ``lines`` to a temporary file beside it and rename that over it (the lock is still held)."""
        folder, name = os.path.split(os.path.abspath(self.path))
        fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write("".join(line + "\n" for line in lines))
                handle.flush()
                os.fchmod(handle.fileno(), stat.S_IMODE(os.fstat(self._fd).st_mode))
                os.fsync(handle.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
