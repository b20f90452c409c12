"""A trainer process for the fair-shares test: an RPCDataloader on one worker, counting samples between two moments.

Usage: python fair_loader_client.py ADDRESS BATCH_SIZE PREFETCH_FACTOR SECONDS_PER_SAMPLE. Iterates from the
start; prints ``ready`` once its first batches came, then, while it goes on iterating, reads a line ``START STOP``
(``time.time()`` values) and prints how many samples it took between them.
"""

from __future__ import annotations

import select
import sys
import time

import helpers

import rpcdl


def main(address: str, batch_size: int, prefetch_factor: int, seconds_per_sample: float) -> int:
    dataset = rpcdl.RPCDataset([address], helpers.RangeDataset, 10_000_000, seconds_per_sample)
    loader = rpcdl.RPCDataloader(dataset, batch_size=batch_size, prefetch_factor=prefetch_factor)
    start = stop = float("inf")  # until the line comes
    taken = 0
    for index, batch in enumerate(loader):
        now = time.time()
        if now >= stop:
            break
        if now >= start:
            taken += len(batch)
        if index == 4:  # the window is measured after the first answer: the loader is under way
            print("ready", flush=True)
        elif index > 4 and start == float("inf") and select.select([sys.stdin], [], [], 0)[0]:
            start, stop = map(float, sys.stdin.readline().split())
    return taken


if __name__ == "__main__":
    print(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])), flush=True)
