"""A call in flight: its id, deadline and how its answer is read, and the future its caller holds.

Threading model: a :class:`Call` is made by the calling thread and then read by
whichever thread reads its answer; its fields do not change after it is made.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from . import held

_call_ids = itertools.count(1)


class AnswerReader(Protocol):
    """What reads a call's answer for a thread that waits for it (a :class:`~rpcdl.rpc.connection.Connection`)."""

    def wait(self, call: Call) -> None: ...


class CallFuture(torch.futures.Future):
    """The future of a call: waiting on it reads answers from the worker meanwhile.

    So a thread blocked in ``wait()`` gets its answer without a thread switch,
    and waiting inside a callback (which runs on whichever thread read the
    answer) cannot starve the connection.
    """

    _connection: AnswerReader | None = None
    _call: Callable[[], Call | None] = staticmethod(lambda: None)  # a weak reference: no cycle holds the result

    def wait(self) -> Any:
        call = self._call()  # None once answered: the result is there or being set
        if call is not None and not self.done() and self._connection is not None:
            self._connection.wait(call)
        return super().wait()


class Call:
    """One call: its id, deadline, what it is (for messages), and who reads its answer."""

    __slots__ = (
        "__weakref__", "background", "call_id", "deadline", "future", "pin_memory", "started", "sync", "timeout",
        "transform", "what",
    )  # fmt: skip

    def __init__(
        self, timeout: float, what: str, *, sync: bool, pin_memory: bool = False, transform: Callable | None = None
    ):
        self.call_id = next(_call_ids)
        self.future = CallFuture()
        self.future._call = weakref.ref(self)
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.timeout = timeout
        self.pin_memory = pin_memory
        self.what = what
        self.transform = transform
        self.sync = sync
        # whether the connection's own thread reads the answer (else a thread waiting for it,
        # or one calling read_answers)
        self.background = not sync and not held.reads_here()
