"""CPU per item of RPCMapper, client and workers, with the chunks it sent: the mapper scenario's cost.

``rpcdl bench --scenario mapper`` maps ``x + 1`` over ``itertools.count()`` on
two local workers; its rates are wall-clock and swing with a loaded machine.
This measures what the rates hide: the CPU seconds per item of the client
process (every thread) and of its worker processes, and the calls that
carried the items (how many, how many items each).

The calls matter: a call's own worker CPU is shared by the items of its
chunk, and a chunk holds what the client pulled from the source within
``rpcdl.data.chunked_pass.TARGET_CHUNK_SECONDS`` (4 ms) of wall time. A
preempted client pulls fewer, so on a busy machine the CPU per item follows
the load. ``--fill-seconds 1`` lets every chunk fill to the bound, which takes
that out: then two versions compare on their code alone. Run it with each
interpreter (a baseline's too), in turns::

    python benchmarks/mapper_cpu.py --rounds 3 [--items 40000] [--fill-seconds 1] [--json FILE]
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

import rpcdl
import rpcdl.data.chunked_pass
from rpcdl.cli.bench.workloads import increment


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (the local workers)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


class ChunkLog:
    """Records the items of each chunk a :class:`~rpcdl.data.chunked_pass.ChunkSizer` learns from (one per call)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        sizer = rpcdl.data.chunked_pass.ChunkSizer
        observe = sizer.observe

        def observed(this: rpcdl.data.chunked_pass.ChunkSizer, items: int, seconds: float, nbytes: int = 0) -> None:
            self.sizes.append(items)
            observe(this, items, seconds, nbytes)

        sizer.observe = observed


def main() -> None:
    parser = harness.parser(__doc__, rounds=3, json_file=True)
    parser.add_argument("--items", type=int, default=40000, help="items mapped per round")
    parser.add_argument(
        "--fill-seconds",
        type=float,
        default=None,
        help="override FILL_SECONDS and TARGET_CHUNK_SECONDS (1: full chunks)",
    )
    args = parser.parse_args()
    from torchdata.nodes import IterableWrapper

    from rpcdl.integrations.torchdata import RPCMapper

    if args.fill_seconds is not None:
        rpcdl.data.chunked_pass.FILL_SECONDS = rpcdl.data.chunked_pass.TARGET_CHUNK_SECONDS = args.fill_seconds
    log = ChunkLog()
    with rpcdl.local_workers(2) as workers:
        node = RPCMapper(IterableWrapper(itertools.count()), workers, increment)
        node.reset()
        for _ in range(10000):  # warm-up: the chunk size grows to its bound
            next(node)
        kids = children(os.getpid())

        def one_round() -> dict[str, float]:
            log.sizes.clear()
            client, worker = harness.process_cpu(os.getpid()), harness.process_cpu(*kids)
            for _ in range(args.items):
                next(node)
            client = harness.process_cpu(os.getpid()) - client
            worker = harness.process_cpu(*kids) - worker
            calls = max(1, len(log.sizes))
            return {
                "client_us_per_item": client / args.items * 1e6,
                "workers_us_per_item": worker / args.items * 1e6,
                "calls": len(log.sizes),
                "mean_chunk": args.items / calls,
                "workers_us_per_call": worker / calls * 1e6,
            }

        rounds = harness.interleave({"mapper": one_round}, args.rounds)["mapper"]
        node.reset()
    for row in rounds:
        print(" ".join(f"{key} {value:.1f}" for key, value in row.items()))
    print(
        sys.executable,
        "medians: client us/item",
        round(harness.median(row["client_us_per_item"] for row in rounds), 1),
        "workers us/item",
        round(harness.median(row["workers_us_per_item"] for row in rounds), 2),
        "mean chunk",
        round(harness.median(row["mean_chunk"] for row in rounds)),
    )
    print(harness.describe_machine())
    harness.save_json(args.json, {"python": sys.executable, "rounds": rounds})


if __name__ == "__main__":
    main()
