"""What one ``rpcdl status`` costs: wall time and peak RSS, beside the torch client's ``rpcdl.stats``.

A Kubernetes liveness probe runs ``rpcdl status`` every 30 s, so its cost
counts. Each round runs, as fresh processes, one after the other:

* ``status``: ``python -m rpcdl status --json WORKER`` (the torch-free probe);
* ``stats``: ``python -c "import rpcdl; rpcdl.stats(WORKER)"``, the torch client,
  what ``rpcdl status`` did before (the baseline, run in the same rounds);
* ``refused``: ``python -m rpcdl status --json 127.0.0.1:PORT`` with nothing on PORT;
* ``python``: ``python -c pass``, the interpreter's own start, the floor of any command.

On a loaded machine every figure grows; the ratios, from the same rounds, hold better.

It prints the medians and the ratios status / stats. Usage::

    python benchmarks/status_cost.py [--rounds 7]
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

import rpcdl


def measure(command: list[str], report: str) -> tuple[float, float]:
    """Run ``command``; return its wall seconds and its peak RSS in MB.

    The RSS comes from GNU time (``/usr/bin/time -f %M``): a child forked from this
    process (which holds torch) would report this process's pages as its own peak.
    """
    started = time.perf_counter()
    subprocess.run(["/usr/bin/time", "-f", "%M", "-o", report, *command], capture_output=True, check=False)
    seconds = time.perf_counter() - started
    with open(report, encoding="utf-8") as file:
        kilobytes = int(file.read().split()[-1])
    return seconds, kilobytes / 1024


def main() -> int:
    args = harness.parser(__doc__, rounds=7).parse_args()
    if not os.path.exists("/usr/bin/time"):
        print("needs GNU time (apt-get install time) for the peak RSS of each command", file=sys.stderr)
        return 2
    report = os.path.join(tempfile.mkdtemp(prefix="rpcdl-status-cost-"), "rss")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        refused = f"127.0.0.1:{probe.getsockname()[1]}"
    with rpcdl.local_workers(1) as (worker,):
        commands = {
            "status": [sys.executable, "-m", "rpcdl", "status", "--json", worker],
            "stats": [sys.executable, "-c", f"import rpcdl; rpcdl.stats({worker!r})"],
            "refused": [sys.executable, "-m", "rpcdl", "status", "--json", refused],
            "python": [sys.executable, "-c", "pass"],
        }
        figures = harness.interleave(
            {name: (lambda command=command: measure(command, report)) for name, command in commands.items()},
            args.rounds,
        )
    medians = {
        name: (harness.median(s for s, _ in runs), harness.median(m for _, m in runs)) for name, runs in figures.items()
    }
    print(f"{args.rounds} rounds, medians (each a fresh process); {harness.describe_machine()}")
    print(f"{'command':<10}{'wall s':>9}{'peak RSS MB':>14}")
    for name, (seconds, megabytes) in medians.items():
        print(f"{name:<10}{seconds:>9.3f}{megabytes:>14.1f}")
    (status_s, status_mb), (stats_s, stats_mb) = medians["status"], medians["stats"]
    print(f"status / stats: time {status_s / stats_s:.2f}x, peak RSS {status_mb / stats_mb:.2f}x")
    floor_s = medians["python"][0]
    print(f"status / a bare interpreter's start: time {status_s / floor_s:.2f}x ({status_s - floor_s:.3f} s more)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
