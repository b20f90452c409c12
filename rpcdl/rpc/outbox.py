"""Bytes many threads send on one socket: the thread that finds nobody sending writes the others' too.

Threading model: any thread may call :meth:`Outbox.send`. One thread at a time
is the sender (under ``_cond``); a thread that arrives while another sends
queues its pieces and waits until the sender has written them. So a send
returns once its bytes are in the socket, as if the thread had written them
itself (its tensors may change afterwards), and threads sending at once share
one system call instead of queueing for a lock to make one each. Order is the
order of arrival. A sender writes at most ``_ROUNDS`` rounds, then hands the
role to a waiting thread, so no thread sends for others for ever.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ..transport.wire import send_pieces

_ROUNDS = 4


class Outbox:
    """What threads send on ``sock``, written in arrival order with as few system calls as possible.

    Args:
        sock: a connected socket (or TLS stream) set up for frames.
        first: pieces to write before any sent later (the frames queued while connecting).
    """

    def __init__(self, sock: Any, first: Sequence[bytes | memoryview] = ()) -> None:
        self._sock = sock
        self._cond = threading.Condition(threading.Lock())
        self._pieces: list[bytes | memoryview] = list(first)
        self._queued = 1 if self._pieces else 0  # sends queued so far: the ticket of the last
        self._written = 0  # sends written (or failed) so far
        self._sending = False
        self._error: OSError | None = None

    def send(self, pieces: Sequence[bytes | memoryview]) -> None:
        """Write ``pieces`` after what was sent before; return once they are in the socket.

        Raises:
            OSError: the socket failed, on this send or an earlier one.
        """
        with self._cond:
            if self._error is not None:
                raise self._error
            self._pieces.extend(pieces)
            self._queued += 1
            ticket = self._queued
            while self._sending and self._written < ticket:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            if self._written >= ticket:  # written by the sender of the time
                return
            self._sending = True
        self._write()

    def _write(self) -> None:
        """Write what is queued, a few rounds at most, as the sender; then hand the role on."""
        error = None
        for _ in range(_ROUNDS):
            with self._cond:
                pieces, self._pieces = self._pieces, []
                upto = self._queued
            if not pieces:
                break
            try:
                send_pieces(self._sock, pieces)
            except OSError as exc:
                error = exc
            with self._cond:
                self._written = upto
                self._error = self._error or error
                self._cond.notify_all()
            if error is not None:
                break
        with self._cond:
            self._sending = False
            if self._written < self._queued:
                self._cond.notify_all()  # a waiting thread writes the rest
        if error is not None:
            raise error
