"""Figures and targets, and how they are printed, saved and drawn."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .workloads import FRAMED, PARALLEL_MAPPER, RPCDL, SOCKET, TORCH

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


@dataclass(frozen=True)
class Target:
    """A goal on a figure: rpcdl's median over ``against``'s (or rpcdl's own when ``against`` is None)."""

    label: str
    scenario: str
    metric: str
    against: str | None
    op: str  # "<=" or ">="
    threshold: float

    def value(self, figures: Sequence[Figure]) -> float | None:
        for figure in figures:
            if figure.scenario == self.scenario and figure.metric == self.metric:
                return figure.median(RPCDL) if self.against is None else figure.ratio(self.against)
        return None

    def met(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return value <= self.threshold if self.op == "<=" else value >= self.threshold


RPCDATALOADER = "rpcdataloader"
TORCH_RPC = "torch.distributed.rpc"

TARGETS = (
    Target("no-op rpc_sync p50 latency vs rpcdataloader", "latency", "p50", RPCDATALOADER, "<=", 0.25),
    Target("no-op rpc_sync p50 latency vs torch.distributed.rpc", "latency", "p50", TORCH_RPC, "<=", 1.0),
    Target("pipelined calls/s vs rpcdataloader", "pipelined", "calls/s", RPCDATALOADER, ">=", 5.0),
    Target("no-op rpc_sync p50 latency vs raw socket ping-pong", "latency", "p50", SOCKET, "<=", 3.0),
    Target("pipelined calls/s vs minimal framed-pickle RPC", "pipelined", "calls/s", FRAMED, ">=", 0.5),
    Target("mapper items/s, trivial function (absolute)", "mapper", "items/s", None, ">=", 20000.0),
    Target("mapper items/s vs ParallelMapper(process)", "mapper", "items/s", PARALLEL_MAPPER, ">=", 2.0),
    Target("small batches/s vs rpcdataloader", "small", "batches/s", RPCDATALOADER, ">=", 3.0),
    Target("small batches/s vs torch DataLoader", "small", "batches/s", TORCH, ">=", 3.0),
    Target("image MB/s vs rpcdataloader", "image", "MB/s", RPCDATALOADER, ">=", 2.0),
    Target("image MB/s vs raw loopback socket", "image", "MB/s", SOCKET, ">=", 1.0),
    Target("image MB/s vs torch DataLoader", "image", "MB/s", TORCH, ">=", 3.0),
    Target("straggler: throughput kept vs fast workers only", "straggler", "kept", None, ">=", 0.8),
    Target("I/O-bound: 8 workers vs 1 worker", "io", "speedup x8", None, ">=", 7.0),
    Target("client peak memory / (prefetch window + 2 batches)", "memory", "peak / bound", None, "<=", 1.0),
    Target("client peak memory growth, epochs 2-5 -> 6-10, in batches", "memory", "growth (batches)", None, "<=", 1.0),
)


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


def evaluate_targets(figures: Sequence[Figure], *, judged: bool = True) -> list[dict[str, Any]]:
    """Where each of :data:`TARGETS` stands in ``figures``.

    Args:
        figures: the measured figures.
        judged: ``False`` for runs too small to mean anything (``--quick``):
            no target is then met or missed (``"met": None``, ``"status": NOT_JUDGED``).

    Returns:
        one dict per target: ``target``, ``goal``, ``value``, ``met`` and ``status``.
    """
    results = []
    for target in TARGETS:
        value = target.value(figures)
        met = target.met(value) if judged else None
        status = {True: "met", False: "MISSED", None: "not measured"}[met] if judged else NOT_JUDGED
        results.append(
            {
                "target": target.label,
                "goal": f"{target.op} {target.threshold:g}",
                "value": value,
                "met": met,
                "status": status,
            }
        )
    return results


def format_targets(results: Sequence[dict[str, Any]]) -> str:
    """The targets, one line each: status, label, value and goal."""
    if results and all(result["status"] == NOT_JUDGED for result in results):
        return f"  {NOT_JUDGED}: its runs are too small to mean anything; run without --quick to judge them"
    lines = []
    for result in results:
        status = result["status"]
        value = "-" if result["value"] is None else f"{result['value']:.2f}"
        lines.append(f"  {status:<12} {result['target']}: {value} (goal {result['goal']})")
    return "\n".join(lines)


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
