"""A dataset's first copy: the wait at start, over as soon as any listed worker has built the dataset.

:func:`wait_for_first_copy` asks every worker of this client's share to build
the dataset at once, and returns when the first of them has (the dataset has
its length then). A worker that refuses connections, whose host name does not
resolve yet (a Pending pod has no DNS record) or whose connection breaks is
asked again every :data:`RETRY_EVERY` seconds. Once one copy is there, the
builds in flight at workers that answer are given a moment to end (as long
again as the first took, at least :data:`SETTLE_FLOOR` seconds; a worker that
refuses is not waited for), so that a healthy fleet starts with every copy
built; the rest go on in the background, and the loader's pool revives
whichever still has no copy (:class:`~rpcdl.data.dataset.DatasetSetup`). When none of
this client's own workers answers, the other ranks' are asked too.

There is one deadline, the start timeout (``RPCDL_START_TIMEOUT``, see
:func:`~rpcdl.data.sources.start_timeout`): a connection's own grace for a
worker not started yet (``RPCDL_CONNECT_GRACE``) ends one attempt, never the
wait. Every :data:`~rpcdl.data.sources.WAIT_LOG_EVERY` seconds a warning says
what it waits for, each worker with why it did not build the dataset yet.

What ends the wait early: an error raised by the dataset's own code on a
worker (it would be raised by every worker), and a worker that cannot serve
whatever the wait (not an rpcdl worker, another token, a build past
``rpcdl_timeout``) once no other worker may still build it.

Threading: :func:`wait_for_first_copy` runs on the thread building the
dataset, which owns the wait's bookkeeping (the builds in flight, the latest
failure and next attempt of each worker); the builds' completions, on the
connections' threads, only put themselves on a queue that thread reads.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import queue
import time
from collections.abc import Callable, Iterable

import torch

from ..errors import AuthenticationError, ProtocolError, UnknownHost, WorkerTimeout, WorkerUnavailable, is_transient
from ..rpc.dial import refusing
from .sources import START_TIMEOUT_ENV, WAIT_LOG_EVERY, Fleet, Membership

__all__ = ["RETRY_EVERY", "wait_for_first_copy"]

log = logging.getLogger("rpcdl.dataset")

#: Seconds between two attempts at a worker that could not build the dataset for now.
RETRY_EVERY = 1.0
#: Once one copy is built, the workers that answer (none refused) are given as long again as it took, and at
#: least this many seconds, to build theirs: a healthy fleet starts with every copy built.
SETTLE_FLOOR = 2.0

#: Starts building the dataset on a worker (or returns the build in flight there): the future completes once the
#: copy is installed, or fails with why not.
Build = Callable[[str], torch.futures.Future]


@dataclasses.dataclass
class _Attempts:
    """What the wait knows of each worker: its build in flight, its latest failure, when to ask it again."""

    started: float
    pending: dict[str, torch.futures.Future] = dataclasses.field(default_factory=dict)
    failed: dict[str, BaseException] = dataclasses.field(default_factory=dict)
    again_at: dict[str, float] = dataclasses.field(default_factory=dict)  # math.inf: never again

    def why(self, address: str) -> str:
        """Why ``address`` has no copy yet, in a few words."""
        refused = refusing(address)
        if address in self.pending:
            return refused or "building it, or connecting"
        failure = self.failed.get(address)
        if failure is None:
            return "not asked yet"
        if isinstance(failure, (UnknownHost, WorkerUnavailable)) and refused is not None:
            return refused  # the connection's own grace is no deadline here
        return str(failure)

    def settled(self, addresses: Iterable[str]) -> bool:
        """Whether every worker of ``addresses`` failed for good (none may still build the dataset)."""
        return all(address not in self.pending and self.again_at.get(address, 0.0) == math.inf for address in addresses)


def wait_for_first_copy(fleet: Fleet, build: Build, name: str, timeout: float) -> str:
    """Build the dataset on this client's share of ``fleet``; return once one worker has installed a copy.

    Args:
        fleet: the workers, with this client's share.
        build: starts a build on a worker (see :data:`Build`).
        name: the dataset, for messages.
        timeout: seconds to wait for the first copy, the start timeout.

    Returns:
        The worker that built the first copy. The other builds go on in the background.

    Raises:
        WorkerUnavailable: no worker built it within ``timeout`` seconds (the message names each and why).
        WorkerTimeout: every worker took longer than its build timeout.
        Exception: what the dataset's code raised on a worker, or a worker that is not an rpcdl worker or has
            another token, when no other worker may build it.

    Example::

        >>> wait_for_first_copy(Fleet(["127.0.0.1:6543"]), dataset.rebuild_async, "MNIST", 600.0)  # doctest: +SKIP
        '127.0.0.1:6543'
    """
    started = time.monotonic()
    membership = fleet.wait_for_workers(timeout) if fleet.changing else fleet.membership()
    attempts = _Attempts(started)
    finished: queue.SimpleQueue[tuple[str, torch.futures.Future]] = queue.SimpleQueue()
    said = looked = started
    while True:
        asked = _asked(membership, attempts)
        now = time.monotonic()
        for address in asked:
            if address not in attempts.pending and attempts.again_at.get(address, 0.0) <= now:
                attempts.again_at.pop(address, None)
                future = build(address)
                attempts.pending[address] = future
                future.add_done_callback(functools.partial(_finished, finished, address))
        wake = min([started + timeout, said + WAIT_LOG_EVERY, looked + RETRY_EVERY, *attempts.again_at.values()])
        try:
            address, future = finished.get(timeout=max(0.0, wake - now))
        except queue.Empty:
            pass
        else:
            while True:
                attempts.pending.pop(address, None)
                try:
                    future.wait()
                except Exception as exc:
                    _failed(attempts, address, exc)
                else:
                    _settle(finished, attempts)
                    _say_built(address, name, membership, attempts)
                    return address
                try:
                    address, future = finished.get_nowait()
                except queue.Empty:
                    break
        now = time.monotonic()
        asked = _asked(membership, attempts)
        if now - started >= timeout or (asked and attempts.settled(asked)):
            raise _no_copy(fleet, name, asked, attempts, now - started, timeout)
        if now - said >= WAIT_LOG_EVERY:
            said = now
            log.warning(
                "waiting for rpcdl workers (%.0fs of %gs, %s): %sbuilding %s on %s",
                now - started,
                timeout,
                START_TIMEOUT_ENV,
                f"{fleet.describe()} lists {len(membership.addresses)}; " if fleet.changing else "",
                name,
                _each(asked, attempts) if asked else f"none yet ({fleet.why_empty() or 'it lists no worker'})",
            )
        if now - looked >= RETRY_EVERY:
            looked = now
            if fleet.changing:
                membership = fleet.refresh()


def _finished(finished: queue.SimpleQueue, address: str, future: torch.futures.Future) -> None:
    # On the thread that completed the build: the waiting thread reads the queue.
    finished.put((address, future))


def _asked(membership: Membership, attempts: _Attempts) -> list[str]:
    """The workers to ask: this client's own, and the others too once none of the own may answer now."""
    own = [address for address in membership.addresses if address in membership.own]
    if own and not all(address in attempts.failed or refusing(address) for address in own):
        return own
    return list(membership.addresses)


def _failed(attempts: _Attempts, address: str, exc: Exception) -> None:
    """Record a failed build: asked again soon, never again, or the wait ends (the error is raised)."""
    if isinstance(exc, UnknownHost) or (is_transient(exc) and not isinstance(exc, (WorkerTimeout, ProtocolError))):
        attempts.again_at[address] = time.monotonic() + RETRY_EVERY  # not there yet: ask again
    elif isinstance(exc, (WorkerTimeout, ProtocolError, AuthenticationError)):
        attempts.again_at[address] = math.inf  # the same again, or still building: another worker may serve
    else:
        raise exc  # the dataset's own code failed: every worker would fail the same way
    attempts.failed[address] = exc


def _each(addresses: Iterable[str], attempts: _Attempts) -> str:
    return ", ".join(f"{address} ({attempts.why(address)})" for address in addresses)


def _settle(finished: queue.SimpleQueue, attempts: _Attempts) -> None:
    """Give the builds in flight at workers that answer a moment to end (see :data:`SETTLE_FLOOR`)."""
    now = time.monotonic()
    until = now + max(SETTLE_FLOOR, now - attempts.started)
    while any(refusing(address) is None for address in attempts.pending) and now < until:
        try:
            address, future = finished.get(timeout=until - now)
        except queue.Empty:
            return
        del attempts.pending[address]
        try:
            future.wait()
        except Exception as exc:  # named with the others; the loader's revivals take it from here
            attempts.failed[address] = exc
        now = time.monotonic()


def _say_built(address: str, name: str, membership: Membership, attempts: _Attempts) -> None:
    seconds = time.monotonic() - attempts.started
    others = [a for a in membership.addresses if a != address and (a in attempts.pending or a in attempts.failed)]
    if not others:
        log.info("%s built on %s in %.1fs", name, address, seconds)
        return
    log.warning(
        "%s built on %s in %.1fs; not yet on %s: the loader asks them again in the background",
        name,
        address,
        seconds,
        _each(others, attempts),
    )


def _no_copy(
    fleet: Fleet, name: str, asked: list[str], attempts: _Attempts, waited: float, timeout: float
) -> Exception:
    failures = [attempts.failed[a] for a in asked if a in attempts.failed]
    if asked and len(failures) == len(asked) and all(isinstance(f, WorkerTimeout) for f in failures):
        return WorkerTimeout("; ".join(dict.fromkeys(str(f) for f in failures)))
    if asked and attempts.settled(asked) and len(failures) == 1:
        return failures[0]
    listed = _each(asked, attempts) if asked else f"none ({fleet.why_empty() or 'it lists no worker'})"
    return WorkerUnavailable(
        f"no rpcdl worker built {name} (waited {waited:.1f}s of {timeout:g}s, {START_TIMEOUT_ENV}): "
        f"{f'{fleet.describe()}: ' if fleet.changing else ''}{listed}. "
        f"Set {START_TIMEOUT_ENV} (or rpcdl_start_timeout=) to a number of seconds to wait longer"
    )
