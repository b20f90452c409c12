"""The project's own performance targets: where rpcdl must stand against its floors and peers.

These are development goals, judged on the figures of ``benchmarks/compare.py``
(``rpcdl bench`` with rpcdataloader and torch.distributed.rpc beside it); the
installed ``rpcdl bench`` measures and prints figures without judging them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rpcdl.cli.bench.report import NOT_JUDGED, Figure
from rpcdl.cli.bench.workloads import FRAMED, PARALLEL_MAPPER, RPCDL, SOCKET, TORCH


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


def judge(figures: Sequence[Figure], judged: bool) -> tuple[str, list[dict[str, Any]]]:
    """The targets' verdicts for ``rpcdl bench``'s ``judge`` hook: the printed lines and the JSON entries."""
    results = evaluate_targets(figures, judged=judged)
    return format_targets(results), results
