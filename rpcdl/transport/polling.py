"""Waiting for a socket's next bytes by polling, when they are microseconds away, and a core is spare.

A thread blocked in ``recv`` sleeps, and the bytes that end its wait have the
kernel wake it: on an idle core, and above all in a virtual machine, that
costs 5-15 µs, as much as the rest of a round trip on loopback. A thread that
polls the socket without blocking sees the bytes as they land. So the two
waits that end within microseconds in a loop of :func:`rpcdl.rpc_sync` poll
first, for at most a window of 200 µs: the caller's wait for its answer, and
the worker's wait for that caller's next call. Each polls only while it paid
last time, that is while the bytes came within the window, so a slow function
or a caller that does other work between calls costs one window, then none,
until the bytes come quickly again.

Polling spends a core to save a wake-up, which is worth it only where the core
had nothing else to do. On a shared node (two jobs sharing two workers on two
cores, say) a polling thread takes its core from a process with work, and
two pollers on one core yield it to each other while the workers queue on
the other. So by default a thread polls only where what it measures says a
core is spare (:class:`PollRule`):

* **the machine has a spare core**: the number of runnable threads
  (``/proc/loadavg``'s fourth field, the poller's own thread counted) is not
  above the cores online, read at most every ``SAMPLE_SECONDS`` (5 ms);
* **its own cores have no one waiting**: a poll that found itself off its
  core for more than ``OFF_CORE_SECONDS`` (50 µs) between two looks at the socket
  (its ``sched_yield`` let another thread run, or it was preempted, or
  throttled, or waited for the GIL) stops polling for ``QUIET_SECONDS`` (1 s),
  after which a single window tells again.

``RPCDL_POLL_MICROSECONDS`` overrides the default: ``0`` never polls, ``N``
polls for up to ``N`` µs while it pays, whatever the machine (a node given
to one job, say).

Threading: a :class:`Poller` belongs to the one thread that reads its socket at
a time (the reading role of a connection, the read turn of a session); its
:class:`PollRule` and its ``LoadSample`` are its own.
"""

from __future__ import annotations

import os
import select
import socket
import time

from ..checks import environment_number

POLL_ENV = "RPCDL_POLL_MICROSECONDS"
DEFAULT_MICROSECONDS = 200
_MAX_MICROSECONDS = 100_000
SAMPLE_SECONDS = 0.005  #: how long a reading of the machine's runnable threads serves
OFF_CORE_SECONDS = 50e-6  #: a gap between two looks at the socket this long: another thread had the core
QUIET_SECONDS = 1.0  #: no polling for this long after a poll found it had taken a core from another thread


def window_from_environment() -> float:
    """Seconds to poll for bytes before sleeping: ``RPCDL_POLL_MICROSECONDS``, else 200 µs.

    Raises:
        ValueError: ``RPCDL_POLL_MICROSECONDS`` is not a whole number from 0 to 100,000.

    Example::

        >>> window_from_environment()  # doctest: +SKIP
        0.0002
    """
    microseconds = environment_number(
        POLL_ENV,
        DEFAULT_MICROSECONDS,
        int,
        f"a whole number of microseconds from 0 (never poll) to {_MAX_MICROSECONDS}: how long a caller of "
        "rpc_sync, or a worker, polls for bytes before sleeping",
        lambda microseconds: 0 <= microseconds <= _MAX_MICROSECONDS,
    )
    return microseconds / 1e6


def window_is_explicit() -> bool:
    """Whether ``RPCDL_POLL_MICROSECONDS`` is set: then pollers poll for that window whatever the machine.

    Example::

        >>> window_is_explicit()  # doctest: +SKIP
        False
    """
    return bool(os.environ.get(POLL_ENV, "").strip())


class PollRule:
    """When to poll, from what was measured: the pure part of a :class:`Poller`.

    Args:
        window: seconds a poll lasts at most; 0 never polls.
        adaptive: poll only where a core is spare (see the module); ``False`` polls whenever it pays.

    Example::

        >>> rule = PollRule(0.0002, adaptive=True)
        >>> rule.may_poll(now=10.0), rule.machine_allows(running=3, cores=2)
        (True, False)
        >>> rule.polled(now=10.0, longest_gap=0.002)  # off its core for 2 ms: it took the core from someone
        >>> rule.may_poll(now=10.5), rule.may_poll(now=11.0)
        (False, True)
    """

    __slots__ = ("adaptive", "pays", "quiet_until", "window")

    def __init__(self, window: float, adaptive: bool):
        self.window = window
        self.adaptive = adaptive
        self.pays = window > 0  #: whether the bytes awaited last came within the window
        self.quiet_until = 0.0  #: no polling before this moment (contention was seen)

    def may_poll(self, now: float) -> bool:
        """Whether polling paid last time and no contention was seen lately."""
        return self.pays and now >= self.quiet_until

    def machine_allows(self, running: int, cores: int) -> bool:
        """Whether ``running`` runnable threads (this one among them) leave none waiting for one of ``cores``."""
        return not self.adaptive or running <= cores

    def polled(self, now: float, longest_gap: float) -> None:
        """A poll ended at ``now``; its longest time between two looks at the socket was ``longest_gap``."""
        if self.adaptive and longest_gap > OFF_CORE_SECONDS:
            self.quiet_until = now + QUIET_SECONDS

    def arrived(self, waited: float) -> None:
        """The bytes came ``waited`` seconds after the wait began: poll next time if that was within the window."""
        self.pays = self.window > 0.0 and waited <= self.window


def _open_loadavg() -> int | None:
    try:
        return os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, AttributeError):
        return None


_LOADAVG = _open_loadavg()  # read with pread, from any thread or forked child: no offset is shared
_CORES = os.cpu_count() or 1


class LoadSample:
    """How many threads the machine runs now (``/proc/loadavg``), read at most every ``SAMPLE_SECONDS`` (5 ms).

    Where that file cannot be read, the count is 1: a core is spare.
    """

    __slots__ = ("_running", "_taken")

    def __init__(self) -> None:
        self._running = 1
        self._taken = -SAMPLE_SECONDS

    def running(self, now: float) -> int:
        """Runnable threads on the machine, this one included (a reading up to ``SAMPLE_SECONDS`` (5 ms) old)."""
        if now - self._taken >= SAMPLE_SECONDS:
            self._taken = now
            self._running = running_threads()
        return self._running


def running_threads() -> int:
    """Runnable threads on the machine now, the caller's included; 1 where ``/proc/loadavg`` cannot be read.

    Example::

        >>> running_threads() >= 1
        True
    """
    if _LOADAVG is None:
        return 1
    try:
        fields = os.pread(_LOADAVG, 128, 0).split()
        return int(fields[3].partition(b"/")[0])
    except (OSError, IndexError, ValueError):
        return 1


class Poller:
    """Polls one socket for its next bytes, for at most ``window`` seconds, while that pays and a core is spare.

    Call :meth:`wait` before a blocking read that is expected to end soon,
    and :meth:`arrived` once that read returned. :meth:`ready` tells, without
    polling, whether a read would find bytes.

    Args:
        sock: the connected socket (or TLS stream) to poll.
        window: seconds to poll at most; 0 never polls.
        adaptive: poll only where a core is spare (see the module); by default,
            unless ``RPCDL_POLL_MICROSECONDS`` is set.
        load: where the count of runnable threads comes from (a
            :class:`LoadSample` of ``/proc/loadavg`` by default).

    Example::

        >>> poller = Poller(sock, window_from_environment())  # doctest: +SKIP
        >>> poller.wait()  # doctest: +SKIP
        >>> frame = reader.read_frame()  # doctest: +SKIP
        >>> poller.arrived()  # doctest: +SKIP
    """

    __slots__ = ("_decrypted", "_load", "_poll", "_since", "rule")

    def __init__(
        self, sock: socket.socket, window: float, adaptive: bool | None = None, load: LoadSample | None = None
    ):
        self.rule = PollRule(window, not window_is_explicit() if adaptive is None else adaptive)
        self._load = LoadSample() if load is None else load
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)
        self._decrypted = getattr(sock, "pending", None)  # a TLS stream's bytes read from the socket already
        self._since = 0.0

    @property
    def window(self) -> float:
        """Seconds a poll lasts at most."""
        return self.rule.window

    @property
    def pays(self) -> bool:
        """Whether the bytes awaited last came within the window (the next :meth:`wait` may poll)."""
        return self.rule.pays

    def wait(self) -> bool:
        """Poll until bytes arrive or the window passes, if the rule says so (see the module).

        Returns:
            Whether bytes wait to be read; ``False`` if it did not poll, or the window passed.
        """
        rule = self.rule
        self._since = now = time.perf_counter()
        if not rule.may_poll(now):
            return False
        if rule.adaptive and not rule.machine_allows(self._load.running(now), _CORES):
            return False
        if self._decrypted is not None and self._decrypted():
            return True
        poll, clock, give_way = self._poll.poll, time.perf_counter, os.sched_yield
        if poll(0):
            return True
        deadline, longest, last = now + rule.window, 0.0, clock()
        arrived = False
        while True:
            give_way()  # to a thread runnable on this core, if there is one; the gap that follows tells
            arrived = bool(poll(0))
            looked = clock()
            longest = max(longest, looked - last)
            last = looked
            if arrived or looked >= deadline:
                break
        rule.polled(looked, longest)
        return arrived

    def ready(self, within: float = 0.0) -> bool:
        """Whether bytes wait to be read now, or arrive within ``within`` seconds (sleeping, not polling)."""
        if self._decrypted is not None and self._decrypted():
            return True
        return bool(self._poll.poll(within * 1000))

    def arrived(self) -> None:
        """The bytes awaited since :meth:`wait` were read: poll next time if they came within the window."""
        self.rule.arrived(time.perf_counter() - self._since)
