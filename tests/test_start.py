"""A trainer's start: one wait for its workers, over as soon as any listed worker has built the dataset.

Real worker processes; the addresses that do not answer are loopback ports
nothing listens on and names under ``.invalid`` (RFC 6761), which no resolver
sends anywhere.
"""

from __future__ import annotations

import logging
import socket
import threading

import helpers
import pytest
import torch

import rpcdl
from rpcdl.data.first_copy import wait_for_first_copy
from rpcdl.data.sources import Fleet
from rpcdl.errors import ProtocolError, UnknownHost

_UNRESOLVED = "no-such-worker.invalid"


def _dead() -> str:
    """A loopback address at which no worker listens (nor served this process)."""
    return f"127.0.0.1:{helpers.port_for_a_late_worker()}"


def _built_within(seconds: float, build):
    """``build()`` in a thread: its result once it returned within ``seconds``, else the test fails.

    The bound is far above what the build takes and far below the deadline it must not wait for (the
    test sets that to minutes), so it tells the two apart on a loaded machine.
    """
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(build()), name="test-build", daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still waiting after {seconds}s: it waits for a worker that does not answer"
    return outcome[0]


def _messages(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def _resolver_answers_for_invalid_names() -> bool:
    try:
        socket.getaddrinfo(f"{_UNRESOLVED}", 6543)
    except socket.gaierror as exc:
        return exc.errno not in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME))
    return True


def test_dead_addresses_delay_no_dataset_and_the_log_names_them(
    spawn_workers, tmp_path, caplog, monkeypatch, switching_often
):
    caplog.set_level(logging.INFO, logger="rpcdl")
    monkeypatch.setenv("RPCDL_CONNECT_GRACE", "600")  # a dead address would hold the build for minutes
    monkeypatch.setenv("RPCDL_START_TIMEOUT", "600")
    live = spawn_workers(1)[0]
    dead = [_dead(), _dead()]
    listing = tmp_path / "workers.txt"
    listing.write_text(f"{dead[0]}\n{dead[1]}\n{live}\n")

    dataset = _built_within(30, lambda: rpcdl.RPCDataset(str(listing), helpers.RangeDataset, 12))

    assert len(dataset) == 12
    assert dataset.rref(live) is not None and dataset.rref(dead[0]) is None
    built = [m for m in _messages(caplog) if "built on" in m]
    assert built and f"built on {live}" in built[0]
    assert f"not yet on {dead[0]} (" in built[0] and f"{dead[1]} (" in built[0]  # with why, as far as known
    # The loader goes on with the worker that serves: every batch once.
    loader = rpcdl.RPCDataloader(dataset, batch_size=3, timeout=30)
    assert sorted(int(x) for batch in _built_within(30, lambda: list(loader)) for x in batch) == list(range(12))


def test_a_healthy_fleet_starts_with_every_copy_built(spawn_workers, caplog):
    """Ready at the first copy does not mean the others are left to the loader's revivals when they answer."""
    caplog.set_level(logging.INFO, logger="rpcdl")
    workers = list(spawn_workers(2))
    for _ in range(3):
        dataset = rpcdl.RPCDataset(workers, helpers.RangeDataset, 6)
        assert [dataset.rref(address) is not None for address in workers] == [True, True]
    assert not [m for m in _messages(caplog) if "not yet on" in m or "is down" in m]


def test_a_data_module_with_two_splits_waits_for_no_dead_address(spawn_workers, monkeypatch):
    pytest.importorskip("lightning")
    from probe_dataset import probe_spec

    from rpcdl.integrations.lightning import RPCDataModule

    monkeypatch.setenv("RPCDL_CONNECT_GRACE", "600")
    live = spawn_workers(1)[0]
    data = RPCDataModule(workers=[_dead(), live], train_dataset=probe_spec(8), val_dataset=probe_spec(4))
    try:
        _built_within(30, lambda: data.setup("fit"))
        assert len(data.datasets["train"]) == 8 and len(data.datasets["val"]) == 4
    finally:
        data.teardown("fit")


def test_a_name_that_does_not_resolve_fails_nothing_while_another_worker_serves(spawn_workers, caplog):
    if _resolver_answers_for_invalid_names():
        pytest.skip("this machine's resolver answers for a .invalid name")
    caplog.set_level(logging.INFO, logger="rpcdl")
    live = spawn_workers(1)[0]
    unresolved = f"{_UNRESOLVED}:{helpers.free_port()}"

    dataset = rpcdl.RPCDataset([live, unresolved], helpers.RangeDataset, 10, rpcdl_start_timeout=60)

    assert len(dataset) == 10
    built = [m for m in _messages(caplog) if "built on" in m]
    assert built and f"not yet on {unresolved} (" in built[0]
    # Its revivals keep it out, asked again later: the epoch is served by the other, every batch once.
    loader = rpcdl.RPCDataloader(dataset, batch_size=2, timeout=30)
    for _ in range(2):
        assert sorted(int(x) for batch in loader for x in batch) == list(range(10))
    assert loader.worker_states()[unresolved] != "excluded"


def test_with_no_worker_serving_the_start_timeout_names_each_and_why(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="rpcdl")
    monkeypatch.setattr("rpcdl.data.first_copy.WAIT_LOG_EVERY", 0.5)
    monkeypatch.setenv("RPCDL_START_TIMEOUT", "4")  # past the connection's first warning (3 s)
    dead = _dead()
    workers = [dead]
    if not _resolver_answers_for_invalid_names():
        workers.append(f"{_UNRESOLVED}:6543")

    with pytest.raises(rpcdl.WorkerUnavailable) as raised:
        rpcdl.RPCDataset(workers, helpers.RangeDataset, 4)

    message = str(raised.value)
    assert "of 4s" in message and "RPCDL_START_TIMEOUT" in message
    assert f"{dead} (connection refused)" in message
    if len(workers) == 2:
        assert f"{workers[1]} (its host name does not resolve" in message
    # One deadline in every message: the connection's grace (20 s by default) is not a second one.
    said = [*_messages(caplog), message]
    assert not [m for m in said if "20s" in m or "giving up" in m or "RPCDL_CONNECT_GRACE" in m], said
    waits = [m for m in said if m.startswith("waiting for rpcdl workers")]
    assert waits and all("of 4s" in m for m in waits)
    assert any(f"waiting for rpcdl worker {dead}: connection refused" in m for m in said)  # the 3 s warning


def test_an_address_without_a_port_is_refused_at_once():
    with pytest.raises(ValueError, match="HOST:PORT"):
        rpcdl.RPCDataset(["127.0.0.1:1", "cpu01"], helpers.RangeDataset, 4)


# ---------------------------------------------------------------------------- the wait's rules, without workers


def _answering(outcomes: dict[str, object], calls: list[str]):
    """A build that ends at once as ``outcomes`` says (an exception, or installed); ``None``: never ends."""

    def build(address: str) -> torch.futures.Future:
        calls.append(address)
        future: torch.futures.Future = torch.futures.Future()
        outcome = outcomes[address]
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        elif outcome is not None:
            future.set_result(None)
        return future

    return build


def test_the_first_copy_ends_the_wait_whatever_the_others_do():
    calls: list[str] = []
    outcomes = {"a:1": None, "b:1": rpcdl.WorkerUnavailable("refused"), "c:1": "built"}
    fleet = Fleet(list(outcomes))
    assert wait_for_first_copy(fleet, _answering(outcomes, calls), "D", timeout=60) == "c:1"
    assert sorted(calls) == ["a:1", "b:1", "c:1"]  # all asked at once, none waited for in turn


def test_what_is_asked_again_what_is_not_and_what_ends_the_wait():
    calls: list[str] = []
    not_rpcdl = ProtocolError("x:1 is not an rpcdl worker")
    outcomes = {"x:1": not_rpcdl, "y:1": UnknownHost("y does not resolve")}
    with pytest.raises(rpcdl.WorkerUnavailable, match=r"waited 1\.\ds of 1\.5s") as raised:
        wait_for_first_copy(Fleet(list(outcomes)), _answering(outcomes, calls), "D", timeout=1.5)
    assert "x:1 (x:1 is not an rpcdl worker)" in str(raised.value) and "y:1 (y does not resolve)" in str(raised.value)
    assert calls.count("x:1") == 1 and calls.count("y:1") >= 2  # the same again is not asked again; a name is
    # Every worker failing for good ends the wait at once, with the error when there is one.
    with pytest.raises(ProtocolError):
        wait_for_first_copy(Fleet(["x:1"]), _answering({"x:1": not_rpcdl}, []), "D", timeout=60)
    # The dataset's own code failing would fail everywhere: raised at once.
    with pytest.raises(ZeroDivisionError):
        wait_for_first_copy(Fleet(["z:1", "a:1"]), _answering({"z:1": ZeroDivisionError(), "a:1": None}, []), "D", 60)
