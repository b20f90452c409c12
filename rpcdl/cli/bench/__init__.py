"""``rpcdl bench``: rpcdl side by side with what users would pick instead, in one run.

Every scenario measures each system in turn, round after round (interleaved,
so a burst of load on the machine hits them all alike), and reports medians
and the ratio of rpcdl's median to each other system's. The systems here are
rpcdl, torch's DataLoader (as many local processes as rpcdl has workers), two
floors, a raw loopback socket (a ping-pong of bytes) and a minimal
framed-pickle RPC (length-prefixed pickles, a one-thread server, a reader
thread), and torchdata's ``ParallelMapper(method="process")``;
``benchmarks/compare.py`` adds rpcdataloader and torch.distributed.rpc through
``main()``'s ``extra_systems``, and judges the project's own targets through
its ``judge``.

Scenarios (two workers unless said):

- ``latency``: no-op call round trips to one worker, p50 and p99;
- ``pipelined``: no-op calls per second to one worker, 64 in flight;
- ``small``: batches of 32 x float32[128] per second;
- ``image``: MB/s of batches of 64 x uint8[3, 224, 224];
- ``straggler``: one worker 10x slower than the others, against the same run
  with the fast workers only;
- ``io``: a dataset sleeping 5 ms per item, with 1, 2, 4 and 8 workers;
- ``memory``: the client's peak RSS in each of 10 epochs of image batches;
- ``mapper``: items per second of ``x + 1`` mapped in order by ``RPCMapper``
  over the workers, and by ``ParallelMapper(method="process")`` with as many
  local processes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from argparse import SUPPRESS
from collections.abc import Callable, Sequence
from typing import Any

from ..args import (
    Deprecated,
    add_workers_argument,
    existing_file,
    new_file,
    positive_float,
    positive_int,
    silent_worker,
)
from .floors import FramedPickleSystem, ParallelMapperSystem
from .report import Figure, format_table, machine_info, plot
from .scenarios import Bench, Sizes
from .systems import RpcdlSystem, SocketSystem, System, TorchLoaderSystem
from .workloads import SCENARIOS

HELP = "measure rpcdl side by side with torch's DataLoader, torchdata's ParallelMapper and transport floors"
DESCRIPTION = (
    "Run benchmark scenarios against local worker processes (--local-workers N, the default being 2) or running "
    "workers (--workers HOST:PORT ...), each figure beside torch's DataLoader with as many local processes "
    "(and torchdata's ParallelMapper), a raw loopback socket and a minimal framed-pickle RPC where meaningful, "
    "interleaved over several rounds. Prints a table of medians "
    "and ratios (rpcdl / other); --json and --plot save them. Speeds depend on the machine and its load: "
    "compare ratios from one run, not figures from different runs."
)


# ---------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``rpcdl bench``."""
    where = parser.add_mutually_exclusive_group()
    add_workers_argument(
        where, "benchmark these running workers (rpcdl worker); the local baselines use as many processes"
    )
    where.add_argument(
        "--local-workers",
        type=positive_int,
        metavar="N",
        help="start N local worker processes (default: 2; the io scenario starts up to 8)",
    )
    where.add_argument(
        "--local", type=positive_int, dest="local_workers", action=Deprecated, new="--local-workers", help=SUPPRESS
    )
    parser.add_argument(
        "--scenario",
        nargs="+",
        choices=SCENARIOS,
        default=list(SCENARIOS),
        metavar="NAME",
        help=f"scenarios to run, in order (default: all): {', '.join(SCENARIOS)}",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        metavar="R",
        help="interleaved rounds per scenario; figures are medians over them (default: 5, 1 with --quick)",
    )
    parser.add_argument(
        "--io-workers",
        type=positive_int,
        nargs="+",
        metavar="K",
        help="worker counts of the io scenario (default: 1 2 4 8; 1 2 with --quick)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes: checks that everything runs, in seconds (no memory ratio shown)",
    )
    parser.add_argument("--json", metavar="FILE", type=new_file, help="write the figures and the machine to FILE")
    parser.add_argument(
        "--plot", metavar="FILE.png", type=new_file, help="draw the figures into FILE.png (needs matplotlib)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    link = parser.add_argument_group("the link to your own workers (--link)")
    link.add_argument(
        "--link",
        action="store_true",
        help="measure the link to the --workers instead of the scenarios: ping p50/p99, the raw rate the workers "
        "stream at, rpcdl image batches and compressible batches (compression off/on/auto) as ratios of it",
    )
    link.add_argument(
        "--token-file",
        metavar="FILE",
        type=existing_file,
        help="file holding the workers' token (default: $RPCDL_TOKEN or $RPCDL_TOKEN_FILE)",
    )
    link.add_argument(
        "--tls-ca",
        metavar="PEM",
        type=existing_file,
        help="CA file to verify TLS workers with (default: $RPCDL_TLS_CA)",
    )
    link.add_argument(
        "--link-seconds", type=positive_float, default=2.0, help="seconds per rate measured (default: %(default)s)"
    )


#: Judges figures: called with them and whether the run is large enough to judge (not ``--quick``); returns
#: the lines to print under ``targets:`` and the verdicts to save under ``"targets"`` in the JSON.
Judge = Callable[[Sequence[Figure], bool], tuple[str, list[dict[str, Any]]]]


def run(args: argparse.Namespace, extra_systems: Sequence[System] = (), judge: Judge | None = None) -> int:
    """Run ``rpcdl bench`` with parsed arguments.

    Args:
        args: the parsed options (:func:`add_arguments`).
        extra_systems: more systems to measure beside the built-in ones.
        judge: judges the figures against goals of the caller's (``benchmarks/targets.py``); none by default.

    Returns:
        the exit code: 0, or 2 for a worker that does not answer or a missing package.

    Example::

        >>> parser = argparse.ArgumentParser()
        >>> add_arguments(parser)
        >>> run(parser.parse_args(["--quick", "--scenario", "latency"]))  # doctest: +SKIP
        0
    """
    # Its loops take batches and do nothing else: that they wait for data is what they measure, not news.
    logging.getLogger("rpcdl.dataloader.wait").setLevel(logging.ERROR)
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.rounds:
        sizes.rounds = args.rounds
    if args.io_workers:
        sizes.io_workers = tuple(sorted(set(args.io_workers)))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("rpcdl bench: --plot needs matplotlib: pip install 'rpcdl[bench]'", file=sys.stderr)
            return 2
    if args.link:
        from .link_command import run_link

        return run_link(args)
    local = args.local_workers or 2
    problem = silent_worker(args.workers, timeout=10.0) if args.workers else None
    if problem:
        print(f"rpcdl bench: {problem}", file=sys.stderr)
        return 2
    systems: list[System] = [
        RpcdlSystem(),
        TorchLoaderSystem(),
        SocketSystem(),
        FramedPickleSystem(),
        ParallelMapperSystem(),
        *extra_systems,
    ]
    names = [system.name for system in systems]
    machine = machine_info()
    bench = Bench(systems, workers=args.workers, local=local, sizes=sizes, progress=not args.no_progress)
    started = time.time()
    try:
        figures = bench.run(args.scenario)
    finally:
        bench.close()
    machine["load_average_after"] = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    verdicts, targets = judge(figures, not args.quick) if judge is not None else ("", None)
    workers = f"{len(args.workers)} given" if args.workers else f"{local} local"
    print(f"rpcdl bench: {workers} workers, {sizes.rounds} rounds, medians; ratios are rpcdl's median / the other's")
    print(
        f"machine: {machine['cpus']} CPUs, {machine['processor']}, {machine['platform']}; "
        f"load average {machine.get('load_average')} before, {machine.get('load_average_after')} after"
    )
    print()
    print(format_table(figures, names, judged=not args.quick))
    if judge is not None:
        print()
        print("targets:")
        print(verdicts)
    for note in bench.notes:
        print(f"note: {note}")
    if args.json:
        document = {
            "command": getattr(args, "command_line", None) or " ".join(["rpcdl", *sys.argv[1:]]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "seconds": round(time.time() - started, 1),
            "machine": machine,
            "workers": args.workers or {"local": local},
            "rounds": sizes.rounds,
            "systems": names,
            "figures": [figure.as_dict() for figure in figures],
            "notes": bench.notes,
        }
        if targets is not None:
            document["targets"] = targets
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=2)
    if args.plot:
        plot(figures, names, args.plot)
    return 0


def main(argv: Sequence[str] | None = None, extra_systems: Sequence[System] = (), judge: Judge | None = None) -> int:
    """``rpcdl bench`` as a function, with more systems to compare and a judge of the figures.

    Args:
        argv: the options (default: ``sys.argv[1:]``).
        extra_systems: more systems to measure beside the built-in ones.
        judge: judges the figures (see :func:`run`).

    Returns:
        the exit code.

    Example::

        >>> main(["--quick", "--scenario", "latency", "--no-progress"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(prog="rpcdl bench", description=DESCRIPTION)
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.command_line = " ".join([os.path.basename(sys.argv[0]), *argv])
    return run(args, extra_systems, judge)
