"""RPCDataModule with real Lightning trainers and real worker processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl
from helpers_lightning import RecordingModel, quiet_trainer
from probe_dataset import probe_spec

import rpcdl
from rpcdl.integrations.lightning import RPCDataModule, read_workers_file, resolve_workers

TESTS = Path(__file__).resolve().parent


def _batches(model: RecordingModel) -> list[tuple]:
    return [(r["epoch"], r["batch"], r["indices"], r["noise"]) for r in model.records]


def _draws(records: list[dict], epoch: int) -> dict[int, float]:
    """The augmentation value drawn for each sample index in ``epoch``."""
    return {i: x for r in records if r["epoch"] == epoch for i, x in zip(r["indices"], r["noise"], strict=True)}


# ---------------------------------------------------------------------------- workers argument


def test_workers_from_list_file_and_environment(tmp_path, monkeypatch):
    listing = tmp_path / "workers.txt"
    listing.write_text("# written by rpcdl worker --address-file\n\ncpu01:6543\n  cpu02:6544  # second\n[::1]:7000\n")
    assert read_workers_file(listing) == ["cpu01:6543", "cpu02:6544", "[::1]:7000"]
    assert resolve_workers(str(listing)) == ["cpu01:6543", "cpu02:6544", "[::1]:7000"]
    monkeypatch.setenv("JOB", "42")
    (tmp_path / "w-42.txt").write_text("cpu03:1\n")
    assert resolve_workers(str(tmp_path / "w-${JOB}.txt")) == ["cpu03:1"]

    assert resolve_workers(None) is None  # then RPCDataModule starts local workers
    monkeypatch.setenv("RPCDL_WORKERS", "a:1, b:2\n c:3")
    assert resolve_workers(None) == ["a:1", "b:2", "c:3"]
    assert resolve_workers(["a:1", "b:2"]) == ["a:1", "b:2"]


def test_workers_argument_errors(tmp_path, monkeypatch):
    bad = tmp_path / "bad.txt"
    bad.write_text("cpu01:6543\ncpu02\n")
    with pytest.raises(ValueError, match=r"line 2"):
        resolve_workers(str(bad))
    (tmp_path / "empty.txt").write_text("# nobody yet\n")
    with pytest.raises(ValueError, match="lists no worker"):
        resolve_workers(str(tmp_path / "empty.txt"))
    monkeypatch.delenv("NO_SUCH_VARIABLE", raising=False)
    with pytest.raises(FileNotFoundError, match="NO_SUCH_VARIABLE not set"):
        resolve_workers("workers-${NO_SUCH_VARIABLE}.txt")
    monkeypatch.setenv("RPCDL_WORKERS", "cpu01:6543 cpu02")
    with pytest.raises(ValueError, match=r"\$RPCDL_WORKERS"):
        resolve_workers(None)
    with pytest.raises(ValueError, match="HOST:PORT"):
        RPCDataModule(workers=["cpu01"], train_dataset=probe_spec(4))
    with pytest.raises(ValueError, match="twice"):
        RPCDataModule(workers=["cpu01:1", "cpu01:1"], train_dataset=probe_spec(4))


def test_arguments_are_checked_where_they_are_given():
    with pytest.raises(ValueError, match="at least one of train_dataset"):
        RPCDataModule()
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        RPCDataModule(train_dataset=probe_spec(4), batch_size=0)
    with pytest.raises(TypeError, match=r"init_args .* do not fit ProbeDataset"):
        RPCDataModule(train_dataset={"class_path": "probe_dataset.ProbeDataset", "init_args": {"size": 4}})
    with pytest.raises(ImportError, match="has no 'Missing'"):
        RPCDataModule(train_dataset="probe_dataset.Missing")
    with pytest.raises(ValueError, match="class_path"):
        RPCDataModule(train_dataset={"init_args": {"n": 4}})
    with pytest.raises(ValueError, match="timeout option should be non-negative"):  # torch's DataLoader message
        RPCDataModule(train_dataset=probe_spec(4), timeout=-1)
    assert RPCDataModule(train_dataset=probe_spec(4), timeout=0).timeout == 0  # no timeout, as in torch
    with pytest.raises(ValueError, match="max_batches_per_call must be a positive integer"):
        RPCDataModule(train_dataset=probe_spec(4), max_batches_per_call=0)


def test_nested_class_paths_in_init_args_are_built_on_the_workers(two_workers):
    shift = {"class_path": "probe_dataset.Shift", "init_args": {"offset": 10.0}}
    data = RPCDataModule(
        workers=two_workers,
        train_dataset={"class_path": "probe_dataset.ProbeDataset", "init_args": {"n": 6, "transform": shift}},
        batch_size=3,
        max_batches_per_call=2,
    )
    data.setup("fit")
    try:
        noise = [x for batch in data.train_dataloader() for x in batch["noise"].tolist()]
    finally:
        data.teardown("fit")
    assert len(noise) == 6 and all(10.0 <= x < 11.0 for x in noise)
    assert data.loaders["train"].max_batches_per_call == 2
    with pytest.raises(ImportError, match="NoSuchTransform"):
        RPCDataModule(
            train_dataset={"class_path": "probe_dataset.ProbeDataset",
                           "init_args": {"n": 6, "transform": {"class_path": "probe_dataset.NoSuchTransform"}}}
        )  # fmt: skip


# ---------------------------------------------------------------------------- training


class _SaveAt(pl.Callback):
    """Save a checkpoint after training batch ``batch`` of ``epoch`` (``None``: at the epoch's end)."""

    def __init__(self, path: Path, epoch: int, batch: int | None):
        self.path, self.epoch, self.batch = path, epoch, batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.batch == batch_idx and trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)

    def on_train_epoch_end(self, trainer, pl_module):
        if self.batch is None and trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)


def _fit(workers, *, callbacks=(), ckpt_path=None, epochs=3) -> RecordingModel:
    data = RPCDataModule(workers=workers, train_dataset=probe_spec(24), batch_size=4, shuffle=True, seed=7)
    model = RecordingModel()
    quiet_trainer(max_epochs=epochs, callbacks=list(callbacks)).fit(model, datamodule=data, ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("saved_after_batch", [2, None], ids=["mid-epoch", "epoch-end"])
def test_checkpoint_resumes_with_the_batches_not_yet_seen(two_workers, tmp_path, saved_after_batch):
    checkpoint = tmp_path / "resume.ckpt"
    full = _batches(_fit(two_workers, callbacks=[_SaveAt(checkpoint, 1, saved_after_batch)]))
    assert len(full) == 3 * 6

    resumed = _batches(_fit(two_workers, ckpt_path=str(checkpoint)))

    first_unseen = 6 + (saved_after_batch + 1 if saved_after_batch is not None else 6)
    assert resumed == full[first_unseen:]  # same epochs, batch numbers, samples and augmentation draws


def test_augmentation_is_redrawn_every_epoch_and_repeats_with_the_seed(two_workers):
    first = _fit(two_workers, epochs=2)
    again = _fit(two_workers, epochs=2)
    assert _batches(first) == _batches(again)
    draws = [_draws(first.records, epoch) for epoch in (0, 1)]
    assert sorted(draws[0]) == sorted(draws[1]) == list(range(24))
    assert all(draws[0][i] != draws[1][i] for i in range(24))
    orders = [[i for r in first.records if r["epoch"] == e for i in r["indices"]] for e in (0, 1)]
    assert orders[0] != orders[1]  # reshuffled for the new epoch


def test_validate_and_predict_use_their_own_splits(two_workers):
    data = RPCDataModule(workers=two_workers, val_dataset=probe_spec(10), predict_dataset=probe_spec(10), batch_size=4)
    model = RecordingModel()
    trainer = quiet_trainer()
    (metrics,) = trainer.validate(model, datamodule=data)
    assert 0.0 <= metrics["val_noise"] < 1.0
    predictions = trainer.predict(model, datamodule=data)
    assert [i for batch in predictions for i in batch.tolist()] == list(range(10))  # every sample once, in order
    assert data.datasets == {}
    with pytest.raises(Exception, match="`train_dataloader` must be implemented"):  # no train split: Lightning's hook
        data.train_dataloader()


def _rrefs(address: str) -> int:
    return rpcdl.stats(address)["rrefs"]


def test_teardown_frees_the_remote_datasets(two_workers):
    data = RPCDataModule(workers=two_workers, train_dataset=probe_spec(8), val_dataset=probe_spec(4), batch_size=4)
    data.setup("fit")
    held = [_rrefs(a) for a in two_workers]
    assert all(n >= 2 for n in held)  # a train and a val dataset on each worker
    data.teardown("fit")
    assert data.datasets == {}
    expected = [n - 2 for n in held]  # (earlier tests' references may be freed meanwhile too)
    deadline = time.monotonic() + 10
    while any(now > n for now, n in zip([_rrefs(a) for a in two_workers], expected, strict=True)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all(now <= n for now, n in zip([_rrefs(a) for a in two_workers], expected, strict=True))


class _RememberWorkers(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.workers = list(trainer.datamodule.workers)
        started = trainer.datamodule.started_workers
        self.processes = list(started.processes) if started is not None else []


def test_without_workers_the_module_starts_local_ones_and_stops_them(monkeypatch):
    monkeypatch.delenv("RPCDL_WORKERS", raising=False)
    data = RPCDataModule(train_dataset=probe_spec(8), batch_size=4, num_local_workers=1)
    seen = _RememberWorkers()
    model = RecordingModel()
    quiet_trainer(max_epochs=1, callbacks=[seen]).fit(model, datamodule=data)
    assert len(seen.workers) == 1 and len(seen.processes) == 1
    assert {pid for r in model.records for pid in r["pids"]} == {seen.processes[0].pid}
    assert seen.processes[0].poll() is not None  # stopped by teardown
    with pytest.raises(Exception):
        rpcdl.ping(seen.workers[0], timeout=2.0)
    assert data.workers == []


def test_state_dict_resumes_a_loop_without_a_trainer(two_workers):
    def make():
        data = RPCDataModule(workers=two_workers, train_dataset=probe_spec(20), batch_size=4, seed=3)
        data.setup("fit")
        return data

    first = make()
    batches = iter(first.train_dataloader())
    seen = [next(batches)["index"].tolist() for _ in range(2)]
    state = first.state_dict()
    rest = [b["index"].tolist() for b in batches]
    first.teardown("fit")

    second = make()
    second.load_state_dict(json.loads(json.dumps(state)))  # a checkpoint holds plain data
    resumed = [b["index"].tolist() for b in second.train_dataloader()]
    second.teardown("fit")
    assert resumed == rest and len(seen) + len(rest) == 5


# ---------------------------------------------------------------------------- DDP


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_two_ranks_split_workers_and_data(spawn_workers, tmp_path):
    """strategy="ddp", devices=2 on CPU (gloo), four workers; the job fits twice with one seed."""
    workers = spawn_workers(4)
    pids = [process.pid for process in workers.processes]
    env = dict(os.environ, RPCDL_WORKERS=",".join(workers), PYTHONPATH=os.pathsep.join(sys.path))
    job = subprocess.run(
        [sys.executable, str(TESTS / "lightning_ddp_job.py"), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr[-4000:]
    runs = [
        [json.loads((tmp_path / f"run{run}" / f"rank{rank}.json").read_text()) for rank in (0, 1)] for run in (1, 2)
    ]

    for ranks in runs:
        for rank, seen in enumerate(ranks):
            assert seen["world_size"] == 2
            assert seen["workers"] == [workers[rank], workers[rank + 2]]
            used = {pid for r in seen["records"] for pid in r["pids"]}
            assert used <= {pids[rank], pids[rank + 2]}, f"rank {rank} used workers {used}"
        for epoch in (0, 1):
            shards = [[i for r in seen["records"] if r["epoch"] == epoch for i in r["indices"]] for seen in ranks]
            assert len(shards[0]) == len(shards[1]) == 16
            assert not set(shards[0]) & set(shards[1])
            assert sorted(shards[0] + shards[1]) == list(range(32))

    records = runs[0][0]["records"] + runs[0][1]["records"]
    draws = [_draws(records, epoch) for epoch in (0, 1)]
    assert all(draws[0][i] != draws[1][i] for i in range(32))  # redrawn on the workers each epoch
    first_draws = [r["noise"] for r in runs[0][0]["records"]] + [r["noise"] for r in runs[0][1]["records"]]
    assert len({x for batch in first_draws for x in batch}) == 64  # no two ranks or epochs share a draw
    for rank in (0, 1):
        same = [(r["epoch"], r["indices"], r["noise"]) for r in runs[1][rank]["records"]]
        assert same == [(r["epoch"], r["indices"], r["noise"]) for r in runs[0][rank]["records"]]
