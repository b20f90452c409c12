"""Every LightningCLI YAML in configs/ is parsed, instantiated and trained briefly, as a user would run it."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("sklearn")

import lightning.pytorch as pl

from rpcdl.integrations.lightning import RPCDataModule, cli_main

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


def test_every_config_is_installed_with_the_package():
    packaged = importlib.resources.files("rpcdl.configs")
    names = sorted(entry.name for entry in packaged.iterdir() if entry.name.endswith(".yaml"))
    assert names == [path.name for path in CONFIGS]
    assert {"digits.yaml", "digits_slurm.yaml"} <= set(names)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_config_is_instantiated_and_trains(config, two_workers, tmp_path, monkeypatch):
    # Workers where each config looks for them: $RPCDL_WORKERS (digits.yaml) or the file a
    # Slurm job's workers wrote in the working directory (digits_slurm.yaml).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # restored after the test: seed_everything sets it
    monkeypatch.setenv("RPCDL_WORKERS", ",".join(two_workers))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    (tmp_path / "rpcdl-workers-4242.txt").write_text("# rpcdl worker --address-file\n" + "\n".join(two_workers) + "\n")

    cli = cli_main(
        args=[
            "fit",
            "--config",
            str(config),
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=3",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
        ]
    )

    assert isinstance(cli.model, pl.LightningModule)
    assert isinstance(cli.datamodule, RPCDataModule)
    assert cli.trainer.global_step == 3
    assert cli.datamodule.all_workers == two_workers
    assert sum(cli.datamodule.loaders["train"].batches_served.values()) >= 3  # plus what was prefetched
    assert "val_acc" in cli.trainer.callback_metrics
    assert cli.datamodule.datasets == {}  # freed by teardown
