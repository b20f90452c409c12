"""``rpcdl worker --procs N``: N worker processes kept running until the supervisor is told to stop.

A child that dies (killed, out of memory, a crash) is logged with the cause
(the signal's name or the exit code) and started again after a backoff that
doubles while it keeps dying young. SIGTERM or SIGINT to the supervisor
drains every child (each gets SIGTERM: it tells its clients it leaves, answers
its calls in flight and exits 0); a second signal is passed on, so they stop
at once; a child still there after the drain timeout and a margin is killed.

Threading: everything runs in the main thread of the supervisor, which owns
every field here; the signal handlers only count signals
(``rpcdl.server.process.StopSignals``), which that thread polls.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import time
from collections.abc import Callable

log = logging.getLogger("rpcdl.worker")

EXIT_MARGIN = 10.0  #: seconds a child gets past the drain timeout before SIGKILL
_TICK = 0.1


@dataclasses.dataclass(frozen=True)
class Backoff:
    """How long a child that died waits before it starts again.

    The first restart waits ``initial`` seconds; each death of a child that ran
    less than ``healthy_after`` seconds doubles its wait, up to ``cap``; a child
    that ran longer than that starts again after ``initial``.

    Example::

        >>> backoff = Backoff(initial=1.0, cap=8.0, healthy_after=60.0)
        >>> [backoff.next(previous, ran_for=1.0) for previous in (0.0, 1.0, 4.0, 8.0)]
        [1.0, 2.0, 8.0, 8.0]
        >>> backoff.next(8.0, ran_for=120.0)
        1.0
    """

    initial: float = 0.5
    cap: float = 30.0
    healthy_after: float = 60.0

    def next(self, previous: float, ran_for: float) -> float:
        """The wait before the next start, given the last wait (``0`` if none) and how long the child ran."""
        if previous <= 0.0 or ran_for >= self.healthy_after:
            return self.initial
        return min(self.cap, previous * 2.0)


def describe_exit(returncode: int) -> str:
    """Why a child ended, from its return code (``-N``: signal ``N``).

    Example::

        >>> describe_exit(-9)
        'killed by SIGKILL'
        >>> describe_exit(3)
        'exited with code 3'
    """
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exited with code {returncode}"


@dataclasses.dataclass
class Running:
    """A child process that runs."""

    process: subprocess.Popen
    started: float  #: ``time.monotonic()`` when it started
    wait: float  #: the backoff it waited before this start (``0`` for the first)


@dataclasses.dataclass
class Waiting:
    """A child that died, to start again at ``restart_at``."""

    restart_at: float
    wait: float


@dataclasses.dataclass
class Ended:
    """A child stopped for good (the supervisor stops)."""

    returncode: int


class Supervisor:
    """Runs ``count`` children and keeps them running until told to stop.

    Args:
        command_for: the command line of child ``i`` (``0 <= i < count``).
        count: how many children.
        drain_timeout: the children's drain timeout (``--drain-timeout``).
        backoff: the waits before restarts.
        spawn: starts a command (default :class:`subprocess.Popen`).
    """

    def __init__(
        self,
        command_for: Callable[[int], list[str]],
        count: int,
        drain_timeout: float,
        backoff: Backoff | None = None,
        spawn: Callable[[list[str]], subprocess.Popen] = subprocess.Popen,
    ) -> None:
        self._command_for = command_for
        self._drain_timeout = drain_timeout
        self._backoff = backoff or Backoff()
        self._spawn = spawn
        self._children: list[Running | Waiting | Ended] = [Waiting(0.0, 0.0) for _ in range(count)]
        self.restarts = 0  #: children started again after they died

    def run(self, told: Callable[[], bool], told_again: Callable[[], bool]) -> int:
        """Start the children, restart those that die, until a stop signal; then drain them.

        Args:
            told: whether a stop signal came.
            told_again: whether a second one came (the children then stop at once).

        Returns:
            0 once stopped (the children's own ends are logged).
        """
        while not told():
            now = time.monotonic()
            for index, child in enumerate(self._children):
                if isinstance(child, Waiting) and now >= child.restart_at:
                    self._start(index, child.wait)
                elif isinstance(child, Running) and child.process.poll() is not None:
                    self._died(index, child, now)
            time.sleep(_TICK)
        self._drain(told_again)
        return 0

    def _start(self, index: int, wait: float) -> None:
        process = self._spawn(self._command_for(index))
        if wait > 0.0:
            self.restarts += 1
            log.info("rpcdl worker process %d started again (pid %d)", index, process.pid)
        self._children[index] = Running(process, time.monotonic(), wait)

    def _died(self, index: int, child: Running, now: float) -> None:
        ran_for = now - child.started
        wait = self._backoff.next(child.wait, ran_for)
        log.warning(
            "rpcdl worker process %d (pid %d) %s after %.1fs; starting it again in %.1fs",
            index,
            child.process.pid,
            describe_exit(child.process.returncode),
            ran_for,
            wait,
        )
        self._children[index] = Waiting(now + wait, wait)

    def _drain(self, told_again: Callable[[], bool]) -> None:
        """SIGTERM to every child, a second one if a second signal comes, SIGKILL after the timeout and margin."""
        passed_on = False
        running = [child for child in self._children if isinstance(child, Running)]
        log.info("rpcdl worker: stopping, draining %d process(es) for up to %gs", len(running), self._drain_timeout)
        for child in running:
            _signal(child.process, signal.SIGTERM)
        deadline = time.monotonic() + self._drain_timeout + EXIT_MARGIN
        while any(child.process.poll() is None for child in running):
            if not passed_on and told_again():
                passed_on = True
                log.warning("rpcdl worker: a second signal: stopping the processes at once")
                for child in running:
                    _signal(child.process, signal.SIGTERM)
            if time.monotonic() >= deadline:
                for child in running:
                    _signal(child.process, signal.SIGKILL)
                break
            time.sleep(_TICK)
        for index, child in enumerate(self._children):
            if isinstance(child, Running):
                code = child.process.wait()
                self._children[index] = Ended(code)
                if code != 0:
                    log.warning("rpcdl worker process %d (pid %d) %s", index, child.process.pid, describe_exit(code))
            else:
                self._children[index] = Ended(0)


def _signal(process: subprocess.Popen, signum: int) -> None:
    if process.poll() is None:
        try:
            process.send_signal(signum)
        except ProcessLookupError:
            pass
