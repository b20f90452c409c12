"""A worker's counters: each thread counts in its own tally; reads sum them (pure logic, real threads)."""

from __future__ import annotations

import threading

from rpcdl.server.counters import Counters


def _in_thread(target) -> None:
    thread = threading.Thread(target=target, name="rpcdl-test-counting")
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_counts_of_several_threads_are_summed():
    counters = Counters()

    def count() -> None:
        for _ in range(100):
            counters.received(10, True)
            counters.ran(0.5, failed=False)
            counters.sent(20, 1)

    threads = [threading.Thread(target=count, name=f"rpcdl-test-counting-{i}") for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    counters.received(3, False)  # a control frame: bytes, no call
    counters.ran(1.0, failed=True)
    totals = counters.totals()
    assert totals["bytes_in"] == 4 * 100 * 10 + 3
    assert totals["bytes_out"] == 4 * 100 * 20
    assert totals["calls_served"] == 400 and totals["calls_failed"] == 1
    assert totals["busy_seconds"] == 4 * 100 * 0.5 + 1.0
    assert totals["outstanding"] == 0


def test_outstanding_counts_calls_received_and_not_answered_across_threads():
    counters = Counters()
    _in_thread(lambda: counters.received(100, True))  # read by one thread ...
    assert counters.outstanding == 1
    counters.sent(50, 1)  # ... answered by another
    assert counters.outstanding == 0


def test_a_retired_thread_keeps_its_counts_and_leaves_no_tally_behind():
    counters = Counters()

    def count_then_retire() -> None:
        counters.received(7, True)
        counters.sent(9, 1)
        counters.retire()

    for _ in range(3):
        _in_thread(count_then_retire)
    assert counters._tallies == []  # nothing grows with the threads that came and went
    totals = counters.totals()
    assert (totals["bytes_in"], totals["bytes_out"], totals["outstanding"]) == (21, 27, 0)


def test_retire_without_counting_and_counting_after_retiring():
    counters = Counters()
    counters.retire()  # never counted: nothing to fold
    counters.received(5, True)
    counters.retire()
    counters.sent(1, 1)  # counts again in a new tally
    totals = counters.totals()
    assert (totals["bytes_in"], totals["bytes_out"], totals["outstanding"]) == (5, 1, 0)


def test_rare_counters_are_added_under_the_lock():
    counters = Counters()
    counters.add(clients=1, connections_total=1)
    counters.add(clients=-1, connections_refused=2)
    totals = counters.totals()
    assert (totals["clients"], totals["connections_total"], totals["connections_refused"]) == (0, 1, 2)
