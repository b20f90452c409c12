"""Draw docs/figures/architecture.svg: trainers, workers and what crosses the wire.

Run it after changing the picture and commit the SVG:

    python docs/figures/architecture.py
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

OUT = Path(__file__).with_suffix(".svg")

GPU = "#e8f0fe"
CPU = "#e9f7ef"
BOX = "#ffffff"
EDGE = "#4a4a4a"
CALL = "#1a73e8"
RESULT = "#188038"


def box(
    ax, x, y, w, h, text="", face=BOX, edge=EDGE, size=9, weight="normal", style="round,pad=0.02,rounding_size=0.08"
):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, facecolor=face, edgecolor=edge, linewidth=1.0))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight, linespacing=1.3)


def arrow(ax, start, end, color, rad=0.0, width=1.6):
    ax.add_patch(
        FancyArrowPatch(
            start, end, arrowstyle="-|>", mutation_scale=12, color=color, linewidth=width,
            connectionstyle=f"arc3,rad={rad}",
        )
    )  # fmt: skip


def trainer(ax, x, y, rank):
    box(ax, x, y, 3.6, 2.3)
    ax.text(x + 0.15, y + 2.02, f"trainer, rank {rank}", fontsize=10, weight="bold", va="center")
    box(ax, x + 0.2, y + 1.2, 3.2, 0.55, "training loop (model on the GPU)", face="#fafafa", size=8.5)
    box(ax, x + 0.2, y + 0.2, 3.2, 0.8, "RPCDataloader\nsampler, scheduler, batches in order", face="#fafafa", size=8.5)


def worker(ax, x, y, index):
    box(ax, x, y, 3.2, 1.0)
    ax.text(x + 0.15, y + 0.78, f"rpcdl worker {index}", fontsize=9.5, weight="bold", va="center")
    ax.text(x + 0.15, y + 0.34, "the dataset, behind an RRef\ncollate_fn([dataset[i] for i in indices])",
            fontsize=7.8, va="center", linespacing=1.4)  # fmt: skip


def call_pair(ax, start, end):
    """A CALL arrow and, just below it, the RESULT arrow back."""
    (x0, y0), (x1, y1) = start, end
    arrow(ax, (x0, y0 + 0.08), (x1, y1 + 0.08), CALL)
    arrow(ax, (x1, y1 - 0.08), (x0, y0 - 0.08), RESULT)


def main() -> None:
    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "rpcdl", "font.family": "DejaVu Sans"})
    fig, ax = plt.subplots(figsize=(12, 7.6))
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 7.6)
    ax.axis("off")

    # The nodes.
    box(ax, 0.2, 1.9, 4.2, 5.45, face=GPU, edge="#9fb8e8", style="round,pad=0.02,rounding_size=0.15")
    ax.text(2.3, 7.08, "GPU node", ha="center", fontsize=10.5, color="#1a4fa0", weight="bold")
    box(ax, 8.0, 1.9, 3.8, 5.45, face=CPU, edge="#9fd3b0", style="round,pad=0.02,rounding_size=0.15")
    ax.text(9.9, 7.08, "CPU nodes", ha="center", fontsize=10.5, color="#1e6b3a", weight="bold")

    trainer(ax, 0.5, 4.5, 0)
    trainer(ax, 0.5, 2.05, 1)
    for index, y in zip((0, 2, 1, 3), (5.8, 4.6, 3.25, 2.05), strict=True):
        worker(ax, 8.3, y, index)

    # Rank r uses workers[r::world_size]: rank 0 workers 0 and 2, rank 1 workers 1 and 3.
    loader_0, loader_1 = (4.0, 5.1), (4.0, 2.65)
    call_pair(ax, loader_0, (8.3, 6.3))
    call_pair(ax, loader_0, (8.3, 5.1))
    call_pair(ax, loader_1, (8.3, 3.75))
    call_pair(ax, loader_1, (8.3, 2.55))
    ax.text(6.2, 6.45, "workers[0::2]", ha="center", fontsize=8.5, style="italic")
    ax.text(6.2, 2.0, "workers[1::2]", ha="center", fontsize=8.5, style="italic")
    ax.text(6.2, 7.1, "one TCP connection per (trainer, worker),\nmany calls in flight, answered in any order",
            ha="center", va="center", fontsize=8.3, color="#555555")  # fmt: skip

    # What crosses the wire.
    legend_y = 1.45
    arrow(ax, (0.3, legend_y), (1.0, legend_y), CALL)
    ax.text(1.15, legend_y + 0.12, "CALL: the function and its arguments,\ne.g. fetch_batches_at(dataset id,\n"
            "[(indices, number)], collate_fn,\n(seed, epoch)), pickled: a few hundred bytes", va="top", fontsize=8.3,
            color=CALL, linespacing=1.4)  # fmt: skip
    arrow(ax, (5.0, legend_y), (4.3, legend_y), RESULT)
    ax.text(5.15, legend_y + 0.12, "RESULT: the collated batches; tensors\ntravel as out-of-band buffers, sent\n"
            "from their memory, received into\nthe final (pinned) tensor", va="top", fontsize=8.3, color=RESULT,
            linespacing=1.4)  # fmt: skip
    box(ax, 8.3, 0.15, 3.5, 1.45, face="#fff8e1", edge="#e0c060")
    ax.text(8.45, 1.45, "before any pickle, once per connection:\nmagic and protocol version,\n"
            "HMAC-SHA256 token proofs both ways\n(optional TLS underneath)", va="top", fontsize=8.3,
            linespacing=1.4)  # fmt: skip

    fig.savefig(OUT, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
