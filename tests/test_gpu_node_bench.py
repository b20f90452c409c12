"""benchmarks/gpu_node.py keeps working: its quick mode on a CPU, a round of a few systems (never speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_node.py"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the benchmark needs a core for the trainer and one more")
def test_the_gpu_node_benchmark_runs_in_its_quick_mode_and_reports_every_system(tmp_path):
    report = tmp_path / "gpu_node.json"
    # One system per kind of loader: rpcdl-tcp differs from rpcdl-shm by RPCDL_SHM_BYTES=0 only, and each
    # system is a process of its own (rpcdl's with its workers): a loaded machine starts few of them in time.
    systems = ["gpu", "rpcdl-shm", "torch-own"]
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--quick",
            "--rounds",
            "1",
            "--batch-size",  # a small workload, for a loaded machine: every path runs, nothing is judged
            "2",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--workers",  # not one per other core: on a 16-core host that is 14 processes per system
            "2",
            "--systems",
            *systems,
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(report.read_text())
    assert figures["device"] == "cpu" and figures["batch_size"] == 2
    assert set(figures["medians"]) == set(systems) and all(value > 0 for value in figures["medians"].values())
    assert set(figures["ratios"]["rpcdl-shm"]) == {"gpu"}  # no torch DataLoader on the worker cores in this run
    assert set(figures["trainer_cores"]).isdisjoint(figures["worker_cores"])
    assert 1 <= len(figures["worker_cores"]) <= 2
    for system in systems:
        assert f"round 1 {system}:" in result.stdout
