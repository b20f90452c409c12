"""Jobs sharing a worker get fair shares of its slots: a greedy client cannot starve a modest one.

The queue's policy alone (:class:`rpcdl.server.fair_queue.FairQueue`), then real
client processes hammering real worker processes.
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
