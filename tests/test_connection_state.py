"""The state of a connection as pure transitions: the reading role and the table of pending calls (no sockets)."""

from __future__ import annotations

from rpcdl.rpc.calls import Call, ReadBy
from rpcdl.rpc.held import answers_read_here
from rpcdl.rpc.state import PendingCalls, Reader, ReadingRole


def _call(*, sync: bool = False, timeout: float = 10.0, read_here: bool = False) -> Call:
    if read_here:
        with answers_read_here():
            return Call(timeout, "f()", sync=sync)
    return Call(timeout, "f()", sync=sync)


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
    assert not role.callers_present and role.background_turn() == float("-inf")  # no caller yet: at once
    assert role.take(Reader.CALLER)
    assert role.callers_present and role.background_turn() == float("inf")  # a caller reads: never
    role.give_back(now=5.0)
    assert not role.callers_present and role.background_turn() == 5.001  # it may come back: not before
    role.begin_waiting()
    role.begin_waiting()
    assert role.waiters == 2 and role.callers_present and role.background_turn() == float("inf")
    role.end_waiting(now=6.0)
    assert role.waiters == 1 and role.background_turn() == float("inf")  # another still waits
    role.end_waiting(now=6.5)
    assert role.waiters == 0 and role.background_turn() == 6.501


def test_the_connections_own_reads_do_not_move_its_turn():
    role = ReadingRole(background_delay=0.001)
    role.take(Reader.CALLER)
    role.give_back(now=1.0)
    assert role.take(Reader.BACKGROUND)
    assert not role.callers_present and not role.free
    role.give_back(now=2.0)
    assert role.free and role.background_turn() == 1.001  # only callers leaving move it
