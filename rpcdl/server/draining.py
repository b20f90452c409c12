"""A worker leaving well: telling its clients, and the drain of a worker process stopped by signals.

Threading: ``serve_until_stopped`` runs in a worker process's main
thread: it waits for a stop signal, then drains (the worker posts one ``LEAVING``
frame to each session, which the process loop writes). ``drain_process`` runs in the
main thread of a worker process; it reads the worker's count of calls in
flight (the counters' own lock) and the signals' times (set by the handlers,
read by the main thread only).
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from .process import StopSignals, add_address, process_exists, remove_address
from .registration import Registration

log = logging.getLogger("rpcdl.worker")

ANNOUNCE_WAIT = 1.0  #: seconds a stop waits at least for the clients to be told, even one at once
SAME_SIGNAL_WINDOW = 0.5  #: seconds after the first stop signal in which another is the same notice


class DrainEnd(enum.Enum):
    """How a drain ended."""

    FINISHED = "finished"  #: every call in flight was answered
    TIMED_OUT = "timed out"  #: the drain timeout passed with calls still running
    INTERRUPTED = "interrupted"  #: a second SIGTERM/SIGINT: stop at once


class Drained(Protocol):
    """What a drain needs of the worker (:class:`rpcdl.server.worker.Worker`)."""

    @property
    def calls_in_flight(self) -> int:
        """How many calls run or wait for a slot."""
        ...


class Served(Drained, Protocol):
    """What serving until told to stop needs of the worker (:class:`rpcdl.server.worker.Worker`)."""

    address: str
    parallel: int

    def drain(self, grace: float = 30.0, reason: str = ...) -> bool:
        """Begin leaving."""
        ...

    def stop(self, grace: float = 30.0) -> bool:
        """Wait for the calls in flight up to ``grace`` seconds, and close."""
        ...


def drain_process(worker: Drained, timeout: float, told_again: Callable[[], bool], tick: float = 0.02) -> DrainEnd:
    """Wait, in a worker process's main thread, for the calls in flight of a draining worker.

    Args:
        worker: the worker, draining already (:meth:`rpcdl.Worker.drain`).
        timeout: seconds to wait at most (``--drain-timeout``).
        told_again: whether a second stop signal came, which interrupts the
            drain (:meth:`~rpcdl.server.process.StopSignals.again`, with
            :data:`SAME_SIGNAL_WINDOW`: a worker of ``--procs`` in a Slurm step gets
            SIGTERM from Slurm and from its supervisor at once, one notice).
        tick: seconds between two looks.

    Returns:
        How the drain ended.

    Example::

        >>> class Idle:
        ...     calls_in_flight = 0
        >>> drain_process(Idle(), 1.0, lambda: False)
        <DrainEnd.FINISHED: 'finished'>
    """
    deadline = time.monotonic() + timeout
    while True:
        if worker.calls_in_flight <= 0:
            return DrainEnd.FINISHED
        if told_again():
            return DrainEnd.INTERRUPTED
        left = deadline - time.monotonic()
        if left <= 0:
            return DrainEnd.TIMED_OUT
        time.sleep(min(tick, left))


def serve_until_stopped(
    worker: Served,
    grace: float,
    address_file: str | os.PathLike | None,
    on_ready: Callable[[Any], Any],
    registration: Registration | None = None,
    watch_pid: int | None = None,
) -> None:
    """Serve with a started ``worker`` until SIGTERM or SIGINT (or ``watch_pid`` gone), then leave well.

    Ready: the address goes to ``address_file`` (once: a line left by a
    worker killed on this port stays the only one) and ``on_ready``, and the
    registration starts beating. Told to stop: the worker drains
    (:meth:`~rpcdl.server.worker.Worker.drain`), its line leaves the address
    file and the registration the registry, for up to ``grace`` seconds, a
    second signal cutting it short, and it stops.

    Args:
        worker: the worker, started.
        grace: the drain timeout, seconds.
        address_file: a file listing the address while the worker serves
            (:func:`~rpcdl.server.process.add_address`), or ``None``.
        on_ready: called with the worker once it is ready.
        registration: the worker's entry in a registry, not started yet, or ``None``.
        watch_pid: stop when the process with this pid is gone, or ``None``.
    """
    stop = StopSignals().install()
    drained = False
    try:
        if address_file is not None:
            add_address(address_file, worker.address)
        if registration is not None:
            registration.start()
        on_ready(worker)
        log.info("rpcdl worker %s ready (pid %d, parallel %d)", worker.address, os.getpid(), worker.parallel)
        reason = ""
        while not stop.wait(0.5):
            if watch_pid is not None and not process_exists(watch_pid):
                reason = f"process {watch_pid} is gone"
                break
        reason = stop.describe() or reason
        log.info("rpcdl worker %s stopping (%s): draining for up to %gs", worker.address, reason, grace)
        worker.drain(grace, reason)
        if address_file is not None:
            _unlist(address_file, worker.address)
        if registration is not None:
            registration.leave()
        end = drain_process(worker, grace, lambda: stop.again(SAME_SIGNAL_WINDOW))
        drained = True
        if end is DrainEnd.INTERRUPTED:
            log.warning(
                "rpcdl worker %s: a second signal: stopping at once, %d call(s) unanswered",
                worker.address,
                worker.calls_in_flight,
            )
        elif end is DrainEnd.TIMED_OUT:
            log.warning(
                "rpcdl worker %s stopped with %d call(s) still running after %gs",
                worker.address,
                worker.calls_in_flight,
                grace,
            )
        else:
            log.info("rpcdl worker %s drained", worker.address)
    finally:
        if address_file is not None and not drained:  # stopped by an error: the line goes all the same
            _unlist(address_file, worker.address)
        if registration is not None:
            registration.leave()
        worker.stop(0.0 if drained else grace)
        stop.restore()
    log.info("rpcdl worker %s left", worker.address)


def _unlist(address_file: str | os.PathLike, address: str) -> None:
    """Remove the worker's line from its address file; a file that cannot be written is said, not raised."""
    try:
        remove_address(address_file, address)
    except OSError as exc:
        log.warning("rpcdl worker %s: could not remove its line from %s: %s", address, os.fspath(address_file), exc)
