"""A call in flight: its id, deadline and how its answer is read, and the future its caller holds.

Threading model: a :class:`Call` is made by the calling thread and then read by
whichever thread reads its answer; its fields do not change after it is made,
except :attr:`Call.read_by`, which only its connection changes, under its
lock (see :class:`rpcdl.rpc.state.PendingCalls`).
"""

from __future__ import annotations

import enum
import itertools
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from . import held

_call_ids = itertools.count(1)


class ReadBy(enum.Enum):
    """Who reads the answer of a call."""

    WAITER = "waiter"  #: the thread that made it, blocked until it comes (rpc_sync, ping, stats)
    CALLER = "caller"  #: the thread that made it, when it waits or calls read_answers (answers_read_here)
    BACKGROUND = "background"  #: the connection's own thread


class AnswerReader(Protocol):
    """What reads a call's answer for a thread that waits for it (a :class:`~rpcdl.rpc.connection.Connection`)."""

    def wait(self, call: Call) -> None: ...


_CFuture = torch._C.Future  # the methods of torch.futures.Future, minus its Python wrappers
_NO_DEVICES: list = []
future_done: Callable[[torch.futures.Future], bool] = _CFuture.done  #: ``future.done()``, one call less
_set_result: Callable[[torch.futures.Future, Any], None] = _CFuture.set_result
_NO_RESULT = object()


def set_future_result(future: CallFuture, result: Any) -> None:
    """Complete a call's ``future`` with ``result``; waiting on it then returns ``result`` without torch."""
    future._result = result
    _set_result(future, result)


class CallFuture(torch.futures.Future):
    """The future of a call: waiting on it reads answers from the worker meanwhile.

    So a thread blocked in ``wait()`` gets its answer without a thread switch,
    and waiting inside a callback (which runs on whichever thread read the
    answer) cannot starve the connection. A result is also kept in Python:
    ``wait()`` and ``value()`` return it from there once the future is done,
    because torch's own release the GIL, and a thread giving it up while
    another runs Python waits for that thread's next switch (milliseconds).
    """

    _connection: AnswerReader | None = None
    _call: Callable[[], Call | None] = staticmethod(lambda: None)  # a weak reference: no cycle holds the result
    _result: Any = _NO_RESULT  # set (before torch's result) by set_future_result

    def __init__(self) -> None:
        _CFuture.__init__(self, _NO_DEVICES)  # no CUDA devices: what torch.futures.Future() does

    def wait(self) -> Any:
        if not _CFuture.done(self):
            call = self._call()  # None once answered: the result is there or being set
            if call is not None and self._connection is not None:
                self._connection.wait(call)
        result = self._result
        if result is _NO_RESULT or not _CFuture.done(self):
            return _CFuture.wait(self)  # an error (raised by torch), or completed another way
        return result

    def value(self) -> Any:
        result = self._result
        if result is _NO_RESULT or not _CFuture.done(self):
            return _CFuture.value(self)
        return result


def describe(func: Callable) -> str:
    """How messages name a call of ``func``: ``"name()"``."""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__name__
    return f"{name}()"


def describe_call(subject: str | Callable) -> str:
    """How messages name a call of ``subject``, a function (``"name()"``) or already a text (``"a ping"``)."""
    return subject if type(subject) is str else describe(subject)


next_call_id: Callable[[], int] = _call_ids.__next__  #: a new call id, unique in this process


class Call:
    """One call: its id, deadline, what it is (for messages), and who reads its answer.

    Args:
        timeout: seconds from now until the call is overdue.
        what: what the call is, for messages (``"a ping"``), or the function it calls, described only when a
            message needs it.
        sync: whether the thread making it blocks until it is answered (it reads the answer).
        pin_memory: receive its tensors into pinned memory.
        transform: applied to the result before the future completes.
        call_id: its id, when it was taken before (:func:`next_call_id`); by default a new one.
        started: when it was made (``time.monotonic()``), when that was before; by default now.
    """

    __slots__ = (
        "__weakref__", "call_id", "deadline", "future", "pin_memory", "read_by", "started", "subject", "timeout",
        "transform",
    )  # fmt: skip

    def __init__(
        self,
        timeout: float,
        what: str | Callable,
        *,
        sync: bool,
        pin_memory: bool = False,
        transform: Callable | None = None,
        call_id: int = 0,
        started: float = 0.0,
    ):
        self.call_id = call_id or next(_call_ids)
        self.future = future = CallFuture()
        future._call = weakref.ref(self)
        self.started = started = started or time.monotonic()
        self.deadline = started + timeout
        self.timeout = timeout
        self.pin_memory = pin_memory
        self.subject = what  #: the function called, or a text such as ``"a ping"``
        self.transform = transform
        if sync:
            self.read_by = ReadBy.WAITER
        else:
            self.read_by = ReadBy.CALLER if held.reads_here() else ReadBy.BACKGROUND

    @property
    def what(self) -> str:
        """What the call is, for messages: ``"f()"``, ``"a ping"``."""
        return describe_call(self.subject)
