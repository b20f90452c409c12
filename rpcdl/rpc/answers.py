"""What a connection does with an answer it read, or a call that got none: completing the call's future.

Threading model: these functions run in whichever thread read the answer (or
found the call overdue), outside the connection's lock: unpickling and
callbacks may make calls.
"""

from __future__ import annotations

import select
import socket
import time
from typing import Any

from ..errors import WorkerTimeout, WorkerUnavailable
from ..serialization.pickling import load_exception, loads_from
from ..transport.control import decode_rejected, decode_stats
from ..transport.tls_stream import TLSStream
from ..transport.wire import Frame, Kind
from .calls import Call, set_future_result

ANSWERS = frozenset((Kind.RESULT, Kind.ERROR, Kind.REJECTED, Kind.PONG, Kind.STATS_REPLY))  #: frame kinds that answer


def deliver(address: str, connection: Any, frame: Frame, call: Call) -> None:
    """Complete ``call``'s future with the answer ``frame`` of worker ``address`` (read on ``connection``)."""
    try:
        if frame.kind == Kind.RESULT:
            value = loads_from(address, connection, frame.payload, frame.buffers)
            result = call.transform(value) if call.transform is not None else value
        elif frame.kind == Kind.STATS_REPLY:
            result = decode_stats(frame.payload)
        elif frame.kind == Kind.PONG:
            result = time.monotonic() - call.started
        elif frame.kind == Kind.ERROR:
            call.future.set_exception(load_exception(frame.payload, address))
            return
        else:
            reason = decode_rejected(frame.payload)
            call.future.set_exception(WorkerUnavailable(f"worker {address} did not run {call.what}: {reason}"))
            return
    except Exception as exc:
        exc.add_note(f"while unpickling the answer of worker {address} to {call.what}")
        call.future.set_exception(exc)
        return
    set_future_result(call.future, result)


def overdue_error(address: str, call: Call, connected: bool, last_connect_error: BaseException | None) -> Exception:
    """The error of ``call``, past its deadline: the worker did not answer, or could not be reached."""
    if connected:
        return WorkerTimeout(f"worker {address} did not answer {call.what} within {call.timeout:g}s")
    return WorkerUnavailable(
        f"could not connect to rpcdl worker {address} within {call.timeout:g}s "
        f"(last error: {last_connect_error or 'still connecting'})"
    )


def readable(sock: socket.socket) -> bool:
    """Whether bytes wait to be read on ``sock`` (a TLS stream may hold some already decrypted)."""
    if isinstance(sock, TLSStream) and sock.pending():
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
