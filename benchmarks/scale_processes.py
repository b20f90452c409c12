"""One worker and many trainer processes on one machine: the worker's memory and its fairness.

Issue 35, the real-process part of item 9, on real processes and sockets:

* **memory**: one worker process (``--parallel 2``) and ``--trainers`` trainer
  processes (16 by default, forked from one process that imported rpcdl once)
  each building the same dataset, which writes 100 MB when built: how much
  the worker's resident memory grew once every trainer holds it;
* **fairness**: one worker process (``--parallel 1``) and two trainers, each
  an :class:`rpcdl.RPCDataloader` whose samples hold the worker's one slot
  for ``--item-ms`` (asleep; ``RPCDL_BENCH_SPIN=1``: spinning on its CPU):
  one fetches batches of 16 with ``prefetch_factor=8``, the other batches of
  2 with ``prefetch_factor=1``. Samples per second each, over
  the same window of ``--seconds``.

A *variant* is a checkout whose ``rpcdl`` the processes import
(``--variant NAME=PATH``, put first on ``PYTHONPATH``; children run from a
scratch directory), so one run compares the code before and after::

    git worktree add --detach /tmp/main-before main
    python benchmarks/scale_processes.py --variant before=/tmp/main-before --variant after=.

Each figure is printed with the load average of the minute beside it (the
machine is shared). Not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

_HERE = Path(__file__).resolve()


# ---------------------------------------------------------------------------- code the workers run


class Allocates:
    """A dataset that writes ``megabytes`` when built (resident memory); item ``i`` is ``i``."""

    def __init__(self, megabytes: int, n: int = 100):
        self.block = bytearray(b"\x01") * (megabytes << 20)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class Spins:
    """A dataset whose every sample takes ``milliseconds`` of the worker's time."""

    def __init__(self, n: int, milliseconds: float):
        self.n = n
        self.seconds = milliseconds / 1000

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        _hold(self.seconds)
        return index


# ---------------------------------------------------------------------------- roles of child processes


def _trainers(address: str, count: int) -> int:
    """Fork ``count`` trainers each building ``Allocates(100)``; print ``built``; on a line in, let them exit."""
    import rpcdl

    ready_read, ready_write = os.pipe()
    go_read, go_write = os.pipe()
    children = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(go_write)  # once this process is gone, reading go ends
                dataset = rpcdl.RPCDataset([address], Allocates, 100, rpcdl_timeout=300)
                os.write(ready_write, b"1" if dataset[3] == 3 else b"0")
                os.read(go_read, 1)
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
    answers = b""
    while len(answers) < count:
        answers += os.read(ready_read, count)
    print("built", answers.decode(), flush=True)
    sys.stdin.readline()
    os.write(go_write, b"1" * count)
    failed = sum(os.waitpid(pid, 0)[1] != 0 for pid in children)
    print("done", failed, flush=True)
    return 0


def spin(items: int, milliseconds: float) -> int:
    """A call taking ``items`` times ``milliseconds`` of the worker's time."""
    _hold(items * milliseconds / 1000)
    return items


def _hold(seconds: float) -> None:
    """Hold the worker's slot for ``seconds``: spinning (``RPCDL_BENCH_SPIN=1``) or asleep (the default, which
    other processes on a busy machine do not stretch)."""
    if os.environ.get("RPCDL_BENCH_SPIN") == "1":
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    else:
        time.sleep(seconds)


def _fair_trainer(
    kind: str, address: str, batch_size: int, prefetch: int, item_ms: float, start: float, stop: float
) -> int:
    """Fetch samples from ``address`` between ``start`` and ``stop`` (``time.time()``); print how many.

    ``loader``: an RPCDataloader of ``batch_size`` and ``prefetch_factor``; ``calls``: ``rpc_async`` calls
    of ``batch_size`` samples each, ``prefetch`` of them (at least 2, as a loader's window on loopback) in
    flight at all times: the worker's queue alone, without the loaders' scheduling.
    """
    import collections

    import rpcdl

    counted = 0
    if kind == "loader":
        dataset = rpcdl.RPCDataset([address], Spins, 10_000_000, item_ms)
        loader = rpcdl.RPCDataloader(dataset, batch_size=batch_size, prefetch_factor=prefetch, timeout=120)
        print("ready", flush=True)
        time.sleep(max(0.0, start - 1.0 - time.time()))  # a second early: windows settle before counting
        for batch in loader:
            now = time.time()
            if now >= stop:
                break
            if now >= start:
                counted += len(batch)
    else:
        rpcdl.rpc_sync(address, min, (1, 2))
        print("ready", flush=True)
        time.sleep(max(0.0, start - 1.0 - time.time()))
        calls = max(2, prefetch)  # as a loader's window on loopback: one call runs while the next waits
        window = collections.deque(rpcdl.rpc_async(address, spin, (batch_size, item_ms)) for _ in range(calls))
        while time.time() < stop:
            done = window.popleft().wait()
            if start <= time.time() < stop:
                counted += done
            window.append(rpcdl.rpc_async(address, spin, (batch_size, item_ms)))
        for future in window:
            future.wait()
    print(counted, flush=True)
    return 0


# ---------------------------------------------------------------------------- the driver


def _environment(checkout: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH", "")) if p)
    env.pop("RPCDL_TOKEN", None)
    env.pop("RPCDL_TOKEN_FILE", None)
    return env


def _start_worker(env: dict[str, str], scratch: str, parallel: int) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "rpcdl", "worker", "--port", "0", "--parallel", str(parallel), "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        env=env,
        cwd=scratch,
        text=True,
    )
    address = process.stdout.readline().strip()
    if not address:
        process.kill()
        raise RuntimeError("the worker did not start")
    return process, address


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _role(env: dict[str, str], scratch: str, *args: str, stdin: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(_HERE), "--role", *args],
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        env=env,
        cwd=scratch,
        text=True,
    )


def measure_memory(env: dict[str, str], scratch: str, trainers: int) -> dict[str, float]:
    """The worker's growth in resident MB once ``trainers`` processes built one dataset of 100 MB."""
    worker, address = _start_worker(env, scratch, parallel=2)
    try:
        warm = _role(env, scratch, "trainers", address, "1", stdin=True)  # the worker's code loaded, then freed
        warm.stdout.readline()
        warm.communicate("go\n", timeout=120)
        time.sleep(0.5)
        before = psutil.Process(worker.pid).memory_info().rss
        group = _role(env, scratch, "trainers", address, str(trainers), stdin=True)
        started = time.monotonic()
        built = group.stdout.readline().split()
        seconds = time.monotonic() - started
        after = psutil.Process(worker.pid).memory_info().rss
        load = os.getloadavg()[0]
        group.communicate("go\n", timeout=120)
        ok = built == ["built", "1" * trainers]
        return {"grown_mb": (after - before) / 2**20, "build_s": seconds, "load": load, "ok": float(ok)}
    finally:
        _stop(worker)


def measure_fairness(
    env: dict[str, str], scratch: str, item_ms: float, seconds: float, kind: str = "loader"
) -> dict[str, float]:
    """Samples per second of two trainers sharing one worker: batches of 16 (prefetch 8) and of 2 (prefetch 1)."""
    worker, address = _start_worker(env, scratch, parallel=1)
    try:
        start = time.time() + 15.0  # both trainers import torch and build their dataset first
        stop = start + seconds
        shapes = {"batches_of_16": ("16", "8"), "batches_of_2": ("2", "1")}
        trainers = {
            name: _role(
                env, scratch, "fair-trainer", kind, address, size, prefetch, str(item_ms), repr(start), repr(stop)
            )
            for name, (size, prefetch) in shapes.items()
        }
        for trainer in trainers.values():
            if trainer.stdout.readline().strip() != "ready":
                raise RuntimeError("a trainer did not start")
        time.sleep(max(0.0, start + seconds / 2 - time.time()))
        load = os.getloadavg()[0]
        counts = {
            name: int(trainer.communicate(timeout=120 + seconds)[0].split()[-1]) for name, trainer in trainers.items()
        }
        return {**{name: count / seconds for name, count in counts.items()}, "load": load}
    finally:
        _stop(worker)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", metavar="NAME=PATH", help="a checkout to run (repeatable)")
    parser.add_argument("--trainers", type=int, default=16, help="trainer processes of the memory run (16)")
    parser.add_argument("--item-ms", type=float, default=2.0, help="worker time per sample of the fairness run (2)")
    parser.add_argument("--seconds", type=float, default=8.0, help="window of the fairness run (8)")
    parser.add_argument(
        "--fairness",
        action="append",
        choices=("loader", "calls"),
        help="what the two trainers are: RPCDataloaders (loader) or windows of rpc_async calls (calls, the "
        "worker's queue alone); repeatable (default: both)",
    )
    parser.add_argument("--skip-memory", action="store_true", help="measure the fairness only")
    parser.add_argument("--role", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        role, *rest = args.role
        if role == "trainers":
            return _trainers(rest[0], int(rest[1]))
        return _fair_trainer(
            rest[0], rest[1], int(rest[2]), int(rest[3]), float(rest[4]), float(rest[5]), float(rest[6])
        )
    variants = [v.split("=", 1) for v in (args.variant or [f"after={_HERE.parent.parent}"])]
    args.fairness = args.fairness or ["loader", "calls"]
    with tempfile.TemporaryDirectory(prefix="rpcdl-scale-") as scratch:
        for name, path in variants:
            env = _environment(Path(path).resolve())
            if not args.skip_memory:
                memory = measure_memory(env, scratch, args.trainers)
                print(
                    f"{name:8s} memory: {args.trainers} trainers x 100 MB -> worker grew {memory['grown_mb']:7.0f} "
                    f"MB (all built in {memory['build_s']:.1f} s, ok={bool(memory['ok'])}; load {memory['load']:.1f})",
                    flush=True,
                )
            for kind in args.fairness:
                fair = measure_fairness(env, scratch, args.item_ms, args.seconds, kind)
                print(
                    f"{name:8s} fairness ({kind}): batches of 16 (prefetch 8) {fair['batches_of_16']:6.0f} items/s, "
                    f"batches of 2 (prefetch 1) {fair['batches_of_2']:6.0f} items/s (load {fair['load']:.1f})",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
