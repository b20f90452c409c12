"""Fleets that change (issue 27, the client side): one fleet for all ranks, hung workers, worker sources.

Real worker processes on loopback (``spawn_workers``), killed, stopped,
restarted and added mid-epoch; every epoch checked for every sample exactly
once. The pure decisions (shares, the hang rule, reserve workers) are tested
beside them on the records.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import threading
import time

import helpers
import pytest
import torch

import rpcdl
import rpcdl.data.worker_pool
from rpcdl.data.records import Attempt, WorkerSlot, WorkerState
from rpcdl.data.scheduling_policy import HUNG_ALONE_FLOOR, HUNG_FLOOR, SchedulingPolicy
from rpcdl.data.sources import DnsSource, FileSource, Fleet, RedisRegistry, SourceReadError, own_share, worker_source
from rpcdl.errors import UnknownHost, WorkerHung

pytestmark = pytest.mark.timeout(120)


def _indices(batch) -> list[int]:
    return [int(i) for i in torch.as_tensor(batch).reshape(-1)]


def _run_epoch(loader, during=None) -> tuple[list[int], float]:
    """One epoch: its sample indices and the longest wait for a batch; ``during(i)`` runs after batch ``i``."""
    seen: list[int] = []
    longest = 0.0
    before = time.monotonic()
    for i, batch in enumerate(loader):
        now = time.monotonic()
        longest = max(longest, now - before)
        seen.extend(_indices(batch))
        if during is not None:
            during(i)
        before = time.monotonic()
    return seen, longest


# ---------------------------------------------------------------------------- pure decisions


def test_a_fixed_list_is_shared_by_stride_and_a_changing_source_in_balance():
    workers = [f"10.0.0.{i}:6543" for i in range(1, 7)]
    assert sorted(own_share(workers, 1, 2, changing=False)) == sorted(workers[1::2])
    assert own_share(workers[:1], 1, 2, changing=False) == {workers[0]}  # fewer workers than ranks: shared
    shares = [own_share(workers, rank, 3, changing=True) for rank in range(3)]
    assert set().union(*shares) == set(workers) and [len(share) for share in shares] == [2, 2, 2]  # each once
    grown = [own_share([*workers, "10.0.0.9:6543"], rank, 3, changing=True) for rank in range(3)]
    assert sorted(map(len, grown)) == [2, 2, 3]  # tests/test_shares.py: few moved
    assert all(own_share(workers[:1], rank, 3, changing=True) for rank in range(3))  # nobody without a worker


def _slot(address: str, index: int, service: float | None = None, preferred: bool = True) -> WorkerSlot:
    slot = WorkerSlot(address, index, preferred)
    slot.service_time = service
    return slot


def _send(policy: SchedulingPolicy, slot: WorkerSlot, at: float, answers: int) -> Attempt:
    attempt = Attempt(0, slot.index, 1, at, torch.futures.Future())
    policy.sent(slot, attempt, answers)
    return attempt


def test_a_worker_silent_while_the_others_answer_is_hung_and_not_before():
    policy = SchedulingPolicy(prefetch_factor=2, timeout=120.0)
    quiet, busy = _slot("a:1", 0, 0.01), _slot("b:2", 1, 0.01)
    _send(policy, quiet, at=0.0, answers=10)
    # Silent past the floor, but nobody else answered meanwhile (the client was away, say): not hung.
    assert policy.hung([quiet, busy], now=HUNG_FLOOR + 1, answers=10) == []
    # The others answered three calls meanwhile: hung, with why.
    [(slot, why)] = policy.hung([quiet, busy], now=HUNG_FLOOR + 1, answers=13)
    assert slot is quiet and "did not answer for" in why and "answered 3 calls" in why
    # Not before the floor, nor before ten of its own service times when it is slow.
    assert policy.hung([quiet, busy], now=HUNG_FLOOR / 2, answers=13) == []
    quiet.service_time = 0.5
    assert policy.hung([quiet, busy], now=4.0, answers=13) == []
    assert [s for s, _ in policy.hung([quiet, busy], now=5.5, answers=13)] == [quiet]
    # An answer resets its silence.
    policy.observe(quiet, Attempt(0, 0, 1, 5.0, torch.futures.Future()), now=5.6, answers=14)
    assert policy.hung([quiet, busy], now=6.0, answers=20) == []
    assert issubclass(WorkerHung, rpcdl.WorkerTimeout)  # taken out as a timeout is: probed with a queued call


def test_a_ranks_only_worker_is_judged_alone_when_others_wait_in_reserve():
    policy = SchedulingPolicy(prefetch_factor=2, timeout=120.0)
    only = _slot("a:1", 0, 0.01)
    _send(policy, only, at=0.0, answers=5)
    assert policy.hung([only], now=HUNG_ALONE_FLOOR + 1, answers=5) == []  # nowhere to go: the timeout decides
    reserve = WorkerSlot("b:2", 1, preferred=False, state=WorkerState.STANDBY)
    assert policy.hung([only, reserve], now=HUNG_ALONE_FLOOR - 1, answers=5) == []
    [(slot, why)] = policy.hung([only, reserve], now=HUNG_ALONE_FLOOR + 1, answers=5)
    assert slot is only and "reserve" in why
    unmeasured = _slot("c:3", 2)
    _send(policy, unmeasured, at=0.0, answers=5)
    assert policy.hung([unmeasured, reserve], now=60.0, answers=5) == []  # its first call: nothing to judge by


def test_own_workers_first_the_others_in_reserve_once_none_of_the_own_is_left():
    policy = SchedulingPolicy(prefetch_factor=2, timeout=120.0)
    own = _slot("a:1", 0, 0.5)
    other = _slot("b:2", 1, 0.01, preferred=False)
    reserve = WorkerSlot("c:3", 2, preferred=False, state=WorkerState.STANDBY)
    slots = [own, other, reserve]
    for _ in range(policy.window(own)):
        assert policy.pick(slots, now=0.0) is own  # though the other is faster
        _send(policy, own, 0.0, 0)
    assert policy.pick(slots, now=0.0) is None  # own window full: wait rather than take another rank's
    assert policy.pass_window(slots) == policy.window(own)
    assert not policy.wants_standby(slots, now=1.0, last_called=-1e9, reserve=1)
    policy.take_down(own, ConnectionResetError("gone"), now=1.0)
    assert policy.pick(slots, now=1.0) is other  # the others' active workers take over at once
    other.state = WorkerState.DOWN
    assert policy.wants_standby(slots, now=2.0, last_called=-1e9, reserve=1)  # nothing active: call one
    policy.call_standby(reserve, now=2.0)
    assert reserve.state is WorkerState.DOWN and reserve.probe_at == 2.0


class _Listed(rpcdl.WorkerSource):
    """A source the test changes by hand."""

    def __init__(self, *addresses: str):
        self.listed = list(addresses)

    def addresses(self) -> list[str]:
        return list(self.listed)


class _NeverAnswers:
    """A setup whose revivals never end: the test sees the states they leave."""

    def revive_async(self, address: str, failure: BaseException | None) -> torch.futures.Future:
        return torch.futures.Future()


def test_the_pool_follows_its_fleet_joins_leaves_and_returns():
    source = _Listed("a:1", "b:2")
    fleet = Fleet(source, interval=3600.0)  # refreshed by hand below
    pool = rpcdl.data.worker_pool.WorkerPool(fleet, prefetch_factor=2, timeout=30.0, setup=_NeverAnswers())
    assert pool.states() == {"a:1": "active", "b:2": "active"}
    source.listed = ["a:1", "b:2", "c:3"]
    fleet.refresh()
    assert pool.states() == {"a:1": "active", "b:2": "active", "c:3": "probing"}  # set up before it serves
    source.listed = ["a:1", "c:3"]
    fleet.refresh()
    assert pool.states()["b:2"] == "left"
    source.listed = ["a:1", "b:2", "c:3"]
    fleet.refresh()
    assert pool.states()["b:2"] == "probing"  # listed again: set up again
    fleet.close()


def test_worker_sources_from_what_users_write(tmp_path):
    listing = tmp_path / "workers.txt"
    listing.write_text("10.0.0.1:6543\n# a comment\n\nnot-an-address\n10.0.0.2:6543  # second\n10.0.0.1:6543\n")
    assert worker_source(str(listing)).addresses() == ["10.0.0.1:6543", "10.0.0.2:6543"]
    with pytest.raises(SourceReadError, match=r"not-yet\.txt does not exist"):  # not an empty list
        FileSource(tmp_path / "not-yet.txt").addresses()
    assert worker_source("dns://workers.ns.svc:6543").describe() == "dns://workers.ns.svc:6543"
    registry = worker_source("redis://127.0.0.1:6380/2?key=jobs:workers&ttl=5")
    assert isinstance(registry, RedisRegistry)
    layout = registry.registry  # parsed by rpcdl.registry, as the workers that register do
    assert (layout.port, layout.db, layout.key, layout.ttl) == (6380, 2, "jobs:workers", 5.0)
    with pytest.raises(ValueError, match="port of registry URL"):
        worker_source("redis://127.0.0.1:x/0")
    with pytest.raises(ValueError, match="malformed worker address"):
        worker_source("dns://workers")
    with pytest.raises(TypeError, match="non-empty list"):
        worker_source("127.0.0.1:6543")  # the classic mistake for a list

    class Mine(rpcdl.WorkerSource):
        def addresses(self):
            return ["127.0.0.1:1", "bad", "127.0.0.1:1"]

    mine = Mine()
    assert worker_source(mine) is mine
    assert Fleet(mine).membership().addresses == ("127.0.0.1:1",)  # checked, once each


def test_a_name_that_does_not_resolve_is_reported_at_once_by_a_call_and_awaited_by_a_dataset(monkeypatch):
    """A call to a name the resolver says does not exist fails at once. A dataset at start waits for it as for
    a worker not started yet (a Pending pod has no DNS record), up to the start timeout, and names it. Where no
    resolver answers (a machine without a network), the failure is the resolver's, maybe passing: retried like
    a refusal, and the error says the name did not resolve and why."""
    try:
        socket.getaddrinfo("no-such-worker.invalid", 6543)
        pytest.skip("this machine's resolver answers for a .invalid name")
    except socket.gaierror as exc:
        resolver_answered = exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME))
    monkeypatch.setenv("RPCDL_CONNECT_GRACE", "1")
    if resolver_answered:
        with pytest.raises(UnknownHost, match="does not resolve"):
            rpcdl.rpc_sync("no-such-worker.invalid:6543", abs, (-1,), timeout=60)
    with pytest.raises(rpcdl.WorkerUnavailable, match="does not resolve") as raised:
        rpcdl.RPCDataset(["no-such-worker.invalid:6543"], helpers.RangeDataset, 4, rpcdl_start_timeout=2)
    assert "no-such-worker.invalid:6543" in str(raised.value) and "RPCDL_START_TIMEOUT" in str(raised.value)


def test_a_dns_source_that_does_not_resolve_yet_says_so():
    def resolver(name: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with pytest.raises(SourceReadError, match=r"no-such-service\.invalid does not resolve"):
        DnsSource("no-such-service.invalid", 6543, resolver=resolver).addresses()
    assert "does not resolve" in Fleet(DnsSource("no-such-service.invalid", 6543, resolver=resolver)).why_empty()


# ---------------------------------------------------------------------------- hung workers


@pytest.mark.parametrize("in_order", [True, False])
def test_a_stopped_worker_never_holds_a_batch(spawn_workers, caplog, in_order):
    """SIGSTOP one of two workers early in an epoch and leave it stopped: over 3 epochs no batch waits for
    the timeout (120 s), the loader says once which worker it routes around, every sample comes once."""
    caplog.set_level(logging.WARNING, logger="rpcdl")
    workers = spawn_workers(2)
    n = 240
    dataset = rpcdl.RPCDataset(list(workers), helpers.RangeDataset, n, 0.002)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, in_order=in_order, shuffle=True)
    victim = workers[0]
    try:
        seen, _ = _run_epoch(loader)  # warm-up
        assert sorted(seen) == list(range(n))
        waits = []
        for epoch in range(3):
            stop = (lambda i: workers.kill(0, signal.SIGSTOP) if i == 3 else None) if epoch == 0 else None
            seen, longest = _run_epoch(loader, stop)
            assert sorted(seen) == list(range(n)), f"epoch {epoch}: not every sample exactly once"
            waits.append(longest)
        assert max(waits) < 30, f"a batch waited {max(waits):.1f}s: the stopped worker held it"
        routed = [r.getMessage() for r in caplog.records if "routing around" in r.getMessage()]
        assert len(routed) == 1 and victim in routed[0] and "did not answer" in routed[0], routed
        assert loader.worker_states()[victim] in ("down", "probing")
    finally:
        workers.processes[0].send_signal(signal.SIGCONT)


# ---------------------------------------------------------------------------- one fleet for all ranks


def test_a_rank_whose_own_workers_all_die_takes_the_others(spawn_workers, caplog):
    """Rank 1 of 2 over 3 workers owns workers[1]; killed mid-epoch, the rank goes on with the others'."""
    caplog.set_level(logging.WARNING, logger="rpcdl")
    workers = spawn_workers(3)
    fleet = Fleet(list(workers), rank=1, world_size=2)
    dataset = rpcdl.RPCDataset(fleet, helpers.RangeDataset, 160, 0.002)
    assert dataset.rref(workers[0]) is None and dataset.rref(workers[1]) is not None  # built on its own only
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, timeout=60)
    assert loader.worker_states() == {workers[0]: "standby", workers[1]: "active", workers[2]: "standby"}
    seen, _ = _run_epoch(loader, lambda i: workers.kill(1) if i == 5 else None)
    assert sorted(seen) == list(range(160))
    served = loader.batches_served
    assert served[workers[1]] >= 5 and served[workers[0]] + served[workers[2]] > 0
    assert any("none of this rank's own workers is left" in r.getMessage() for r in caplog.records)
    seen, _ = _run_epoch(loader)
    assert sorted(seen) == list(range(160))


# ---------------------------------------------------------------------------- sources that change


def _join_mid_epoch(loader, add, newcomer: str, n: int) -> None:
    """Run an epoch of ``loader``, calling ``add()`` after its 3rd batch; ``newcomer`` must serve in it."""
    seen, _ = _run_epoch(loader, lambda i: add() if i == 2 else None)
    assert sorted(seen) == list(range(n))
    assert loader.batches_served.get(newcomer, 0) > 0, f"{newcomer} served nothing: {loader.batches_served}"


def test_a_worker_added_to_the_file_serves_mid_epoch_and_one_removed_drains(spawn_workers, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rpcdl")
    first = spawn_workers(1)
    listing = tmp_path / "workers.txt"
    listing.write_text(f"{first[0]}\n")
    n = 400  # 100 batches of 20 ms: 2 s for one worker
    dataset = rpcdl.RPCDataset(Fleet(FileSource(listing), interval=0.1), helpers.RangeDataset, n, 0.005)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, max_batches_per_call=1)
    second = spawn_workers(1)
    _join_mid_epoch(loader, lambda: listing.write_text(f"{first[0]}\n{second[0]}\n"), second[0], n)
    about_second = [r for r in caplog.records if second[0] in r.getMessage()]
    assert any("joined" in r.getMessage() and r.levelno == logging.INFO for r in about_second)
    # a worker joining is news, not trouble: no warning (it said "joined", then "is back", both as warnings)
    assert not [r.getMessage() for r in about_second if r.levelno >= logging.WARNING]
    # The first one leaves the file: its calls in flight finish, it is given no more.
    seen, _ = _run_epoch(loader, lambda i: listing.write_text(f"{second[0]}\n") if i == 2 else None)
    assert sorted(seen) == list(range(n))
    helpers.eventually(lambda: loader.worker_states()[first[0]] == "left", "the first worker to be left", timeout=30)
    served = loader.batches_served[first[0]]
    seen, _ = _run_epoch(loader)
    assert sorted(seen) == list(range(n)) and loader.batches_served[first[0]] == served


def test_a_worker_found_through_dns_serves_mid_epoch(spawn_workers):
    """``dns://NAME:PORT`` with a test resolver standing for the name server (a headless Service whose
    records the test changes): a name that resolves to one more address."""
    first, second = spawn_workers(1), spawn_workers(1)
    records = {"workers.test": [first[0]]}

    def resolver(name: str, port: int) -> list[str]:
        if name not in records:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(records[name])

    source = DnsSource("workers.test", 6543, resolver=resolver)
    n = 400
    dataset = rpcdl.RPCDataset(Fleet(source, interval=0.1), helpers.RangeDataset, n, 0.005)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, max_batches_per_call=1)
    _join_mid_epoch(loader, lambda: records["workers.test"].append(second[0]), second[0], n)


def test_a_worker_registered_in_redis_serves_mid_epoch(spawn_workers):
    """The registry's layout (rpcdl.registry, the worker's side): a sorted set of addresses scored by their
    last heartbeat on the server's clock. The test beats for the workers."""
    redis = pytest.importorskip("redis")
    from rpcdl.data.cache.redis_server import RedisServer

    first, second = spawn_workers(1), spawn_workers(1)
    with RedisServer() as server:
        client = redis.Redis(host=server.host, port=server.port)
        url = f"redis://{server.host}:{server.port}/0?key=test:workers&ttl=30"

        def beat(address: str) -> None:
            seconds, micros = client.time()
            client.zadd("test:workers", {address: seconds + micros / 1e6})

        client.zadd("test:workers", {"10.9.9.9:1": 1.0})  # an entry that stopped beating long ago
        beat(first[0])
        n = 400
        fleet = Fleet(url, interval=0.1)
        assert fleet.membership().addresses == (first[0],)
        dataset = rpcdl.RPCDataset(fleet, helpers.RangeDataset, n, 0.005)
        loader = rpcdl.RPCDataloader(dataset, batch_size=4, max_batches_per_call=1)
        _join_mid_epoch(loader, lambda: beat(second[0]), second[0], n)
        fleet.close()


def test_a_node_back_under_a_new_address(spawn_workers, tmp_path):
    """A worker's node is replaced: the old address dies and leaves the file, a new one is listed."""
    workers = spawn_workers(2)
    listing = tmp_path / "workers.txt"
    listing.write_text(f"{workers[0]}\n{workers[1]}\n")
    n = 320
    dataset = rpcdl.RPCDataset(Fleet(listing, interval=0.1), helpers.RangeDataset, n, 0.005)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, max_batches_per_call=1)
    replacement = spawn_workers(1)

    def replace(i: int) -> None:
        if i == 3:
            workers.kill(1)
            listing.write_text(f"{workers[0]}\n{replacement[0]}\n")

    seen, _ = _run_epoch(loader, replace)
    assert sorted(seen) == list(range(n))
    seen, _ = _run_epoch(loader)
    assert sorted(seen) == list(range(n))
    assert loader.batches_served[replacement[0]] > 0
    states = loader.worker_states()
    assert states[workers[1]] == "left" and states[replacement[0]] == "active"


# ---------------------------------------------------------------------------- starting and rejoining


def test_a_trainer_waits_for_its_fleet_and_says_what_it_waits_for(spawn_workers, tmp_path, caplog, monkeypatch):
    """A file not written yet is said missing (issue 37), in the wait messages and the final error; an empty
    one lists no worker yet."""
    caplog.set_level(logging.WARNING, logger="rpcdl")
    monkeypatch.setattr("rpcdl.data.sources.WAIT_LOG_EVERY", 0.3)
    listing = tmp_path / "workers.txt"
    workers = spawn_workers(1)
    later = threading.Timer(1.5, lambda: listing.write_text(f"{workers[0]}\n"))
    later.start()
    try:
        dataset = rpcdl.RPCDataset(str(listing), helpers.RangeDataset, 8, rpcdl_start_timeout=60)
    finally:
        later.cancel()
    assert len(dataset) == 8
    waits = [r.getMessage() for r in caplog.records if "waiting for rpcdl workers" in r.getMessage()]
    assert waits and f"the file {listing} does not exist" in waits[0], waits
    assert not any("lists no worker yet" in wait for wait in waits), waits
    monkeypatch.setenv("RPCDL_START_TIMEOUT", "0.5")
    with pytest.raises(rpcdl.WorkerUnavailable, match="RPCDL_START_TIMEOUT") as missing:
        rpcdl.RPCDataset(str(tmp_path / "nobody.txt"), helpers.RangeDataset, 8)
    assert f"the file {tmp_path / 'nobody.txt'} does not exist" in str(missing.value)
    (tmp_path / "empty.txt").write_text("# nobody yet\n")
    with pytest.raises(rpcdl.WorkerUnavailable, match=r"empty\.txt lists no worker yet"):
        rpcdl.RPCDataset(str(tmp_path / "empty.txt"), helpers.RangeDataset, 8)


def _restart(workers, index: int) -> None:
    """Restart worker ``index`` on its port; the ping that checks it may find this process's connection to
    the process killed (then it is asked again, on a new connection)."""
    try:
        workers.restart(index)
    except rpcdl.ConnectionLost:
        rpcdl.ping(workers[index], timeout=30)


def test_a_worker_killed_while_it_rebuilds_its_dataset_rejoins(spawn_workers, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="rpcdl")
    workers = spawn_workers(2)
    slow_flag, building = tmp_path / "slow", tmp_path / "building"
    n = 160
    dataset = rpcdl.RPCDataset(list(workers), helpers.SlowBuildDataset, n, 0.002, str(slow_flag), str(building), 3.0)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, timeout=60)
    seen, _ = _run_epoch(loader)
    assert sorted(seen) == list(range(n))
    slow_flag.write_text("")  # from now on a build takes 3 s
    _restart(workers, 1)  # it lost its dataset: the loader rebuilds it there

    def kill_during_rebuild() -> None:
        helpers.eventually(building.exists, "the dataset to start building", timeout=30)
        workers.kill(1)

    killer = threading.Thread(target=kill_during_rebuild, name="test-killer")
    killer.start()
    for _ in range(10):  # epochs until the rebuild began and the worker was killed in it
        seen, _ = _run_epoch(loader)
        assert sorted(seen) == list(range(n))
        if not killer.is_alive():
            break
    killer.join()
    slow_flag.unlink()
    _restart(workers, 1)
    served = loader.batches_served.get(workers[1], 0)
    for _ in range(20):  # it rejoins: a later epoch uses it again
        seen, _ = _run_epoch(loader)
        assert sorted(seen) == list(range(n))
        if loader.batches_served.get(workers[1], 0) > served:
            break
    assert loader.worker_states()[workers[1]] == "active", caplog.text[-2000:]
    assert not any("kept out" in r.getMessage() for r in caplog.records), caplog.text[-2000:]
    assert os.path.exists(building)


def test_a_remote_map_follows_a_file_source(spawn_workers, tmp_path):
    nodes = pytest.importorskip("torchdata.nodes")
    from rpcdl.integrations.torchdata import RPCMapper

    first, second = spawn_workers(1), spawn_workers(1)
    listing = tmp_path / "workers.txt"
    listing.write_text(f"{first[0]}\n")
    n = 800  # 5 ms each: 4 s on one worker, the file is looked at every 2 s
    mapper = RPCMapper(
        nodes.IterableWrapper(range(n)), str(listing), functools.partial(helpers.sleep_and_return, 0.005)
    )
    out = []
    for i, value in enumerate(nodes.Loader(mapper)):
        out.append(value)
        if i == 10:
            listing.write_text(f"{first[0]}\n{second[0]}\n")
    assert out == list(range(n))
    assert mapper.items_served.get(second[0], 0) > 0, mapper.items_served


def test_a_worker_sent_sigterm_mid_epoch_is_given_nothing_more(spawn_workers, caplog):
    """The worker tells its clients it is leaving (a LEAVING notice, then WorkerLeaving for new calls): its
    batches go to the other worker at once, none waits for a timeout, and it exits 0 once drained."""
    caplog.set_level(logging.WARNING, logger="rpcdl")
    workers = spawn_workers(2)
    n = 320
    dataset = rpcdl.RPCDataset(list(workers), helpers.RangeDataset, n, 0.005)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, max_batches_per_call=1)
    leaving = workers.processes[0]
    seen, longest = _run_epoch(loader, lambda i: leaving.send_signal(signal.SIGTERM) if i == 3 else None)
    assert sorted(seen) == list(range(n))
    assert longest < 10, f"a batch waited {longest:.1f}s for the worker that left"
    assert leaving.wait(60) == 0
    served = loader.batches_served[workers[0]]
    seen, _ = _run_epoch(loader)
    assert sorted(seen) == list(range(n)) and loader.batches_served[workers[0]] == served
