"""Bytes many threads send on one socket: the thread that finds nobody sending writes the others' too.

Threading model: any thread may call :meth:`Outbox.send`. One thread at a time
is the sender (under ``_lock``); a thread that arrives while another sends
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
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # senders waiting for theirs to be written
        self._pieces: list[bytes | memoryview] = list(first)  # queued, not yet taken by the sender
        self._queued = 1 if self._pieces else 0  # sends queued so far: the ticket of the last
        self._written = 0  # sends written (or failed) so far
        self._sending = False
        self._error: OSError | None = None

    def send(self, pieces: Sequence[bytes | memoryview]) -> None:
        """Write ``pieces`` after what was sent before; return once they are in the socket.

        Raises:
            OSError: the socket failed, on this send or an earlier one.
        """
        with self._lock:
            if self._error is not None:
                raise self._error
            self._queued += 1
            ticket = self._queued
            if not self._sending and not self._pieces:  # the usual case: nobody else sends
                taken = pieces
            else:  # another thread sends: it writes these too, or leaves them to this one
                self._pieces.extend(pieces)
                while self._sending and self._written < ticket:
                    self._cond.wait()
                if self._error is not None:
                    raise self._error
                if self._written >= ticket:
                    return
                taken, self._pieces = self._pieces, []
            self._sending = True
            upto, start = self._queued, self._written
        self._write(taken, upto, start)

    def _write(self, pieces: Sequence[bytes | memoryview], upto: int, start: int) -> None:
        """Write ``pieces`` (sends up to ``upto``), then what others queued meanwhile, a few rounds at most, as the
        sender (which it became once sends up to ``start`` were written); then hand the role on."""
        for rounds_left in range(_ROUNDS - 1, -1, -1):
            error = None
            try:
                if pieces:
                    send_pieces(self._sock, pieces)
            except OSError as exc:
                error = exc
            with self._lock:
                self._written = upto
                self._error = self._error or error
                more = bool(self._pieces) and error is None and rounds_left > 0
                if more:
                    pieces, self._pieces = self._pieces, []
                    upto = self._queued
                else:
                    self._sending = False  # what is left, a waiting thread writes
                if self._queued - start > 1:  # other threads queued sends since: they wait
                    self._cond.notify_all()
            if not more:
                break
        if error is not None:
            raise error
