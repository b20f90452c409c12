"""A worker's counters: one lock for every count, however many threads count and read (real threads)."""

from __future__ import annotations

import threading

import pytest

from rpcdl.server.counters import Counters


def _in_thread(target) -> None:
    thread = threading.Thread(target=target, name="rpcdl-test-counting")
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_counts_of_several_threads_are_summed(switching_often):
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


def test_totals_read_while_threads_count_never_show_a_call_answered_and_not_received(switching_often):
    counters = Counters()
    done = threading.Event()
    seen: list[int] = []

    def read() -> None:
        while not done.is_set():
            seen.append(counters.totals()["outstanding"])

    reader = threading.Thread(target=read, name="rpcdl-test-reading")
    reader.start()
    try:
        for _ in range(4):
            _in_thread(lambda: [(counters.received(1, True), counters.sent(1, 1)) for _ in range(2000)])
    finally:
        done.set()
        reader.join(timeout=10)
    assert seen and min(seen) >= 0 and max(seen) <= 1
    assert counters.totals()["outstanding"] == 0


def test_rare_counters_are_added_under_the_lock():
    counters = Counters()
    counters.add(calls_rejected=1, connections_total=1)
    counters.add(calls_rejected=1, connections_refused=2)
    totals = counters.totals()
    assert (totals["calls_rejected"], totals["connections_total"], totals["connections_refused"]) == (2, 1, 2)


def test_an_unknown_counter_is_refused():
    with pytest.raises(KeyError):
        Counters().add(calls_lost=1)
