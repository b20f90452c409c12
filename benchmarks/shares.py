"""The shares of a changing fleet at scale (rpcdl.data.shares): balance, movement and time.

Usage: python benchmarks/shares.py [--ranks 1024] [--sizes 4096,4000,4097,4200,1024,8192] [--changes 200]
       [--seeds 0,1] [--workers 4096]

Prints:

* balance: for many (W, R), whether every rank got floor(W/R) or ceil(W/R) workers (one each with W < R, no
  worker serving more than ceil(R/W) ranks);
* movement: for each fleet size W of ``--sizes`` over ``--ranks`` ranks, and for each seed of ``--seeds`` a
  fleet of W random addresses, ``--changes`` single changes of that fleet (joins and leaves in turn, each
  one worker, each against the same fleet): the (rank, worker) pairs of the assignment that changed, as a
  fraction of its pairs, mean, 99th percentile and max over all the changes of all the seeds, and the same
  as moved workers (the joined or left worker not counted). A worker moved from rank a to rank b is one pair
  changed ((a, w) became (b, w)); the joined or left worker's pair is one more. That is the larger of
  (pairs only before, pairs only after); counting both sides would count each moved worker twice against
  the pairs of one assignment;
* time: one assignment of ``--workers`` workers, and every rank's share computed in one process (as every
  rank of a job does after a change), from a cold cache.

The figures of benchmarks/README.md come from ``--changes 500 --seeds 0,1,2,3`` (2,000 changes per size;
about 20 minutes on a 2-vCPU machine).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections import Counter

from rpcdl.data import shares
from rpcdl.data.sources import own_share


def _fleet(size: int, rng: random.Random) -> list[str]:
    return [f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(256)}:{rng.randrange(1024, 65536)}"
            for _ in range(size)]  # fmt: skip


def _balanced(addresses: list[str], ranks: int) -> bool:
    assigned = shares.assignment(addresses, ranks)
    workers = len(set(addresses))
    served = Counter(worker for share in assigned for worker in share)
    if set(served) != set(addresses):
        return False
    if workers >= ranks:
        return {len(s) for s in assigned} <= {workers // ranks, math.ceil(workers / ranks)} and max(
            served.values()
        ) == 1
    return all(len(s) == 1 for s in assigned) and max(served.values()) <= math.ceil(ranks / workers)


def _pairs(assigned) -> set[tuple[int, str]]:
    return {(rank, worker) for rank, share in enumerate(assigned) for worker in share}


def changed_pairs(before: set[tuple[int, str]], after: set[tuple[int, str]]) -> int:
    """The pairs of the assignment that changed: a moved worker once, a joined or a left one once."""
    return max(len(before - after), len(after - before))


def changes(workers: int, ranks: int, count: int, seed: int) -> list[tuple[int, int]]:
    """(pairs changed, pairs of the larger assignment) for each of ``count`` single joins and leaves (in turn) of
    one random fleet of ``workers`` addresses over ``ranks`` ranks: the same list for the same arguments on
    every run."""
    rng = random.Random(seed)
    fleet = _fleet(workers, rng)
    base = _pairs(shares.assignment(fleet, ranks))
    counts = []
    for change in range(count):
        if change % 2 == 0:
            changed = [*fleet, f"10.200.{change // 256}.{change % 256}:{7000 + seed}"]
        else:
            changed = list(fleet)
            changed.pop(rng.randrange(len(changed)))
        after = _pairs(shares.assignment(changed, ranks))
        counts.append((changed_pairs(base, after), max(len(base), len(after))))
    return counts


def _percentile(ordered: list, fraction: float):
    return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)]


def _sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--sizes", type=_sizes, default=[4096, 4000, 4097, 4200, 1024, 8192], help="fleet sizes W")
    parser.add_argument("--changes", type=int, default=200, help="single joins and leaves per size and seed")
    parser.add_argument("--seeds", type=_sizes, default=[0, 1], help="one random fleet per seed")
    parser.add_argument("--workers", type=int, default=4096, help="the fleet size of the time measure")
    options = parser.parse_args()
    if options.ranks < 1 or options.changes < 1 or not options.seeds or min(options.sizes, default=0) < 2:
        parser.error("--ranks and --changes must be at least 1, --seeds not empty, every size at least 2")
    rng = random.Random(options.seeds[0])

    sizes = [
        (w, r) for r in (1, 2, 3, 7, 8, 16, 64, 100, 1024) for w in (1, 2, r - 1, r, r + 1, 4 * r, 4 * r + 3, 10 * r)
    ]
    bad = [(w, r) for w, r in sizes if w >= 1 and not _balanced(_fleet(w, rng), r)]
    print(f"balance: {len(sizes) - len(bad)} of {len(sizes)} (W, R) balanced{'; not: ' + str(bad) if bad else ''}")

    for workers in options.sizes:
        measured = [pair for seed in options.seeds for pair in changes(workers, options.ranks, options.changes, seed)]
        fractions = sorted(changed / pairs for changed, pairs in measured)
        moved = sorted(changed - 1 for changed, _ in measured)  # the joined or left worker is not a move
        print(
            f"movement at W={workers} R={options.ranks}, {len(measured)} changes ({len(options.seeds)} seeds): "
            f"pairs changed mean {statistics.mean(fractions):.2%} p99 {_percentile(fractions, 0.99):.2%} "
            f"max {fractions[-1]:.2%}; moved workers mean {statistics.mean(moved):.1f} "
            f"p99 {_percentile(moved, 0.99)} max {moved[-1]}"
        )

    fleet = tuple(_fleet(options.workers, rng))  # a new fleet: nothing cached
    started = time.perf_counter()
    shares.assignment(fleet, options.ranks)
    one = time.perf_counter() - started
    fleet = tuple(_fleet(options.workers, rng))  # as a fleet's membership holds it
    started = time.perf_counter()
    for rank in range(options.ranks):
        own_share(fleet, rank, options.ranks, changing=True)
    every = time.perf_counter() - started
    print(f"time: one assignment {one * 1000:.0f} ms; all {options.ranks} ranks' shares in one process {every:.2f} s")


if __name__ == "__main__":
    main()
