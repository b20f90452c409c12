"""The shares of a changing fleet at scale (rpcdl.data.shares): balance, movement and time.

Usage: python benchmarks/shares.py [--workers 4096] [--ranks 1024] [--changes 200] [--seed 0]

Prints:

* balance: for many (W, R), whether every rank got floor(W/R) or ceil(W/R) workers (one each with W < R, no
  worker serving more than ceil(R/W) ranks);
* movement: over random single joins and leaves of a fleet of W workers over R ranks (W, W - 96, W / 2,
  W / 4 and 2 W), the (rank, worker) pairs of the assignment that changed, as a fraction of its pairs, max,
  mean and median. A worker moved from rank a to rank b is one pair changed ((a, w) became (b, w)); the
  joined or left worker's pair is one more. That is the larger of (pairs only before, pairs only after);
  counting both sides would count each moved worker twice against the pairs of one assignment;
* time: one assignment of the whole fleet, and every rank's share computed in one process (as every rank of
  a job does after a change), from a cold cache.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4096)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--changes", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    rng = random.Random(options.seed)

    sizes = [
        (w, r) for r in (1, 2, 3, 7, 8, 16, 64, 100, 1024) for w in (1, 2, r - 1, r, r + 1, 4 * r, 4 * r + 3, 10 * r)
    ]
    bad = [(w, r) for w, r in sizes if w >= 1 and not _balanced(_fleet(w, rng), r)]
    print(f"balance: {len(sizes) - len(bad)} of {len(sizes)} (W, R) balanced{'; not: ' + str(bad) if bad else ''}")

    size = options.workers
    for workers in (size, size - 96, size // 2, size // 4, 2 * size):
        fleet = _fleet(workers, rng)
        base = _pairs(shares.assignment(fleet, options.ranks))
        fractions = []
        for change in range(options.changes):
            if change % 2 == 0:
                changed = [*fleet, f"10.200.{change // 256}.{change % 256}:7000"]
            else:
                changed = list(fleet)
                changed.pop(rng.randrange(len(changed)))
            after = _pairs(shares.assignment(changed, options.ranks))
            fractions.append(changed_pairs(base, after) / max(len(base), len(after)))
        print(
            f"movement at W={workers} R={options.ranks} over {options.changes} single joins and leaves: pairs "
            f"changed max {max(fractions):.2%} mean {statistics.mean(fractions):.2%} "
            f"median {statistics.median(fractions):.2%}"
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
