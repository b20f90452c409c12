"""Draw docs/figures/threads.svg: the threads of a trainer and of a worker, and what each owns.

Run it after changing the picture and commit the SVG:

    python docs/figures/threads.py
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

OUT = Path(__file__).with_suffix(".svg")

TRAINER = "#e8f0fe"
WORKER = "#e9f7ef"
THREAD = "#ffffff"
LOCK = "#fff8e1"
EDGE = "#4a4a4a"
WIRE = "#1a73e8"
EVENT = "#b3261e"


def panel(ax, x, y, w, h, title, face):
    ax.add_patch(
        FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12", facecolor=face, edgecolor=EDGE)
    )
    ax.text(x + 0.2, y + h - 0.3, title, fontsize=11, weight="bold", va="center")


def thread(ax, x, y, w, h, name, owns):
    """A thread: its name in bold, then what it owns."""
    ax.add_patch(
        FancyBboxPatch(
            (x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", facecolor=THREAD, edgecolor=EDGE, linewidth=1.0
        )
    )
    ax.text(x + 0.12, y + h - 0.22, name, fontsize=8.6, weight="bold", va="center", family="monospace")
    ax.text(x + 0.12, y + h - 0.42, owns, fontsize=7.6, va="top", linespacing=1.35)


def lock(ax, x, y, w, h, name, guards):
    """A lock: dashed, with what it guards (every access to it holds the lock)."""
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            w,
            h,
            boxstyle="round,pad=0.02,rounding_size=0.08",
            facecolor=LOCK,
            edgecolor=EDGE,
            linestyle="--",
            linewidth=1.0,
        )
    )
    ax.text(x + 0.12, y + h - 0.2, name, fontsize=8.2, weight="bold", va="center")
    ax.text(x + 0.12, y + h - 0.38, guards, fontsize=7.4, va="top", linespacing=1.3)


def arrow(ax, start, end, color, text="", rad=0.0, style="-|>"):
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle=style,
            mutation_scale=11,
            color=color,
            linewidth=1.3,
            connectionstyle=f"arc3,rad={rad}",
        )
    )
    if text:
        mid = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
        ax.text(mid[0], mid[1] + 0.12, text, fontsize=7.4, color=color, ha="center", va="bottom")


def draw_trainer(ax):
    panel(ax, 0.0, 0.0, 6.4, 7.4, "trainer process", TRAINER)
    thread(
        ax,
        0.3,
        5.2,
        5.8,
        1.6,
        "training thread (any thread in an epoch's next())",
        "advances its epoch in next(): owns the pass (tasks waiting, in flight,\n"
        "finished; its stage) and the iterator's stage. It submits calls (over\n"
        "plain TCP, once open, it writes the frame itself) and\n"
        "unpickles the answers it takes; it never reads a socket.\n"
        "A second thread entering the same next() gets a RuntimeError.",
    )
    thread(
        ax,
        0.3,
        3.2,
        5.8,
        1.5,
        "rpcdl-loop (one per process, whatever the workers)",
        "the event loop owns every socket: dials, handshakes (TLS), receives\n"
        "answers into pooled buffers and completes their futures, writes the\n"
        "calls handed to it; fails overdue calls, sends releases on timers.",
    )
    lock(
        ax,
        0.3,
        1.6,
        2.75,
        1.2,
        "connection lock",
        "state: Connecting | Open |\nLeaving | Closed; calls in flight,\ncalls not yet taken by the loop",
    )
    lock(
        ax,
        3.35,
        1.6,
        2.75,
        1.2,
        "pool lock",
        "workers' records (health, calls\nin flight, estimates), the\nregistry of passes",
    )
    lock(
        ax,
        0.3,
        0.3,
        5.8,
        1.0,
        "queues, not locks",
        "a call's hook only puts a typed event (Answered, Orphaned, ...) on its pass's\n"
        "queue; RRef finalizers append releases to a lock-free deque, sent with the next frame",
    )
    arrow(ax, (4.6, 4.7), (4.6, 5.2), EVENT, rad=0.0)
    ax.text(4.7, 4.92, "events", fontsize=7.4, color=EVENT, va="center")


def draw_worker(ax):
    panel(ax, 7.6, 0.0, 6.4, 7.4, "worker process", WORKER)
    thread(
        ax,
        7.9,
        5.0,
        5.8,
        1.8,
        "rpcdl-loop (the process's one loop, whatever the clients)",
        "accepts connections and runs each handshake (TLS) within its\n"
        "deadline; reads every session's frames into pooled buffers; answers\n"
        "pings, releases and counters itself; queues calls fairly by time;\n"
        "writes the answers a session holds and the LEAVING notices.",
    )
    thread(
        ax,
        7.9,
        3.0,
        5.8,
        1.6,
        "rpcdl-executor-N (parallel of them)",
        "the only threads that run your code: each takes the next call of\n"
        "the client that has used the least time, runs it, pickles its answer\n"
        "(compressed, or placed in shared memory) and writes it itself when\n"
        "nothing else waits on a plain socket, else leaves it to the loop.",
    )
    lock(ax, 7.9, 1.6, 2.75, 1.1, "worker lock", "phase (new, serving,\ndraining, stopped), sessions")
    lock(ax, 10.95, 1.6, 2.75, 1.1, "session lock", "session state, answers not\nwritten yet, who writes next")
    lock(
        ax,
        7.9,
        0.3,
        5.8,
        1.0,
        "their own locks",
        "the slots (queue, free slots), the counters, the RRef store, the shared-memory\n"
        "segment, the compressor; locks nest in one order, none is held while a call runs",
    )


def main() -> None:
    fig, ax = plt.subplots(figsize=(12.6, 6.8))
    ax.set_xlim(-0.2, 14.2)
    ax.set_ylim(-0.2, 7.6)
    ax.axis("off")
    draw_trainer(ax)
    draw_worker(ax)
    arrow(ax, (6.1, 5.9), (7.9, 5.0), WIRE, "calls", rad=-0.1)
    arrow(ax, (7.9, 4.6), (6.1, 4.0), WIRE, "answers", rad=-0.1)
    fig.tight_layout()
    fig.savefig(OUT, format="svg", metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    main()
