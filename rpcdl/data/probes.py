"""How a worker taken out is asked whether it may serve again, and what it needs before it does.

A :class:`~rpcdl.data.worker_pool.WorkerPool` revives a worker through its
:class:`WorkerSetup`: :class:`PingSetup` (the default) asks whether the worker
answers (:func:`probe_async`); a loader's setup
(:class:`rpcdl.data.dataset.DatasetSetup`) also builds its dataset there again
when the worker lost it.

Threading: nothing here keeps state between calls. The pool starts a revival
on the thread advancing one of its passes, outside the pool's lock; its future
completes on whichever thread reads the answers, and its callback only queues
an event (see :mod:`rpcdl.data.events`).
"""

from __future__ import annotations

import enum
import functools
from typing import Protocol

import torch

from ..errors import WorkerTimeout
from ..rpc.client import ping_async, rpc_async

__all__ = ["PROBE_TIMEOUT", "PingSetup", "Revival", "WorkerSetup", "back_when", "does_nothing", "probe_async"]

#: Seconds a probe may take at most.
PROBE_TIMEOUT = 10.0


class Revival(enum.Enum):
    """How a revival of a worker ended, when it did not fail."""

    BACK = "back"  #: the worker may be given tasks again
    BUSY = "busy"  #: it answers, but still runs calls that timed out; it is asked again at once


def back_when(future: torch.futures.Future) -> torch.futures.Future[Revival]:
    """A future that gives :attr:`Revival.BACK` once ``future`` succeeds, or fails with its error.

    Unlike ``future.then()``, which fails with a ``RuntimeError`` carrying the
    message of an error raised in its callback, the error keeps its type: a
    transient one leaves the worker to be revived later, another keeps it out.
    """
    revived: torch.futures.Future[Revival] = torch.futures.Future()
    future.add_done_callback(functools.partial(_settle, revived))
    return revived


def _settle(revived: torch.futures.Future, done: torch.futures.Future) -> None:
    try:
        done.wait()
    except Exception as exc:
        revived.set_exception(exc)
    else:
        revived.set_result(Revival.BACK)


class WorkerSetup(Protocol):
    """What a worker needs before it serves a pool's calls, and how it is given it."""

    def revive_async(self, address: str, failure: BaseException | None) -> torch.futures.Future[Revival]:
        """Make the worker at ``address``, taken out by ``failure``, usable again: a future that completes
        with a :class:`Revival`, or fails with the reason the worker cannot serve."""
        ...


class PingSetup:
    """A worker serves as soon as it answers (see :func:`probe_async`).

    Args:
        timeout: seconds a probe may take.
    """

    def __init__(self, timeout: float):
        self.timeout = timeout

    def revive_async(self, address: str, failure: BaseException | None) -> torch.futures.Future[Revival]:
        """Probe the worker (see :class:`WorkerSetup`)."""
        return probe_async(address, failure, self.timeout)


def does_nothing() -> None:
    """Runs on a worker for :func:`probe_async`: a call that does nothing."""


def probe_async(address: str, failure: BaseException | None, timeout: float) -> torch.futures.Future[Revival]:
    """Ask whether a worker that was taken out may be given tasks again: a future that fails if not.

    A worker taken out because a call timed out is most likely still running
    that call, which nothing can interrupt. Tasks sent to it would wait behind
    that call and time out in turn, failing on every worker for a cost that is
    not theirs. So it is sent a call that does nothing, queued behind its
    calls, together with a ping: it rejoins once the call is answered (it has
    a free slot), and the future gives :attr:`Revival.BUSY` when only the ping
    was (it is alive, to be asked again). Any other worker is pinged: it
    answers at once, even while calls run.

    Args:
        address: the worker.
        failure: what took it out.
        timeout: seconds the probe may take.

    Example::

        >>> probe_async("127.0.0.1:6543", ConnectionRefusedError(), timeout=2.0).wait()  # doctest: +SKIP
        <Revival.BACK: 'back'>
    """
    ping = ping_async(address, timeout=timeout)
    if not isinstance(failure, WorkerTimeout):
        return back_when(ping)
    queued = rpc_async(address, does_nothing, timeout=timeout)
    probed: torch.futures.Future = torch.futures.Future()
    torch.futures.collect_all([queued, ping]).add_done_callback(lambda _: _free_or_busy(queued, ping, probed))
    return probed


def _free_or_busy(queued: torch.futures.Future, ping: torch.futures.Future, probed: torch.futures.Future) -> None:
    try:
        queued.wait()
    except WorkerTimeout:
        try:
            ping.wait()
        except Exception as exc:  # unreachable, not only busy
            probed.set_exception(exc)
        else:
            probed.set_result(Revival.BUSY)
    except Exception as exc:
        probed.set_exception(exc)
    else:
        probed.set_result(Revival.BACK)
