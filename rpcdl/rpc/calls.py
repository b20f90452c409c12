"""A call in flight: its id, deadline and how its answer is read, and the future its caller holds.

Threading model: a :class:`Call` is made by the calling thread and then read by
whichever thread reads its answer; its fields do not change after it is made,
except :attr:`Call.read_by`, which only its connection changes, under its
lock (see :class:`rpcdl.rpc.state.PendingCalls`). Its future is completed
once, by whichever thread takes the call from the pending calls
(:meth:`CallFuture.complete`, :meth:`CallFuture.fail`); torch's future is
thread-safe, and the future's Python copy of its outcome is written before
torch's, which publishes it.
"""

from __future__ import annotations

import copy
import enum
import itertools
import threading
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
    """What a call goes over, and reads its answer for a thread that waits (a
    :class:`~rpcdl.rpc.connection.Connection`)."""

    def wait(self, call: Call) -> None: ...

    def read_in_background(self, call: Call) -> None: ...


_NO_RESULT = object()


def pending_call(future: torch.futures.Future) -> Call | None:
    """The call of an rpcdl ``future`` while it waits for its answer; ``None`` for another future, or once the
    call is answered (the future holds its call weakly)."""
    return future._call() if isinstance(future, CallFuture) else None


class CallFuture(torch.futures.Future):
    """The future of a call: waiting on it reads answers from the worker meanwhile.

    So a thread blocked in ``wait()`` gets its answer without a thread switch,
    and waiting inside a callback (which runs on whichever thread read the
    answer) cannot starve the connection. Its outcome is also kept in Python:
    ``wait()`` and ``value()`` return a result from there once the future is
    done, because torch's own release the GIL, and a thread giving it up while
    another runs Python waits for that thread's next switch (milliseconds).
    An error is raised as a copy (see :func:`raisable`), so the frames it
    passes through are freed with it; torch's future keeps a copy without a
    traceback, the only one the cyclic collector cannot see (a remote
    error's traceback may hold frames of the thread that read it, which hold
    this future). It extends :class:`torch.futures.Future` through its public
    methods only.

    Args:
        call: the call whose answer completes it (held weakly: the answer's
            reader holds the call until it completes the future).
    """

    _result: Any = _NO_RESULT  # set before torch's result, by complete()
    _error: BaseException | None = None  # set before torch's, by fail()

    def __init__(self, call: Call) -> None:
        super().__init__()
        self._call = weakref.ref(call)  # weak: no cycle holds the result; dead once answered

    def complete(self, result: Any) -> None:
        """Complete the future with ``result`` (its call's answer)."""
        self._result = result
        self.set_result(result)

    def fail(self, error: Exception) -> None:
        """Complete the future with ``error`` (why its call got no answer, or the remote error)."""
        self._error = error
        self.set_exception(_copy(error, None))

    def wait(self) -> Any:
        if not self.done():
            call = self._call()  # None once answered: the outcome is there or being set
            if call is not None:
                call.connection.wait(call)
            if not self.done():  # another thread took the call from the pending calls, and completes it now
                completed = threading.Event()
                self.add_done_callback(lambda _: completed.set())
                completed.wait()
        return self._outcome()

    def value(self) -> Any:
        return self._outcome() if self.done() else super().value()

    def then(self, callback: Callable[[torch.futures.Future], Any]) -> torch.futures.Future:
        """As torch's ``then``, but an error ``callback`` raises is the new future's error as it is.

        torch's own wraps it in a ``RuntimeError`` ("Got the following error
        when running the callback: ...", with torch's frames in the text).

        Args:
            callback: called with this future once it is done, on the thread that completes it.

        Returns:
            a future of what ``callback`` returns, or of its error.

        Example::

            >>> rpcdl.rpc_async(worker, len, ([1, 2],)).then(lambda f: f.value() * 10).wait()  # doctest: +SKIP
            20
        """
        following: torch.futures.Future = torch.futures.Future()

        def run(done: torch.futures.Future) -> None:
            try:
                result = callback(done)
            except Exception as exc:
                following.set_exception(_copy(exc, None))  # no traceback kept by torch's future (see raisable)
                return
            following.set_result(result)

        self.add_done_callback(run)
        return following

    def _outcome(self) -> Any:
        result = self._result
        if result is not _NO_RESULT:
            return result
        if self._error is not None:
            raise raisable(self._error)
        return super().wait()  # completed through torch's own methods


def raisable(error: BaseException) -> BaseException:
    """A copy of ``error`` to raise, so that ``error`` itself never holds a traceback.

    Raising an exception ties to it every frame it passes through, and a torch
    future keeps its error where the cyclic garbage collector cannot see it:
    raised itself, the error would keep the frames that waited on the future
    (which hold the future) alive for ever, and all they hold. A copy raised
    instead goes with its frames. An error that does not rebuild from its
    arguments is returned itself.

    Example::

        >>> error = ValueError("bad")
        >>> copied = raisable(error)
        >>> type(copied), copied.args, copied is error
        (<class 'ValueError'>, ('bad',), False)
    """
    return _copy(error, error.__traceback__)


def _copy(error: BaseException, traceback: Any) -> BaseException:
    """``error`` anew (type, arguments, attributes, notes, cause, context) with ``traceback``; ``error`` itself
    if it does not rebuild from its arguments."""
    try:
        fresh = copy.copy(error)
    except Exception:
        return error
    if type(fresh) is not type(error):
        return error
    fresh.__dict__.update(error.__dict__)  # what a __reduce__ of its own may leave out (notes, attributes)
    notes = getattr(error, "__notes__", None)
    if notes is not None:
        fresh.__notes__ = list(notes)  # notes added to the copy stay its own
    fresh.__cause__, fresh.__context__ = error.__cause__, error.__context__
    fresh.__suppress_context__ = error.__suppress_context__
    return fresh.with_traceback(traceback)


def describe(func: Callable) -> str:
    """How messages name a call of ``func``: ``"name()"``."""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__name__
    return f"{name}()"


def describe_call(subject: str | Callable) -> str:
    """How messages name a call of ``subject``, a function (``"name()"``) or already a text (``"a ping"``)."""
    return subject if type(subject) is str else describe(subject)


def next_call_id() -> int:
    """A new call id, unique in this process (``itertools.count`` steps atomically)."""
    return next(_call_ids)


class Call:
    """One call: its id, deadline, what it is (for messages), and who reads its answer.

    Args:
        connection: what the call goes over (and what reads its answer for a thread that waits).
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
        "__weakref__",
        "call_id",
        "connection",
        "deadline",
        "future",
        "pin_memory",
        "read_by",
        "started",
        "subject",
        "timeout",
        "transform",
    )

    def __init__(
        self,
        connection: AnswerReader,
        timeout: float,
        what: str | Callable,
        *,
        sync: bool,
        pin_memory: bool = False,
        transform: Callable | None = None,
        call_id: int = 0,
        started: float = 0.0,
    ):
        self.call_id = call_id or next_call_id()
        self.connection = connection
        self.future = CallFuture(self)
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
