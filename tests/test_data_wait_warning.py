"""The data-wait warning at an epoch's end: only for an epoch long enough to mean something, naming the
workers that served it, and no estimate from a loop that does no work.

Real loaders over real worker processes; the warning's text is pure logic, tested beside them.
"""

from __future__ import annotations

import logging
import signal
import time

import pytest
from helpers import RangeDataset

import rpcdl
from rpcdl.data import epoch as epoch_module
from rpcdl.data.epoch import served_workers, wait_warning
from rpcdl.data.flow import FlowFigures

pytestmark = pytest.mark.timeout(120)

WAIT_LOGGER = "rpcdl.dataloader.wait"


def _warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == WAIT_LOGGER]


@pytest.fixture
def short_epochs_warn(monkeypatch):
    """The warning's minimum epoch lowered so that a test's few batches can show it."""
    monkeypatch.setattr(epoch_module, "WAIT_WARNING_MIN_SECONDS", 0.0, raising=False)
    monkeypatch.setattr(epoch_module, "WAIT_WARNING_MIN_BATCHES", 1, raising=False)


def test_the_warning_needs_a_long_epoch_and_names_the_workers_that_served():
    long_epoch = FlowFigures(batches=500, wait_seconds=8.0, work_seconds=4.0, worker_seconds=60.0, worker_batches=500)
    message = wait_warning(long_epoch, 3, 7)
    assert "67% of epoch 7 (8.0 s of 12.0 s, 500 batches)" in message
    assert "about 15 workers of the measured speed" in message and "served by 3 workers" in message
    assert "served by 1 worker;" in wait_warning(long_epoch, 1, 7)
    short = FlowFigures(batches=500, wait_seconds=4.0, work_seconds=2.0, worker_seconds=30.0, worker_batches=500)
    few = FlowFigures(batches=50, wait_seconds=20.0, work_seconds=10.0, worker_seconds=30.0, worker_batches=50)
    fed = FlowFigures(batches=500, wait_seconds=0.1, work_seconds=12.0, worker_seconds=30.0, worker_batches=500)
    assert wait_warning(short, 3, 7) == wait_warning(few, 3, 7) == wait_warning(fed, 3, 7) == ""


def test_a_loop_that_does_no_work_gets_no_estimate():
    idle = FlowFigures(batches=500, wait_seconds=12.0, work_seconds=0.01, worker_seconds=60.0, worker_batches=500)
    message = wait_warning(idle, 2, 0)
    assert "too little to estimate" in message and "about" not in message


def test_served_workers_counts_those_whose_batches_grew():
    assert served_workers({"a:1": 5, "b:2": 5}, {"a:1": 9, "b:2": 5, "c:3": 1}) == 2
    assert served_workers({}, {}) == 0


def test_a_toy_epoch_that_waits_logs_no_warning(two_workers, caplog):
    dataset = rpcdl.RPCDataset(two_workers, RangeDataset, 20, delay=0.01)
    loader = rpcdl.RPCDataloader(dataset, batch_size=2, max_batches_per_call=1)
    with caplog.at_level(logging.WARNING, logger="rpcdl.dataloader"):
        start = loader.data_flow()
        assert sum(1 for _ in loader) == 10  # 10 batches, a fraction of a second: it waited most of it
    assert loader.data_flow().since(start).data_wait_fraction > epoch_module.WAIT_WARNING_FRACTION
    assert _warnings(caplog) == []
    dataset.release()


def test_a_loop_that_does_no_work_is_not_extrapolated_from(two_workers, caplog, short_epochs_warn):
    dataset = rpcdl.RPCDataset(two_workers, RangeDataset, 40, delay=0.01)
    loader = rpcdl.RPCDataloader(dataset, batch_size=2, max_batches_per_call=1)
    with caplog.at_level(logging.WARNING, logger="rpcdl.dataloader"):
        for _ in loader:
            pass
    (message,) = _warnings(caplog)
    assert "too little to estimate" in message and "about" not in message
    dataset.release()


def test_the_warning_counts_every_worker_that_served_the_epoch(spawn_workers, caplog, short_epochs_warn):
    workers = spawn_workers(3)
    dataset = rpcdl.RPCDataset(list(workers), RangeDataset, 96, delay=0.01)
    loader = rpcdl.RPCDataloader(dataset, batch_size=2, max_batches_per_call=1, timeout=5)
    served_before = dict(loader.batches_served)
    with caplog.at_level(logging.WARNING, logger="rpcdl.dataloader"):
        for index, _ in enumerate(loader):
            time.sleep(0.002)  # the training step
            if index == 24:
                workers.kill(2, signal.SIGKILL)  # it served this epoch, then died: 2 workers are left
    assert loader.worker_states()[workers[2]] != "active"
    served = [w for w in workers if loader.batches_served[w] > served_before.get(w, 0)]
    (message,) = _warnings(caplog)
    assert f"served by {len(served)} workers" in message, message
    assert len(served) == 3, loader.batches_served
