"""A client process for the fair-shares test: keeps ``in_flight`` calls on one worker between two moments.

Usage: python fair_client.py ADDRESS IN_FLIGHT. Prints ``ready`` once connected, then reads a line
``START STOP`` (``time.time()`` values) and prints how many calls were answered between them.
"""

from __future__ import annotations

import collections
import sys
import time

import rpcdl


def work(seconds: float) -> int:
    time.sleep(seconds)  # holds the worker's slot, not its CPU
    return 1


def main(address: str, in_flight: int) -> int:
    rpcdl.rpc_sync(address, min, (1, 2))  # connected before the start
    print("ready", flush=True)
    start, stop = map(float, sys.stdin.readline().split())
    time.sleep(max(0.0, start - time.time()))
    futures: collections.deque = collections.deque(rpcdl.rpc_async(address, work, (0.005,)) for _ in range(in_flight))
    answered = 0
    while time.time() < stop:
        futures.popleft().wait()
        if start <= time.time() < stop:
            answered += 1
        futures.append(rpcdl.rpc_async(address, work, (0.005,)))
    for future in futures:
        future.wait()
    return answered


if __name__ == "__main__":
    print(main(sys.argv[1], int(sys.argv[2])), flush=True)
