"""Calls made while the worker is busy with others leave together: a real worker in this process, over loopback.

A gated call keeps the worker busy (the connection has a call in flight), so
whether the next call waits in the outbox is decided by the test, not by
timing; a long deferral delay makes every flush one the test can attribute.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import GATES, gated, gated_workers

import rpcdl
import rpcdl.rpc.sending
from rpcdl.rpc import client
from rpcdl.rpc.outbox import OutboxState

pytestmark = pytest.mark.timeout(20)


def echo(value):
    return value


@pytest.fixture
def workers(monkeypatch):
    """Two workers in this process, two slots each, and fresh client connections."""
    monkeypatch.setattr(rpcdl.rpc.sending, "DEFER_DELAY", 5.0)
    with gated_workers(2) as started:
        yield started


def _busy(address: str) -> tuple[threading.Event, torch.futures.Future]:
    """A call the worker runs until the test opens its gate; the connection is open and busy."""
    rpcdl.ping(address)
    gate = GATES.setdefault(f"busy-{address}", threading.Event())
    return gate, rpcdl.rpc_async(address, gated, (f"busy-{address}", 0))


def _outbox_state(address: str) -> OutboxState | None:
    return client.connection_to(address).status().outbox


def test_a_call_with_none_in_flight_goes_at_once_and_one_made_while_busy_waits_for_the_thread_to_wait(workers):
    address = workers[0].address
    rpcdl.ping(address)
    first = rpcdl.rpc_async(address, echo, (1,))
    assert _outbox_state(address) is OutboxState.IDLE  # none in flight: sent at once
    assert first.wait() == 1
    gate, busy = _busy(address)
    assert _outbox_state(address) is OutboxState.IDLE
    later = rpcdl.rpc_async(address, echo, (2,))
    assert _outbox_state(address) is OutboxState.DEFERRED
    started = time.monotonic()
    assert later.wait() == 2  # waiting flushes it (the delay is 5 s)
    assert time.monotonic() - started < 4
    gate.set()
    assert busy.wait() == 0


def test_a_call_with_tensors_is_never_deferred_and_takes_the_deferred_ones_with_it(workers):
    address = workers[0].address
    gate, busy = _busy(address)
    deferred = rpcdl.rpc_async(address, echo, (1,))
    assert _outbox_state(address) is OutboxState.DEFERRED
    tensor = torch.arange(4)
    with_tensor = rpcdl.rpc_async(address, echo, (tensor,))
    assert _outbox_state(address) is OutboxState.IDLE  # sent at once, after the deferred one
    tensor += 10  # the caller may change it now: what was sent is unchanged
    deadline = time.monotonic() + 5
    while not (deferred.done() and with_tensor.done()):  # no wait(): nothing else flushes
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert deferred.wait() == 1
    assert with_tensor.wait().tolist() == [0, 1, 2, 3]
    gate.set()
    busy.wait()


def test_the_connections_thread_sends_deferred_calls_of_a_thread_that_goes_on_without_waiting(workers, monkeypatch):
    monkeypatch.setattr(rpcdl.rpc.sending, "DEFER_DELAY", 0.2)
    address = workers[0].address
    gate, busy = _busy(address)
    futures = [rpcdl.rpc_async(address, echo, (n,)) for n in range(5)]
    assert _outbox_state(address) is OutboxState.DEFERRED
    deadline = time.monotonic() + 5
    while not all(future.done() for future in futures):  # this thread never waits: the connection's thread sends
        assert time.monotonic() < deadline, "the deferred calls never left"
        time.sleep(0.005)
    assert [future.wait() for future in futures] == list(range(5))
    gate.set()
    busy.wait()


def test_a_thread_waiting_on_another_worker_first_sends_what_it_deferred(workers):
    first, second = (worker.address for worker in workers)
    gate, busy = _busy(first)
    deferred = rpcdl.rpc_async(first, echo, (1,))
    assert _outbox_state(first) is OutboxState.DEFERRED
    assert rpcdl.rpc_sync(second, echo, (2,)) == 2  # this thread waits: its deferred call leaves first
    assert _outbox_state(first) is OutboxState.IDLE
    gate.set()
    assert deferred.wait() == 1 and busy.wait() == 0


def test_many_threads_pipelining_on_one_connection_get_every_answer(workers):
    address = workers[0].address
    rpcdl.ping(address)
    results: dict[int, list] = {}

    def pipeline(index: int) -> None:
        window = []
        got = []
        for number in range(300):
            window.append(rpcdl.rpc_async(address, echo, ((index, number),)))
            if len(window) >= 16:
                got.append(window.pop(0).wait())
            if number % 97 == 0:
                time.sleep(0.002)  # goes on with something else while calls are deferred
        got.extend(future.wait() for future in window)
        results[index] = got

    threads = [threading.Thread(target=pipeline, args=(i,), name=f"test-pipeline-{i}") for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert not any(thread.is_alive() for thread in threads)
    for index in range(4):
        assert results[index] == [(index, number) for number in range(300)]


def test_a_call_creating_an_rref_is_never_deferred(workers):
    address = workers[0].address
    gate, busy = _busy(address)
    rref = rpcdl.remote(address, echo, (5,))
    assert _outbox_state(address) is OutboxState.IDLE  # another worker may name it at once
    gate.set()
    assert rref.to_here() == 5 and busy.wait() == 0
