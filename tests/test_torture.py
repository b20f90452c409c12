"""Torture: loaders shared by threads, epochs abandoned and peeked at, a worker killed and restarted.

Issue 26: an abandoned epoch lived in a reference cycle, and the cyclic
collector, running on whichever thread allocated, finalized it there: it
changed the pool's records while their owner walked them ("Set changed size
during iteration") or deadlocked on a connection's lock. Here several threads
switch every microsecond, the collector runs often, every loader abandons
epochs and peeks with ``next(iter(loader))``, two threads share one loader,
and a worker is killed, then restarted, in the middle. Every epoch that runs
to its end must give every batch exactly once; nothing may raise or hang.
"""

from __future__ import annotations

import gc
import signal
import sys
import threading
import time

import helpers
import pytest

import rpcdl

SAMPLES = 96
BATCH = 4


def _indices(batches) -> list[int]:
    return sorted(i for batch in batches for i in batch.tolist())


@pytest.mark.timeout(120)
def test_threads_share_loaders_abandon_and_peek_at_epochs_while_a_worker_is_killed(spawn_workers):
    workers = spawn_workers(3)
    datasets = [rpcdl.RPCDataset(workers, helpers.RangeDataset, SAMPLES) for _ in range(2)]
    shared = rpcdl.RPCDataloader(datasets[0], batch_size=BATCH, prefetch_factor=4, timeout=20)
    loaders = {
        "shared-a": shared,
        "shared-b": shared,  # two threads, one loader: two passes of one pool advanced at once
        "unordered": rpcdl.RPCDataloader(
            datasets[1], batch_size=BATCH, prefetch_factor=2, in_order=False, timeout=20, max_batches_per_call=1
        ),
        "shuffled": rpcdl.RPCDataloader(datasets[1], batch_size=BATCH, shuffle=True, timeout=20, seed=3),
    }
    errors: list[BaseException] = []
    complete: dict[str, list[list[int]]] = {name: [] for name in loaders}
    after_kill: dict[str, int] = dict.fromkeys(loaders, 0)
    killed, stop = threading.Event(), threading.Event()

    def run(name: str) -> None:
        loader = loaders[name]
        try:
            rounds = 0
            while not stop.is_set():
                rounds += 1
                for i, _ in enumerate(loader):  # abandoned, with a peek dropped at once
                    next(iter(loader))
                    if i == rounds % 5:
                        break
                seen = []
                for i, batch in enumerate(loader):  # to its end, peeking inside
                    seen.append(batch)
                    if i % 7 == 3:
                        assert len(next(iter(loader))) == BATCH
                complete[name].append(_indices(seen))
                if killed.is_set():
                    after_kill[name] += 1
            complete[name].append(_indices(loader))  # the loader goes on after it all: one last whole epoch
            after_kill[name] += 1
        except BaseException as exc:
            errors.append(exc)

    def watch() -> None:
        try:
            while not stop.is_set():  # readers of the pool and of the epochs, from another thread
                for loader in loaders.values():
                    assert sum(entry["in_flight"] for entry in loader.worker_windows().values()) >= 0
                    assert loader.state_dict()["batches"] == SAMPLES // BATCH
                time.sleep(0.001)
        except BaseException as exc:
            errors.append(exc)

    previous_interval, previous_thresholds = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(1e-6)
    gc.set_threshold(100)  # the cyclic collector runs often, on whichever thread allocates
    threads = [threading.Thread(target=run, args=(name,), name=f"torture-{name}", daemon=True) for name in loaders]
    threads.append(threading.Thread(target=watch, name="torture-watch", daemon=True))
    try:
        for thread in threads:
            thread.start()
        time.sleep(2)
        workers.kill(1, signal.SIGKILL)
        killed.set()
        time.sleep(2)
        workers.restart(1)  # on its port: it comes back without the datasets, which are built there again
        time.sleep(2)
        stop.set()
        deadline = time.monotonic() + 60
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung = [thread.name for thread in threads if thread.is_alive()]
    finally:
        stop.set()
        sys.setswitchinterval(previous_interval)
        gc.set_threshold(*previous_thresholds)
    if errors:
        raise AssertionError(f"{len(errors)} thread(s) failed, the first with {errors[0]!r}") from errors[0]
    assert not hung, f"threads hung: {hung}"
    for name, epochs in complete.items():
        assert epochs and all(epoch == list(range(SAMPLES)) for epoch in epochs), name
        assert after_kill[name] >= 1, name
