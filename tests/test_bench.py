"""``rpcdl bench``: a tiny run of every scenario, the table, the JSON and the plot (never speed)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rpcdl.cli.bench.report import NOT_JUDGED, Figure, format_table
from rpcdl.cli.bench.workloads import FRAMED, PARALLEL_MAPPER, RPCDL, SCENARIOS, SOCKET, TORCH

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load_benchmark(name: str):
    """``benchmarks/NAME.py`` as a module (the scripts are not part of the package)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


targets = _load_benchmark("targets")  # the project's own goals
TARGETS, evaluate_targets, format_targets = targets.TARGETS, targets.evaluate_targets, targets.format_targets


def run_bench(*args: str, timeout: float = 110, **environment: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **environment}
    return subprocess.run(
        [sys.executable, "-m", "rpcdl", "bench", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_a_quick_run_prints_the_table_and_writes_json_and_plot(two_workers, tmp_path):
    report, picture = tmp_path / "bench.json", tmp_path / "bench.png"
    result = run_bench(
        "--workers",
        *two_workers,
        "--quick",
        "--io-workers",
        "1",
        "2",
        "--no-progress",
        "--json",
        str(report),
        "--plot",
        str(picture),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("scenario"))
    for column in ("metric", RPCDL, TORCH, SOCKET, f"{RPCDL}/{TORCH}", f"{RPCDL}/{SOCKET}"):
        assert column in header
    for scenario in SCENARIOS:
        assert any(line.startswith(scenario) for line in lines), scenario
    assert "load average" in result.stdout
    assert "targets:" not in result.stdout  # the project's own goals are judged by benchmarks/compare.py only
    # --quick: no memory ratios from its 2-batch epochs
    for line in lines:
        if line.startswith("memory"):
            assert not re.search(r"\d\.\d\dx", line) and NOT_JUDGED in line, line
    assert not any(line.startswith("memory") and "peak / bound" in line and "1." in line for line in lines)

    document = json.loads(report.read_text())
    assert document["systems"][:3] == [RPCDL, TORCH, SOCKET]
    assert document["machine"]["cpus"] == os.cpu_count()
    figures = {(f["scenario"], f["metric"]): f for f in document["figures"]}
    latency = figures[("latency", "p50")]
    assert set(latency["systems"]) == {RPCDL, SOCKET, FRAMED}  # torch's DataLoader makes no calls
    assert latency["systems"][RPCDL]["median"] > 0 and latency["ratios"][SOCKET] > 0
    for key in [("small", "batches/s"), ("image", "MB/s"), ("straggler", "kept"), ("io", "speedup x2")]:
        assert set(figures[key]["systems"]) >= {RPCDL, TORCH}, key
    assert SOCKET in figures[("image", "MB/s")]["systems"]
    assert figures[("straggler", "kept")]["systems"][RPCDL]["median"] > 0
    assert [f"epoch {e} peak" for e in range(1, 11)] == [
        metric for scenario, metric in figures if scenario == "memory" and metric.startswith("epoch")
    ]
    assert "targets" not in document
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_mapper_scenario_and_the_framed_pickle_floor_run_in_quick_mode(two_workers, tmp_path):
    report = tmp_path / "bench.json"
    result = run_bench(
        "--workers",
        *two_workers,
        "--quick",
        "--no-progress",
        "--scenario",
        "latency",
        "pipelined",
        "mapper",
        "--json",
        str(report),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    header = next(line for line in result.stdout.splitlines() if line.startswith("scenario"))
    for column in (FRAMED, PARALLEL_MAPPER, f"{RPCDL}/{FRAMED}", f"{RPCDL}/{PARALLEL_MAPPER}"):
        assert column in header
    figures = {(f["scenario"], f["metric"]): f for f in json.loads(report.read_text())["figures"]}
    for key in [("latency", "p50"), ("pipelined", "calls/s")]:
        assert set(figures[key]["systems"]) == {RPCDL, SOCKET, FRAMED}, key
        assert figures[key]["ratios"][FRAMED] > 0 and figures[key]["ratios"][SOCKET] > 0
    mapper = figures[("mapper", "items/s")]
    assert set(mapper["systems"]) == {RPCDL, PARALLEL_MAPPER}
    assert mapper["systems"][RPCDL]["median"] > 0 and mapper["ratios"][PARALLEL_MAPPER] > 0


def test_a_judge_given_to_the_bench_prints_and_saves_its_verdicts(two_workers, tmp_path):
    report = tmp_path / "bench.json"
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from targets import judge; from rpcdl.cli.bench import main; "
        "sys.exit(main(sys.argv[2:], judge=judge))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    arguments = ["--workers", *two_workers, "--quick", "--no-progress", "--scenario", "latency", "--json", str(report)]
    result = subprocess.run(
        [sys.executable, "-c", code, str(BENCHMARKS), *arguments], capture_output=True, text=True, timeout=110, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "targets:" in result.stdout and f"{NOT_JUDGED}: its runs are too small" in result.stdout
    verdicts = [line for line in result.stdout.splitlines() if line.strip().startswith(("met ", "MISSED "))]
    assert verdicts == []  # --quick judges nothing
    document = json.loads(report.read_text())
    assert len(document["targets"]) == len(TARGETS)
    assert {(target["met"], target["status"]) for target in document["targets"]} == {(None, NOT_JUDGED)}
    goals = {target.label for target in TARGETS}
    assert "mapper items/s vs ParallelMapper(process)" in goals
    assert "pipelined calls/s vs minimal framed-pickle RPC" in goals


def test_ratios_and_targets_from_figures():
    latency = Figure("latency", "p50", "us", "lower")
    for value in (100.0, 300.0, 200.0):
        latency.add(RPCDL, value)
    latency.add("rpcdataloader", 1000.0)
    latency.add(SOCKET, 50.0)
    kept = Figure("straggler", "kept", "x", "higher")
    kept.add(RPCDL, 0.9)
    assert latency.median(RPCDL) == 200.0
    assert latency.ratio("rpcdataloader") == pytest.approx(0.2)
    assert latency.ratio(SOCKET) == pytest.approx(4.0)

    results = {r["target"]: r for r in evaluate_targets([latency, kept])}
    assert results["no-op rpc_sync p50 latency vs rpcdataloader"]["met"] is True
    assert results["no-op rpc_sync p50 latency vs torch.distributed.rpc"]["met"] is None  # not measured
    assert results["straggler: throughput kept vs fast workers only"]["met"] is True
    assert results["pipelined calls/s vs rpcdataloader"]["value"] is None

    table = format_table([latency, kept], [RPCDL, "rpcdataloader", SOCKET])
    row = next(line for line in table.splitlines() if line.startswith("latency"))
    assert "200" in row and "0.20x" in row and "4.00x" in row


def test_a_quick_run_judges_no_target_and_shows_no_memory_ratio():
    kept = Figure("straggler", "kept", "x", "higher")
    kept.add(RPCDL, 0.5)
    bound = Figure("memory", "peak / bound", "x", "lower")
    bound.add(RPCDL, 3.0)
    bound.add(TORCH, 1.5)
    peak = Figure("memory", "epoch 1 peak", "MB", "lower")
    peak.add(RPCDL, 12.0)
    peak.add(TORCH, 6.0)

    judged = {r["target"]: r for r in evaluate_targets([kept, bound])}
    assert judged["straggler: throughput kept vs fast workers only"]["met"] is False
    assert "MISSED" in format_targets(list(judged.values()))
    quick = evaluate_targets([kept, bound], judged=False)
    assert {(r["met"], r["status"]) for r in quick} == {(None, NOT_JUDGED)}
    assert "MISSED" not in format_targets(quick) and NOT_JUDGED in format_targets(quick)

    table = format_table([kept, bound, peak], [RPCDL, TORCH], judged=False).splitlines()
    bound_row = next(line for line in table if "peak / bound" in line)
    peak_row = next(line for line in table if "epoch 1 peak" in line)
    assert "3.00" not in bound_row and "2.00x" not in bound_row and NOT_JUDGED in bound_row
    assert "12.0" in peak_row and "2.00x" not in peak_row  # the figure, without the ratio
    full = format_table([kept, bound, peak], [RPCDL, TORCH]).splitlines()
    assert "2.00x" in next(line for line in full if "peak / bound" in line)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--local-workers", "0"], "expected a positive integer"),
        (["--workers", "not-an-address"], "malformed worker address"),
        (["--scenario", "nope"], "invalid choice"),
        (["--local-workers", "2", "--workers", "127.0.0.1:1"], "not allowed with argument"),
    ],
    ids=["local", "workers", "scenario", "both"],
)
def test_bad_arguments_are_explained(args, message):
    result = run_bench(*args, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr


def test_a_worker_that_does_not_answer_is_reported(unused_port):
    # a refused connection is retried for RPCDL_CONNECT_GRACE: 1 s is enough to tell it does not answer
    result = run_bench("--workers", f"127.0.0.1:{unused_port}", "--quick", timeout=60, RPCDL_CONNECT_GRACE="1")
    assert result.returncode == 2
    assert f"worker 127.0.0.1:{unused_port} does not answer" in result.stderr


@pytest.fixture
def unused_port():
    """A port nothing listens on: bound by this test (so no one else gets it) but not listening."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        yield holder.getsockname()[1]


def _children() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def _ended(pids: set[int], timeout: float = 20.0) -> list[int]:
    """The processes of ``pids`` still alive after ``timeout`` seconds."""
    import psutil

    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return [process.pid for process in alive]


def test_releasing_a_torch_loader_stops_its_persistent_worker_processes():
    from rpcdl.cli.bench.systems import LoaderSpec, TorchLoaderSystem
    from rpcdl.cli.bench.workloads import SmallDataset

    before = _children()
    system = TorchLoaderSystem()
    loader = system.loader(LoaderSpec(SmallDataset, (64,), 16, 2))
    for _ in range(2):  # persistent workers: the second epoch reuses the first one's processes
        assert len(list(loader)) == 4
    started = _children() - before
    assert len(started) >= 2
    system.release_loader(loader)
    assert _ended(started) == []
    with pytest.raises(RuntimeError, match="released"):
        iter(loader)


def test_releasing_a_parallel_mapper_stops_its_processes():
    pytest.importorskip("torchdata.nodes")
    from rpcdl.cli.bench.floors import ParallelMapperSystem

    before = _children()
    system = ParallelMapperSystem()
    mapper = system.mapper(2)
    assert [next(mapper) for _ in range(5)] == [1, 2, 3, 4, 5]
    started = _children() - before
    assert len(started) >= 2
    system.release_mapper(mapper)
    assert _ended(started) == []
    with pytest.raises(RuntimeError, match="released"):
        next(mapper)


def _run_script(name: str, *args: str, timeout: float = 100) -> subprocess.CompletedProcess:
    """``python benchmarks/NAME ARGS``, this checkout's rpcdl first on its path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, str(BENCHMARKS / name), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.timeout(200)  # five processes start torch at once, on a machine that may be busy
def test_the_real_process_scale_bench_reports_threads_files_and_memory_per_peer_on_both_sides(tmp_path):
    report = tmp_path / "peers.json"
    counts = ["--trainer-workers", "1,2", "--worker-trainers", "1,2"]
    result = _run_script("scale_processes.py", "--part", "peers", *counts, "--json", str(report), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if " peers: " in line]
    expected = [
        "one trainer,   1 workers:",
        "one trainer,   2 workers:",
        "one trainer, per worker from 1 to 2:",
        "one worker,   1 trainers:",
        "one worker,   2 trainers:",
        "one worker, per trainer from 1 to 2:",
    ]
    assert [next((text for text in expected if text in line), line) for line in lines] == expected
    for line in lines:
        assert re.search(r"threads .*files.*RSS .*Python .*\(load \d+\.\d\)$", line), line
    peers = json.loads(report.read_text())["variants"]["after"]["peers"]
    for side in ("trainer", "worker"):
        first, second = peers[side]
        assert (first["peers"], second["peers"]) == (1, 2)
        assert second["sockets"] >= first["sockets"] + 1, (side, first, second)  # the new peer's connection is open
        assert (
            first["threads"] >= first["python_threads"] >= first["rpcdl_threads"] == sum(first["rpcdl_kinds"].values())
        )
        assert first["rss_mb"] > 0 and first["python_mb"] >= 0 and first["load"] >= 0
    assert peers["trainer"][0]["rpcdl_threads"] >= 1  # the call went through rpcdl's own threads
    assert set(peers["trainer_per_worker"]) == set(peers["worker_per_trainer"]) >= {"threads", "fds", "rss_mb", "load"}


def test_the_trainer_cpu_bench_prints_the_load_beside_every_figure():
    systems = ("socket", "frames", "frames-loop")
    result = _run_script("trainer_cpu.py", "--rounds", "1", "--batches", "2", "--systems", *systems)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = [line for line in result.stdout.splitlines() if "CPU s/GB" in line]
    assert len(figures) == 2 * len(systems)  # each system's round, then its median
    for line in figures:
        assert re.search(r"load \d+\.\d(-\d+\.\d)?\)$", line), line


def test_the_loop_floor_bench_measures_four_systems_and_stops_its_processes(tmp_path):
    import psutil

    report = tmp_path / "floor.json"
    result = _run_script("loop_floor.py", "--rounds", "1", "--calls", "50", "--json", str(report))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split("  ")[0]: line for line in result.stdout.splitlines()}
    assert {"socket", "framed pickle RPC", "loop floor", "rpcdl"} <= set(rows), result.stdout
    assert re.search(r"load average at the rounds' ends: \d+\.\d-\d+\.\d$", result.stdout.strip()), result.stdout
    medians = json.loads(report.read_text())["medians"]
    for name in ("socket", "framed pickle RPC", "loop floor", "rpcdl"):
        assert medians[name]["p50_us"] > 0 and medians[name]["client_cpu_us"] >= 0, (name, medians[name])
    servers = [p for p in psutil.process_iter(["cmdline"]) if "--serve" in (p.info["cmdline"] or [])]
    assert not [p for p in servers if any("loop_floor.py" in part for part in p.info["cmdline"])]


@pytest.mark.timeout(200)  # two sides, each with two workers, start torch on a machine that may be busy
def test_the_in_turns_bench_pairs_two_versions_and_stops_its_processes(tmp_path):
    import psutil

    report = tmp_path / "turns.json"
    args = ("--baseline", sys.executable, "--quick", "--pairs", "2", "--scenario", "small", "mapper")
    result = _run_script("in_turns.py", *args, "--json", str(report), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if "paired ratio" in line]
    assert [row.split()[0] for row in rows] == ["small", "mapper"], result.stdout
    assert all(re.search(r"this faster in [0-2]/2\)", row) for row in rows), rows
    assert re.search(r"load average before \[.*\], after \[.*\]; 2 pairs$", result.stdout.strip()), result.stdout
    document = json.loads(report.read_text())
    assert document["overlapped_turns"] == 0  # the side waiting for its turn was stopped during every other turn
    figures = document["figures"]
    for scenario in ("small", "mapper"):
        assert figures[scenario]["ratio"] > 0 and figures[scenario]["this_rate"] > 0, figures[scenario]
    sides = [p for p in psutil.process_iter(["cmdline"]) if "--side" in (p.info["cmdline"] or [])]
    assert not [p for p in sides if any("in_turns.py" in part for part in p.info["cmdline"])]


def test_the_in_turns_bench_assembles_a_checkouts_package_with_its_integrations(tmp_path):
    """A checkout laid out as this repository gets its integrations and configs inside its package, where an
    editable install of this side cannot map them to this side's folders; any other folder is used as it is."""
    in_turns = _load_benchmark("in_turns")
    checkout, plain, scratch = tmp_path / "checkout", tmp_path / "plain", tmp_path / "scratch"
    for folder, text in (("rpcdl", "VERSION = 'old'"), ("integrations", "NAME = 'old'"), ("configs", "old: 1")):
        (checkout / folder).mkdir(parents=True)
        (checkout / folder / ("data.yaml" if folder == "configs" else "__init__.py")).write_text(text)
    (plain / "rpcdl").mkdir(parents=True)
    (plain / "rpcdl" / "__init__.py").write_text("")
    scratch.mkdir()
    package = in_turns.package_of(checkout, scratch) / "rpcdl"
    assert package.parent != checkout and package.parent.is_relative_to(scratch)
    assert (package / "__init__.py").read_text() == "VERSION = 'old'"
    assert (package / "integrations" / "__init__.py").read_text() == "NAME = 'old'"
    assert (package / "configs" / "data.yaml").read_text() == "old: 1"
    assert in_turns.package_of(plain, scratch) == plain


def test_the_in_turns_bench_wants_a_baseline_that_holds_rpcdl(tmp_path):
    result = _run_script("in_turns.py", "--baseline-path", str(tmp_path))
    assert result.returncode == 2 and "holds no rpcdl package" in result.stderr, result.stderr
    result = _run_script("in_turns.py")
    assert result.returncode == 2 and "give the baseline" in result.stderr, result.stderr
