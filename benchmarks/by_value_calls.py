"""Per-call cost of ``rpc_sync`` with functions pickled by value: a lambda, and a ``__main__`` function with a
small closure, on an embedded Worker (loopback). Run: ``python benchmarks/by_value_calls.py``.

Prints, for each, the best and median microseconds per call over ``--rounds`` (5) rounds of 2000 calls, and the
cost and size of serializing the call alone (``rpcdl.serialization.pickling.dumps``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

import rpcdl
from rpcdl.serialization.pickling import dumps

OFFSET = 1


def make_scaler(factor: int) -> Callable[[int], int]:
    def scale(x: int) -> int:
        return x * factor + OFFSET

    return scale


def per_call_microseconds(worker: str, func: Callable, calls: int = 2000, rounds: int = 5) -> tuple[float, float]:
    def one_round() -> float:
        start = time.perf_counter()
        for i in range(calls):
            rpcdl.rpc_sync(worker, func, (i,))
        return (time.perf_counter() - start) / calls * 1e6

    rpcdl.rpc_sync(worker, func, (1,))
    rounds_taken = harness.interleave({"calls": one_round}, rounds)["calls"]
    return min(rounds_taken), harness.median(rounds_taken)


def serializing_microseconds(func: Callable, calls: int = 5000) -> tuple[float, int]:
    start = time.perf_counter()
    for i in range(calls):
        dumps((func, (i,), {}))
    return (time.perf_counter() - start) / calls * 1e6, len(dumps((func, (1,), {}))[0])


def main() -> None:
    args = harness.parser(__doc__, rounds=5).parse_args()
    print(harness.describe_machine())
    worker = rpcdl.Worker(timeout=10).start()
    try:
        for name, func in (("lambda", lambda x: x * 2), ("closure", make_scaler(3))):
            best, median = per_call_microseconds(worker.address, func, rounds=args.rounds)
            cost, size = serializing_microseconds(func)
            print(f"{name:8s} rpc_sync best {best:7.1f} us, median {median:7.1f} us | dumps {cost:5.1f} us, {size} B")
    finally:
        rpcdl.shutdown()
        worker.stop(grace=1)


if __name__ == "__main__":
    main()
