"""``rpcdl demo``: the README's main job, shortened."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import helpers
import pytest

pytest.importorskip("lightning")
pytest.importorskip("sklearn")

from rpcdl.cli import main


@pytest.fixture(autouse=True)
def _keep_global_seed(monkeypatch):
    """LightningCLI's seed_everything sets $PL_GLOBAL_SEED: undo it after each test."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")


OPTIONS = (
    "--workers",
    "--local-workers",
    "--max-epochs",
    "--limit",
    "--batch-size",
    "--seed",
    "--config",
    "--no-progress",
    "--json",
    "--token-file",
)


def test_help_describes_every_option(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "digits" in text and "validation accuracy" in text
    for option in OPTIONS:
        assert option in text


def test_short_demo_with_its_own_workers_learns(tmp_path, monkeypatch, capsys):
    """`rpcdl demo` as the README runs it (local workers), 2 short epochs: accuracy far above chance (0.1)."""
    monkeypatch.chdir(tmp_path)
    summary_file = tmp_path / "summary.json"
    code = main(["demo", "--max-epochs", "2", "--limit", "30", "--no-progress", "--json", str(summary_file)])
    assert code == 0
    out = capsys.readouterr().out
    summary = json.loads(summary_file.read_text())
    assert summary["epochs"] == 2
    assert summary["val_acc"] >= 0.5
    assert summary["samples_per_s"] > 0
    assert len(summary["workers"]) == 2
    # 2 x 30 training batches, 2 sanity-check and 2 x 3 validation batches, plus what was prefetched
    assert sum(w["batches"] for w in summary["workers"].values()) >= 2 * 30 + 2 + 2 * 3
    for address, counters in summary["workers"].items():
        # a call carries one batch, or a chunk of up to max_batches_per_call (32 by default) quick ones
        assert 0 < counters["batches"] <= 32 * counters["calls"] and counters["busy_s"] > 0
        assert address in out
    assert f"validation accuracy  {summary['val_acc']:.3f}" in out
    assert "samples/s" in out
    assert list(tmp_path.iterdir()) == [summary_file]  # no logs or checkpoints left behind


def test_demo_uses_the_workers_it_is_given(two_workers, tmp_path, capsys):
    summary_file = tmp_path / "summary.json"
    code = main(
        [
            "demo",
            "--workers",
            *two_workers,
            "--max-epochs",
            "1",
            "--limit",
            "4",
            "--no-progress",
            "--seed",
            "5",
            "--json",
            str(summary_file),
        ]
    )
    assert code == 0
    summary = json.loads(summary_file.read_text())
    assert sorted(summary["workers"]) == sorted(two_workers)
    assert sum(w["batches"] for w in summary["workers"].values()) >= 4
    assert "starting" not in capsys.readouterr().out


def test_demo_reads_the_workers_token_from_token_file(spawn_workers, tmp_path, monkeypatch):
    monkeypatch.setenv("RPCDL_TOKEN", "demo-secret")  # this process pings the worker it starts
    (address,) = spawn_workers(1, token="demo-secret")
    monkeypatch.delenv("RPCDL_TOKEN")
    monkeypatch.setenv("RPCDL_TOKEN_FILE", "")  # restored after the test: the demo sets it for its trainer
    token_file = tmp_path / "token"
    token_file.write_text("demo-secret\n")
    argv = ["demo", "--workers", address, "--token-file", str(token_file), "--max-epochs", "1", "--limit", "2"]
    assert main([*argv, "--no-progress"]) == 0
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--token-file", str(empty)])
    assert exited.value.code == 2


def test_demo_reports_a_worker_that_does_not_answer(capsys):
    address = f"127.0.0.1:{helpers.free_port()}"  # nothing listens there
    assert main(["demo", "--workers", address, "--max-epochs", "1"]) == 1
    assert f"worker {address} does not answer" in capsys.readouterr().err


def test_demo_rejects_bad_options(capsys):
    for argv in (["--limit", "0"], ["--limit", "1.5"], ["--max-epochs", "0"], ["--workers", "nohost"]):
        with pytest.raises(SystemExit) as exited:
            main(["demo", *argv])
        assert exited.value.code == 2
    assert "expected" in capsys.readouterr().err


@pytest.mark.timeout(150)
def test_demo_shows_progress_before_its_slow_steps_and_no_third_party_tips(tmp_path):
    """The real command: its first line comes before Lightning is even imported, then a line before each
    slow step; Lightning's tips, adverts and hardware lines are not shown."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-m", "rpcdl", "demo", "--max-epochs", "1", "--limit", "2", "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=140,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    lines = result.stdout.splitlines()
    steps = [
        "rpcdl demo: loading Lightning and scikit-learn...",
        "rpcdl demo: starting 2 local workers...",
        "rpcdl demo: building the model and the trainer...",
        "rpcdl demo: loading the digits on the workers...",
        "rpcdl demo: training for 1 epoch...",
    ]
    assert lines[0] == steps[0], lines[:3]
    assert [line for line in lines if line in steps] == steps
    for noise in ("Tip", "litlogger", "LitLogger", "litmodels", "GPU available", "TPU available", "Seed set"):
        assert noise not in result.stdout, noise
    assert "validation accuracy" in result.stdout
