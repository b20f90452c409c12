"""The state of a connection as pure transitions (no sockets): its lifecycle, the reading role, the table of
pending calls, and when its thread must be woken."""

from __future__ import annotations

import math

from rpcdl.errors import ConnectionLost, WorkerUnavailable
from rpcdl.rpc.calls import Call, ReadBy
from rpcdl.rpc.held import answers_read_here
from rpcdl.rpc.state import Alarm, Closed, Connecting, PendingCalls, Reader, ReadingRole
from rpcdl.transport.wire import Frame, Kind


class _NoConnection:
    """What a call made in a pure test goes over: nothing reads for it."""

    def wait(self, call: Call) -> None:
        raise AssertionError("nothing waits in these tests")

    def read_in_background(self, call: Call) -> None:
        raise AssertionError("nothing reads in these tests")


def _call(*, sync: bool = False, timeout: float = 10.0, read_here: bool = False) -> Call:
    if read_here:
        with answers_read_here():
            return Call(_NoConnection(), timeout, "f()", sync=sync)
    return Call(_NoConnection(), timeout, "f()", sync=sync)


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


def test_the_reading_role_is_held_by_one_reader_at_a_time():
    role = ReadingRole()
    assert role.free and role.holder is Reader.NOBODY
    assert role.take(Reader.CALLER)
    assert not role.take(Reader.BACKGROUND) and role.holder is Reader.CALLER
    role.give_back(now=1.0)
    assert role.take(Reader.BACKGROUND) and role.holder is Reader.BACKGROUND


def test_who_reads_a_call_follows_how_it_was_made():
    assert _call(sync=True).read_by is ReadBy.WAITER
    assert _call().read_by is ReadBy.BACKGROUND
    assert _call(read_here=True).read_by is ReadBy.CALLER
    assert _call(sync=True, read_here=True).read_by is ReadBy.WAITER


def test_the_table_counts_background_answers_by_itself_through_every_transition():
    calls = PendingCalls(patience=0.1)
    waiter, background, mine = _call(sync=True), _call(), _call(read_here=True)
    for call in (waiter, background, mine):
        calls.add(call, now=0.0)
    assert (len(calls), calls.background, calls.left_to_callers) == (3, 1, 1)
    assert calls.adopt([mine, waiter]) == 1  # only an answer left to its caller moves
    assert (calls.background, calls.left_to_callers) == (2, 0) and mine.read_by is ReadBy.BACKGROUND
    assert calls.pop(background.call_id) is background and calls.pop(background.call_id) is None
    assert calls.background == 1
    assert calls.clear() == [waiter, mine]
    assert (len(calls), calls.background, calls.left_to_callers) == (0, 0, 0)


def test_answers_left_unread_past_the_patience_go_to_the_background():
    calls = PendingCalls(patience=0.1)
    mine = _call(read_here=True)
    calls.add(mine, now=5.0)
    assert calls.adopt_unread(now=5.05) == 0
    calls.caller_came(now=5.1)
    assert calls.adopt_unread(now=5.15) == 0 and mine.read_by is ReadBy.CALLER
    assert calls.adopt_unread(now=5.3) == 1 and calls.background == 1


def test_after_a_large_answer_new_calls_are_read_in_the_background_except_a_waiters():
    calls = PendingCalls(patience=0.1)
    calls.answers_are_large = True
    mine, waiter = _call(read_here=True), _call(sync=True)
    calls.add(mine, now=0.0)
    calls.add(waiter, now=0.0)
    assert mine.read_by is ReadBy.BACKGROUND and waiter.read_by is ReadBy.WAITER
    assert calls.background == 1


def test_overdue_calls_are_removed_once_and_the_next_check_moves_on():
    calls = PendingCalls(patience=0.1)
    soon, later = _call(timeout=1.0), _call(timeout=60.0)
    calls.add(soon, now=0.0)
    calls.add(later, now=0.0)
    assert calls.check_at == soon.deadline
    assert calls.pop_overdue(soon.deadline - 0.5) == []
    assert calls.pop_overdue(soon.deadline) == [soon]
    assert calls.check_at == later.deadline and calls.background == 1
    assert calls.pop_overdue(soon.deadline + 1) == []
    assert calls.latest_deadline() == later.deadline
    calls.pop(later.call_id)
    assert calls.pop_overdue(later.deadline + 1) == [] and calls.check_at == float("inf")


def test_the_connections_thread_reads_only_once_no_caller_has_been_here_for_the_delay():
    role = ReadingRole(background_delay=0.001)
    assert role.background_turn() == float("-inf")  # no caller yet: at once
    assert role.take(Reader.CALLER)
    assert role.background_turn() == float("inf")  # a caller reads: never
    role.give_back(now=5.0)
    assert role.background_turn() == 5.001  # it may come back: not before
    role.begin_waiting()
    role.begin_waiting()
    assert role.waiters == 2 and role.background_turn() == float("inf")
    role.end_waiting(now=6.0)
    assert role.waiters == 1 and role.background_turn() == float("inf")  # another still waits
    role.end_waiting(now=6.5)
    assert role.waiters == 0 and role.background_turn() == 6.501


def test_the_connections_own_reads_do_not_move_its_turn():
    role = ReadingRole(background_delay=0.001)
    role.take(Reader.CALLER)
    role.give_back(now=1.0)
    assert role.take(Reader.BACKGROUND)
    assert not role.free and role.background_turn() == 1.001  # its own reading is no caller's
    role.give_back(now=2.0)
    assert role.free and role.background_turn() == 1.001  # only callers leaving move it


def test_the_connections_thread_is_woken_only_when_asleep_past_what_became_due():
    alarm = Alarm()
    assert not alarm.wake_by(0.0)  # awake: it looks at everything before it sleeps
    alarm.sleep_until(10.0)
    assert not alarm.wake_by(10.0) and not alarm.wake_by(12.0)  # it looks by then anyway
    assert alarm.wake_by(3.0)  # due sooner: woken once
    assert not alarm.wake_by(1.0)  # woken already: it counts as awake
    alarm.woke()
    alarm.sleep_until(5.0)
    alarm.woke()
    assert not alarm.wake_by(0.0)  # it woke by itself


def test_a_caller_may_read_its_answers_only_while_they_are_left_to_it():
    calls = PendingCalls(patience=0.1)
    mine, background = _call(read_here=True), _call()
    calls.add(mine, now=0.0)
    calls.add(background, now=0.0)
    assert calls.left_to_caller([mine, background]) and not calls.left_to_caller([background])
    calls.adopt([mine])
    assert not calls.left_to_caller([mine])
    assert calls.get(mine.call_id) is mine and calls.pop(mine.call_id) is mine and calls.get(mine.call_id) is None
    assert not calls.left_to_caller([mine])  # answered: nothing left to read
