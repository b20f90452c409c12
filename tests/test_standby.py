"""Other ranks' workers in reserve (issue 35): called one at a time, never probed unless needed, let go when idle.

Real worker processes on loopback (``spawn_workers``); what a worker saw is read
from its own counters, asked as an observer (:func:`rpcdl.cli.probe.ask_stats`,
which is not counted among its clients). The pure rules (when to call one
more, when one goes back to the reserve) are tested beside them on the records.
"""

from __future__ import annotations

import socket

import helpers
import pytest
import torch

import rpcdl
import rpcdl.data.scheduling_policy
import rpcdl.data.worker_pool
from rpcdl.cli.probe import ask_stats
from rpcdl.data.records import Attempt, WorkerSlot, WorkerState
from rpcdl.data.scheduling_policy import STANDBY_GROW_AFTER, SchedulingPolicy
from rpcdl.data.sources import Fleet

pytestmark = pytest.mark.timeout(120)


def _indices(batch) -> list[int]:
    return [int(i) for i in torch.as_tensor(batch).reshape(-1)]


def _epoch(loader, during=None) -> list[int]:
    seen: list[int] = []
    for i, batch in enumerate(loader):
        seen.extend(_indices(batch))
        if during is not None:
            during(i)
    return seen


def _counters(address: str) -> dict:
    answer = ask_stats(address, None, timeout=10.0)
    assert answer.counters is not None, f"{address}: {answer.reason}"
    return answer.counters


def _spawn_unconnected(spawn_workers, n: int):
    """``n`` worker processes, this process connected to none of them (``local_workers`` pinged them)."""
    workers = spawn_workers(n)
    rpcdl.shutdown()
    return workers


def _connections_since(address: str, before: int) -> int:
    """Connections ``address`` accepted since its count was ``before``, less the observer asking now and the
    one that took ``before``."""
    return _counters(address)["connections_total"] - before - 1


class _Listed(rpcdl.WorkerSource):
    """A source the test changes by hand."""

    def __init__(self, *addresses: str):
        self.listed = list(addresses)

    def addresses(self) -> list[str]:
        return list(self.listed)


# ---------------------------------------------------------------------------- pure decisions


def _slot(address: str, index: int, preferred: bool, state: WorkerState = WorkerState.ACTIVE) -> WorkerSlot:
    slot = WorkerSlot(address, index, preferred, state)
    slot.service_time = 0.01
    return slot


def test_one_standby_at_a_time_the_next_only_after_waiting_on():
    policy = SchedulingPolicy(prefetch_factor=2, timeout=120.0)
    own = _slot("a:1", 0, preferred=True)
    assert not policy.wants_standby([own], now=0.0, last_called=-1e9, reserve=5)  # its own serves
    own.state = WorkerState.PROBING  # listed (again): being set up, it comes first
    assert not policy.wants_standby([own], now=0.0, last_called=-1e9, reserve=5)
    own.state, own.failure = WorkerState.DOWN, ConnectionResetError("gone")  # it failed: not waited for
    assert not policy.wants_standby([own], now=0.0, last_called=-1e9, reserve=0)  # none in reserve
    assert policy.wants_standby([own], now=0.0, last_called=-1e9, reserve=5)  # nothing active: call one
    called = _slot("b:2", 1, preferred=False, state=WorkerState.STANDBY)
    policy.call_standby(called, now=1.0)
    assert called.state is WorkerState.DOWN and called.probe_at == 1.0
    called.state = WorkerState.PROBING
    assert not policy.wants_standby([own, called], now=30.0, last_called=1.0, reserve=4)  # one at a time
    called.state = WorkerState.DOWN  # its probe failed: the next one now
    assert policy.wants_standby([own, called], now=2.0, last_called=1.0, reserve=4)
    called.state = WorkerState.ACTIVE  # it serves: another only after waiting on for a while
    assert not policy.wants_standby([own, called], now=1.0 + STANDBY_GROW_AFTER / 2, last_called=1.0, reserve=4)
    assert policy.wants_standby([own, called], now=1.0 + STANDBY_GROW_AFTER, last_called=1.0, reserve=4)


def test_a_standby_idle_for_its_time_or_down_while_an_own_worker_serves_goes_back_to_the_reserve():
    policy = SchedulingPolicy(prefetch_factor=2, timeout=120.0, standby_idle=60.0)
    own = _slot("a:1", 0, preferred=True, state=WorkerState.DOWN)
    busy, idle = _slot("b:2", 1, preferred=False), _slot("c:3", 2, preferred=False)
    policy.sent(busy, Attempt(0, 1, 1, 0.0, torch.futures.Future()))
    idle.last_done = 10.0
    slots = [own, busy, idle]
    assert policy.idle_standbys(slots, now=69.0) == []
    assert policy.idle_standbys(slots, now=70.0) == [idle]  # a call in flight keeps the other
    assert idle.state is WorkerState.STANDBY and busy.state is WorkerState.ACTIVE
    failed = _slot("d:4", 3, preferred=False, state=WorkerState.DOWN)
    assert policy.idle_standbys([own, failed], now=0.0) == []  # nothing of its own serves: kept, probed
    own.state = WorkerState.ACTIVE
    assert policy.idle_standbys([own, failed], now=0.0) == [failed]
    own.last_done = 0.0
    assert policy.idle_standbys([own], now=1e6) == []  # its own are never let go


def test_a_pool_over_thousands_of_addresses_has_records_for_its_share_only():
    addresses = [f"127.1.{i // 250}.{i % 250 + 1}:6543" for i in range(4000)]
    fleet = Fleet(addresses, rank=3, world_size=1000)
    pool = rpcdl.data.worker_pool.WorkerPool(fleet, prefetch_factor=2, timeout=30.0)
    with pool.locked() as state:
        assert [slot.address for slot in state.in_use] == addresses[3::1000]
        assert len(state.reserve()) == 3996 and set(state.reserve()).isdisjoint(addresses[3::1000])
    states = pool.states()
    assert len(states) == 4000 and sum(value == "standby" for value in states.values()) == 3996
    other = rpcdl.data.worker_pool.WorkerPool(
        Fleet(addresses, rank=4, world_size=1000), prefetch_factor=2, timeout=30.0
    )
    with pool.locked() as mine, other.locked() as theirs:
        assert mine.reserve()[:4] != theirs.reserve()[:4]  # ranks call on different workers first


# ---------------------------------------------------------------------------- real workers


def test_a_rank_whose_share_dies_calls_on_one_or_two_others_not_all(spawn_workers, caplog):
    """Rank 0 of 3 over 6 workers owns workers 0 and 3; both killed mid-epoch, it takes one or two of the
    four others, and every sample comes once."""
    workers = _spawn_unconnected(spawn_workers, 6)
    others = [address for i, address in enumerate(workers) if i not in (0, 3)]
    before = {address: _counters(address)["connections_total"] for address in others}
    dataset = rpcdl.RPCDataset(Fleet(list(workers), rank=0, world_size=3), helpers.RangeDataset, 160, 0.002)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, timeout=60)

    def kill_the_share(i: int) -> None:
        if i == 5:
            workers.kill(0)
            workers.kill(3)

    assert sorted(_epoch(loader, kill_the_share)) == list(range(160))
    connected = [address for address in others if _connections_since(address, before[address]) > 0]
    assert 1 <= len(connected) <= 2, (connected, loader.worker_states())
    states = loader.worker_states()
    assert sum(states[address] == "standby" for address in others) >= 2, states


def test_the_list_back_after_an_outage_probes_no_other_ranks_worker(spawn_workers):
    """The source lists nothing for a while, then every worker again: this rank's own are set up again,
    the other rank's are not touched (no connection)."""
    workers = _spawn_unconnected(spawn_workers, 4)
    source = _Listed(*workers)
    fleet = Fleet(source, rank=0, world_size=2, interval=3600.0)  # refreshed by hand below
    own = sorted(fleet.membership().own)
    others = [address for address in workers if address not in own]
    before = {address: _counters(address)["connections_total"] for address in others}
    dataset = rpcdl.RPCDataset(fleet, helpers.RangeDataset, 64, 0.001)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, timeout=60)
    assert sorted(_epoch(loader)) == list(range(64))
    source.listed = []
    fleet.refresh()
    assert set(loader.worker_states().values()) == {"left"}
    source.listed = list(workers)
    fleet.refresh()
    assert sorted(_epoch(loader)) == list(range(64))
    states = loader.worker_states()
    assert all(states[address] == "active" for address in own), states
    assert all(states[address] == "standby" for address in others), states
    assert {address: _connections_since(address, before[address]) for address in others} == dict.fromkeys(others, 0)
    fleet.close()


def test_an_idle_standby_goes_back_to_the_reserve_and_its_connection_closes(spawn_workers, monkeypatch):
    monkeypatch.setattr(rpcdl.data.scheduling_policy, "STANDBY_IDLE", 0.3)
    workers = _spawn_unconnected(spawn_workers, 2)
    dataset = rpcdl.RPCDataset(Fleet(list(workers), rank=0, world_size=2), helpers.RangeDataset, 160, 0.004)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, timeout=60)
    standby = workers[1]
    assert sorted(_epoch(loader, lambda i: workers.kill(0) if i == 3 else None)) == list(range(160))
    assert loader.batches_served.get(standby, 0) > 0 and _counters(standby)["clients"] == 1
    workers.restart(0)
    for _ in range(5):  # its own back, the standby idles; let go at a step of an epoch
        assert sorted(_epoch(loader)) == list(range(160))
        if loader.worker_states()[standby] == "standby":
            break
    assert loader.worker_states() == {workers[0]: "active", standby: "standby"}
    assert _counters(standby)["clients"] == 0  # its connection closed


def test_rank_0_of_1000_over_4000_addresses_connects_to_its_share_only(spawn_workers):
    """Rank 0 of 2000 ranks over 4000 addresses: its share (addresses 0 and 2000) are live workers, three of the
    others are listening sockets that no connection may reach, the rest unreachable."""
    workers = spawn_workers(2)
    port = helpers.free_port()
    addresses = [f"127.1.{i // 250}.{i % 250 + 1}:{port}" for i in range(4000)]
    addresses[0], addresses[2000] = workers[0], workers[1]
    listeners = []
    for position in (1, 1999, 3999):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        listeners.append(listener)
        addresses[position] = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        dataset = rpcdl.RPCDataset(Fleet(addresses, rank=0, world_size=2000), helpers.RangeDataset, 160, 0.001)
        loader = rpcdl.RPCDataloader(dataset, batch_size=4, timeout=60)
        for _ in range(2):
            assert sorted(_epoch(loader)) == list(range(160))
        for listener in listeners:
            with pytest.raises(BlockingIOError):
                listener.accept()  # nobody connected
        served = loader.batches_served
        assert served[workers[0]] + served[workers[1]] == 80
    finally:
        for listener in listeners:
            listener.close()
