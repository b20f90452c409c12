"""LightningCLI's ``--data.workers FILE`` (and ``workers: FILE`` in YAML) is that file, watched: real LightningCLI
runs of configs/digits.yaml, real worker processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("sklearn")

import rpcdl
from rpcdl.integrations.lightning import cli_main

DIGITS = Path(__file__).resolve().parent.parent / "configs" / "digits.yaml"


@pytest.fixture(autouse=True)
def _no_pytest_arguments(monkeypatch):
    """LightningCLI is given its arguments: pytest's own must not look like more of them."""
    monkeypatch.setattr(sys, "argv", sys.argv[:1])


_QUIET = ["--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false"]


@pytest.mark.parametrize("where", ["command line", "yaml"])
@pytest.mark.parametrize("kind", ["empty", "commented", "twice", "missing"])
def test_a_workers_path_is_given_to_the_data_module_as_a_path(kind, where, tmp_path, monkeypatch):
    """jsonargparse reads a path it can open: the data module must get the path, not the file's contents."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / f"{kind}.txt"
    contents = {"empty": "", "commented": "# my fleet\n127.0.0.1:7101\n", "twice": "127.0.0.1:7101\n127.0.0.1:7101\n"}
    if kind in contents:
        path.write_text(contents[kind])
    if where == "yaml":
        config = tmp_path / "data.yaml"
        config.write_text(f"data:\n  init_args:\n    workers: {path.name}\n")
        given = ["--config", str(config)]
    else:
        given = ["--data.workers", str(path)]
    cli = cli_main(args=["--config", str(DIGITS), *given, *_QUIET], run=False)
    assert str(cli.datamodule.workers_argument) in (str(path), path.name)


def test_a_fit_reads_the_workers_file_comments_and_all_and_watches_it(spawn_workers, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where LightningCLI saves its config
    workers = spawn_workers(1)
    listing = tmp_path / "workers.txt"
    listing.write_text(f"# my fleet\n{workers[0]}\n{workers[0]}  # the same, twice\n")
    before = rpcdl.stats(workers[0])["batches"]

    cli = cli_main(
        args=["fit", "--config", str(DIGITS), "--data.workers", str(listing), "--trainer.max_steps=2",
              "--trainer.limit_val_batches=1", *_QUIET]
    )  # fmt: skip

    assert cli.trainer.global_step == 2
    assert cli.datamodule.all_workers == workers  # the file's worker, no local ones
    assert rpcdl.stats(workers[0])["batches"] > before
    cli.datamodule.setup("fit")  # as a next fit would: the file is a watched source
    try:
        assert cli.datamodule.fleet.changing and str(listing) in cli.datamodule.fleet.describe()
    finally:
        cli.datamodule.teardown("fit")


@pytest.mark.parametrize("kind", ["empty", "missing"])
def test_an_empty_or_missing_workers_file_is_waited_for_never_replaced_by_local_workers(kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RPCDL_START_TIMEOUT", "1")
    listing = tmp_path / "workers.txt"
    if kind == "empty":
        listing.write_text("")
    with pytest.raises(rpcdl.WorkerUnavailable, match="RPCDL_START_TIMEOUT") as raised:
        cli_main(args=["fit", "--config", str(DIGITS), "--data.workers", str(listing), "--trainer.max_steps=2",
                       *_QUIET])  # fmt: skip
    assert str(listing) in str(raised.value)
