"""Jobs sharing a worker get fair shares of its time: a greedy client cannot starve a modest one.

The queue's policy alone (:class:`rpcdl.server.fair_queue.FairQueue`): turns
among equals, equal time among clients whose calls last differently, no idle
time banked; then real client processes hammering real worker processes. The
items/s two trainers with unequal batches get are measured in
``benchmarks/scale_processes.py``, never asserted here: they depend on how soon
each trainer sends its next call, which a busy machine delays. What is asserted
for them is the worker's own account (:meth:`rpcdl.server.slots.Slots.time_shares`):
the time each got while the other had a call waiting.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rpcdl.local import child_environment
from rpcdl.rpc.rref import RRefStore
from rpcdl.server.fair_queue import FairQueue
from rpcdl.server.slots import Slots
from rpcdl.server.time_shares import TimeShare, TimeShares
from rpcdl.transport.wire import Frame, Kind

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


def test_a_call_that_passes_through_an_empty_queue_counts_as_one_pushed_and_popped():
    passed: FairQueue[str, int] = FairQueue()
    queued: FairQueue[str, int] = FairQueue()
    for call in range(100):  # a keeps the worker busy alone: its calls run at once (see Slots.enqueue)
        passed.pass_through("a")
        queued.push("a", call)
        assert queued.pop() == ("a", call)
        for queue in (passed, queued):
            queue.charge("a", 0.01)
    for queue in (passed, queued):
        for call in range(20):
            queue.push("a", call)
            queue.push("c", call)
    taken: list[list[str]] = [[], []]
    for queue, clients in zip((passed, queued), taken, strict=True):
        for _ in range(20):
            client, _ = queue.pop()
            queue.charge(client, 0.01)
            clients.append(client)
    # c, idle meanwhile, starts at a's usage: a second banked would give it 20 calls in a row
    assert taken[0] == taken[1] and 9 <= taken[0].count("c") <= 11
    assert passed.usage("a") == pytest.approx(queued.usage("a"))
    with pytest.raises(ValueError, match="push it behind the queued ones"):
        passed.pass_through("c")


def test_time_shares_count_each_clients_time_and_keep_the_clients_served_last():
    shares = TimeShares(capacity=2)
    shares.add("a:1", 0.5, contended=False)
    shares.add("b:2", 0.25, contended=True)
    shares.add("a:1", 0.25, contended=True)
    assert shares.snapshot() == {"b:2": TimeShare(1, 0.25, 0.25), "a:1": TimeShare(2, 0.75, 0.25)}
    shares.add("c:3", 1.0, contended=False)  # the record of b, served longest ago, goes
    assert list(shares.snapshot()) == ["a:1", "c:3"]
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        TimeShares(capacity=0)


class _Session:
    """A session of the slots' own test: records the ids of the answers it is sent."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.call_context = ()
        self.closed = False
        self.answers = threading.Semaphore(0)

    def send(self, frame: Frame, answers_call: bool = False, hold: bool = False) -> None:
        self.answers.release()


def test_the_slots_count_a_call_as_contended_when_another_client_waited_as_it_was_taken():
    first_runs, go_on = threading.Event(), threading.Event()

    def execute(session: _Session, frame: Frame) -> Frame:
        if frame.call_id == 1:
            first_runs.set()
            assert go_on.wait(10.0)
        return Frame(Kind.RESULT, frame.call_id)

    slots = Slots(1, execute, RRefStore())
    slots.start()
    try:
        a, b = _Session("a:1"), _Session("b:2")
        slots.enqueue(a, Frame(Kind.CALL, 1))  # a free slot: taken with nobody else waiting
        assert first_runs.wait(10.0)
        for call_id in (2, 3):
            slots.enqueue(a, Frame(Kind.CALL, call_id))
        slots.enqueue(b, Frame(Kind.CALL, 4))
        go_on.set()
        for session, calls in ((a, 3), (b, 1)):
            for _ in range(calls):
                assert session.answers.acquire(timeout=10.0), f"{session.peer}: a call never ran"
        shares = slots.time_shares()
    finally:
        slots.stop(timeout=5.0)
    # a used the slot first: b's call goes next, while a's wait; a's last two find nobody else waiting
    assert (shares["b:2"].calls, shares["b:2"].contended) == (1, shares["b:2"].busy)
    assert (shares["a:1"].calls, shares["a:1"].contended) == (3, 0.0)
    assert shares["a:1"].busy > 0


def test_calls_racing_the_parked_executors_each_run_once(switching_often):
    # Calls arrive while executors park, free their slots and take calls handed to them: each runs once.
    ran: list[int] = []

    def execute(session: _Session, frame: Frame) -> Frame:
        ran.append(frame.call_id)
        return Frame(Kind.RESULT, frame.call_id)

    slots = Slots(2, execute, RRefStore())
    slots.start()
    sessions = [_Session(f"c:{i}") for i in range(4)]

    def calls(index: int) -> None:
        for k in range(150):
            slots.enqueue(sessions[index], Frame(Kind.CALL, index * 1000 + k))
            if k % 7 == 0:
                time.sleep(0.0005)  # now and then the executors run dry and park

    threads = [threading.Thread(target=calls, args=(i,), name=f"enqueuer-{i}") for i in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        for session in sessions:
            for _ in range(150):
                assert session.answers.acquire(timeout=10.0), f"{session.peer}: a call never ran"
        shares = slots.time_shares()
    finally:
        slots.stop(timeout=5.0)
    assert sorted(ran) == sorted(i * 1000 + k for i in range(4) for k in range(150))
    assert {peer: share.calls for peer, share in shares.items()} == {f"c:{i}": 150 for i in range(4)}


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


def test_two_loaders_with_unequal_batches_share_one_worker_by_time(embedded_worker):
    # batches of 16 samples with prefetch_factor=8 and batches of 2 with prefetch_factor=1, each sample holding
    # the worker's one slot for 2 ms. How many samples each loader gets depends on how soon it sends its next
    # call (a loaded machine delays it, and a loader with no call waiting has no claim on the slot), so what is
    # asserted is the worker's own account: the time each got while the other had a call waiting.
    worker = embedded_worker(parallel=1)
    shapes = [(16, 8), (2, 1)]
    clients = [
        subprocess.Popen(
            [sys.executable, _LOADER_CLIENT, worker.address, str(batch_size), str(prefetch_factor), "0.002"],
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
        start = time.time() + 0.2
        for client in clients:
            client.stdin.write(f"{start!r} {start + 2.0!r}\n")
            client.stdin.flush()
        samples = [int(client.communicate(timeout=60)[0]) for client in clients]
    finally:
        for client in clients:
            client.kill()
            client.wait()
    assert all(taken > 0 for taken in samples), f"samples per loader (batches of 16, of 2): {samples}"
    served = [share for share in worker.slots.time_shares().values() if share.calls >= 5]
    assert len(served) == 2, f"one record per loader: {worker.slots.time_shares()}"
    small, large = sorted(served, key=lambda share: share.busy / share.calls)
    assert small.calls >= 20 and small.contended > 0, f"the loader of small batches was served: {small}"
    # taking turns per call would give the loader of long calls 8 times the time of the other while both waited;
    # by time, it is taken ahead of a waiting loader that used less only to even out, one long call at most
    long_call = large.busy / large.calls
    assert large.contended <= 1.25 * small.contended + 3 * long_call, (
        f"while the other waited, batches of 16 got {large.contended:.3f} s, batches of 2 {small.contended:.3f} s "
        f"(samples {samples}, worker time {large.busy:.3f} s and {small.busy:.3f} s)"
    )
