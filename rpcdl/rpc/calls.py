"""A call in flight: its id and deadline, and the future its caller holds.

Threading model: a :class:`Call` is made by the calling thread and handed to
the event loop (``rpcdl-loop``), which owns it from then on: its fields do not
change after it is made. Its future is completed once, by the loop (an answer,
a deadline passed, the connection closed) or by the calling thread (a call
refused at once); torch's future is thread-safe, and the future's Python copy
of its outcome is written before torch's, which publishes it. An answer is
kept as it came (a frame) and unpickled by the first thread that asks for the
result (:meth:`CallFuture.wait`, :meth:`CallFuture.value`), never by the loop
unless a callback asks there; ``_decoding`` guards that one unpickling.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

_call_ids = itertools.count(1)


_NO_RESULT = object()


class CallFuture(torch.futures.Future):
    """The future of a call, completed by the event loop; its answer is unpickled by a thread that waits for it.

    When the answer comes, the loop hands it over as it came (:meth:`answered`).
    If a thread waits for it (:meth:`wait`, :meth:`value`) or said it will take
    it (:meth:`when_answered`, the data loader), that thread unpickles it: user
    code never runs on the loop for it. Otherwise (nobody waits yet, or torch's
    own functions wait, such as :func:`torch.futures.wait_all`) the loop
    unpickles it then, so torch's future completes as it would. A callback
    added with ``then`` or ``add_done_callback`` runs on the thread that
    completes the future (often the loop's): it must be quick and must not
    wait for a call. Its outcome is also kept in Python: ``wait()`` and
    ``value()`` return a result from there once the future is done. An error
    is raised as a copy (see :func:`raisable`), so the frames it passes
    through are freed with it; torch's future keeps a copy without a
    traceback, the only one the cyclic collector cannot see. It extends
    :class:`torch.futures.Future` through its public methods only.

    Threading: ``_lock`` guards the answer not yet unpickled, who takes it
    (``_taken``) and the hooks; ``_pending`` is held from creation until the
    outcome is here (a thread waits by taking it, which a signal interrupts).
    """

    _result: Any = _NO_RESULT  # set before torch's result
    _error: BaseException | None = None  # set before torch's

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._pending = threading.Lock()
        self._pending.acquire()
        self._answer: tuple[Any, Callable[[Any], Any]] | None = None  # (frame, decode) until unpickled
        self._arrived = False
        self._taken = False  # a thread will unpickle the answer: the loop must not
        self._hooks: list[Callable[[CallFuture], Any]] = []

    # ------------------------------------------------------------------ completed by the loop (or a caller)

    def complete(self, result: Any) -> None:
        """Complete the future with ``result`` (nothing to unpickle)."""
        self._result = result
        self.set_result(result)
        self._arrive()

    def fail(self, error: Exception) -> None:
        """Complete the future with ``error`` (why its call got no answer)."""
        self._error = error
        self.set_exception(_copy(error, None))
        self._arrive()

    def answered(self, frame: Any, decode: Callable[[Any], Any]) -> None:
        """The answer ``frame`` came, which ``decode`` turns into the result (or raises): a thread that takes
        it unpickles it, else this one does now."""
        with self._lock:
            self._answer = (frame, decode)
            taken = self._taken
            if taken:  # arrived at once, in the same hold of the lock: the thread that takes it unpickles it
                self._arrived = True
                hooks, self._hooks = self._hooks, []
        if not taken:
            self._decode()
            self._arrive()
            return
        self._pending.release()
        for hook in hooks:
            hook(self)

    # ------------------------------------------------------------------ for the caller's threads

    def when_answered(self, hook: Callable[[CallFuture], Any]) -> None:
        """Call ``hook(self)`` once the outcome is here (at once if it is), without unpickling the answer: the
        thread that takes it from there does, with :meth:`wait` (a hook runs on the loop: it must be quick)."""
        with self._lock:
            self._taken = True
            if not self._arrived:
                self._hooks.append(hook)
                return
        hook(self)

    def done(self) -> bool:
        return self._arrived or super().done()

    def wait(self) -> Any:
        if not self._arrived and not super().done():  # (done already: a callback of its own completion)
            with self._lock:
                self._taken = True
            self._pending.acquire()  # a signal (Ctrl-C) interrupts this wait, not torch's
            self._pending.release()
        return self._outcome()

    def value(self) -> Any:
        return self._outcome() if self._arrived else super().value()

    def add_done_callback(self, callback: Callable[[torch.futures.Future], Any]) -> None:
        with self._lock:
            waiting = self._answer is not None
        if waiting:  # arrived, taken by a thread that did not unpickle it yet: the callback needs the result
            self._decode()
        super().add_done_callback(callback)

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

    def _arrive(self) -> None:
        with self._lock:
            self._arrived = True
            hooks, self._hooks = self._hooks, []
        self._pending.release()
        for hook in hooks:
            hook(self)

    def _outcome(self) -> Any:
        if self._answer is not None:
            self._decode()
        result = self._result
        if result is not _NO_RESULT:
            return result
        if self._error is not None:
            raise raisable(self._error)
        return super().wait()  # completed through torch's own methods

    def _decode(self) -> None:
        """Unpickle the answer (once, whoever asks first) and complete torch's future with the outcome."""
        with self._lock:
            answer, self._answer = self._answer, None
        if answer is None:
            return  # unpickled by another thread, or being: torch's future is complete, or about to be
        frame, decode = answer
        try:
            result = decode(frame)
        except Exception as exc:
            # Not this frame nor decode's: they hold the future (and the call), which would never be freed.
            tb = exc.__traceback__
            self._error = exc.with_traceback(tb.tb_next.tb_next if tb is not None and tb.tb_next else None)
            self.set_exception(_copy(exc, None))
            return
        self._result = result
        self.set_result(result)


def when_answered(future: torch.futures.Future, hook: Callable[[torch.futures.Future], Any]) -> None:
    """Call ``hook(future)`` once ``future`` is done, leaving an rpcdl call's answer to be unpickled by the
    thread that then waits for it (see :meth:`CallFuture.when_answered`); any other future's callback.

    Args:
        future: an rpcdl call's future, or any torch future.
        hook: called on the thread that completes it (for an rpcdl call, the loop): quick, and no waiting.

    Example::

        >>> done = []
        >>> when_answered(torch.futures.Future(), done.append)
    """
    if isinstance(future, CallFuture):
        future.when_answered(hook)
    else:
        future.add_done_callback(hook)


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
    """One call: its id, deadline, what it is (for messages), and its future.

    Args:
        connection: what the call goes over.
        timeout: seconds from now until the call is overdue.
        what: what the call is, for messages (``"a ping"``), or the function it calls, described only when a
            message needs it.
        pin_memory: receive its tensors into pinned memory.
        transform: applied to the result before the caller gets it.
        started: when it was made (``time.monotonic()``), when that was before; by default now.
    """

    __slots__ = (
        "call_id",
        "connection",
        "deadline",
        "future",
        "pin_memory",
        "started",
        "subject",
        "timeout",
        "transform",
    )

    def __init__(
        self,
        connection: Any,
        timeout: float,
        what: str | Callable,
        *,
        pin_memory: bool = False,
        transform: Callable | None = None,
        started: float = 0.0,
    ):
        self.call_id = next(_call_ids)
        self.connection = connection
        self.future = CallFuture()
        self.started = started = started or time.monotonic()
        self.deadline = started + timeout
        self.timeout = timeout
        self.pin_memory = pin_memory
        self.subject = what  #: the function called, or a text such as ``"a ping"``
        self.transform = transform

    @property
    def what(self) -> str:
        """What the call is, for messages: ``"f()"``, ``"a ping"``."""
        return describe_call(self.subject)
