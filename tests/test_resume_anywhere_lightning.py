"""Resume anywhere with Lightning: a checkpoint of 4 DDP ranks (CPU, gloo) resumes on 2 and on 3 ranks,
mid-epoch and at an epoch's end, every sample once per epoch (see tests/lightning_resume_job.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl
from helpers_lightning import RecordingModel, quiet_trainer
from lightning_resume_job import BATCH_SIZE, SAMPLES, SAVED_AFTER_BATCH
from probe_dataset import probe_spec

from rpcdl.integrations.lightning import RPCDataModule

TESTS = Path(__file__).resolve().parent


def _run(workers: list[str], *args: str) -> None:
    env = dict(os.environ, RPCDL_WORKERS=",".join(workers), PYTHONPATH=os.pathsep.join(sys.path))
    job = subprocess.run(
        [sys.executable, str(TESTS / "lightning_resume_job.py"), *args],
        env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr[-6000:]


def _records(directory: Path, world_size: int) -> list[dict]:
    ranks = [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(world_size)]
    assert [seen["world_size"] for seen in ranks] == [world_size] * world_size
    return [record for seen in ranks for record in seen["records"]]


def _samples(records: list[dict], epoch: int, batches=range(10**6)) -> list[int]:
    return [i for r in records if r["epoch"] == epoch and r["batch"] in batches for i in r["indices"]]


def _assert_once(samples: list[int], world_size: int, left: int) -> None:
    """``samples`` hold each of the ``left`` samples once, and at most the padding of a split among ``world_size``."""
    counts = Counter(samples)
    padding = -left % world_size
    assert len(samples) == left + padding and len(counts) == left, sorted(counts.items())


@pytest.fixture(scope="module")
def saved(two_workers, tmp_path_factory) -> Path:
    """4 ranks fit epoch 0 and save mid.ckpt (after batch 1) and end.ckpt."""
    out = tmp_path_factory.mktemp("resume")
    _run(two_workers, "save", str(out))
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("devices", [2, 3])
def test_a_4_rank_checkpoint_resumes_on_another_number_of_ranks(two_workers, saved, devices):
    before = _records(saved / "save", 4)
    assert len(_samples(before, 0)) == SAMPLES  # 4 ranks: 10 samples each, no padding
    taken = _samples(before, 0, range(SAVED_AFTER_BATCH + 1))
    assert len(taken) == len(set(taken)) == 4 * (SAVED_AFTER_BATCH + 1) * BATCH_SIZE

    # the ranks' states agree (rank 0's is the one saved), but for the rank
    for name, consumed in (("mid", len(taken)), ("end", 0)):
        states = [json.loads((saved / "states" / f"{name}-rank{r}.json").read_text()) for r in range(4)]
        loaders = [
            {**state["train_loader"], "layout": {**state["train_loader"]["layout"], "rank": 0}} for state in states
        ]
        assert all(loader == loaders[0] for loader in loaders), loaders
        assert loaders[0]["consumed"] == consumed and loaders[0]["epoch"] == (0 if name == "mid" else 1)

    _run(two_workers, "resume", str(saved), str(devices))

    mid = _records(saved / f"resume{devices}-mid", devices)
    resumed = _samples(mid, 0)
    assert min(r["batch"] for r in mid if r["epoch"] == 0) == SAVED_AFTER_BATCH + 1  # Lightning counts on
    assert not set(resumed) & set(taken)
    _assert_once(resumed, devices, SAMPLES - len(taken))  # epoch 0: the rest, once
    _assert_once(_samples(mid, 1), devices, SAMPLES)  # epoch 1: whole, on the new world size

    end = _records(saved / f"resume{devices}-end", devices)
    assert {r["epoch"] for r in end} == {1}
    _assert_once(_samples(end, 1), devices, SAMPLES)
    assert sorted(_samples(end, 1)) == sorted(_samples(mid, 1))  # the same epoch 1 either way


class _SaveAfter(pl.Callback):
    def __init__(self, path: Path, batch: int):
        self.path, self.batch = path, batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.batch and trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def _fit(workers, samples: int, epochs: int = 1, **options) -> RecordingModel:
    data = RPCDataModule(workers=workers, train_dataset=probe_spec(samples), batch_size=4, shuffle=True, seed=3)
    model = RecordingModel()
    trainer = quiet_trainer(max_epochs=epochs, callbacks=list(options.pop("callbacks", ())))
    trainer.fit(model, datamodule=data, **options)
    return model


@pytest.mark.timeout(300)
def test_a_checkpoint_over_other_data_is_refused_saying_how_to_go_on(two_workers, tmp_path):
    checkpoint = tmp_path / "mid.ckpt"
    _fit(two_workers, 24, callbacks=[_SaveAfter(checkpoint, 1)])
    with pytest.raises(ValueError, match="length: the state has 24, this loader has 20") as info:
        _fit(two_workers, 20, ckpt_path=str(checkpoint))
    assert "start the epoch again" in "\n".join(info.value.__notes__)

    # the way on the message gives: a checkpoint saved at the epoch's end
    _fit(two_workers, 24, callbacks=[_SaveAfter(checkpoint, 5)])  # 24 samples: batches 0..5
    model = _fit(two_workers, 20, ckpt_path=str(checkpoint), epochs=2)
    assert {r["epoch"] for r in model.records} == {1}
    assert sorted(i for r in model.records for i in r["indices"]) == list(range(20))
