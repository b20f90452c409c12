"""Two rpcdl versions in turns, paired: small batches/s, image MB/s and the mapper's items/s, before and after.

``rpcdl bench`` runs a version's scenarios back to back, half a minute each;
on a shared machine whose speed drifts by 2x over minutes, two such runs of
two versions differ by more than the versions do. Here each version keeps
one process with its own two local workers and its loaders open, and the two
take turns at short bursts (well under a second each), in the order ABBA, so
a drift hits both alike. The side waiting for its turn is stopped (``SIGSTOP``,
its client and its workers) until its turn: an idle version's timers would
otherwise run on the CPUs the other side is measured on, and two versions
differ there (56d68bd's two idle workers took 3% of a core, HEAD's 0.6%).
Each pair gives a ratio (the rate of the rpcdl this interpreter imports over
the baseline's); the report is the median ratio, its quartiles, how many
pairs this side won, and the CPU per unit of each side, its client
process and its workers, from ``/proc``.

The baseline is another interpreter (its own rpcdl), or this interpreter
with another checkout first on its path::

    python benchmarks/in_turns.py --baseline /path/to/old/venv/bin/python [--pairs 20]
    python benchmarks/in_turns.py --baseline-path /path/to/old/checkout [--scenario small mapper]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

#: Per scenario: the unit, and the burst of one turn (epochs of a loader, or thousands of items).
SCENARIOS = {"small": ("batches/s", 6), "image": ("MB/s", 5), "mapper": ("items/s", 5)}
SMALL_BATCHES, IMAGE_BATCHES = 300, 20  # per epoch
_IMAGE_MB = 64 * 3 * 224 * 224 / 1e6


# ---------------------------------------------------------------------------- one version's process


def side(quick: bool) -> None:
    """Serve bursts: read ``SCENARIO COUNT`` lines, answer ``rate client_cpu_us workers_cpu_us`` per unit."""
    from torchdata.nodes import IterableWrapper

    import rpcdl
    from rpcdl.cli.bench.workloads import ImageDataset, SmallDataset, increment
    from rpcdl.data.dataloader import RPCDataloader
    from rpcdl.data.dataset import RPCDataset
    from rpcdl.integrations.torchdata import RPCMapper

    logging.getLogger("rpcdl.dataloader.wait").setLevel(logging.ERROR)  # bursts of a few batches: no advice
    small_batches, image_batches = (20, 4) if quick else (SMALL_BATCHES, IMAGE_BATCHES)
    with rpcdl.local_workers(2) as workers:
        addresses, pids = list(workers), [process.pid for process in workers.processes]
        small = RPCDataloader(RPCDataset(addresses, SmallDataset, small_batches * 32), batch_size=32)
        image = RPCDataloader(RPCDataset(addresses, ImageDataset, image_batches * 64), batch_size=64)
        mapper = RPCMapper(IterableWrapper(itertools.count()), addresses, increment)
        mapper.reset()

        def burst(scenario: str, count: int) -> float:
            """Run one turn; return its units (batches, MB or items)."""
            if scenario == "mapper":
                items = count * (100 if quick else 2000)
                for _ in range(items):
                    next(mapper)
                return items
            loader = small if scenario == "small" else image
            batches = sum(1 for _ in range(count) for _ in loader)
            return batches * (_IMAGE_MB if scenario == "image" else 1)

        for scenario in SCENARIOS:  # connections up, chunk sizes grown
            burst(scenario, 2)
        print("ready", os.getpid(), *pids, flush=True)
        for line in sys.stdin:
            scenario, count = line.split()
            client, workers_cpu, started = (
                harness.process_cpu(os.getpid()),
                harness.process_cpu(*pids),
                time.perf_counter(),
            )
            units = burst(scenario, int(count))
            seconds = time.perf_counter() - started
            client, workers_cpu = harness.process_cpu(os.getpid()) - client, harness.process_cpu(*pids) - workers_cpu
            print(units / seconds, client / units * 1e6, workers_cpu / units * 1e6, flush=True)


# ---------------------------------------------------------------------------- the driver


def package_of(checkout: Path, scratch: Path) -> Path:
    """The folder to put first on the baseline's path for ``checkout``.

    A checkout laid out as this repository keeps ``rpcdl.integrations`` and
    ``rpcdl.configs`` beside the package (``integrations/``, ``configs/``),
    where only an install maps them; an editable install of this side maps
    them to this side's folders, whatever rpcdl comes first on the path. So
    such a checkout's package is assembled in ``scratch``, with both inside.
    """
    beside = [name for name in ("integrations", "configs") if (checkout / name).is_dir()]
    if not beside:
        return checkout
    package = scratch / "baseline" / "rpcdl"
    shutil.copytree(checkout / "rpcdl", package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in beside:
        shutil.copytree(checkout / name, package / name, ignore=shutil.ignore_patterns("__pycache__"))
    return package.parent


def signal_all(pids: list[int], signum: int) -> None:
    """Send ``signum`` to each of ``pids`` that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def all_stopped(pids: list[int]) -> bool:
    """Whether each of ``pids`` is stopped (state ``T`` in ``/proc``), or gone."""
    for pid in pids:
        try:
            state = harness.stat_fields(pid)[0]
        except FileNotFoundError:
            continue
        if state != "T":
            return False
    return True


def stop(pids: list[int], timeout: float = 5.0) -> None:
    """Stop ``pids`` (``SIGSTOP``) and wait until each is stopped: a signal takes effect once its process runs."""
    signal_all(pids, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not all_stopped(pids) and time.monotonic() < deadline:
        time.sleep(0.001)


def driver(args: argparse.Namespace) -> dict:
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    baseline_environment = dict(environment)
    commands = {
        "baseline": ([args.baseline or sys.executable], baseline_environment),
        "this": ([sys.executable], environment),
    }
    scenarios = args.scenario
    samples: dict[str, dict[str, list[tuple[float, float, float]]]] = {
        s: {"baseline": [], "this": []} for s in scenarios
    }
    loads = [harness.load_average()]
    with tempfile.TemporaryDirectory() as scratch:  # each side imports its interpreter's rpcdl, not the cwd's
        if args.baseline_path:
            baseline_environment["PYTHONPATH"] = str(package_of(args.baseline_path, Path(scratch)))
        sides = {
            name: subprocess.Popen(
                [*python, os.path.abspath(__file__), "--side", *(["--quick"] if args.quick else [])],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=scratch,
                env=env,
            )
            for name, (python, env) in commands.items()
        }
        pids: dict[str, list[int]] = {}  # per side: its client and its workers, stopped except during its own turns
        overlapped = 0  # turns during which the other side was not stopped (a check of the above)
        try:
            for name, process in sides.items():
                word, *numbers = process.stdout.readline().split() or [""]
                if word != "ready":
                    raise SystemExit(f"the {name} side did not start (see its error above)")
                pids[name] = [int(number) for number in numbers]
                stop(pids[name])
            for pair in range(args.pairs):
                for scenario in scenarios:
                    order = ("baseline", "this") if pair % 2 == 0 else ("this", "baseline")
                    for name in order:
                        process = sides[name]
                        signal_all(pids[name], signal.SIGCONT)
                        process.stdin.write(f"{scenario} {SCENARIOS[scenario][1]}\n")
                        process.stdin.flush()
                        waiting = [pid for other, others in pids.items() if other != name for pid in others]
                        overlapped += not all_stopped(waiting)
                        rate, client, workers = map(float, process.stdout.readline().split())
                        stop(pids[name])
                        samples[scenario][name].append((rate, client, workers))
        finally:
            for side_pids in pids.values():
                signal_all(side_pids, signal.SIGCONT)
            for process in sides.values():
                process.stdin.close()
            for process in sides.values():
                process.wait(timeout=60)
                process.stdout.close()
    loads.append(harness.load_average())
    return {"loads": loads, "pairs": args.pairs, "samples": samples, "overlapped_turns": overlapped}


def report(result: dict) -> dict:
    """Print one line per scenario; return the figures."""
    figures = {}
    for scenario, by_side in result["samples"].items():
        before, after = by_side["baseline"], by_side["this"]
        ratios = sorted(new[0] / old[0] for old, new in zip(before, after, strict=True))
        quartiles = (ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4])
        figure = {
            "ratio": harness.median(ratios),
            "quartiles": quartiles,
            "won": sum(ratio > 1 for ratio in ratios),
            **{
                f"{name}_{what}": harness.median(sample[index] for sample in samples)
                for name, samples in (("baseline", before), ("this", after))
                for index, what in enumerate(("rate", "client_cpu_us", "workers_cpu_us"))
            },
        }
        figures[scenario] = figure
        unit = SCENARIOS[scenario][0]
        print(
            f"{scenario:7s} {unit:10s} baseline {figure['baseline_rate']:9.0f}  this {figure['this_rate']:9.0f}  "
            f"paired ratio {figure['ratio']:.3f} (quartiles {quartiles[0]:.3f}-{quartiles[1]:.3f}, "
            f"this faster in {figure['won']}/{len(ratios)})  CPU us per unit, client "
            f"{figure['baseline_client_cpu_us']:.1f} -> {figure['this_client_cpu_us']:.1f}, workers "
            f"{figure['baseline_workers_cpu_us']:.1f} -> {figure['this_workers_cpu_us']:.1f}"
        )
    before, after = result["loads"]
    print(f"load average before {before}, after {after}; {result['pairs']} pairs")
    return figures


def main() -> None:
    parser = harness.parser(__doc__, json_file=True)
    parser.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="tiny bursts: checks the script, measures nothing")
    parser.add_argument("--baseline", metavar="PYTHON", help="the baseline's interpreter (default: this one)")
    parser.add_argument("--baseline-path", metavar="DIR", type=Path, help="a checkout put first on the baseline's path")
    parser.add_argument("--pairs", type=harness.positive_int, default=20, help="turns of each side (default: 20)")
    parser.add_argument("--scenario", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    args = parser.parse_args()
    if args.side:
        side(args.quick)
        return
    if args.baseline is None and args.baseline_path is None:
        parser.error("give the baseline: --baseline PYTHON (its own rpcdl) and/or --baseline-path CHECKOUT")
    if args.baseline_path is not None and not (args.baseline_path / "rpcdl" / "__init__.py").is_file():
        parser.error(f"--baseline-path {args.baseline_path} holds no rpcdl package (rpcdl/__init__.py)")
    result = driver(args)
    figures = report(result)
    harness.save_json(
        args.json,
        {
            "machine": harness.machine(),
            "pairs": args.pairs,
            "figures": figures,
            "overlapped_turns": result["overlapped_turns"],
        },
    )


if __name__ == "__main__":
    main()
