"""One dataset per worker, not per trainer: trainers sending the same definition share one instance.

The store's rule alone (:meth:`rpcdl.rpc.rref.RRefStore.share`), then datasets
built through real workers: trainers in this process, and trainer processes
forked from it sharing a dataset of 100 MB on a worker process.
"""

from __future__ import annotations

import gc
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from helpers import Allocates, RangeDataset, eventually, start_worker_process
from torch.utils.data import Dataset

import rpcdl
from rpcdl.local import child_environment
from rpcdl.processes import stop_process
from rpcdl.rpc.rref import RRefStore
from rpcdl.serialization.definition import pickle_definition


class CountsBuilds(Dataset):
    """Appends a line to ``log`` per build, after ``seconds``; raises instead while the file ``fail`` exists."""

    def __init__(self, log: str, seconds: float, fail: str):
        time.sleep(seconds)
        with open(log, "a") as out:
            out.write("built\n")
        if os.path.exists(fail):
            raise ValueError("this build fails on purpose")

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index


def _dataset_id(dataset: rpcdl.RPCDataset, address: str) -> int:
    return rpcdl.rpc_sync(address, id, (dataset.rref(address),))


def _grow(dataset: Allocates) -> int:
    return dataset.grow()


# ------------------------------------------------------------------ the store's rule


def test_the_store_shares_one_object_per_definition_and_frees_it_with_its_last_entry():
    store = RRefStore(secret=b"token")
    built = []

    def build():
        built.append(1)
        return ["the object"]

    first, value = store.share("kind", b"recipe", build, holder="a")
    second, same = store.share("kind", b"recipe", build, holder="b")
    other, different = store.share("another kind", b"recipe", build, holder="a")
    assert same is value and different is not value and len(built) == 2
    assert first != second and store.shared_count() == 2
    assert store.resolve(second) is value
    store.release(first)
    assert store.resolve(second) is value  # b still holds it
    store.release(second)
    store.release(other)
    assert store.shared_count() == 0 and len(store) == 0
    assert store.share("kind", b"recipe", build, holder="c")[1] is not value  # built again
    assert len(built) == 3


class _Holder:
    """Stands for a connection (held weakly by the store once it disconnected)."""


def test_a_holder_that_disconnected_frees_its_share():
    store = RRefStore()
    a, b = _Holder(), _Holder()
    store.share("kind", b"recipe", lambda: ["x"], holder=a)
    store.share("kind", b"recipe", lambda: ["y"], holder=b)
    assert store.release_holder(a) == 1
    assert store.shared_count() == 1
    store.release_holder(b)
    assert store.shared_count() == 0 and len(store) == 0
    store.share("kind", b"recipe", lambda: ["z"], holder=a)  # gone: nothing kept for it
    assert store.shared_count() == 0 and len(store) == 0
    assert store.share("kind", b"recipe", lambda: ["z"], holder=_Holder())[1] == ["z"]


def test_racing_holders_build_once_and_a_failed_build_raises_for_all_and_is_not_kept(switching_often):
    store = RRefStore()
    builds = []
    started = threading.Event()

    def build(fails: bool):
        builds.append(1)
        started.set()
        deadline = time.monotonic() + 10
        while store.sharing("kind", b"recipe") < 8:  # every other holder awaits this build
            assert time.monotonic() < deadline, "the other holders never came to await the build"
            time.sleep(0.001)
        if fails:
            raise ValueError("the build failed")
        return ["built"]

    for fails in (True, False):
        builds.clear()
        started.clear()
        results: list = [None] * 8

        def share(i: int, fails: bool = fails, results: list = results) -> None:
            try:
                results[i] = store.share("kind", b"recipe", lambda: build(fails), holder=f"holder-{i}")[1]
            except ValueError as exc:
                results[i] = exc

        threads = [threading.Thread(target=share, args=(i,), name=f"test-share-{i}") for i in range(8)]
        threads[0].start()
        started.wait(5)
        for thread in threads[1:]:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert len(builds) == 1
        if fails:
            assert all(isinstance(result, ValueError) for result in results), results
            assert store.shared_count() == 0 and len(store) == 0  # not kept: the next call builds again
        else:
            assert all(result is results[0] for result in results) and results[0] == ["built"]
            assert store.shared_count() == 1 and len(store) == 8


def test_a_definition_is_the_same_bytes_in_another_process():
    # cloudpickle pickles a class of a user's module (tests/ is not installed) with an id drawn in each
    # process: the definition names it by its module's source instead, so two trainers agree
    definition = (Allocates, (100,), {"n": 3})
    here = hashlib.sha256(pickle_definition(definition)).hexdigest()
    code = (
        "import hashlib; from rpcdl.serialization.definition import pickle_definition; "
        "from helpers import Allocates; "
        "print(hashlib.sha256(pickle_definition((Allocates, (100,), {'n': 3}))).hexdigest())"
    )
    there = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert there == here
    assert hashlib.sha256(pickle_definition((Allocates, (101,), {"n": 3}))).hexdigest() != here


# ------------------------------------------------------------------ through a worker


def test_datasets_with_one_definition_share_one_instance_until_the_last_releases_it(embedded_worker):
    worker = embedded_worker()
    address = worker.address
    first = rpcdl.RPCDataset([address], Allocates, 1, n=5)
    second = rpcdl.RPCDataset([address], Allocates, 1, n=5)
    other = rpcdl.RPCDataset([address], Allocates, 1, n=6)
    assert _dataset_id(first, address) == _dataset_id(second, address) != _dataset_id(other, address)
    assert worker.stats()["rrefs_shared"] == 2
    first.release()
    gc.collect()
    eventually(lambda: worker.stats()["rrefs"] == 2, "the first dataset's reference to be released")
    assert second[4] == 4 and len(second) == 5  # the other trainer's instance still serves
    assert worker.stats()["rrefs_shared"] == 2
    second.release()
    other.release()
    gc.collect()
    eventually(lambda: worker.stats()["rrefs_shared"] == 0, "the shared datasets to be freed")


def test_a_dataset_built_per_trainer_is_its_own_and_a_mutation_stays_with_it(embedded_worker):
    address = embedded_worker().address
    shared = [rpcdl.RPCDataset([address], Allocates, 1, n=5) for _ in range(2)]
    own = rpcdl.RPCDataset([address], Allocates, 1, n=5, rpcdl_per_trainer=True)
    assert _dataset_id(own, address) != _dataset_id(shared[0], address)
    assert rpcdl.rpc_sync(address, _grow, (own.rref(address),)) == 6
    assert rpcdl.rpc_sync(address, len, (shared[0].rref(address),)) == 5
    assert rpcdl.rpc_sync(address, _grow, (shared[0].rref(address),)) == 6  # a mutation through a shared one...
    assert rpcdl.rpc_sync(address, len, (shared[1].rref(address),)) == 6  # ...is seen by every trainer sharing it


def test_per_trainer_must_be_a_bool(embedded_worker):
    address = embedded_worker().address
    with pytest.raises(TypeError, match=r"rpcdl_per_trainer must be True .* or False .*got 'yes'"):
        rpcdl.RPCDataset([address], RangeDataset, 4, rpcdl_per_trainer="yes")


def test_two_trainers_racing_build_once_and_a_failing_build_fails_both_and_is_not_kept(embedded_worker, tmp_path):
    address = embedded_worker(parallel=2).address
    log, fail = tmp_path / "builds.log", tmp_path / "fail"
    for failing in (True, False):
        fail.touch() if failing else fail.unlink()
        log.write_text("")
        outcomes: list = [None, None]

        def build(i: int, outcomes: list = outcomes) -> None:
            try:
                outcomes[i] = rpcdl.RPCDataset([address], CountsBuilds, str(log), 0.5, str(fail))
            except ValueError as exc:
                outcomes[i] = exc

        threads = [threading.Thread(target=build, args=(i,), name=f"test-trainer-{i}") for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert log.read_text().count("built") == 1  # the second call waited for the first's build
        if failing:
            assert all(isinstance(outcome, ValueError) for outcome in outcomes), outcomes
        else:
            assert _dataset_id(outcomes[0], address) == _dataset_id(outcomes[1], address)


# ------------------------------------------------------------------ trainer processes


@pytest.mark.timeout(300)  # a worker and a trainer process import torch: a minute or two on a busy machine
def test_trainer_processes_sending_one_dataset_cost_the_worker_one_copy():
    trainers = 8
    process, address = start_worker_process("--parallel", "2")
    script = str(Path(__file__).resolve().parent / "shared_dataset_trainers.py")
    group = None
    try:
        rpcdl.RPCDataset([address], Allocates, 1).release()  # the worker's first build: its code loaded
        before = psutil.Process(process.pid).memory_info().rss
        group = subprocess.Popen(
            [sys.executable, script, address, str(trainers)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_environment(),
            text=True,
        )
        assert group.stdout.readline().split() == ["built", "1" * trainers]
        grown = psutil.Process(process.pid).memory_info().rss - before
        assert grown < 150 << 20, f"the worker grew by {grown >> 20} MB for {trainers} trainers of 100 MB"
        assert rpcdl.stats(address)["rrefs_shared"] == 1
        for _ in range(trainers):  # the first releases its reference as it exits: the others' copy still serves
            group.stdin.write("go\n")
            group.stdin.flush()
            assert group.stdout.readline().strip() == "0"
        assert group.wait(30) == 0
        eventually(lambda: rpcdl.stats(address)["rrefs_shared"] == 0, "the last trainer's release")
    finally:
        if group is not None:
            stop_process(group, grace=1.0)
        rpcdl.shutdown()
        stop_process(process, grace=5.0)
