"""Running one call: unpickle the function and its arguments, run it, pickle its answer.

Threading: :meth:`CallRunner.run` runs in whichever thread holds the call's slot
(see :mod:`rpcdl.server.slots`). A runner has no state that changes; it
reaches the RRef store and the counters, each guarded by its own lock, and sets
the calling thread's own context (:data:`rpcdl.transport.context.thread_context`)
and the counters its batches count into (:func:`rpcdl.server.counters.running_for`)
for the call.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from ..errors import LimitExceeded
from ..rpc.calls import describe
from ..rpc.rref import RRefStore
from ..serialization.pickling import dump_exception, dumps_answer, loads
from ..transport.context import thread_context
from ..transport.wire import MAX_MESSAGE_BYTES_ENV, SMALLEST_MESSAGE_LIMIT, Frame, Kind, Limits
from .counters import Counters, running_for

log = logging.getLogger("rpcdl.worker")


class Session(Protocol):
    """What running and answering a call needs of the session it came from
    (:class:`rpcdl.server.session.ClientConnection`)."""

    peer: str  #: the client's address, for messages
    call_context: tuple[Any, ...]  #: the context its calls run in (see :mod:`rpcdl.transport.context`)

    @property
    def closed(self) -> bool:
        """Whether the connection is closed (its calls have nobody to answer)."""
        ...

    def send(self, frame: Frame, answers_call: bool = False, hold: bool = False) -> None:
        """Send ``frame``, counting its call as answered if it ``answers_call``; with ``hold``, together with
        the next frame sent (sent soon by the same thread)."""
        ...


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

    def run(self, session: Session, frame: Frame) -> Frame:
        """Run the call of ``frame`` from ``session``; return its answer: a RESULT or an ERROR frame."""
        started = time.perf_counter()
        context = thread_context  # the session's peer and segment, for this call in this thread
        previous, context.value = context.value, session.call_context
        counting_before = running_for(self.counters)  # batches made by the call count here
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
                running_for(counting_before)
        except BaseException as exc:
            if frame.ref:
                self.store.complete(frame.ref, error=exc)
            log.debug("call from %s raised %s", session.peer, type(exc).__name__)
            self.counters.ran(time.perf_counter() - started, True)
            return Frame(Kind.ERROR, frame.call_id, 0, self.error_report(exc))
        self.counters.ran(time.perf_counter() - started, False)
        return Frame(Kind.RESULT, frame.call_id, 0, payload, buffers)

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
