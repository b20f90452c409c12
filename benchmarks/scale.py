"""The fleet, pool and scheduling code at scale, with stand-in connections: 1,024 ranks x 4,096 workers.

Usage::

    python benchmarks/scale.py [--quick] [--ranks 8] [--batches 3000] [--json out.json]
    python benchmarks/scale.py --real

Nothing here opens a socket. The real :class:`~rpcdl.data.sources.Fleet`,
:class:`~rpcdl.data.worker_pool.WorkerPool` and :class:`~rpcdl.data.scheduler.Dispatch`
run as a trainer's loader runs them; the call layer is a stand-in that answers
at once (a completed future), and the pool's revivals (a probe, a dataset
built) go to the same stand-in. Every address the stand-in is asked to reach,
by a call or a revival, counts as a connection opened.

What it reports, each figure with the load average when it was measured
(``os.getloadavg()``, 1 min; the figures are times on a shared machine):

- the share (:func:`rpcdl.data.sources.own_share`, whatever is merged): the
  time to compute every rank's share of a changing source, and its balance;
- scheduling time per batch: one pass of ``--batches`` payloads through rank 0
  of ``W / 4`` ranks (a share of 4 workers) over ``W`` = 4, 64, 1,024 and 4,096
  workers, and rank 0 of 10,000 trainers over one fleet of 10,000 workers;
  the ratio is to the 4-worker figure;
- connections opened per rank when its whole share dies at the start of a
  pass (the others' workers serve), and when the source lists nothing for a
  while and then every worker again, for ``--ranks`` ranks spread over the job:
  its own workers and the others', each pass checked for every payload once.

``--real`` times real loaders instead, over 4 local worker processes: rank 0
of 1,000 ranks over 4,000 addresses (its share live, the rest unreachable)
against the same loader over its share alone (median of 3 epochs, each after
one to warm up).

Run it on two versions of the code to compare them: ``PYTHONPATH=/path/to/old
python benchmarks/scale.py`` imports ``rpcdl`` from there (an editable install
of this checkout otherwise).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import statistics
import time
from collections.abc import Sequence

import torch

import rpcdl
from rpcdl.data.probes import Revival
from rpcdl.data.scheduler import Dispatch
from rpcdl.data.sources import Fleet, own_share
from rpcdl.data.worker_pool import WorkerPool
from rpcdl.errors import ConnectionLost, WorkerUnavailable

JOB = (1024, 4096)  # ranks, workers
SHARED_FLEET = (10_000, 10_000)  # trainers sharing one fleet, its workers


def load() -> float:
    """The load average over the last minute."""
    return os.getloadavg()[0]


def addresses(count: int) -> list[str]:
    """``count`` loopback addresses (none is reached: the stand-in answers for them)."""
    return [f"127.{1 + i // 62500}.{i // 250 % 250}.{i % 250 + 1}:6543" for i in range(count)]


class StandIn:
    """The call layer and the revivals, answering at once; the workers in ``dead`` fail as a dead worker does.

    ``contacted`` counts, per address, the calls and revivals it was asked for.
    """

    def __init__(self, dead: Sequence[str] = ()):
        self.dead = set(dead)
        self.contacted: collections.Counter[str] = collections.Counter()

    def call(self, task, address: str) -> torch.futures.Future:
        """A call of ``task`` to ``address``: answered with its payload, or lost when the worker is dead."""
        self.contacted[address] += 1
        future: torch.futures.Future = torch.futures.Future()
        if address in self.dead:
            future.set_exception(ConnectionLost(f"worker {address} is dead"))
        else:
            future.set_result(task.payload)
        return future

    def revive_async(self, address: str, failure: BaseException | None) -> torch.futures.Future:
        """A revival (a probe, a dataset built): back at once, or unreachable when the worker is dead."""
        self.contacted[address] += 1
        future: torch.futures.Future = torch.futures.Future()
        if address in self.dead:
            future.set_exception(WorkerUnavailable(f"worker {address} is not reachable"))
        else:
            future.set_result(Revival.BACK)
        return future


class Listed(rpcdl.WorkerSource):
    """A source set by hand. Its shares are the fixed list's (``workers[rank::ranks]``): the pool's behaviour
    does not depend on how shares are made, and the share of a changing source is timed apart (:func:`shares`)."""

    changing = False

    def __init__(self, listed: Sequence[str]):
        self.listed = list(listed)

    def addresses(self) -> list[str]:
        return list(self.listed)


def run_pass(pool: WorkerPool, stand_in: StandIn, payloads: int) -> float:
    """One pass of ``payloads`` through ``pool``; its seconds. Raises if a payload is lost or doubled."""
    started = time.perf_counter()
    out = [task.value for task in Dispatch(pool, iter(range(payloads)), stand_in.call)]
    seconds = time.perf_counter() - started
    if out != list(range(payloads)):
        raise AssertionError(f"the pass gave {len(out)} payloads, not each of {payloads} once")
    return seconds


def per_batch(workers: int, ranks: int, batches: int, repeats: int = 3) -> tuple[float, float]:
    """Microseconds of scheduling per batch for rank 0 of ``ranks`` over ``workers`` (median of ``repeats``
    passes after one to warm up), and the load average then."""
    stand_in = StandIn()
    pool = WorkerPool(
        Fleet(addresses(workers), rank=0, world_size=ranks), prefetch_factor=2, timeout=120.0, setup=stand_in
    )
    run_pass(pool, stand_in, min(batches, 500))
    times = [run_pass(pool, stand_in, batches) / batches for _ in range(repeats)]
    return statistics.median(times) * 1e6, load()


def spread(ranks: int, sampled: int) -> list[int]:
    """``sampled`` ranks spread over ``ranks``."""
    return sorted({round(i * ranks / sampled) % ranks for i in range(sampled)})


def share_dies(workers: int, ranks: int, sampled: int, payloads: int) -> dict:
    """Connections opened by each sampled rank whose whole share is dead as its pass begins."""
    listed = addresses(workers)
    others_opened, own_opened, seconds = [], [], []
    chosen: collections.Counter[str] = collections.Counter()
    for rank in spread(ranks, sampled):
        own = set(listed[rank::ranks])
        stand_in = StandIn(dead=own)
        pool = WorkerPool(Fleet(listed, rank=rank, world_size=ranks), prefetch_factor=2, timeout=120.0, setup=stand_in)
        seconds.append(run_pass(pool, stand_in, payloads))
        others = [address for address in stand_in.contacted if address not in own]
        chosen.update(others)
        others_opened.append(len(others))
        own_opened.append(sum(address in own for address in stand_in.contacted))
    return {
        "ranks": len(others_opened),
        "others_opened": others_opened,
        "own_opened": own_opened,
        "distinct_others": len(chosen),
        "most_ranks_on_one_worker": max(chosen.values()),
        "pass_seconds": statistics.median(seconds),
        "load": load(),
    }


def outage(workers: int, ranks: int, sampled: int, payloads: int) -> dict:
    """Connections opened by each sampled rank when its source lists nothing and then every worker again."""
    listed = addresses(workers)
    others_opened, own_opened = [], []
    for rank in spread(ranks, sampled):
        source = Listed(listed)
        fleet = Fleet(source, rank=rank, world_size=ranks, interval=3600.0)  # refreshed by hand
        own = set(fleet.membership().own)
        stand_in = StandIn()
        pool = WorkerPool(fleet, prefetch_factor=2, timeout=120.0, setup=stand_in)
        run_pass(pool, stand_in, payloads)
        stand_in.contacted.clear()
        source.listed = []
        fleet.refresh()
        pool.states()  # the pool follows its fleet: every worker left
        source.listed = listed
        fleet.refresh()
        run_pass(pool, stand_in, payloads)
        fleet.close()
        others_opened.append(sum(address not in own for address in stand_in.contacted))
        own_opened.append(sum(address in own for address in stand_in.contacted))
    return {"ranks": len(others_opened), "others_opened": others_opened, "own_opened": own_opened, "load": load()}


def shares(workers: int, ranks: int, budget: float = 60.0) -> dict:
    """The time to compute every rank's share of a changing source (:func:`own_share`) and the balance."""
    listed = addresses(workers)
    started = time.perf_counter()
    own_share(listed, 0, ranks, changing=True)
    one = time.perf_counter() - started
    if one * ranks > budget:  # too slow to do them all: the total is projected, the balance not known
        return {"seconds_all_ranks": one * ranks, "projected": True, "load": load()}
    started = time.perf_counter()
    sizes = [len(own_share(listed, rank, ranks, changing=True)) for rank in range(ranks)]
    return {
        "seconds_all_ranks": time.perf_counter() - started,
        "projected": False,
        "smallest": min(sizes),
        "largest": max(sizes),
        "ranks_without": sizes.count(0),
        "load": load(),
    }


class Numbers(torch.utils.data.Dataset):
    """Sample ``i`` is ``i`` (no work: what is timed is the loader)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def real_epochs(ranks: int = 1000, listed: int = 4000, samples: int = 4000, repeats: int = 3) -> dict:
    """Real loaders over 4 local worker processes: rank 0 of ``ranks`` over ``listed`` addresses (its share
    live, the others unreachable) against the same loader over its share alone; median epoch seconds."""
    share = listed // ranks
    seconds = {}
    with rpcdl.local_workers(share) as workers:
        unreachable = addresses(listed)
        for i, address in enumerate(workers):
            unreachable[i * ranks] = address  # rank 0's share: addresses[0::ranks]
        for name, fleet in (
            ("share alone", Fleet(list(workers), rank=0, world_size=1)),
            (f"rank 0 of {ranks} over {listed}", Fleet(unreachable, rank=0, world_size=ranks)),
        ):
            dataset = rpcdl.RPCDataset(fleet, Numbers, samples)
            loader = rpcdl.RPCDataloader(dataset, batch_size=8, max_batches_per_call=1)
            for _ in loader:  # warm: connections, windows
                pass
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                count = sum(len(batch) for batch in loader)
                times.append(time.perf_counter() - started)
                if count != samples:
                    raise AssertionError(f"{name}: {count} samples, not {samples}")
            seconds[name] = (statistics.median(times), load())
            dataset.release()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches and ranks: a smoke run")
    parser.add_argument("--ranks", type=int, default=8, help="ranks sampled for the connection counts")
    parser.add_argument("--batches", type=int, default=3000, help="batches of a timed pass")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--real", action="store_true", help="only the real loaders' epochs (worker processes)")
    args = parser.parse_args()
    logging.getLogger("rpcdl").setLevel(logging.ERROR)  # a rank's warnings, thousands of times over
    batches, sampled = (300, 2) if args.quick else (args.batches, args.ranks)
    print(f"rpcdl from {os.path.dirname(rpcdl.__file__)}; load {load():.2f}", flush=True)
    figures: dict = {"rpcdl": os.path.dirname(rpcdl.__file__)}
    if args.real:
        epochs = real_epochs()
        (alone, _), (many, _) = epochs.values()
        for name, (seconds, then) in epochs.items():
            print(f"real epoch, {name}: {seconds:.2f} s (load {then:.2f})")
        print(f"ratio {many / alone:.2f}")
        return

    figures["per_batch_us"] = {}
    for workers in (4, 64, 1024, 4096):
        micros, then = per_batch(workers, max(1, workers // 4), batches)
        figures["per_batch_us"][workers] = (micros, then)
        print(
            f"scheduling, rank 0 of {max(1, workers // 4)} over {workers} workers: {micros:.1f} us/batch "
            f"(load {then:.2f})"
        )
    trainers, fleet_size = SHARED_FLEET
    micros, then = per_batch(fleet_size, trainers, batches)
    figures["per_batch_us_shared_fleet"] = (micros, then)
    print(
        f"scheduling, trainer 0 of {trainers} over {fleet_size} workers: {micros:.1f} us/batch (load {then:.2f})",
        flush=True,
    )

    ranks, workers = JOB
    for name, (r, w) in {"job": (ranks, workers), "shared_fleet": SHARED_FLEET}.items():
        died = share_dies(w, r, sampled, payloads=200)
        figures[f"share_dies_{name}"] = died
        print(
            f"share dies, {r} ranks x {w} workers: others' workers reached per rank {died['others_opened']}, "
            f"own {died['own_opened']}; {died['distinct_others']} distinct others over {died['ranks']} ranks "
            f"(at most {died['most_ranks_on_one_worker']} ranks on one); pass {died['pass_seconds']:.2f} s "
            f"(load {died['load']:.2f})"
        )
        lost = outage(w, r, sampled, payloads=200)
        figures[f"outage_{name}"] = lost
        print(
            f"outage and back, {r} ranks x {w} workers: others' workers reached per rank {lost['others_opened']}, "
            f"own {lost['own_opened']} (load {lost['load']:.2f})"
        )

    share = shares(workers, ranks)
    figures["shares"] = share
    if share["projected"]:
        print(
            f"shares of {ranks} ranks over {workers} workers: {share['seconds_all_ranks']:.1f} s projected from "
            f"one rank (too slow to do them all; load {share['load']:.2f})"
        )
    else:
        print(
            f"shares of {ranks} ranks over {workers} workers: {share['seconds_all_ranks']:.2f} s for all, "
            f"{share['smallest']}-{share['largest']} workers a rank, {share['ranks_without']} without "
            f"(load {share['load']:.2f})"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)


if __name__ == "__main__":
    main()
