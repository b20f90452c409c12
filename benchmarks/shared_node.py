"""Two training jobs sharing two workers on one node: what polling costs when cores are scarce.

Issue 26, item 7: two trainer processes, each an :class:`rpcdl.RPCDataloader`
over the same two local worker processes, a dataset with real CPU work per
sample, three epochs; the wall time of each job. A *variant* is an interpreter
(``--python``: each runs the ``rpcdl`` it imports, so one run compares two
versions) and a polling setting (``--poll``: ``default`` leaves
``RPCDL_POLL_MICROSECONDS`` unset, a number sets it, for the workers and the
trainers alike). Rounds take the variants in turn, their order rotating, so a
burst of load on the machine hits them all alike::

    python benchmarks/shared_node.py \\
        --python /root/.pyenv/versions/3.11.7/bin/python --python .venv/bin/python \\
        --poll default --poll 0 --rounds 3

Each job reports its wall time and its own CPU seconds; the workers' CPU
seconds over the whole variant are read from ``/proc``. The medians over the
rounds, and each variant's ratio to the first, are printed at the end.
Children run from a scratch directory, so ``python -m rpcdl`` imports the
interpreter's own ``rpcdl``, never this checkout's by accident.

Not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

POLL_ENV = "RPCDL_POLL_MICROSECONDS"


class BusyDataset:
    """Samples that cost real CPU: a float32[3, 32, 32] image built and filtered in Python and numpy."""

    def __init__(self, length: int, work: int):
        self.length = length
        self.work = work

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        import numpy as np
        import torch

        generator = np.random.default_rng(index)
        image = generator.random((3, 32, 32), dtype=np.float32)
        for _ in range(self.work):  # numpy calls on small arrays: the GIL held most of the time, as augmentations
            image = np.clip(image * 1.01 + np.roll(image, 1, axis=2) * 0.01, 0.0, 1.0)
        return torch.from_numpy(image)


# ---------------------------------------------------------------------------- one trainer process


def load_batch(first: int, size: int, work: int) -> Any:
    """A batch of :class:`BusyDataset` samples, made where it is called."""
    import torch

    dataset = BusyDataset(first + size, work)
    return torch.stack([dataset[index] for index in range(first, first + size)])


def trainer(args: argparse.Namespace) -> None:
    import rpcdl

    if args.mode == "loader":
        dataset = rpcdl.RPCDataset(args.workers, BusyDataset, args.samples, args.work)
        loader = rpcdl.RPCDataloader(dataset, batch_size=args.batch, shuffle=True)
        epoch = loader.__iter__
    else:  # a loop of rpc_sync, one batch per call, the workers in turn

        def epoch():
            for step, first in enumerate(range(0, args.samples, args.batch)):
                yield rpcdl.rpc_sync(args.workers[step % len(args.workers)], load_batch, (first, args.batch, args.work))

        for address in args.workers:
            rpcdl.rpc_sync(address, load_batch, (0, 1, 1))  # connected, and the function known there
    print("ready", flush=True)
    sys.stdin.readline()  # the driver starts both jobs at once
    cpu, usage, started = time.process_time(), _usage(), time.perf_counter()
    batches = 0
    for _ in range(args.epochs):
        for batch in epoch():
            batch.sum()  # the training step's least: the batch is read
            batches += 1
    wall, cpu, after = time.perf_counter() - started, time.process_time() - cpu, _usage()
    print(json.dumps({"wall": wall, "cpu": cpu, "batches": batches, "nivcsw": after[1] - usage[1]}), flush=True)
    rpcdl.shutdown()


def hog() -> None:
    """Another job on the node: pure CPU, counting its loops until SIGTERM; prints loops per second."""
    import signal

    running = [True]
    signal.signal(signal.SIGTERM, lambda *_: running.__setitem__(0, False))
    print("ready", flush=True)
    sys.stdin.readline()
    started, loops = time.perf_counter(), 0
    while running[0]:
        for _ in range(10_000):
            pass
        loops += 1
    print(json.dumps({"rate": loops / (time.perf_counter() - started)}), flush=True)


def _usage() -> tuple[int, int]:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw, usage.ru_nivcsw


# ---------------------------------------------------------------------------- the driver


def _cpu_seconds(pid: int) -> float:
    """User and system CPU of a live process, from ``/proc``."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuQuota:
    """A cgroup (v1 ``cpu`` controller or v2) holding the jobs and workers to ``cores`` CPUs of time, as a
    container's CPU limit does; needs root. Its throttling counters tell how often the quota ran out."""

    def __init__(self, cores: float):
        name = f"rpcdl-shared-node-{os.getpid()}"
        v1 = "/sys/fs/cgroup/cpu"
        if os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):
            self.path = os.path.join(v1, name)
            os.mkdir(self.path)
            self._write("cpu.cfs_period_us", "100000")
            self._write("cpu.cfs_quota_us", str(int(cores * 100000)))
            self.procs = os.path.join(self.path, "cgroup.procs")
        else:
            self.path = os.path.join("/sys/fs/cgroup", name)
            os.mkdir(self.path)
            self._write("cpu.max", f"{int(cores * 100000)} 100000")
            self.procs = os.path.join(self.path, "cgroup.procs")

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as control:
            control.write(value)

    def enter(self) -> None:
        """Move the calling process into the group (a ``preexec_fn``)."""
        with open(self.procs, "w") as procs:
            procs.write(str(os.getpid()))

    def throttled(self) -> tuple[int, float]:
        """How many periods the group was throttled in, and for how many seconds, so far."""
        with open(os.path.join(self.path, "cpu.stat")) as stat:
            fields = dict(line.split() for line in stat if line.strip())
        if "throttled_time" in fields:
            return int(fields["nr_throttled"]), int(fields["throttled_time"]) / 1e9
        return int(fields["nr_throttled"]), int(fields["throttled_usec"]) / 1e6

    def remove(self) -> None:
        os.rmdir(self.path)


def _environment(poll: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in (POLL_ENV, "PYTHONPATH")}
    if poll != "default":
        env[POLL_ENV] = poll
    return env


def _start_workers(
    python: str, env: dict[str, str], count: int, scratch: str, quota: CpuQuota | None
) -> tuple[list, list[str]]:
    workers = [
        subprocess.Popen(
            [python, "-m", "rpcdl", "worker", "--port", "0", "--log-level", "WARNING"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=scratch,
            preexec_fn=quota.enter if quota else None,
        )
        for _ in range(count)
    ]
    return workers, [worker.stdout.readline().strip() for worker in workers]


def run_variant(
    python: str, poll: str, args: argparse.Namespace, scratch: str, quota: CpuQuota | None
) -> dict[str, Any]:
    """Both jobs over two fresh workers; each job's wall and CPU, the workers' CPU."""
    env = _environment(poll)
    workers, addresses = _start_workers(python, env, 2, scratch, quota)
    jobs: list[subprocess.Popen] = []
    hogs: list[subprocess.Popen] = []
    try:
        before = [_cpu_seconds(worker.pid) for worker in workers]
        command = [
            python,
            os.path.abspath(__file__),
            "--trainer",
            *addresses,
            "--samples",
            str(args.samples),
            "--work",
            str(args.work),
            "--batch",
            str(args.batch),
            "--epochs",
            str(args.epochs),
            "--mode",
            args.mode,
        ]
        jobs = [
            subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                cwd=scratch,
                preexec_fn=quota.enter if quota else None,
            )
            for _ in range(args.jobs)
        ]
        hogs = [
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--hog"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=scratch,
            )
            for _ in range(args.hogs)
        ]
        for job in [*jobs, *hogs]:
            if job.stdout.readline().strip() != "ready":
                raise RuntimeError("a trainer failed to start")
        loads_before = (harness.load_average() or [0.0])[0]
        throttled_before = quota.throttled() if quota else (0, 0.0)
        for job in [*hogs, *jobs]:
            job.stdin.write("go\n")
            job.stdin.flush()
        results = [json.loads(job.stdout.readline()) for job in jobs]
        throttled_after = quota.throttled() if quota else (0, 0.0)
        worker_cpu = sum(_cpu_seconds(worker.pid) - cpu for worker, cpu in zip(workers, before, strict=True))
        for process in hogs:
            process.terminate()
        hog_rate = sum(json.loads(process.stdout.readline())["rate"] for process in hogs)
    finally:
        for process in [*jobs, *hogs, *workers]:
            if process.poll() is None:
                process.terminate()
        for process in [*jobs, *hogs, *workers]:
            process.wait(timeout=30)
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    pipe.close()
    return {
        "wall": max(result["wall"] for result in results),
        "walls": [round(result["wall"], 2) for result in results],
        "trainer_cpu": sum(result["cpu"] for result in results),
        "nivcsw": sum(result["nivcsw"] for result in results),
        "worker_cpu": worker_cpu,
        "load": loads_before,
        "hog_rate": hog_rate,
        "throttled_periods": throttled_after[0] - throttled_before[0],
        "throttled_seconds": throttled_after[1] - throttled_before[1],
    }


def driver(args: argparse.Namespace) -> None:
    variants = {f"{python} poll={poll}": (python, poll) for python in args.python for poll in args.poll}
    quota = CpuQuota(args.cpu_quota) if args.cpu_quota else None
    try:
        with tempfile.TemporaryDirectory() as scratch:
            figures = harness.interleave(
                {
                    name: (lambda python=python, poll=poll: run_variant(python, poll, args, scratch, quota))
                    for name, (python, poll) in variants.items()
                },
                args.rounds,
                rotate=True,
                after_round=_show,
            )
    finally:
        if quota is not None:
            quota.remove()
    _summary(args, list(variants), figures)


def _show(index: int, this_round: dict[str, dict[str, Any]]) -> None:
    for name, result in this_round.items():
        print(
            f"round {index} {name}: jobs {result['walls']} s, trainers' CPU "
            f"{result['trainer_cpu']:.2f} s, workers' CPU {result['worker_cpu']:.2f} s, "
            f"involuntary switches {result['nivcsw']}, other jobs' loops/s {result['hog_rate']:.0f}, "
            f"throttled {result['throttled_periods']} periods ({result['throttled_seconds']:.2f} s), "
            f"load {result['load']:.2f}",
            flush=True,
        )


def _summary(args: argparse.Namespace, names: list[str], figures: dict[str, list[dict[str, Any]]]) -> None:
    first = harness.median(result["wall"] for result in figures[names[0]])
    print("\nmedians over the rounds (wall: the slower job):")
    for name in names:
        runs = figures[name]
        wall = harness.median(result["wall"] for result in runs)
        print(
            f"  {name}: wall {wall:.2f} s ({wall / first:.2f}x the first), trainers' CPU "
            f"{harness.median(r['trainer_cpu'] for r in runs):.2f} s, workers' CPU "
            f"{harness.median(r['worker_cpu'] for r in runs):.2f} s, other jobs' loops/s "
            f"{harness.median(r['hog_rate'] for r in runs):.0f}"
        )
    harness.save_json(args.json, {"rounds": figures})


def main() -> None:
    parser = harness.parser(__doc__, rounds=3, json_file=True)
    parser.add_argument("--trainer", nargs="+", dest="workers", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--hog", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hogs", type=int, default=0, help="CPU-bound processes (other jobs) running beside the jobs")
    parser.add_argument("--python", action="append", help="an interpreter to run (repeat; default: this one)")
    parser.add_argument("--poll", action="append", help="'default' or microseconds (repeat; default: default, 0)")
    parser.add_argument("--jobs", type=int, default=2, help="trainer processes sharing the workers")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1024, help="samples per epoch")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--work", type=int, default=80, help="numpy passes per sample (about 20 us each)")
    parser.add_argument(
        "--mode",
        choices=("loader", "sync"),
        default="loader",
        help="each job an RPCDataloader (default), or a loop of rpc_sync calls of one batch each",
    )
    parser.add_argument(
        "--cpu-quota", type=float, help="hold the jobs and workers to this many CPUs of time in a cgroup (root)"
    )
    args = parser.parse_args()
    if args.hog:
        hog()
        return
    if args.workers:
        trainer(args)
        return
    args.python = [os.path.abspath(p) if os.sep in p else p for p in args.python or [sys.executable]]
    args.poll = args.poll or ["default", "0"]
    driver(args)


if __name__ == "__main__":
    main()
