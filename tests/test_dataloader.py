"""RPCDataset and RPCDataloader on real worker processes: torch parity, failures, resume, leaks."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import helpers
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

import rpcdl
import rpcdl.local
from rpcdl.cli.bench.workloads import ImageDataset


def indices_of(batches) -> list[int]:
    return [int(i) for batch in batches for i in torch.as_tensor(batch).reshape(-1)]


def test_seed_example_two_workers_200_batches(two_workers):
    dataset = rpcdl.RPCDataset(workers=two_workers, dataset=torch.rand, size=(1000, 128))
    loader = rpcdl.RPCDataloader(dataset, batch_size=5)
    count = 0
    for batch in loader:
        assert isinstance(batch, torch.Tensor) and batch.shape == (5, 128)
        count += 1
    assert count == 200


def double_collate(samples):
    return torch.stack(samples) * 2 if isinstance(samples, list) else samples * 2


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [1, 7, None])
@pytest.mark.parametrize("collate_fn", [None, double_collate])
def test_same_batches_as_torch_dataloader(two_workers, shuffle, drop_last, batch_size, collate_fn):
    n = 53
    local = helpers.RangeDataset(n)

    def sampler():
        if shuffle:
            return RandomSampler(range(n), generator=torch.Generator().manual_seed(1234))
        return SequentialSampler(range(n))

    options = dict(batch_size=batch_size, drop_last=drop_last, collate_fn=collate_fn)
    if batch_size is None and drop_last:
        with pytest.raises(ValueError) as torch_error:
            DataLoader(local, sampler=sampler(), **options)
        with pytest.raises(ValueError) as our_error:
            rpcdl.RPCDataloader(rpcdl.RPCDataset(two_workers, helpers.RangeDataset, n), sampler=sampler(), **options)
        assert str(our_error.value) == str(torch_error.value)
        return
    expected = list(DataLoader(local, sampler=sampler(), **options))
    remote = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, n)
    got = list(rpcdl.RPCDataloader(remote, sampler=sampler(), **options))
    assert len(got) == len(expected) == len(rpcdl.RPCDataloader(remote, sampler=sampler(), **options))
    for ours, theirs in zip(got, expected, strict=True):
        assert torch.equal(ours, theirs)


def test_torch_argument_rules_and_messages(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 10)
    local = helpers.RangeDataset(10)
    cases = [
        dict(sampler=SequentialSampler(range(10)), shuffle=True),
        dict(batch_sampler=BatchSampler(SequentialSampler(range(10)), 2, False), batch_size=3),
        dict(batch_sampler=BatchSampler(SequentialSampler(range(10)), 2, False), drop_last=True),
    ]
    for case in cases:
        with pytest.raises(ValueError) as theirs:
            DataLoader(local, **case)
        with pytest.raises(ValueError) as ours:
            rpcdl.RPCDataloader(dataset, **case)
        assert str(ours.value) == str(theirs.value)
    with pytest.raises(TypeError, match="must be an RPCDataset"):
        rpcdl.RPCDataloader(local)
    with pytest.raises(ValueError, match="prefetch_factor"):
        rpcdl.RPCDataloader(dataset, prefetch_factor=0)
    with pytest.raises(TypeError, match="non-empty list"):
        rpcdl.RPCDataset("127.0.0.1:1", helpers.RangeDataset, 3)


def test_custom_batch_sampler_and_as_completed(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 40)
    batch_sampler = [[3, 1], [0], list(range(4, 40))]
    assert [b.tolist() for b in rpcdl.RPCDataloader(dataset, batch_sampler=batch_sampler)] == batch_sampler
    unordered = list(rpcdl.RPCDataloader(dataset, batch_size=3, in_order=False))
    assert sorted(indices_of(unordered)) == list(range(40))


def test_rpcdataloader_seed_readme_form(two_workers):
    loader = rpcdl.RPCDataloader(workers=two_workers, dataset=helpers.RangeDataset, kwargs={"n": 12}, batch_size=4)
    assert indices_of(loader) == list(range(12))


def test_pin_memory_without_cuda_warns_once(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 8)
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: batches are pinned, no warning")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = rpcdl.RPCDataloader(dataset, batch_size=4, pin_memory=True)
        assert indices_of(loader) == list(range(8))
    assert len([w for w in caught if "pin_memory" in str(w.message)]) == 1


def test_user_error_raises_with_indices_and_is_not_retried(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.FailingDataset, 20, 9)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4)
    _, failed_before = helpers.worker_calls(two_workers)
    iterator = iter(loader)
    assert [next(iterator).tolist() for _ in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="index 9 is broken") as info:
        next(iterator)
    notes = "\n".join(info.value.__notes__)
    assert "[8, 9, 10, 11]" in notes and "batch 2" in notes
    assert "__getitem__" in info.value.remote_traceback
    assert [batch.tolist() for batch in iterator] == [[12, 13, 14, 15], [16, 17, 18, 19]]
    assert helpers.worker_calls(two_workers)[1] == failed_before + 1


def test_sampler_set_epoch_is_called(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 30)
    sampler = DistributedSampler(range(30), num_replicas=2, rank=0, shuffle=True, seed=3)
    loader = rpcdl.RPCDataloader(dataset, batch_size=5, sampler=sampler)
    epochs = [indices_of(loader) for _ in range(3)]
    for epoch, got in enumerate(epochs):
        reference = DistributedSampler(range(30), num_replicas=2, rank=0, shuffle=True, seed=3)
        reference.set_epoch(epoch)
        assert got == list(reference)
    sampler.set_epoch(7)  # a training loop that manages epochs itself is followed
    reference.set_epoch(7)
    assert indices_of(loader) == list(reference)


def test_seeded_random_augmentation_repeats_across_runs_and_differs_across_epochs(two_workers):
    def noisy(n):
        return [torch.rand(()) for _ in range(n)]

    class Noise(torch.utils.data.Dataset):
        def __len__(self):
            return 24

        def __getitem__(self, index):
            return torch.rand(())

    def run():
        dataset = rpcdl.RPCDataset(two_workers, Noise)
        loader = rpcdl.RPCDataloader(dataset, batch_size=4, seed=42)
        return [torch.cat(list(loader)) for _ in range(2)]

    first, second = run(), run()
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not torch.equal(first[0], first[1])
    del noisy


# ---------------------------------------------------------------------------- failures


def test_sigkill_mid_epoch_every_index_once_and_the_worker_rejoins(spawn_workers):
    workers = spawn_workers(3)
    n = 300
    dataset = rpcdl.RPCDataset(workers, helpers.RangeDataset, n, 0.004)
    loader = rpcdl.RPCDataloader(dataset, batch_size=5, timeout=20)
    seen, restart = [], threading.Thread(target=workers.restart, args=(1,))
    for i, batch in enumerate(loader):
        seen.extend(batch.tolist())
        if i == 10:
            workers.kill(1, signal.SIGKILL)
            restart.start()  # back on its port while the epoch goes on
    assert sorted(seen) == list(range(n))
    served_before = loader.batches_served[workers[1]]
    restart.join()
    assert sorted(indices_of(loader)) == list(range(n))
    assert loader.batches_served[workers[1]] > served_before
    assert loader.worker_states()[workers[1]] == "active"


def test_every_worker_dead_raises_no_workers_left(spawn_workers):
    workers = spawn_workers(2)
    dataset = rpcdl.RPCDataset(workers, helpers.RangeDataset, 200, 0.005)
    loader = rpcdl.RPCDataloader(dataset, batch_size=5, timeout=2)
    with pytest.raises(rpcdl.NoWorkersLeft, match="no worker is left") as info:
        for i, _ in enumerate(loader):
            if i == 3:
                workers.kill(0)
                workers.kill(1)
    assert workers[0] in str(info.value) and workers[1] in str(info.value)


def test_slow_worker_serves_fewer_batches(spawn_workers):
    workers = spawn_workers(4)
    rpcdl.rpc_sync(workers[0], helpers.set_slowdown, (10.0,))
    dataset = rpcdl.RPCDataset(workers, helpers.ScaledDelayDataset, 400, 0.002)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4)
    assert indices_of(loader) == list(range(400))
    served = loader.batches_served
    slow = served[workers[0]]
    assert all(slow < served[fast] for fast in workers[1:]), served


@pytest.mark.timeout(60)
def test_worker_windows_show_a_parallel_worker_given_more_calls_in_flight(spawn_workers):
    serial, parallel = spawn_workers(1)[0], spawn_workers(1, parallel=4)[0]
    loader = rpcdl.RPCDataloader(
        rpcdl.RPCDataset([serial, parallel], helpers.RangeDataset, 80, 0.05), prefetch_factor=2
    )
    before = loader.worker_windows()
    assert before[parallel] == {
        "state": "active", "in_flight": 0, "window": 1, "service_time": None, "rtt": None, "round_trip": None
    }  # fmt: skip
    assert indices_of(loader) == list(range(80))
    windows = loader.worker_windows()
    assert set(windows) == {serial, parallel}
    assert all(entry["state"] == "active" and entry["in_flight"] == 0 for entry in windows.values())
    assert all(3 <= entry["window"] <= 8 for entry in windows.values())  # MIN_WINDOW to 4 x prefetch_factor
    assert windows[parallel]["window"] >= 4, windows  # it runs four calls at once: more are sent to it
    assert windows[parallel]["rtt"] > 0 and windows[parallel]["round_trip"] >= windows[parallel]["rtt"]


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_breaking_out_of_epochs_leaks_nothing(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 500)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, prefetch_factor=4)
    list(itertools.islice(loader, 3))  # warm up connections and threads
    threads, descriptors = threading.active_count(), _open_descriptors()
    for _ in range(50):
        for i, _ in enumerate(loader):
            if i == 2:
                break
    time.sleep(0.5)
    assert threading.active_count() <= threads
    assert _open_descriptors() <= descriptors
    assert indices_of(loader) == list(range(500))  # and the loader still works


def test_an_abandoned_epoch_leaves_no_worker_sending(two_workers):
    # 8 batches of 9.6 MB in flight: more than the sockets hold, so a worker whose
    # answers nobody reads stays blocked in send (until its timeout)
    dataset = rpcdl.RPCDataset(two_workers, ImageDataset, 64 * 40)
    loader = rpcdl.RPCDataloader(dataset, batch_size=64, prefetch_factor=4)
    iterator = iter(loader)
    next(iterator)
    # asked by another process: this one's connections would read the answers on the way
    in_flight_code = "import sys, rpcdl; print(sum(rpcdl.stats(a)['calls_in_flight'] for a in sys.argv[1:]))"
    deadline = time.monotonic() + 30
    while True:
        result = subprocess.run(
            [sys.executable, "-c", in_flight_code, *two_workers], capture_output=True, text=True, timeout=60,
            env=rpcdl.local.child_environment(),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        if int(result.stdout) == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert int(result.stdout) == 0
    del iterator


# ---------------------------------------------------------------------------- resume


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("in_order", [True, False])
def test_state_dict_resumes_after_batch_k(two_workers, shuffle, in_order):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 64)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, shuffle=shuffle, in_order=in_order)
    list(loader)  # a first full epoch: the state must name the right epoch
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(5)]
    state = loader.state_dict()
    rest = [batch.tolist() for batch in iterator]

    resumed = rpcdl.RPCDataloader(dataset, batch_size=4, shuffle=shuffle, in_order=in_order)
    resumed.load_state_dict(state)
    tail = [batch.tolist() for batch in resumed]
    if in_order:
        assert tail == rest
    else:
        assert sorted(map(tuple, tail)) == sorted(map(tuple, rest))
    assert sorted(i for batch in head + tail for i in batch) == list(range(64))
    assert len(list(resumed)) == 16  # the next epoch is whole again


def test_load_state_dict_rejects_foreign_state(two_workers):
    loader = rpcdl.RPCDataloader(rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 4))
    with pytest.raises(ValueError, match="not an RPCDataloader state"):
        loader.load_state_dict({"foo": 1})


def test_an_iterator_starts_its_epoch_on_the_first_batch(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 12)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, shuffle=True)
    first = [b.tolist() for b in loader]
    state = loader.state_dict()
    iter(loader)  # made and dropped, as Lightning does to check the loader is iterable
    after = loader.state_dict()
    assert after == state and state["epoch"] == 1 and loader.epoch == 0
    # As torch's sampler, the next epoch's order is drawn from torch's global generator when it starts.
    assert state["generator_state"] is None
    resumed = rpcdl.RPCDataloader(dataset, batch_size=4, shuffle=True)
    resumed.load_state_dict(state)
    iter(resumed)
    assert resumed.state_dict()["epoch"] == 1  # the loaded state is not used up by iter() alone
    assert sorted(i for b in resumed for i in b.tolist()) == list(range(12))
    assert sorted(i for b in first for i in b) == list(range(12))


def test_state_after_the_last_batch_is_the_next_epoch(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 12)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4)
    iterator = iter(loader)
    for _ in range(3):  # every batch, without asking for one more
        next(iterator)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["yielded_prefix"] == 0
    loader.close()
    with pytest.raises(StopIteration):
        next(iterator)
