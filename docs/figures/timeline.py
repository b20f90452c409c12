"""Draw docs/figures/timeline.svg: one real epoch on three local workers, one slow, one killed.

The workers log when they start and finish each item (to a file: every copy of
a batch shows, used or not); the training loop records which worker's copy of
each batch it received, and when. Worker 2 is made three
times slower, worker 0 is killed (SIGKILL) after the tenth batch. Run it and
commit the SVG (the picture changes a little from run to run):

    python docs/figures/timeline.py
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from torch.utils.data import Dataset

import rpcdl

OUT = Path(__file__).with_suffix(".svg")
BATCHES, BATCH_SIZE = 36, 4
ITEM_SECONDS, SLOWDOWN, STEP_SECONDS = 0.01, 3.0, 0.012
KILL_AFTER = 10


class Timed(Dataset):
    """Sleeps per item (longer in the slow worker) and logs when it started and finished each item."""

    def __init__(self, slow_pid: int, log: str):
        self.slow_pid, self.log = slow_pid, log

    def __len__(self) -> int:
        return BATCHES * BATCH_SIZE

    def _write(self, event: str, index: int) -> None:
        with open(self.log, "a") as log:  # one short append per line: lines never interleave
            log.write(f"{event} {os.getpid()} {index} {time.time()!r}\n")

    def __getitem__(self, index: int):
        self._write("start", index)
        time.sleep(ITEM_SECONDS * (SLOWDOWN if os.getpid() == self.slow_pid else 1.0))
        self._write("end", index)
        return index


def loaded_by(samples):
    """Runs on the worker: which process loaded the batch."""
    return os.getpid()


def record(log: Path) -> dict:
    with rpcdl.local_workers(3) as workers:
        pids = [process.pid for process in workers.processes]
        dataset = rpcdl.RPCDataset(workers, Timed, pids[2], str(log))
        loader = rpcdl.RPCDataloader(dataset, batch_size=BATCH_SIZE, collate_fn=loaded_by, timeout=10)
        list(loader)  # warm up: connections, first calls
        time.sleep(1.0)  # copies of late batches the warm-up did not need finish meanwhile
        log.write_text("")
        started, received, killed_at = time.time(), [], None
        for number, pid in enumerate(loader):
            received.append((number, pid, time.time()))
            if number == KILL_AFTER - 1:
                os.kill(pids[0], signal.SIGKILL)  # not workers.kill(): it waits for the process
                killed_at = time.time()
            time.sleep(STEP_SECONDS)  # the training step
    return {"pids": pids, "started": started, "killed_at": killed_at, "received": received, "log": log.read_text()}


def executions(run: dict) -> list[tuple[int, int, float, float, bool]]:
    """``(batch, pid, start, end, finished)`` for every time a worker loaded a batch, used or not."""
    spans: dict[tuple[int, int], list[float]] = {}
    ends: dict[tuple[int, int], int] = {}
    for line in run["log"].splitlines():
        event, pid, index, when = line.split()
        key = (int(index) // BATCH_SIZE, int(pid))
        span = spans.setdefault(key, [float(when), float(when)])
        span[0], span[1] = min(span[0], float(when)), max(span[1], float(when))
        ends[key] = ends.get(key, 0) + (event == "end")
    return [(b, pid, lo, hi, ends[(b, pid)] == BATCH_SIZE) for (b, pid), (lo, hi) in sorted(spans.items())]


def draw(run: dict) -> None:
    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "rpcdl", "font.family": "DejaVu Sans"})
    fig, ax = plt.subplots(figsize=(11, 3.7))
    rows = {pid: row for row, pid in enumerate(run["pids"])}
    used = {(number, pid) for number, pid, _ in run["received"]}
    t0, kill = run["started"], (run["killed_at"] - run["started"]) * 1000
    for number, pid, start, end, finished in executions(run):
        left, width = (start - t0) * 1000, max((end - start) * 1000, 4.0)
        if not finished:  # cut short by the kill
            width = max(kill - left, 4.0)
        color = "#1a73e8" if (number, pid) in used else "#f9ab00" if finished else "#d93025"
        ax.barh(rows[pid], width, left=left, height=0.6, color=color, edgecolor="white", linewidth=0.6)
        ax.text(left + width / 2, rows[pid], str(number), ha="center", va="center", fontsize=6.5, color="white")
    for _, _, when in run["received"]:
        ax.plot([(when - t0) * 1000] * 2, [3 - 0.3, 3 + 0.3], color="#188038", linewidth=1.2)
    ax.plot([kill], [0], marker="X", markersize=11, color="#d93025")
    ax.text(kill + 12, 0, "SIGKILL", fontsize=8, color="#d93025", va="center")
    ax.set_yticks(range(4), ["worker 0 (killed)", "worker 1", "worker 2 (3x slower)", "training loop"], fontsize=8.5)
    ax.set_ylim(3.6, -0.7)
    ax.set_xlabel("milliseconds since the start of the epoch", fontsize=8.5)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    cut_short = any(not finished for *_, finished in executions(run))
    ax.set_title(
        f"One epoch of {len(run['received'])} batches (numbered in sampler order). Bars: a worker loading a batch. "
        "Blue: the copy the\ntraining loop used. Orange: a copy it did not need (the batch was late, another worker "
        f"also ran it).{' Red: cut short by the kill.' if cut_short else ''}\n"
        "Ticks: the training loop receiving each batch, in order.",
        fontsize=8.5, loc="left",
    )  # fmt: skip
    fig.tight_layout()
    fig.savefig(OUT, format="svg", metadata={"Date": None, "Creator": None})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as directory:
        draw(record(Path(directory) / "items.log"))
