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

Issue 36, item 3: threads and memory per peer, on both sides (``--part peers``):

* **trainer**: one trainer process connected to ``--trainer-workers`` real
  worker processes (4, then 32 by default; one call to each, so every
  connection is open): its threads (all of the process's, and those named
  ``rpcdl-*``), its open files (sockets among them), its resident memory and
  the memory Python allocated since it started connecting (``tracemalloc``);
* **worker**: one worker process (``--parallel 1``) with ``--worker-trainers``
  connected trainer processes (1, then 64 by default; forked from one process
  that imported rpcdl once, each holding a session after one call): the same
  figures, read inside the worker by a call from the first trainer.

Per peer: the growth between the smallest and the largest count, divided by
the peers added.

A *variant* is a checkout whose ``rpcdl`` the processes import
(``--variant NAME=PATH``, put first on ``PYTHONPATH``; children run from a
scratch directory), so one run compares the code before and after::

    git worktree add --detach /tmp/main-before main
    python benchmarks/scale_processes.py --variant before=/tmp/main-before --variant after=.
    python benchmarks/scale_processes.py --part peers --variant before=/tmp/main-before --variant after=.

Each figure is printed with the load average of the minute beside it (the
machine is shared). Not a test: it asserts nothing about speed.
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

import psutil

_HERE = Path(__file__).resolve()
sys.path.insert(0, str(_HERE.parent))

import harness  # noqa: E402  (benchmarks/ is not a package: this folder, put first on the path just above)

PARTS = ("memory", "fairness", "peers")


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


def process_figures() -> dict[str, Any]:
    """This process's threads (all, Python's, ``rpcdl-*``), open files (sockets), resident and traced memory.

    Runs in the trainer, and in the worker as a call (pickled by value, so it imports what it reads).
    """
    import threading
    import tracemalloc

    named = [thread.name for thread in threading.enumerate()]
    files = os.listdir("/proc/self/fd")
    sockets = 0
    for entry in files:
        try:
            sockets += os.readlink(f"/proc/self/fd/{entry}").startswith("socket:")
        except OSError:  # the listing's own descriptor, closed since
            pass
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return {
        "threads": len(os.listdir("/proc/self/task")),
        "python_threads": len(named),
        "rpcdl_threads": sum(name.startswith("rpcdl-") for name in named),
        "rpcdl_kinds": _kinds(name for name in named if name.startswith("rpcdl-")),
        "fds": len(files),
        "sockets": sockets,
        "rss_mb": resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20,
        "python_mb": tracemalloc.get_traced_memory()[0] / 2**20 if tracemalloc.is_tracing() else float("nan"),
    }


def _kinds(names: Any) -> dict[str, int]:
    """How many threads of each kind: a name's first two words (``rpcdl-executor-0`` is an ``rpcdl-executor``)."""
    kinds: dict[str, int] = {}
    for name in names:
        kind = "-".join(name.split("-")[:2])
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _start_tracing() -> bool:
    """Trace Python's allocations from now on (in the worker, as a call); whether it was off before."""
    import tracemalloc

    was_off = not tracemalloc.is_tracing()
    tracemalloc.start()
    return was_off


def _settled(figures: Any) -> dict[str, Any]:
    """``figures()`` once the process's threads stopped changing (a thread ending or starting is not a peer's)."""
    last = figures()
    for _ in range(20):
        time.sleep(0.1)
        now = figures()
        if now["threads"] == last["threads"] and now["fds"] == last["fds"]:
            return now
        last = now
    return last


def _trainer_peers(addresses: list[str], counts: list[int]) -> int:
    """Connect to ``addresses`` in steps of ``counts`` (one call each); print this process's figures per step."""
    import gc
    import tracemalloc

    import torch  # noqa: F401  (its memory is not the connections')

    import rpcdl

    tracemalloc.start()
    connected = 0
    for count in counts:
        for address in addresses[connected:count]:
            if rpcdl.rpc_sync(address, min, (1, 2), timeout=120) != 1:
                raise RuntimeError(f"{address} answered min(1, 2) wrongly")
        connected = count
        gc.collect()
        print(json.dumps({"peers": count, **_settled(process_figures), "load": os.getloadavg()[0]}), flush=True)
    return 0


def _worker_sessions(address: str, counts: list[int]) -> int:
    """Hold ``counts`` sessions on the worker at ``address`` in turn (this process and forked trainers, one
    call each); print the worker's figures per step, read by a call from this process."""
    import torch  # noqa: F401  (imported once here, not by every forked trainer as it connects)

    import rpcdl

    def probe() -> dict[str, Any]:
        return rpcdl.rpc_sync(address, process_figures, timeout=120)

    ready_read, ready_write = os.pipe()
    connect_read, connect_write = os.pipe()  # a byte: one more child connects; the end of the file: none
    release_read, release_write = os.pipe()  # its end: every child lets its session go
    children = []
    for _ in range(max(counts) - 1):  # forked before this process starts any thread of rpcdl
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(connect_write)
                os.close(release_write)
                if os.read(connect_read, 1):
                    held = False
                    try:
                        held = rpcdl.rpc_sync(address, min, (1, 2), timeout=120) == 1
                    finally:
                        os.write(ready_write, b"1" if held else b"0")  # the parent waits for every child's byte
                    os.read(release_read, 1)
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
    try:
        rpcdl.rpc_sync(address, _start_tracing, timeout=120)
        connected = 1
        for count in counts:
            os.write(connect_write, b"1" * (count - connected))
            answers = b""
            while len(answers) < count - connected:
                answers += os.read(ready_read, count - connected - len(answers))
            if answers != b"1" * len(answers):
                raise RuntimeError("a trainer process got a wrong answer")
            connected = count
            print(json.dumps({"peers": count, **_settled(probe), "load": os.getloadavg()[0]}), flush=True)
    finally:
        os.close(connect_write)
        os.close(release_write)
        failed = sum(os.waitpid(pid, 0)[1] != 0 for pid in children)
    return 1 if failed else 0


# ---------------------------------------------------------------------------- the driver


def _environment(checkout: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH", "")) if p)
    env.pop("RPCDL_TOKEN", None)
    env.pop("RPCDL_TOKEN_FILE", None)
    return env


def _start_worker(env: dict[str, str], scratch: str, parallel: int) -> tuple[subprocess.Popen, str]:
    processes, addresses = _start_workers(env, scratch, parallel, 1)
    return processes[0], addresses[0]


def _start_workers(env: dict[str, str], scratch: str, parallel: int, count: int) -> tuple[list, list[str]]:
    """``count`` worker processes started at once; their processes and addresses once each printed its own."""
    command = [sys.executable, "-m", "rpcdl", "worker", "--port", "0", "--parallel", str(parallel)]
    processes = [
        subprocess.Popen([*command, "--log-level", "WARNING"], stdout=subprocess.PIPE, env=env, cwd=scratch, text=True)
        for _ in range(count)
    ]
    addresses = [process.stdout.readline().strip() for process in processes]
    if not all(addresses):
        for process in processes:
            _stop(process)
        raise RuntimeError(f"{addresses.count('')} of {count} worker processes did not start (see their stderr)")
    return processes, addresses


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


def measure_peers(
    env: dict[str, str], scratch: str, trainer_workers: list[int], worker_trainers: list[int]
) -> dict[str, Any]:
    """Threads, files and memory of one trainer over ``trainer_workers`` workers, and of one worker with
    ``worker_trainers`` trainer processes: each step's figures and the growth per peer.

    The two sides run at once, on separate processes: the trainer's workers are not the measured worker.
    """
    print(f"  starting {max(trainer_workers) + 1} worker processes", flush=True)
    workers, addresses = _start_workers(env, scratch, 1, max(trainer_workers) + 1)
    try:
        trainer = _role(env, scratch, "trainer-peers", ",".join(addresses[:-1]), ",".join(map(str, trainer_workers)))
        trainers = _role(env, scratch, "worker-sessions", addresses[-1], ",".join(map(str, worker_trainers)))
        trainer_steps = _steps(trainer, len(trainer_workers), "the trainer")
        worker_steps = _steps(trainers, len(worker_trainers), "the trainer processes")
    finally:
        for process in workers:
            process.terminate()
        for process in workers:
            _stop(process)
    return {
        "trainer": trainer_steps,
        "trainer_per_worker": _per_peer(trainer_steps),
        "worker": worker_steps,
        "worker_per_trainer": _per_peer(worker_steps),
    }


def _steps(role: subprocess.Popen, count: int, what: str) -> list[dict[str, Any]]:
    output, _ = role.communicate(timeout=600)
    steps = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    if role.returncode != 0 or len(steps) != count:
        raise RuntimeError(f"{what} exited with {role.returncode} after {len(steps)} of {count} steps (see stderr)")
    return steps


def _per_peer(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Growth from the first step to the last, per peer added (zeros when one step only)."""
    first, last = steps[0], steps[-1]
    added = last["peers"] - first["peers"]
    figures = ("threads", "rpcdl_threads", "fds", "sockets", "rss_mb", "python_mb")
    return {
        "from": first["peers"],
        "to": last["peers"],
        **{name: (last[name] - first[name]) / added if added else 0.0 for name in figures},
        "load": last["load"],
    }


def _show_peers(name: str, peers: dict[str, Any]) -> None:
    for side, peer_kind, what in (("trainer", "worker", "one trainer"), ("worker", "trainer", "one worker")):
        for step in peers[side]:
            kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(step["rpcdl_kinds"].items())) or "none"
            print(
                f"{name:8s} peers: {what}, {step['peers']:3d} {peer_kind}s: {step['threads']:3d} threads "
                f"(rpcdl-*: {step['rpcdl_threads']}: {kinds}), {step['fds']} files ({step['sockets']} sockets), "
                f"RSS {step['rss_mb']:.1f} MB, Python {step['python_mb']:.2f} MB (load {step['load']:.1f})",
                flush=True,
            )
        grown = peers[f"{side}_per_{peer_kind}"]
        print(
            f"{name:8s} peers: {what}, per {peer_kind} from {grown['from']} to {grown['to']}: "
            f"{grown['threads']:+.2f} threads ({grown['rpcdl_threads']:+.2f} rpcdl-*), {grown['fds']:+.2f} files, "
            f"RSS {grown['rss_mb'] * 1024:+.0f} KiB, Python {grown['python_mb'] * 1024:+.1f} KiB "
            f"(load {grown['load']:.1f})",
            flush=True,
        )


def _counts(text: str) -> list[int]:
    """``argparse`` type of ``--trainer-workers`` and ``--worker-trainers``: peer counts, increasing, from 1."""
    values = [int(value) for value in text.split(",")]
    if values[0] < 1 or values != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"expected increasing counts of at least 1 like 4,32; got {text}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variant", action="append", type=_variant, metavar="NAME=PATH", help="a checkout to run (repeatable)"
    )
    parser.add_argument(
        "--part", action="append", choices=PARTS, help="what to measure; repeatable (default: all: %(choices)s)"
    )
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
    parser.add_argument(
        "--trainer-workers",
        type=_counts,
        default=[4, 32],
        metavar="N,N",
        help="worker processes one trainer connects to, in steps (default: 4,32)",
    )
    parser.add_argument(
        "--worker-trainers",
        type=_counts,
        default=[1, 64],
        metavar="N,N",
        help="trainer processes holding a session on one worker, in steps (default: 1,64)",
    )
    parser.add_argument("--json", metavar="FILE", type=Path, help="write every figure and the machine to FILE")
    parser.add_argument("--role", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        return _run_role(*args.role)
    variants = args.variant or [("after", _HERE.parent.parent)]
    parts = args.part or list(PARTS)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="rpcdl-scale-") as scratch:
        for name, path in variants:
            env = _environment(path)
            results[name] = found = {}
            if "memory" in parts:
                memory = found["memory"] = measure_memory(env, scratch, args.trainers)
                print(
                    f"{name:8s} memory: {args.trainers} trainers x 100 MB -> worker grew {memory['grown_mb']:7.0f} "
                    f"MB (all built in {memory['build_s']:.1f} s, ok={bool(memory['ok'])}; load {memory['load']:.1f})",
                    flush=True,
                )
            for kind in (args.fairness or ["loader", "calls"]) if "fairness" in parts else []:
                fair = found[f"fairness_{kind}"] = measure_fairness(env, scratch, args.item_ms, args.seconds, kind)
                print(
                    f"{name:8s} fairness ({kind}): batches of 16 (prefetch 8) {fair['batches_of_16']:6.0f} items/s, "
                    f"batches of 2 (prefetch 1) {fair['batches_of_2']:6.0f} items/s (load {fair['load']:.1f})",
                    flush=True,
                )
            if "peers" in parts:
                found["peers"] = measure_peers(env, scratch, args.trainer_workers, args.worker_trainers)
                _show_peers(name, found["peers"])
    harness.save_json(args.json, {"variants": results})
    return 0


def _variant(text: str) -> tuple[str, Path]:
    """``argparse`` type of ``--variant``: ``NAME=PATH``, PATH a checkout holding ``rpcdl/``."""
    name, equals, path = text.partition("=")
    if not (name and equals and (Path(path) / "rpcdl" / "__init__.py").is_file()):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH with PATH a checkout holding rpcdl/; got {text!r}")
    return name, Path(path).resolve()


def _run_role(role: str, *rest: str) -> int:
    """A child process of the driver: which one is its first word."""
    if role == "trainers":
        return _trainers(rest[0], int(rest[1]))
    if role == "trainer-peers":
        return _trainer_peers(rest[0].split(","), _counts(rest[1]))
    if role == "worker-sessions":
        return _worker_sessions(rest[0], _counts(rest[1]))
    return _fair_trainer(rest[0], rest[1], int(rest[2]), int(rest[3]), float(rest[4]), float(rest[5]), float(rest[6]))


if __name__ == "__main__":
    sys.exit(main())
