"""Running one call: unpickle the function and its arguments, run it, pickle its answer.

Threading: :meth:`CallRunner.run` runs in whichever thread holds the call's slot
(see :mod:`rpcdl.server.slots`); it touches no state of its own, only the RRef
store, which has its own lock, and the counters, where each thread counts in its own tally.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..errors import LimitExceeded
from ..rpc.calls import describe
from ..rpc.rref import RRefStore
from ..serialization.pickling import dump_exception, dumps_answer, loads
from ..transport.context import thread_context
from ..transport.wire import MAX_MESSAGE_BYTES_ENV, SMALLEST_MESSAGE_LIMIT, Frame, Kind, Limits
from .counters import Counters

log = logging.getLogger("rpcdl.worker")

_clock = time.perf_counter
_RESULT = Kind.RESULT  # read on every call: an enum member's lookup through its class costs ~0.1 us (3.11)


class CallRunner:
    """Runs calls for a worker and turns their outcome into answer frames.

    Args:
        store: the worker's RRef store (results kept under a ``ref``).
        limits: bounds on an answer.
        counters: where time spent and calls served or failed are counted.
    """

    def __init__(self, store: RRefStore, limits: Limits, counters: Counters):
        self.store = store
        self.limits = limits
        self.counters = counters

    def run(self, session: Any, frame: Frame) -> Frame:
        """Run the call of ``frame`` from ``session``; return its answer: a RESULT or an ERROR frame."""
        started = _clock()
        context = thread_context  # the session's peer and segment, for this call in this thread
        previous, context.value = context.value, session.call_context
        try:
            try:
                func, args, kwargs = loads(frame.payload, frame.buffers)
                value = func(*args, **kwargs)
                if frame.ref:
                    self.store.complete(frame.ref, value)
                    value = None
                try:
                    payload, buffers = dumps_answer(value)
                except Exception as exc:
                    raise TypeError(f"the result of {describe(func)} could not be pickled: {exc}") from exc
                if buffers or len(payload) > SMALLEST_MESSAGE_LIMIT:
                    sizes = [b.nbytes for b in buffers]
                    self.limits.check_outgoing(len(payload), sizes, lambda: f"the result of {describe(func)}")
            finally:
                context.value = previous
        except BaseException as exc:
            if frame.ref:
                self.store.complete(frame.ref, error=exc)
            log.debug("call from %s raised %s", session.peer, type(exc).__name__)
            self.counters.ran(_clock() - started, True)
            return Frame(Kind.ERROR, frame.call_id, 0, self.error_report(exc))
        self.counters.ran(_clock() - started, False)
        return Frame(_RESULT, frame.call_id, 0, payload, buffers)

    def error_report(self, exc: BaseException) -> bytes:
        """The report of ``exc`` for the client; a shorter one if it would break the message limit."""
        report = dump_exception(exc)
        if len(report) <= self.limits.max_message_bytes:
            return report
        began = f"{type(exc).__qualname__}: {exc}"[:200]
        return dump_exception(
            LimitExceeded(
                f"the exception a call raised is {len(report)} bytes with its traceback, more than the limit of "
                f"{self.limits.max_message_bytes} bytes in one message ({MAX_MESSAGE_BYTES_ENV}); it began: {began}"
            )
        )
