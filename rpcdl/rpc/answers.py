"""What a connection does with an answer that came, or a call that got none: completing the call's future.

Threading model: :func:`deliver` runs on the event loop (``rpcdl-loop``),
which received the answer: it completes the future with the answer as it came,
and the thread that asks for the result unpickles it there
(:func:`outcome`, through :meth:`~rpcdl.rpc.calls.CallFuture.answered`). No
state of its own.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from ..errors import WorkerLeaving, WorkerTimeout, WorkerUnavailable
from ..serialization.pickling import load_exception, loads_from
from ..transport.control import DEFAULT_REJECTION, decode_rejected, decode_stats
from ..transport.wire import Frame, Kind
from .calls import Call, describe_call

ANSWERS = frozenset((Kind.RESULT, Kind.ERROR, Kind.REJECTED, Kind.PONG, Kind.STATS_REPLY))  #: frame kinds that answer


def deliver(address: str, connection: Any, frame: Frame, call: Call) -> None:
    """Complete ``call``'s future with the answer ``frame`` of worker ``address`` (read on ``connection``).

    A pong is the round trip's time at once; any other answer is unpickled by the thread that asks for it.
    """
    if frame.kind is Kind.PONG:
        call.future.complete(time.monotonic() - call.started)
        return
    call.future.answered(frame, functools.partial(decode, address, connection, call.subject, call.transform))


def decode(address: str, connection: Any, subject: str | Callable, transform: Callable | None, frame: Frame) -> Any:
    """The result the answer ``frame`` to a call of ``subject`` brings, through ``transform`` if any; raise its
    error. (Given the call's parts, not the call: the future keeps this until then, and the call holds the
    future.)"""
    result, error = outcome(address, connection, frame, subject)
    if error is None and transform is not None:
        try:
            result = transform(result)
        except Exception as exc:
            exc.add_note(f"while unpickling the answer of worker {address} to {describe_call(subject)}")
            error = exc
    if error is not None:
        raise error
    return result


def outcome(address: str, connection: Any, frame: Frame, subject: str | Callable) -> tuple[Any, Exception | None]:
    """What the answer ``frame`` of worker ``address`` (read on ``connection``) to a call of ``subject`` (a function,
    or a text such as ``"a ping"``) brings: ``(result, None)``, or ``(None, the exception to raise)``."""
    kind = frame.kind
    if kind is Kind.RESULT:
        try:
            return loads_from(address, connection, frame.payload, frame.buffers), None
        except Exception as exc:
            exc.add_note(f"while unpickling the answer of worker {address} to {describe_call(subject)}")
            return None, exc
    if kind is Kind.STATS_REPLY:
        return decode_stats(frame.payload), None
    if kind is Kind.ERROR:
        return None, load_exception(frame.payload, address)
    reason = decode_rejected(frame.payload)
    if reason == DEFAULT_REJECTION:  # the worker drains: it said LEAVING before it rejected anything
        return None, WorkerLeaving(f"worker {address} did not run {describe_call(subject)}: {reason}", address)
    return None, WorkerUnavailable(f"worker {address} did not run {describe_call(subject)}: {reason}")


def overdue_error(
    address: str, subject: str | Callable, timeout: float, connected: bool, last_connect_error: BaseException | None
) -> Exception:
    """The error of a call of ``subject`` past its deadline: the worker did not answer, or could not be reached."""
    if connected:
        return WorkerTimeout(f"worker {address} did not answer {describe_call(subject)} within {timeout:g}s")
    return WorkerUnavailable(
        f"could not connect to rpcdl worker {address} within {timeout:g}s "
        f"(last error: {last_connect_error or 'still connecting'})"
    )
