"""What every script in ``benchmarks/`` shares: its command line, interleaved rounds, medians and the machine's load.

Every script measures some systems or variants side by side. Taken in turns,
round after round (:func:`interleave`), a burst of load on the machine hits
them all alike, so the ratios of their medians (:func:`medians`) from one run
mean something even on a shared machine; figures from different runs do not.
Each script prints the load average with its figures (:func:`machine`).

The scripts run as ``python benchmarks/NAME.py``, which puts this folder on
``sys.path``: they ``import harness``. Not part of the installed package.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def parser(doc: str | None, *, rounds: int | None = None, json_file: bool = False) -> argparse.ArgumentParser:
    """A command line for a benchmark script: its docstring as help, and the options every script spells alike.

    Args:
        doc: the script's docstring; its first paragraph is the description, the rest the epilog.
        rounds: adds ``--rounds`` with this default (measured rounds, interleaved).
        json_file: adds ``--json FILE`` (where :func:`save_json` writes the figures).

    Returns:
        the parser, to which the script adds its own options.

    Example::

        >>> args = parser("Measures nothing.", rounds=3).parse_args([])
        >>> args.rounds
        3
    """
    description, _, epilog = (doc or "").strip().partition("\n\n")
    made = argparse.ArgumentParser(
        description=description, epilog=epilog or None, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if rounds is not None:
        made.add_argument(
            "--rounds", type=positive_int, default=rounds, help="measured rounds, interleaved (default: %(default)s)"
        )
    if json_file:
        made.add_argument("--json", metavar="FILE", type=Path, help="write the figures and the machine to FILE")
    return made


def positive_int(text: str) -> int:
    """``argparse`` type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def interleave(
    measures: Mapping[str, Callable[[], T]],
    rounds: int,
    *,
    warmup: int = 0,
    rotate: bool = False,
    after_warmup: Callable[[], object] | None = None,
    after_round: Callable[[int, dict[str, T]], None] | None = None,
) -> dict[str, list[T]]:
    """Run every measure once per round, in turn, and collect what each returns.

    Args:
        measures: name -> a function measuring one round of that system (a figure, or a dict of them).
        rounds: measured rounds.
        warmup: rounds run first and thrown away (connections, heaps, caches).
        rotate: start each round with the next measure, so that none always runs first (or after the same one).
        after_warmup: called once the warm-up rounds are done (to reset counters kept beside the measures).
        after_round: called after each measured round with its index (from 1) and that round's results.

    Returns:
        name -> the results of its measured rounds, in order.

    Example::

        >>> samples = interleave({"a": lambda: 1.0, "b": lambda: 2.0}, rounds=3)
        >>> medians(samples)
        {'a': 1.0, 'b': 2.0}
    """
    for _ in range(warmup):
        for measure in measures.values():
            measure()
    if after_warmup is not None:
        after_warmup()
    samples: dict[str, list[T]] = {name: [] for name in measures}
    names = list(measures)
    for index in range(1, rounds + 1):
        shift = (index - 1) % len(names) if rotate and names else 0
        this_round = {}
        for name in names[shift:] + names[:shift]:
            this_round[name] = measures[name]()
            samples[name].append(this_round[name])
        if after_round is not None:
            after_round(index, this_round)
    return samples


def median(values: Iterable[float]) -> float:
    """The median of ``values`` (the middle one, or the mean of the two middle ones)."""
    return statistics.median(values)


def medians(samples: Mapping[str, Iterable[float]]) -> dict[str, float]:
    """The median of each name's samples."""
    return {name: median(values) for name, values in samples.items()}


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, rounded, or ``None`` where the system does not say."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (Linux): ``[0]`` is the state, ``[7]`` the minor
    faults, ``[11]`` and ``[12]`` the user and system CPU in clock ticks. Raises ``FileNotFoundError`` once the
    process is gone.

    Example::

        >>> stat_fields(os.getpid())[0] in ("R", "S")
        True
    """
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_cpu(*pids: int) -> float:
    """User + system CPU seconds of the processes ``pids`` so far (all their threads, summed), from ``/proc``
    (Linux).

    Example::

        >>> process_cpu(os.getpid()) >= 0.0
        True
    """
    seconds = 0.0
    for pid in pids:
        fields = stat_fields(pid)
        seconds += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def machine() -> dict[str, Any]:
    """The machine a run measured and its load now: CPUs, Python, torch's version, the load average.

    Example::

        >>> sorted(machine())
        ['cpus', 'load_average', 'platform', 'python', 'torch']
    """
    import torch

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average": load_average(),
    }


def describe_machine() -> str:
    """:func:`machine` in one line, to print with the figures."""
    info = machine()
    return (
        f"{info['cpus']} CPUs, {info['platform']}, Python {info['python']}, torch {info['torch']}, "
        f"load average {info['load_average']}"
    )


def save_json(path: Path | str | None, document: Mapping[str, Any]) -> None:
    """Write ``document`` and :func:`machine` (``"machine"``) as JSON to ``path``; nothing when ``path`` is None."""
    if path is None:
        return
    Path(path).write_text(json.dumps({**document, "machine": machine()}, indent=1))
