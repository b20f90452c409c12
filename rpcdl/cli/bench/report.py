"""Figures, and how they are printed, saved and drawn."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .workloads import RPCDL

# ---------------------------------------------------------------------------- figures


@dataclass
class Figure:
    """One measured quantity for every system that could measure it."""

    scenario: str
    metric: str
    unit: str
    better: str  # "higher" or "lower"
    samples: dict[str, list[float]] = field(default_factory=dict)
    note: str = ""

    def add(self, system: str, value: float) -> None:
        self.samples.setdefault(system, []).append(float(value))

    def median(self, system: str) -> float | None:
        values = self.samples.get(system)
        return statistics.median(values) if values else None

    def ratio(self, system: str, reference: str = RPCDL) -> float | None:
        """``reference``'s median over ``system``'s."""
        mine, theirs = self.median(reference), self.median(system)
        if mine is None or not theirs:
            return None
        return mine / theirs

    def as_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "metric": self.metric,
            "unit": self.unit,
            "better": self.better,
            "note": self.note,
            "systems": {
                name: {"median": self.median(name), "min": min(values), "max": max(values), "samples": values}
                for name, values in self.samples.items()
            },
            "ratios": {name: self.ratio(name) for name in self.samples if name != RPCDL},
        }


def percentile(values: Sequence[float], fraction: float) -> float:
    """The value at ``fraction`` (0.5: the median, 0.99: p99) of ``values``, by rank, no interpolation."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


# ---------------------------------------------------------------------------- report


def machine_info() -> dict[str, Any]:
    """The machine and its load, for the report."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    with contextlib.suppress(OSError):
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as handle:
        models = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
        if models:
            info["processor"] = models[0]
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as handle:
        info["memory_gb"] = round(int(handle.readline().split()[1]) / 1e6, 1)
    return info


def _format_value(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


NOT_JUDGED = "not judged: --quick"
#: Figures that are ratios of memory to batch sizes: meaningless over the few batches of ``--quick``.
MEMORY_RATIOS = frozenset({("memory", "peak / bound"), ("memory", "growth (batches)"), ("memory", "peak (batches)")})


def format_table(figures: Sequence[Figure], systems: Sequence[str], *, judged: bool = True) -> str:
    """A text table: one row per figure, each system's median, and rpcdl's ratio to each other system.

    Args:
        figures: the figures, one row each (those without samples are left out).
        systems: the systems, one column each, rpcdl's first.
        judged: ``False`` for runs too small to mean anything (``--quick``):
            the memory ratios are then marked :data:`NOT_JUDGED` instead of shown.

    Returns:
        the table, one line per row.
    """
    others = [name for name in systems if name != RPCDL]
    headers = ["scenario", "metric", "unit", *systems, *(f"{RPCDL}/{name}" for name in others)]
    rows = []
    for figure in figures:
        if not figure.samples:
            continue
        hidden = not judged and (figure.scenario, figure.metric) in MEMORY_RATIOS
        cells = [figure.scenario, figure.metric, f"{figure.unit} ({figure.better})"]
        if hidden:
            cells += [NOT_JUDGED if name in figure.samples else "-" for name in systems]
        else:
            cells += [_format_value(figure.median(name)) for name in systems]
        if hidden or (not judged and figure.scenario == "memory"):
            cells += [NOT_JUDGED if name in figure.samples else "-" for name in others]
        else:
            cells += [_format_ratio(figure.ratio(name)) for name in others]
        rows.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def _format_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def plot(figures: Sequence[Figure], systems: Sequence[str], path: str) -> None:
    """Draw each figure's medians (bars, with min-max whiskers) per system into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [f for f in figures if f.samples and not f.metric.startswith("epoch ")]
    columns = 4
    rows = max(1, -(-len(shown) // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, figure in zip(axes.flat, shown, strict=False):
        names = [name for name in systems if name in figure.samples]
        medians = [figure.median(name) for name in names]
        low = [m - min(figure.samples[n]) for m, n in zip(medians, names, strict=True)]
        high = [max(figure.samples[n]) - m for m, n in zip(medians, names, strict=True)]
        axis.bar(
            range(len(names)),
            medians,
            yerr=[low, high],
            capsize=3,
            color=[colors[systems.index(n) % len(colors)] for n in names],
        )
        axis.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=7)
        axis.set_title(f"{figure.scenario}: {figure.metric}", fontsize=9)
        axis.set_ylabel(f"{figure.unit} ({figure.better} is better)", fontsize=7)
    for axis in list(axes.flat)[len(shown) :]:
        axis.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
