"""The state of a connection as pure transitions (no sockets): its lifecycle and the table of pending calls."""

from __future__ import annotations

import math

from rpcdl.errors import ConnectionLost, WorkerUnavailable
from rpcdl.rpc.calls import Call
from rpcdl.rpc.state import Closed, Connecting, PendingCalls
from rpcdl.transport.wire import Frame, Kind


def _call(*, timeout: float = 10.0) -> Call:
    return Call(None, timeout, "f()")


def test_a_connecting_connection_queues_frames_in_order_and_keeps_trying_while_calls_want_it():
    connecting = Connecting(deadline=10.0)
    assert connecting.name == "connecting" and connecting.queued == [] and connecting.last_error is None
    first, second = Frame(Kind.CALL, 1), Frame(Kind.CALL, 2)
    connecting.queued.append(first)
    connecting.queued.append(second)
    assert connecting.queued == [first, second]
    refused = ConnectionRefusedError("refused")
    connecting.attempt_failed(refused)
    assert connecting.last_error is refused
    assert connecting.wanted_until(latest_call_deadline=-math.inf) == 10.0  # no call pending: its own deadline
    assert connecting.wanted_until(latest_call_deadline=25.0) == 25.0  # a call still wants it


def test_a_closed_connection_fails_calls_with_its_reason_and_error_type():
    closed = Closed("the connection was closed by rpcdl.shutdown()", ConnectionLost)
    error = closed.error()
    assert closed.name == "closed" and type(error) is ConnectionLost and str(error) == closed.reason
    assert type(Closed("refused for 20s", WorkerUnavailable).error()) is WorkerUnavailable


def test_overdue_calls_are_removed_once_and_the_next_check_moves_on():
    calls = PendingCalls()
    soon, later = _call(timeout=1.0), _call(timeout=60.0)
    calls.add(later)
    assert calls.check_at == later.deadline  # the first: no call is overdue before it
    calls.add(soon)
    assert calls.check_at == soon.deadline  # sooner than the first: the check moves
    calls.add(_call(timeout=120.0))
    assert len(calls) == 3 and calls.check_at == soon.deadline
    assert calls.pop_overdue(soon.deadline - 0.5) == []
    assert calls.pop_overdue(soon.deadline) == [soon]
    assert calls.check_at == later.deadline and soon.call_id not in calls
    assert calls.pop_overdue(soon.deadline + 1) == []
    assert calls.pop(later.call_id) is later and calls.pop(later.call_id) is None
    assert len(calls.clear()) == 1 and len(calls) == 0 and calls.check_at == math.inf


def test_calls_have_ids_of_their_own_and_deadlines_from_when_they_were_made():
    first, second = Call(None, 5.0, "a ping", started=100.0), _call()
    assert first.call_id != second.call_id
    assert first.deadline == 105.0 and first.what == "a ping"
