"""Jobs sharing a worker get fair shares of its time: a greedy client cannot starve a modest one.

The queue's policy alone (:class:`rpcdl.server.fair_queue.FairQueue`): turns
among equals, equal time among clients whose calls last differently, no idle
time banked; then real client processes hammering real worker processes (the
items/s two trainers with unequal batches get are measured in
``benchmarks/scale_processes.py``, never asserted here).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from rpcdl.local import child_environment
from rpcdl.server.fair_queue import FairQueue

_CLIENT = str(Path(__file__).resolve().parent / "fair_client.py")


def test_the_fair_queue_takes_clients_in_turn_and_keeps_each_clients_order():
    queue: FairQueue[str, int] = FairQueue()
    for call in range(6):
        queue.push("greedy", call)
    queue.push("modest", 100)
    assert queue.pop() == ("greedy", 0)
    queue.push("modest", 101)  # arrives while it waits its turn
    queue.push("late", 200)  # joins the rotation at its end
    assert [queue.pop() for _ in range(5)] == [
        ("modest", 100),
        ("greedy", 1),
        ("late", 200),
        ("modest", 101),
        ("greedy", 2),
    ]
    assert (len(queue), queue.clients()) == (3, 1)
    assert [call for _, call in (queue.pop() for _ in range(3))] == [3, 4, 5]
    assert not queue
    with pytest.raises(IndexError):
        queue.pop()


def test_the_queue_takes_the_waiting_client_that_used_the_least_time():
    queue: FairQueue[str, int] = FairQueue()
    for call in range(4):
        queue.push("long", call)
        queue.push("short", 100 + call)
    order = []
    for _ in range(8):
        client, call = queue.pop()
        order.append(call)
        queue.charge(client, 0.008 if client == "long" else 0.002)  # as the slot measured it
    # long's first call weighs four of short's: short runs until it has used as much
    assert order == [0, 100, 101, 102, 103, 1, 2, 3]


def test_busy_clients_get_equal_time_whatever_their_calls_last():
    queue: FairQueue[str, int] = FairQueue()
    durations = {"batches-of-16": 0.032, "batches-of-2": 0.004}
    used = dict.fromkeys(durations, 0.0)
    for client in durations:
        for call in range(8):
            queue.push(client, call)
    for _ in range(400):
        client, _ = queue.pop()
        queue.charge(client, durations[client])
        used[client] += durations[client]
        queue.push(client, 0)  # each keeps calls waiting
    assert abs(used["batches-of-16"] - used["batches-of-2"]) <= 0.032  # one long call apart at most


def test_a_client_that_starts_waiting_does_not_bank_its_idle_time():
    queue: FairQueue[str, int] = FairQueue()
    for call in range(100):
        queue.push("a", call)
        queue.push("b", call)
    for _ in range(100):  # a and b keep the worker busy for a second; c is idle
        client, _ = queue.pop()
        queue.charge(client, 0.01)
    for call in range(50):
        queue.push("c", call)
    taken = []
    for _ in range(30):
        client, _ = queue.pop()
        queue.charge(client, 0.01)
        taken.append(client)
    # c starts at the others' usage, not at zero: it shares from now on, not 30 calls in a row
    assert 9 <= taken.count("c") <= 11 and taken.count("a") >= 9 and taken.count("b") >= 9


def test_a_call_run_at_once_counts_against_its_client_too():
    queue: FairQueue[str, int] = FairQueue()
    queue.charge("inline", 0.05)  # ran in a free slot without waiting in the queue
    queue.push("inline", 1)
    queue.push("other", 2)
    assert queue.pop() == ("other", 2)
    assert queue.usage("inline") == pytest.approx(0.05)


@pytest.mark.parametrize(("workers", "parallel"), [(1, 1), (2, 2)])
def test_a_greedy_client_and_a_modest_one_get_throughputs_within_20_percent(spawn_workers, workers, parallel):
    addresses = spawn_workers(workers, parallel=parallel)
    clients = []
    try:
        # on each worker: one client keeps 64 calls queued, the other 8 per slot: both keep calls waiting (fair
        # queueing shares the slots among the clients that wait) even when a busy machine slows their round trips
        for address in addresses:
            for in_flight in (64, 8 * parallel):
                clients.append(
                    subprocess.Popen(
                        [sys.executable, _CLIENT, address, str(in_flight)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        env=child_environment(),
                        text=True,
                    )
                )
        for client in clients:
            assert client.stdout.readline().strip() == "ready"
        start = time.time() + 0.5
        for client in clients:  # the same window for every client
            client.stdin.write(f"{start!r} {start + 3.0!r}\n")
            client.stdin.flush()
        answered = [int(client.communicate(timeout=60)[0]) for client in clients]
    finally:
        for client in clients:
            client.kill()
            client.wait()
    for greedy, modest in zip(answered[::2], answered[1::2], strict=True):
        assert greedy > 0 and modest > 0
        assert abs(greedy - modest) <= 0.2 * max(greedy, modest), f"greedy {greedy} vs modest {modest} calls"


_LOADER_CLIENT = str(Path(__file__).resolve().parent / "fair_loader_client.py")


def test_two_loaders_with_unequal_batches_share_one_worker_by_time(spawn_workers):
    # batches of 16 samples with prefetch_factor=8 and batches of 2 with prefetch_factor=1, each sample holding
    # the worker's one slot for 2 ms: the loader of small batches must keep a call waiting at the worker while
    # its answer travels back, or the worker's fair queue gives that turn to the other loader's long call
    (address,) = spawn_workers(1, parallel=1)
    shapes = [(16, 8), (2, 1)]
    clients = [
        subprocess.Popen(
            [sys.executable, _LOADER_CLIENT, address, str(batch_size), str(prefetch_factor), "0.002"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_environment(),
            text=True,
        )
        for batch_size, prefetch_factor in shapes
    ]
    try:
        for client in clients:
            assert client.stdout.readline().strip() == "ready"
        start = time.time() + 0.5  # both loaders are under way: their windows settle first
        for client in clients:
            client.stdin.write(f"{start!r} {start + 3.0!r}\n")
            client.stdin.flush()
        samples = [int(client.communicate(timeout=60)[0]) for client in clients]
    finally:
        for client in clients:
            client.kill()
            client.wait()
    total = sum(samples)
    assert total > 0
    for (batch_size, _), taken in zip(shapes, samples, strict=True):
        # equal time means equal samples here (every sample costs the same); a generous band, not a speed
        assert taken >= 0.35 * total, f"batches of {batch_size}: {taken} of {total} samples ({samples})"
