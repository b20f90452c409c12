"""Metrics: a real Prometheus server scrapes a real worker; a trainer's data wait and the workers it needs.

- Prometheus (Debian's ``prometheus``, started here on loopback with a scrape
  config written here) scrapes ``rpcdl worker --metrics-port``, and its HTTP
  API shows ``rpcdl_worker_calls_total`` rising.
- Data wait, both ways: a loop that waits for a slow dataset reports its wait
  and more than one worker needed (and a warning at the epoch's end); a loop
  whose own step is slow reports about no wait and under one worker.
- The trainer's metrics over HTTP (:func:`rpcdl.serve_metrics`) and their names
  against the documentation's table; the figures' arithmetic.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from helpers import RangeDataset, free_port

import rpcdl
from rpcdl.data import epoch as epoch_module
from rpcdl.data.flow import CallSeconds, DataFlow, FlowSnapshot
from rpcdl.data.trainer_metrics import serve_metrics_from_environment
from rpcdl.metrics.names import TRAINER_METRICS, WORKER_METRICS

ROOT = Path(__file__).resolve().parent.parent
METRICS_DOC = ROOT / "docs" / "guides" / "metrics.rst"


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return answer.read().decode()


def _sample(text: str, name: str, labels: str = "") -> float | None:
    """The value of ``name{labels}`` in Prometheus text, or ``None``."""
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, flags=re.M)
    return float(match.group(1)) if match else None


# ---------------------------------------------------------------------------- a real Prometheus


def _start_prometheus(tmp_path: Path, target: str) -> tuple[subprocess.Popen, str]:
    """Prometheus on a free loopback port, scraping ``target`` every second; retried if the port was taken."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Debian's prometheus is not installed (apt-get install prometheus; .ci/run installs it)")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: rpcdl-worker\n    static_configs:\n      - targets: ['{target}']\n"
    )
    for attempt in range(3):
        address = f"127.0.0.1:{free_port()}"
        log = (tmp_path / f"prometheus-{attempt}.log").open("wb")
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / f'tsdb-{attempt}'}",
                f"--web.listen-address={address}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and process.poll() is None:
            try:
                _get(f"http://{address}/-/ready", timeout=1)
                return process, address
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
        process.kill()
        process.wait()
        output = (tmp_path / f"prometheus-{attempt}.log").read_text(errors="replace")
        if "address already in use" not in output:
            raise AssertionError(f"prometheus did not become ready:\n{output[-3000:]}")
    raise AssertionError("prometheus found its port taken three times")


def _query(prometheus: str, expression: str) -> float | None:
    """The value of an instant query through Prometheus's HTTP API, or ``None`` when it has no sample."""
    url = f"http://{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
    answer = json.loads(_get(url))
    assert answer["status"] == "success", answer
    results = answer["data"]["result"]
    return float(results[0]["value"][1]) if results else None


def _wait_for(prometheus: str, expression: str, at_least: float, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = _query(prometheus, expression)
        if value is not None and value >= at_least:
            return value
        time.sleep(0.25)
    raise AssertionError(f"{expression} was {value} after {timeout}s, expected at least {at_least}")


def _worker_with_metrics():
    """A worker process (``rpcdl worker --metrics-port``) on a free metrics port; retried if it was taken."""
    for _ in range(3):
        metrics_port = free_port()
        context = rpcdl.local_workers(1, extra_args=["--metrics-port", str(metrics_port)])
        try:
            return context, context.__enter__()[0], metrics_port
        except Exception as exc:
            if "in use" not in str(exc):
                raise
    raise AssertionError("the metrics port was taken three times")


def test_prometheus_scrapes_a_worker_and_sees_its_calls_rise(tmp_path):
    if shutil.which("prometheus") is None:
        pytest.skip("Debian's prometheus is not installed (apt-get install prometheus; .ci/run installs it)")
    context, worker, metrics_port = _worker_with_metrics()
    prometheus = None
    try:
        text = _get(f"http://127.0.0.1:{metrics_port}/metrics")
        assert _sample(text, "rpcdl_worker_calls_total") == 0
        prometheus, address = _start_prometheus(tmp_path, f"127.0.0.1:{metrics_port}")
        query = 'rpcdl_worker_calls_total{job="rpcdl-worker"}'
        assert _wait_for(address, "up", 1) == 1  # scraped
        for value in range(3):
            assert rpcdl.rpc_sync(worker, abs, (-value,)) == value
        first = _wait_for(address, query, 3)
        for value in range(5):
            rpcdl.rpc_sync(worker, abs, (-value,))
        assert _wait_for(address, query, first + 5) >= 8  # rising, as Prometheus scraped it
        assert _query(address, 'rpcdl_worker_failures_total{job="rpcdl-worker"}') == 0
        assert _query(address, 'rpcdl_worker_clients{job="rpcdl-worker"}') >= 1
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        context.__exit__(None, None, None)
        rpcdl.shutdown()


# ---------------------------------------------------------------------------- data wait, both ways


def _run_epoch(loader: rpcdl.RPCDataloader, step_seconds: float) -> int:
    batches = 0
    for _ in loader:
        time.sleep(step_seconds)  # the training step
        batches += 1
    return batches


def test_a_loop_that_waits_for_data_reports_it_and_more_than_one_worker(two_workers, caplog, monkeypatch):
    monkeypatch.setattr(epoch_module, "WAIT_WARNING_MIN_SECONDS", 0.0)  # its 20 batches: a warning all the same
    monkeypatch.setattr(epoch_module, "WAIT_WARNING_MIN_BATCHES", 1)
    port = rpcdl.serve_metrics()
    before = _get(f"http://127.0.0.1:{port}/metrics")
    dataset = rpcdl.RPCDataset(two_workers, RangeDataset, 40, delay=0.01)  # 20 ms a batch, on each worker
    loader = rpcdl.RPCDataloader(dataset, batch_size=2, max_batches_per_call=1)
    start = loader.data_flow()
    with caplog.at_level(logging.WARNING, logger="rpcdl.dataloader"):
        assert _run_epoch(loader, step_seconds=0.001) == 20
    figures = loader.data_flow().since(start)
    assert figures.batches == figures.worker_batches == 20
    assert figures.data_wait_fraction > 0.5, figures
    assert figures.workers_needed > 1, figures
    assert figures.worker_seconds >= 20 * 0.02  # each batch slept 20 ms on its worker
    warnings = [r.getMessage() for r in caplog.records if r.name == "rpcdl.dataloader.wait"]
    assert len(warnings) == 1, warnings  # once for the epoch
    assert f"about {math.ceil(figures.workers_needed)} workers" in warnings[0]
    assert "served by 2 workers" in warnings[0]

    after = _get(f"http://127.0.0.1:{port}/metrics")
    assert _sample(after, "rpcdl_batches_total") - _sample(before, "rpcdl_batches_total") >= 20
    assert _sample(after, "rpcdl_data_wait_seconds_total") > _sample(before, "rpcdl_data_wait_seconds_total")
    assert _sample(after, "rpcdl_workers_needed") > 1
    assert _sample(after, "rpcdl_workers", '{state="active"}') >= 2
    assert _sample(after, "rpcdl_call_seconds_count") >= 20
    assert _sample(after, "rpcdl_bytes_received_total") > 0
    dataset.release()


def test_a_loop_whose_step_is_slow_reports_the_little_it_waited(two_workers, caplog):
    # The figures must be the consumer's own: the wait is the time spent in next(), which the test measures
    # beside the loader. How little that is depends on the machine's load, so only a generous band is asserted
    # about it: a loader that did not prefetch during the 50 ms steps would wait about half the time.
    dataset = rpcdl.RPCDataset(two_workers, RangeDataset, 80)
    loader = rpcdl.RPCDataloader(dataset, batch_size=2)
    start = loader.data_flow()
    waited = 0.0
    with caplog.at_level(logging.WARNING, logger="rpcdl.dataloader"):
        batches = iter(loader)
        next(batches)  # the epoch's first batch is always waited for: the steady state is what is asserted
        after_first = loader.data_flow()
        for _ in range(39):
            time.sleep(0.05)  # the training step
            began = time.perf_counter()
            next(batches)
            waited += time.perf_counter() - began
        assert next(batches, None) is None
    figures = loader.data_flow().since(start)
    steady = loader.data_flow().since(after_first)
    assert figures.batches == 40 and steady.batches == 39
    assert steady.work_seconds >= 39 * 0.05
    assert steady.wait_seconds <= waited, (steady, waited)  # counted inside the next() calls timed here
    assert steady.wait_seconds >= waited - 0.002 * 40 - 0.05 * waited, (steady, waited)
    assert steady.data_wait_fraction < 0.3, steady
    assert figures.workers_needed < 1, figures
    # an epoch this short (2 s) never warns, whatever it waited: its first batch alone would make the fraction
    assert not [r for r in caplog.records if "waited for data" in r.getMessage()]
    dataset.release()


def test_loaders_on_several_threads_count_every_batch_while_scraped(two_workers):
    import sys
    import threading

    from rpcdl.data.flow import PROCESS_FLOW
    from rpcdl.data.trainer_metrics import TrainerCollector

    collector = TrainerCollector()
    start = PROCESS_FLOW.snapshot()
    datasets = [rpcdl.RPCDataset(two_workers, RangeDataset, 30) for _ in range(3)]
    counted, scraped, done = [], [], threading.Event()

    def consume(dataset: rpcdl.RPCDataset) -> None:
        counted.append(sum(1 for _ in rpcdl.RPCDataloader(dataset, batch_size=2, max_batches_per_call=2)))

    def scrape() -> None:
        while not done.is_set():
            families = {family.name: family for family in collector.collect()}
            scraped.append(families["rpcdl_batches"].samples[0].value)

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        scraper = threading.Thread(target=scrape, name="test-scraper")
        scraper.start()
        consumers = [
            threading.Thread(target=consume, args=(d,), name=f"test-consumer-{i}") for i, d in enumerate(datasets)
        ]
        for thread in consumers:
            thread.start()
        for thread in consumers:
            thread.join(timeout=60)
        done.set()
        scraper.join(timeout=10)
    finally:
        sys.setswitchinterval(previous)
    assert counted == [15, 15, 15]
    figures = PROCESS_FLOW.snapshot().since(start)
    assert figures.batches == figures.worker_batches == 45  # no count lost between the threads
    assert scraped and scraped == sorted(scraped)  # a counter never goes back
    for dataset in datasets:
        dataset.release()


# ---------------------------------------------------------------------------- serving, names, figures


def test_serve_metrics_serves_a_port_once_and_names_a_taken_one(monkeypatch):
    port = rpcdl.serve_metrics()
    assert _sample(_get(f"http://127.0.0.1:{port}/metrics"), "rpcdl_batches_total") is not None
    fixed = free_port()
    assert rpcdl.serve_metrics(fixed) == fixed
    assert rpcdl.serve_metrics(fixed) == fixed  # asked again: the same server
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{busy}: .*in use"):
            rpcdl.serve_metrics(busy)
    with pytest.raises(ValueError, match="port"):
        rpcdl.serve_metrics(70000)
    monkeypatch.setenv("RPCDL_METRICS_PORT", "not a port")
    with pytest.raises(ValueError, match=r"\$RPCDL_METRICS_PORT='not a port' is not PORT or HOST:PORT"):
        serve_metrics_from_environment()
    monkeypatch.setenv("RPCDL_METRICS_PORT", str(fixed - 1))
    assert serve_metrics_from_environment(local_rank=1) == fixed  # the same server: PORT + local rank
    monkeypatch.setenv("RPCDL_METRICS_PORT", "0")
    first = serve_metrics_from_environment(local_rank=1)
    assert serve_metrics_from_environment() == first  # served once, by the first to ask
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("RPCDL_METRICS_PORT", f"127.0.0.1:{fixed - 3}")
    assert serve_metrics_from_environment() == fixed  # the rank from $LOCAL_RANK
    monkeypatch.delenv("RPCDL_METRICS_PORT")
    assert serve_metrics_from_environment() is None


def test_every_metric_is_exposed_and_in_the_documentation_table(embedded_worker):
    from rpcdl.server.worker_metrics import serve_worker_metrics

    worker = embedded_worker()
    server = serve_worker_metrics(worker, 0, "127.0.0.1")
    try:
        worker_text = _get(server.url)
    finally:
        server.stop()
    trainer_text = _get(f"http://127.0.0.1:{rpcdl.serve_metrics()}/metrics")
    for names, text in ((WORKER_METRICS, worker_text), (TRAINER_METRICS, trainer_text)):
        exposed = set(re.findall(r"^# TYPE (\w+) (\w+)$", text, flags=re.M))
        for metric in names.values():
            if metric.name in ("rpcdl_workers_needed", "rpcdl_data_wait_fraction"):
                continue  # absent until batches were measured (see the test above)
            assert (metric.name, metric.kind) in exposed, metric
    documented = set(re.findall(r"``(rpcdl_\w+)``", METRICS_DOC.read_text()))
    named = set(WORKER_METRICS) | set(TRAINER_METRICS)
    assert named <= documented, f"not in {METRICS_DOC.name}: {sorted(named - documented)}"
    assert not {name for name in documented - named if not name.startswith("rpcdl_call_seconds_")}


def test_the_worker_command_names_a_taken_metrics_port(tmp_path):
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        for command in (["-m", "rpcdl", "worker"], ["-m", "rpcdl.launch", "--port", "0"]):
            result = subprocess.run(
                [sys.executable, *command, "--metrics-port", str(busy)], capture_output=True, text=True, timeout=60
            )
            assert result.returncode != 0
            assert f"cannot serve metrics on 127.0.0.1:{busy}: Address already in use" in result.stderr, result.stderr
            assert not result.stdout  # no ready line: the worker did not start


def test_worker_metrics_stop_with_the_worker_and_refuse_a_taken_port(embedded_worker):
    from rpcdl.server.worker_metrics import serve_worker_metrics

    worker = embedded_worker()
    server = serve_worker_metrics(worker, 0, "127.0.0.1")
    with pytest.raises(OSError, match="cannot serve metrics"):
        serve_worker_metrics(worker, server.port, "127.0.0.1")
    server.stop()
    with pytest.raises(urllib.error.URLError):
        _get(server.url, timeout=2)


def test_figures_from_two_snapshots():
    start = FlowSnapshot()
    waited = FlowSnapshot(batches=10, wait_seconds=3.0, work_seconds=1.0, worker_seconds=4.0, worker_batches=10)
    figures = waited.since(start)
    assert figures.data_wait_fraction == 0.75
    assert figures.batches_per_second == 2.5
    assert figures.workers_needed == 4.0  # 0.4 s of worker time per batch, 0.1 s of work per batch
    assert math.isnan(FlowSnapshot().since(start).workers_needed)
    assert FlowSnapshot().since(start).data_wait_fraction == 0.0
    idle = FlowSnapshot(batches=2, wait_seconds=1.0, worker_seconds=1.0, worker_batches=2)
    assert math.isinf(idle.since(start).workers_needed)  # a loop that only takes batches


def test_a_flow_adds_to_its_parent():
    parent = DataFlow()
    child = DataFlow(parent=parent)
    child.yielded(wait_seconds=0.5, work_seconds=0.25)
    child.served(batches=2, seconds=1.0, nbytes=100)
    assert parent.snapshot() == child.snapshot() == FlowSnapshot(1, 0.5, 0.25, 1.0, 2, 100)


def test_call_seconds_counts_each_bucket_cumulatively():
    times = CallSeconds([0.1, 1.0])
    for seconds in (0.05, 0.1, 0.5, 3.0):
        times.observe(seconds)
    buckets, total = times.snapshot()
    assert buckets == [(0.1, 2), (1.0, 3), (float("inf"), 4)]
    assert total == pytest.approx(3.65)


# ---------------------------------------------------------------------------- Lightning's logger


def test_the_lightning_logger_receives_the_three_figures(two_workers, tmp_path):
    pytest.importorskip("lightning")
    import csv

    import lightning.pytorch as pl
    import torch
    from helpers_lightning import quiet_trainer
    from lightning.pytorch.loggers import CSVLogger

    from rpcdl.integrations.lightning import DataFlowLogger, RPCDataModule

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(batch.float().unsqueeze(1)).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = RPCDataModule(
        workers=two_workers,
        train_dataset={"class_path": "helpers.RangeDataset", "init_args": {"n": 24, "delay": 0.005}},
        batch_size=4,
        max_batches_per_call=1,
    )
    trainer = quiet_trainer(max_epochs=2, logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=1)
    trainer.fit(Model(), datamodule=data)
    assert sum(isinstance(callback, DataFlowLogger) for callback in trainer.callbacks) == 1
    rows = list(csv.DictReader((Path(trainer.logger.log_dir) / "metrics.csv").open()))
    figures = ("rpcdl/data_wait_fraction", "rpcdl/batches_per_second", "rpcdl/workers_needed")
    logged = [row for row in rows if row.get("rpcdl/data_wait_fraction")]
    assert [int(row["epoch"]) for row in logged] == [0, 1]  # once per epoch
    for row in logged:
        values = {name: float(row[name]) for name in figures}
        assert 0 < values["rpcdl/data_wait_fraction"] < 1, values  # 20 ms a batch on the workers: it waited
        assert values["rpcdl/batches_per_second"] > 0, values
        assert values["rpcdl/workers_needed"] > 1, values


def test_rpcdl_workers_shows_and_documents_every_state_a_pool_knows():
    from rpcdl.data.records import WorkerState

    text = _get(f"http://127.0.0.1:{rpcdl.serve_metrics()}/metrics")
    documented = METRICS_DOC.read_text()
    for state in WorkerState:
        assert f'rpcdl_workers{{state="{state.value}"}}' in text, state
        assert f"``{state.value}``" in documented, state
