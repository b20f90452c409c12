"""Frame limits: the side that would break one raises LimitExceeded at once, and nothing retries it."""

from __future__ import annotations

import time

import pytest
import torch

import rpcdl
from rpcdl.errors import LimitExceeded, is_transient
from rpcdl.transport.wire import Limits

MANY = 70_000  # past the default limit of 65,536 buffers in one message


def many_tensors(n: int) -> list[torch.Tensor]:
    return [torch.tensor(i) for i in range(n)]


def identity(value):
    return value


def total_stats(workers: list[str]) -> tuple[int, int]:
    stats = [rpcdl.stats(worker) for worker in workers]
    return sum(s["calls_served"] for s in stats), sum(s["calls_failed"] for s in stats)


@pytest.mark.timeout(30)
def test_a_result_with_too_many_tensors_raises_at_once_and_the_worker_stays_healthy(two_workers):
    worker = two_workers[0]
    served, failed = total_stats([worker])
    with pytest.raises(LimitExceeded) as caught:
        rpcdl.rpc_sync(worker, many_tensors, (MANY,), timeout=60)
    message = str(caught.value)
    assert f"{MANY} tensors" in message and "65536" in message and "RPCDL_MAX_BUFFERS" in message
    assert "many_tensors()" in message
    assert caught.value.rpcdl_worker == worker
    assert not is_transient(caught.value)
    assert isinstance(caught.value, rpcdl.RPCDLError)
    assert rpcdl.rpc_sync(worker, sum, ([1, 2, 3],)) == 6  # the same connection still serves
    assert total_stats([worker]) == (served + 1, failed + 1)


@pytest.mark.timeout(30)
def test_a_result_past_the_byte_limit_raises_with_the_setting_to_raise(embedded_worker):
    worker = embedded_worker(limits=Limits(max_message_bytes=4096))
    with pytest.raises(LimitExceeded, match="RPCDL_MAX_MESSAGE_BYTES") as caught:
        rpcdl.rpc_sync(worker.address, bytes, (10_000,))
    assert "4096" in str(caught.value)
    with pytest.raises(LimitExceeded, match="RPCDL_MAX_MESSAGE_BYTES"):  # the same through tensor buffers
        rpcdl.rpc_sync(worker.address, torch.zeros, (10_000,), {"dtype": torch.uint8})
    assert rpcdl.rpc_sync(worker.address, bytes, (100,)) == bytes(100)
    assert worker.stats()["calls_failed"] == 2


@pytest.mark.timeout(30)
def test_a_call_whose_arguments_break_a_limit_raises_on_the_client_before_sending(two_workers, monkeypatch):
    worker = two_workers[0]
    before = rpcdl.stats(worker)
    with pytest.raises(LimitExceeded, match="RPCDL_MAX_BUFFERS") as caught:
        rpcdl.rpc_sync(worker, len, (many_tensors(MANY),))
    assert "len()" in str(caught.value) and not is_transient(caught.value)
    monkeypatch.setenv("RPCDL_MAX_MESSAGE_BYTES", "2048")
    with pytest.raises(LimitExceeded, match="RPCDL_MAX_MESSAGE_BYTES"):
        rpcdl.rpc_async(worker, len, (bytes(4096),))
    after = rpcdl.stats(worker)
    assert after["bytes_in"] - before["bytes_in"] < 1024  # only the stats request itself arrived
    assert after["calls_served"] + after["calls_failed"] == before["calls_served"] + before["calls_failed"]


@pytest.mark.timeout(60)
def test_raising_the_limit_through_the_environment_lets_the_message_through(spawn_workers, monkeypatch):
    monkeypatch.setenv("RPCDL_MAX_BUFFERS", str(2 * MANY))
    (worker,) = spawn_workers(1)  # inherits the environment, as workers and trainers sharing a job script do
    result = rpcdl.rpc_sync(worker, many_tensors, (MANY,), timeout=60)
    assert len(result) == MANY and int(result[-1]) == MANY - 1
    assert rpcdl.rpc_sync(worker, len, (result,), timeout=60) == MANY


def test_a_malformed_limit_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("RPCDL_MAX_BUFFERS", "lots")
    with pytest.raises(ValueError, match="RPCDL_MAX_BUFFERS must be a whole number, got 'lots'"):
        Limits()
    monkeypatch.setenv("RPCDL_MAX_BUFFERS", "0")
    with pytest.raises(ValueError, match=r"max_buffers \(RPCDL_MAX_BUFFERS\) must be in 1\.\."):
        Limits()


@pytest.mark.timeout(30)
def test_a_batch_past_the_limit_raises_once_in_the_loop_and_is_not_retried(two_workers):
    n = 80_000
    dataset = rpcdl.RPCDataset(two_workers, torch.utils.data.TensorDataset, torch.arange(n))
    loader = rpcdl.RPCDataloader(dataset, batch_size=n, collate_fn=lambda b: b, timeout=120)  # as in the issue
    served, failed = total_stats(two_workers)
    started = time.monotonic()
    with pytest.raises(LimitExceeded, match="RPCDL_MAX_BUFFERS") as caught:
        next(iter(loader))
    assert time.monotonic() - started < 20  # not the loader's timeout of 120 s, nor for ever
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "while loading batch 0" in notes and "80000 in all" in notes
    assert total_stats(two_workers) == (served, failed + 1)  # one attempt, on one worker: never retried
    small = rpcdl.RPCDataloader(dataset, batch_size=40_000)
    assert [len(tensors) for (tensors,) in small] == [40_000, 40_000]  # both workers still serve


@pytest.mark.timeout(30)
def test_an_answer_past_the_clients_own_limits_fails_its_call_for_good(embedded_worker):
    worker = embedded_worker(limits=Limits(max_buffers=2 * MANY))  # set for the worker only: a mistake
    with pytest.raises(LimitExceeded, match="the sender's limits are higher") as caught:
        rpcdl.rpc_sync(worker.address, many_tensors, (MANY,))
    assert "RPCDL_MAX_BUFFERS" in str(caught.value) and not is_transient(caught.value)
    assert rpcdl.rpc_sync(worker.address, sum, ([1, 2],)) == 3  # a new connection serves


def raise_long(size: int) -> None:
    raise ValueError("x" * size)


@pytest.mark.timeout(30)
def test_an_exception_past_the_byte_limit_still_fails_its_call_with_a_summary(embedded_worker):
    worker = embedded_worker(limits=Limits(max_message_bytes=4096))
    with pytest.raises(LimitExceeded, match=r"RPCDL_MAX_MESSAGE_BYTES.*it began: ValueError: xxx"):
        rpcdl.rpc_sync(worker.address, raise_long, (10_000,))
    with pytest.raises(ValueError, match=r"^x{100}\n"):  # a small one keeps its own type
        rpcdl.rpc_sync(worker.address, raise_long, (100,))
