"""``rpcdl worker --procs N``: N worker processes kept running until the supervisor is told to stop.

A child is *starting* until it prints its ready line (its ``HOST:PORT``, the
first line of its standard output, which the supervisor reads and passes on
to its own with the rest), then *running*. A child that dies once it has
served (killed, out of memory, a crash) is logged with the cause (the
signal's name or the exit code), its line is removed from the address file
(it could not remove it itself when killed) and it is started again after a
backoff that doubles while it keeps dying young. A child that dies before it
was ever ready fails the same way each time (its port is in use, its import
fails): the supervisor drains the others and exits 1, the child's own error
above its last line. So does a child that cannot be started at all (its fork
server cannot import torch, say), unless it served before: then it is tried
again after the backoff. SIGTERM or SIGINT to the supervisor drains every child
(each gets SIGTERM: it tells its clients it leaves, answers its calls in
flight and exits 0); a second signal is passed on, so they stop at once; a
child still there after the drain timeout and a margin is killed.

Threading: everything runs in the main thread of the supervisor, which owns
every field here (it reads the children's output without blocking, at each
tick); the signal handlers only count signals
(``rpcdl.server.process.StopSignals``), which that thread polls.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import IO, Any, Protocol, TextIO

from .process import remove_address

log = logging.getLogger("rpcdl.worker")

EXIT_MARGIN = 10.0  #: seconds a child gets past the drain timeout before SIGKILL
_TICK = 0.1


class ChildProcess(Protocol):
    """What the supervisor uses of a child process: ``subprocess.Popen``'s, or a fork server's command's."""

    pid: int
    stdout: IO[Any] | None
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


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


class ChildOutput:
    """A child's standard output, read without blocking and passed on line by line; its first line is the ready line.

    Args:
        pipe: the read end of the child's standard output (``Popen.stdout``; made non-blocking here and read
            with ``os.read`` only).
        out: where its lines go on (the supervisor's standard output).
    """

    def __init__(self, pipe: IO[Any], out: TextIO) -> None:
        self._pipe = pipe
        self._out = out
        self._partial = b""
        self.first_line: str | None = None  #: the ready line once it came (``None`` before: a state of the child)
        os.set_blocking(pipe.fileno(), False)

    def read(self) -> None:
        """Pass on the complete lines that came since the last read."""
        while True:
            try:
                chunk = os.read(self._pipe.fileno(), 65536)
            except BlockingIOError:
                return
            if not chunk:
                return
            *lines, self._partial = (self._partial + chunk).split(b"\n")
            for line in lines:
                text = line.decode("utf-8", "replace")
                if self.first_line is None:
                    self.first_line = text.strip()
                self._out.write(text + "\n")
            self._out.flush()

    def close(self) -> None:
        """Pass on what is left (the child ended) and close the pipe."""
        self.read()
        if self._partial:
            self._out.write(self._partial.decode("utf-8", "replace") + "\n")
            self._out.flush()
            self._partial = b""
        self._pipe.close()


@dataclasses.dataclass
class Starting:
    """A child process started and not ready yet (it has not printed its address)."""

    process: ChildProcess
    output: ChildOutput
    started: float  #: ``time.monotonic()`` when it started
    wait: float  #: the backoff it waited before this start (``0`` for the first)
    served_before: bool  #: whether an earlier process of this child was ready once


@dataclasses.dataclass
class Running:
    """A child process that is ready and serves at ``address``."""

    process: ChildProcess
    output: ChildOutput
    started: float  #: ``time.monotonic()`` when it started
    wait: float  #: the backoff it waited before this start (``0`` for the first)
    address: str  #: its ready line


@dataclasses.dataclass
class Waiting:
    """A child that died, to start again at ``restart_at``."""

    restart_at: float
    wait: float
    served_before: bool  #: whether a process of this child was ready once


@dataclasses.dataclass
class Ended:
    """A child stopped for good (the supervisor stops)."""

    returncode: int


class _FailedAtStart(Exception):
    """A child died before it was ever ready: starting it again would fail the same way."""


class Supervisor:
    """Runs ``count`` children and keeps them running until told to stop.

    Args:
        start_child: starts child ``i`` (``0 <= i < count``), its standard output a pipe (say
            ``subprocess.Popen(command, stdout=subprocess.PIPE)``).
        count: how many children.
        drain_timeout: the children's drain timeout (``--drain-timeout``).
        backoff: the waits before restarts.
        address_file: the children's ``--address-file``, whose line of a child that died is removed here.
        out: where the children's standard output goes on (default: ``sys.stdout``).

    Example::

        >>> def start_child(index):  # doctest: +SKIP
        ...     command = [sys.executable, "-m", "rpcdl", "worker", "--port", str(7000 + index)]
        ...     return subprocess.Popen(command, stdout=subprocess.PIPE)
        >>> stop = StopSignals().install()  # doctest: +SKIP
        >>> Supervisor(start_child, 4, drain_timeout=30.0).run(  # doctest: +SKIP
        ...     lambda: stop.received, lambda: stop.again(2.0)
        ... )
        0
    """

    def __init__(
        self,
        start_child: Callable[[int], ChildProcess],
        count: int,
        drain_timeout: float,
        backoff: Backoff | None = None,
        address_file: str | os.PathLike | None = None,
        out: TextIO | None = None,
    ) -> None:
        self._start_child = start_child
        self._drain_timeout = drain_timeout
        self._backoff = backoff or Backoff()
        self._address_file = address_file
        self._out = out or sys.stdout
        self._children: list[Starting | Running | Waiting | Ended] = [
            Waiting(0.0, 0.0, served_before=False) for _ in range(count)
        ]
        self.restarts = 0  #: children started again after they died

    def run(self, told: Callable[[], bool], told_again: Callable[[], bool]) -> int:
        """Start the children, restart those that die, until a stop signal; then drain them.

        Args:
            told: whether a stop signal came.
            told_again: whether a second one came (the children then stop at once).

        Returns:
            0 once stopped (the children's own ends are logged); 1 when a child died before it was ever
            ready (the others are drained first).
        """
        try:
            while not told():
                self._tick(time.monotonic())
                time.sleep(_TICK)
        except _FailedAtStart as exc:
            log.error("rpcdl worker: %s; stopping", exc)
            self._drain(told_again)
            return 1
        self._drain(told_again)
        return 0

    def _tick(self, now: float) -> None:
        for index, child in enumerate(self._children):
            if isinstance(child, Waiting) and now >= child.restart_at:
                self._start(index, child.wait, child.served_before)
            elif isinstance(child, (Starting, Running)):
                child.output.read()
                if child.process.poll() is not None:
                    self._died(index, child, now)
                elif isinstance(child, Starting) and child.output.first_line is not None:
                    address = child.output.first_line
                    self._children[index] = Running(child.process, child.output, child.started, child.wait, address)

    def _start(self, index: int, wait: float, served_before: bool) -> None:
        try:
            process = self._start_child(index)
        except (OSError, RuntimeError) as exc:  # no process (a fork server that cannot import torch, say)
            if not served_before:
                self._children[index] = Ended(1)
                raise _FailedAtStart(f"process {index} could not be started: {exc}") from exc
            wait = self._backoff.next(wait, ran_for=0.0)
            log.warning("rpcdl worker process %d could not be started again: %s; trying in %.1fs", index, exc, wait)
            self._children[index] = Waiting(time.monotonic() + wait, wait, served_before=True)
            return
        if process.stdout is None:
            raise ValueError("start_child must give the child a pipe for its standard output: its ready line is read")
        output = ChildOutput(process.stdout, self._out)
        if wait > 0.0:
            self.restarts += 1
            log.info("rpcdl worker process %d started again (pid %d)", index, process.pid)
        self._children[index] = Starting(process, output, time.monotonic(), wait, served_before)

    def _died(self, index: int, child: Starting | Running, now: float) -> None:
        child.output.close()
        if isinstance(child, Running):
            self._unlist(child.address)
        elif child.output.first_line is not None:  # it printed its line and died before this tick saw it
            self._unlist(child.output.first_line)
        why = describe_exit(child.process.returncode)
        if isinstance(child, Starting) and child.output.first_line is None and not child.served_before:
            self._children[index] = Ended(child.process.returncode)
            raise _FailedAtStart(
                f"process {index} (pid {child.process.pid}) {why} before it was ready (its error is above): "
                "it would fail the same way again"
            )
        ran_for = now - child.started
        wait = self._backoff.next(child.wait, ran_for)
        log.warning(
            "rpcdl worker process %d (pid %d) %s after %.1fs; starting it again in %.1fs",
            index,
            child.process.pid,
            why,
            ran_for,
            wait,
        )
        self._children[index] = Waiting(now + wait, wait, served_before=True)

    def _unlist(self, address: str) -> None:
        """Remove a dead child's line from the address file (killed, it could not)."""
        if self._address_file is None:
            return
        try:
            remove_address(self._address_file, address)
        except OSError as exc:
            log.warning("rpcdl worker: could not remove %s from %s: %s", address, os.fspath(self._address_file), exc)

    def _drain(self, told_again: Callable[[], bool]) -> None:
        """SIGTERM to every child, a second one if a second signal comes, SIGKILL after the timeout and margin."""
        passed_on = False
        running = [child for child in self._children if isinstance(child, (Starting, Running))]
        log.info("rpcdl worker: stopping, draining %d process(es) for up to %gs", len(running), self._drain_timeout)
        for child in running:
            _signal(child.process, signal.SIGTERM)
        deadline = time.monotonic() + self._drain_timeout + EXIT_MARGIN
        while any(child.process.poll() is None for child in running):
            for child in running:
                child.output.read()
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
            if isinstance(child, (Starting, Running)):
                code = child.process.wait()
                child.output.close()
                self._children[index] = Ended(code)
                if code != 0:
                    log.warning("rpcdl worker process %d (pid %d) %s", index, child.process.pid, describe_exit(code))
                    address = child.address if isinstance(child, Running) else child.output.first_line
                    if address:
                        self._unlist(address)
            elif not isinstance(child, Ended):
                self._children[index] = Ended(0)


def _signal(process: ChildProcess, signum: int) -> None:
    if process.poll() is None:
        try:
            process.send_signal(signum)
        except ProcessLookupError:
            pass
