"""A worker source that fails is no news (issue 35, item 1): the fleet keeps its last list.

Real worker processes, a real redis-server; an outage of each source (a file renamed away, a resolver that
errs, a Redis stopped and started again empty) mid-epoch: no worker is drained or probed, no connection is
opened (the workers' own counters), every sample comes once, and the failure is said once, its end once.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import helpers
import pytest
import torch

import rpcdl
from rpcdl.data.sources import BACKOFF_CAP, DnsSource, FileSource, Fleet, SourceReadError

pytestmark = pytest.mark.timeout(120)

INTERVAL = 0.05  # the fleet looks at its source 20 times a second: the outage is seen many times over
OUTAGE = 1.5  # seconds; the 10 s, shortened


def _opened(workers) -> dict[str, int]:
    return {address: rpcdl.stats(address)["connections_total"] for address in workers}


def _through_an_outage(fleet: Fleet, workers, fail, heal, caplog) -> None:
    """Warm up one epoch, then run one during which the source fails for OUTAGE seconds; check the outage
    was no news."""
    n = 800  # 200 batches of 4 x 5 ms: about 2 s on two workers
    dataset = rpcdl.RPCDataset(fleet, helpers.RangeDataset, n, 0.005)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, max_batches_per_call=1)
    assert sorted(int(i) for batch in loader for i in batch) == list(range(n))
    opened = _opened(workers)
    states: set[str] = set()
    healer = threading.Timer(OUTAGE, heal)
    seen: list[int] = []
    try:
        for i, batch in enumerate(loader):
            seen.extend(int(x) for x in torch.as_tensor(batch).reshape(-1))
            if i == 2:
                fail()
                healer.start()
                deadline = time.monotonic() + 5
                while fleet.why_empty() is None and time.monotonic() < deadline:  # the fleet saw it fail
                    time.sleep(INTERVAL)
            states.update(loader.worker_states().values())
    finally:
        healer.join()
    deadline = time.monotonic() + 10
    while fleet.why_empty() is not None:
        assert time.monotonic() < deadline, f"the source does not read again: {fleet.why_empty()}"
        time.sleep(INTERVAL)
    assert sorted(seen) == list(range(n)), "not every sample exactly once"
    assert states == {"active"}, f"workers were drained or probed during the outage: {states}"
    assert fleet.membership().addresses and set(fleet.membership().addresses) == set(workers)
    assert _opened(workers) == opened, "a connection was opened during the outage"
    messages = [r.getMessage() for r in caplog.records if r.name == "rpcdl.fleet"]
    assert sum("keeping its last list (2 workers)" in m for m in messages) == 1, messages
    assert sum("reads again" in m for m in messages) == 1, messages
    assert not any("left" in r.getMessage() for r in caplog.records if r.name.startswith("rpcdl")), caplog.text
    fleet.close()


def test_a_file_renamed_away_mid_epoch_is_no_news(spawn_workers, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rpcdl")
    workers = spawn_workers(2)
    listing, away = tmp_path / "workers.txt", tmp_path / "away.txt"
    listing.write_text("".join(f"{w}\n" for w in workers))
    fleet = Fleet(FileSource(listing), interval=INTERVAL)
    _through_an_outage(fleet, workers, lambda: os.rename(listing, away), lambda: os.rename(away, listing), caplog)


def test_a_file_half_written_is_no_news(spawn_workers, tmp_path, caplog):
    """A writer caught between its bytes: the last line has no newline yet and is not a whole address."""
    caplog.set_level(logging.INFO, logger="rpcdl")
    workers = spawn_workers(2)
    listing = tmp_path / "workers.txt"
    whole = "".join(f"{w}\n" for w in workers)
    listing.write_text(whole)
    fleet = Fleet(FileSource(listing), interval=INTERVAL)
    host, _ = workers[1].rsplit(":", 1)
    _through_an_outage(
        fleet, workers, lambda: listing.write_text(f"{workers[0]}\n{host}:"), lambda: listing.write_text(whole), caplog
    )
    with pytest.raises(SourceReadError, match="ends in a line being written"):
        listing.write_text(f"{workers[0]}\n{host}:")
        FileSource(listing).addresses()
    listing.write_text(f"{workers[0]}\n{workers[1]}")  # a whole address without its newline: read
    assert FileSource(listing).addresses() == list(workers)


def test_a_resolver_error_mid_epoch_is_no_news(spawn_workers, caplog):
    caplog.set_level(logging.INFO, logger="rpcdl")
    workers = spawn_workers(2)
    failing = threading.Event()

    def resolver(name: str, port: int) -> list[str]:
        if failing.is_set():
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return list(workers)

    fleet = Fleet(DnsSource("workers.test", 6543, resolver=resolver), interval=INTERVAL)
    _through_an_outage(fleet, workers, failing.set, failing.clear, caplog)


def test_a_redis_restart_mid_epoch_is_no_news(spawn_workers, caplog):
    """The registry's server stops and starts again without its data; the workers register again at their
    next heartbeat (here the worker side's own code, rpcdl.server.registration, runs in this process)."""
    pytest.importorskip("redis")
    from rpcdl.data.cache.redis_server import RedisServer, find_redis_server
    from rpcdl.registry import RegistryURL
    from rpcdl.server.registration import Registration

    try:
        find_redis_server()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    caplog.set_level(logging.INFO, logger="rpcdl")
    workers = spawn_workers(2)
    with RedisServer() as server:
        url = f"redis://{server.host}:{server.port}/0?key=outage:workers&ttl=1.5"
        registrations = [Registration(RegistryURL.parse(url), address) for address in workers]
        for registration in registrations:
            registration.start()
        try:
            fleet = Fleet(url, interval=INTERVAL)
            deadline = time.monotonic() + 10
            while set(fleet.refresh().addresses) != set(workers):
                assert time.monotonic() < deadline, "the workers did not register"
                time.sleep(INTERVAL)
            _through_an_outage(fleet, workers, server.stop, server.start, caplog)
        finally:
            for registration in registrations:
                registration.leave()


class _Flaky(rpcdl.WorkerSource):
    """A user's source whose service fails now and then."""

    def __init__(self, workers):
        self.workers = list(workers)
        self.failing = threading.Event()

    def addresses(self) -> list[str]:
        if self.failing.is_set():
            raise TimeoutError("the scheduler did not answer")
        return list(self.workers)

    def describe(self) -> str:
        return "my scheduler"


def test_a_custom_source_that_raises_is_no_news(spawn_workers, caplog, switching_often):
    """Threads switched as often as the interpreter can: the fleet's thread, the loader's and this one."""
    caplog.set_level(logging.INFO, logger="rpcdl")
    workers = spawn_workers(2)
    source = _Flaky(workers)
    fleet = Fleet(source, interval=INTERVAL)
    _through_an_outage(fleet, workers, source.failing.set, source.failing.clear, caplog)
    assert any("my scheduler: the scheduler did not answer" in r.getMessage() for r in caplog.records)


def test_a_failing_source_is_asked_with_backoff_and_jitter():
    source = _Flaky(["127.0.0.1:1"])
    fleet = Fleet(source, interval=1.0)
    assert 0.8 <= fleet.next_look() <= 1.2  # reading: the interval, with jitter
    source.failing.set()
    looks = []
    for _ in range(8):
        fleet.refresh()
        looks.append(fleet.next_look())
    assert fleet.membership().addresses == ("127.0.0.1:1",)  # the last list stands
    bounds = [min(2**k, 16.0, BACKOFF_CAP) for k in range(8)]
    assert all(bound / 2 <= look <= bound for look, bound in zip(looks, bounds, strict=True)), looks
    assert len({round(look, 6) for look in looks[4:]}) > 1  # capped, and jittered
    source.failing.clear()
    fleet.refresh()
    assert fleet.why_empty() is None and 0.8 <= fleet.next_look() <= 1.2
    fleet.close()


def test_a_source_that_reads_an_empty_list_drains_every_worker():
    """The other side: a read that succeeds and lists nobody is news."""
    source = _Flaky(["127.0.0.1:1"])
    fleet = Fleet(source, interval=3600.0)
    source.workers = []
    assert fleet.refresh().addresses == () and fleet.why_empty() is None
    fleet.close()


def test_an_empty_file_is_being_rewritten_and_a_file_of_comments_lists_nobody(tmp_path):
    """``echo ... > workers.txt`` truncates the file before it writes: a reader in between finds it empty."""
    listing = tmp_path / "workers.txt"
    listing.write_text("127.0.0.1:1\n")
    fleet = Fleet(FileSource(listing), interval=3600.0)
    listing.write_text("")
    assert fleet.refresh().addresses == ("127.0.0.1:1",)  # kept: no news
    assert "is empty (to list no worker, write a '#' line)" in fleet.why_empty()
    listing.write_text("# nobody\n")
    assert fleet.refresh().addresses == () and fleet.why_empty() is None  # a whole file that lists nobody
    fleet.close()


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"world_size": 0}, "world_size"),
        ({"interval": 0}, "interval"),
        ({"interval": "2"}, "interval"),
    ],
)
def test_a_fleet_checks_its_arguments(options, words):
    with pytest.raises((TypeError, ValueError), match=words):
        Fleet(["127.0.0.1:1"], **options)
