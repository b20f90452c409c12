"""Fleets that change on the cluster in a box: workers on their own hosts (network namespaces), real addresses.

A DDP job whose rank loses all its own workers, a worker stopped with SIGSTOP
and left stopped, a worker found through DNS mid-epoch, a node back under a
new address; every epoch every sample exactly once. Skipped, with the reason,
where namespaces cannot be made.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import helpers
import pytest
from cluster_box import cluster_of_workers
from test_fleet import _run_epoch

import rpcdl
from rpcdl.data.sources import DnsSource, Fleet

TOKEN = "fleet-cluster-token"
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def with_token(monkeypatch):
    monkeypatch.setenv("RPCDL_TOKEN", TOKEN)
    yield
    rpcdl.shutdown()


def _process(box, index: int) -> subprocess.Popen:
    return box.hosts[index].processes[-1]


@pytest.mark.timeout(240)
def test_ddp_completes_when_all_of_one_ranks_workers_die_mid_epoch(tmp_path):
    with cluster_of_workers(tmp_path, TOKEN, [(), (), (), ()]) as box:
        env = dict(
            os.environ, RPCDL_WORKERS=",".join(box.workers), RPCDL_TOKEN=TOKEN, PYTHONPATH=os.pathsep.join(sys.path)
        )
        job = subprocess.Popen(
            [sys.executable, str(TESTS / "lightning_fleet_job.py"), str(tmp_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 150
            while not (tmp_path / "ready").exists():
                assert job.poll() is None, job.stdout.read()[-4000:]
                assert time.monotonic() < deadline, "the job did not reach its 4th batch"
                time.sleep(0.1)
            for index in (1, 3):  # rank 1's own workers
                _process(box, index).kill()
                _process(box, index).wait(30)
            (tmp_path / "killed").write_text("")
            output, _ = job.communicate(timeout=150)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
        assert job.returncode == 0, output[-4000:]
    ranks = [json.loads((tmp_path / "fit" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for epoch in (0, 1):
        shards = [[i for r in seen["records"] if r["epoch"] == epoch for i in r["indices"]] for seen in ranks]
        assert len(shards[0]) == len(shards[1]) == 64
        assert sorted(shards[0] + shards[1]) == list(range(128)), f"epoch {epoch}: not every sample exactly once"
    served = ranks[1]["batches_served"]
    assert sum(served.get(box.workers[i], 0) for i in (0, 2)) > 0, served  # rank 1 took rank 0's workers
    assert "routing around" in output or "none of this rank's own workers is left" in output, output[-4000:]


@pytest.mark.parametrize("in_order", [True, False])
def test_a_stopped_worker_on_its_host_never_holds_a_batch(tmp_path, with_token, caplog, in_order):
    caplog.set_level(logging.WARNING, logger="rpcdl")
    with cluster_of_workers(tmp_path, TOKEN, [(), ()]) as box:
        n = 240
        dataset = rpcdl.RPCDataset(box.workers, helpers.RangeDataset, n, 0.002)
        loader = rpcdl.RPCDataloader(dataset, batch_size=4, in_order=in_order, shuffle=True)
        stopped = _process(box, 0)
        try:
            seen, _ = _run_epoch(loader)
            waits = []
            for epoch in range(3):
                stop = (lambda i: stopped.send_signal(signal.SIGSTOP) if i == 3 else None) if epoch == 0 else None
                seen, longest = _run_epoch(loader, stop)
                assert sorted(seen) == list(range(n)), f"epoch {epoch}: not every sample exactly once"
                waits.append(longest)
            assert max(waits) < 30, f"a batch waited {max(waits):.1f}s (the timeout is 120 s)"
            routed = [r.getMessage() for r in caplog.records if "routing around" in r.getMessage()]
            assert len(routed) == 1 and box.workers[0] in routed[0], routed
        finally:
            stopped.send_signal(signal.SIGCONT)


def test_dns_joins_and_a_node_back_under_a_new_address(tmp_path, with_token):
    """``dns://workers.box:PORT`` resolved by a test resolver over the box's hosts (the name server of a
    headless Service): a host added mid-epoch serves; then a host replaced by another (a new address) and the
    epoch completes; every sample once."""
    with socket.socket() as probe:  # the port the Service's pods listen on (each host has its own ports)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with cluster_of_workers(tmp_path, TOKEN, [("--port", str(port))] * 3) as box:
        assert all(address.endswith(f":{port}") for address in box.workers)
        records = {"workers.box": [box.hosts[0].address]}

        def resolver(name: str, wanted_port: int) -> list[str]:
            return [f"{address}:{wanted_port}" for address in records[name]]

        fleet = Fleet(DnsSource("workers.box", port, resolver=resolver), interval=0.1)
        n = 400
        dataset = rpcdl.RPCDataset(fleet, helpers.RangeDataset, n, 0.005)
        loader = rpcdl.RPCDataloader(dataset, batch_size=4, max_batches_per_call=1)
        joining = box.workers[1]
        seen, _ = _run_epoch(loader, lambda i: records["workers.box"].append(box.hosts[1].address) if i == 2 else None)
        assert sorted(seen) == list(range(n))
        assert loader.batches_served.get(joining, 0) > 0, loader.batches_served

        def replace(i: int) -> None:  # the joined node dies; its replacement comes up under another address
            if i == 3:
                _process(box, 1).kill()
                records["workers.box"] = [box.hosts[0].address, box.hosts[2].address]

        seen, _ = _run_epoch(loader, replace)
        assert sorted(seen) == list(range(n))
        seen, _ = _run_epoch(loader)
        assert sorted(seen) == list(range(n))
        assert loader.batches_served.get(box.workers[2], 0) > 0, loader.batches_served
        assert loader.worker_states()[joining] == "left"
        fleet.close()
