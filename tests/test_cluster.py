"""A cluster in a box: workers on their own "hosts" (network namespaces) behind real, shaped links.

The trainer (this process) reaches each worker at a non-loopback address over
a veth pair shaped by ``tbf``, with the token that such a bind demands. The
faults are real: a link taken down mid-epoch, a link throttled to a trickle.
Skipped, with the reason, where namespaces cannot be made (not root, no
iproute2).
"""

from __future__ import annotations

import subprocess

import helpers
import pytest
import torch
from cluster_box import cluster_of_workers, skip_without_namespaces
from netns_cluster import Cluster

import rpcdl

pytestmark = pytest.mark.timeout(120)

TOKEN = "cluster-in-a-box-token"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two worker hosts on 1 Gbit/s links, one plain worker on each."""
    with cluster_of_workers(tmp_path_factory.mktemp("cluster"), TOKEN, [(), ()]) as box:
        yield box


@pytest.fixture
def with_token(monkeypatch):
    monkeypatch.setenv("RPCDL_TOKEN", TOKEN)
    yield
    rpcdl.shutdown()


def batch_indices(batches) -> list[int]:
    return [int(i) for batch in batches for i in torch.as_tensor(batch).reshape(-1)]


def test_workers_listen_on_their_hosts_not_on_loopback(cluster, with_token):
    hosts = [address.rsplit(":", 1)[0] for address in cluster.workers]
    assert hosts == [host.address for host in cluster.hosts]
    assert all(not host.startswith("127.") for host in hosts)
    pids = {rpcdl.stats(address)["pid"] for address in cluster.workers}
    assert len(pids) == 2


def test_a_worker_refuses_a_trainer_without_the_token(cluster):
    with pytest.raises(rpcdl.AuthenticationError):
        rpcdl.rpc_sync(cluster.workers[0], len, ([1],), timeout=10)


def test_the_loader_across_the_cluster(cluster, with_token):
    dataset = rpcdl.RPCDataset(cluster.workers, helpers.RangeDataset, 300)
    loader = rpcdl.RPCDataloader(dataset, batch_size=8, shuffle=True)
    for _ in range(2):
        assert sorted(batch_indices(loader)) == list(range(300))
    assert all(served > 0 for served in loader.batches_served.values())


def test_the_mapper_across_the_cluster(cluster, with_token):
    from torchdata.nodes import SamplerWrapper

    from rpcdl.integrations.torchdata import RPCMapper

    node = RPCMapper(SamplerWrapper(range(200)), cluster.workers, helpers.worker_pid_and, prefetch_factor=4)
    results = list(node)
    assert [index for index, _ in results] == list(range(200))
    assert len({pid for _, pid in results}) == 2


def test_the_datamodule_across_the_cluster(cluster, with_token):
    pytest.importorskip("lightning")
    from helpers_lightning import RecordingModel, quiet_trainer
    from probe_dataset import probe_spec

    from rpcdl.integrations.lightning import RPCDataModule

    data = RPCDataModule(workers=cluster.workers, train_dataset=probe_spec(40), batch_size=4, shuffle=True, seed=1)
    model = RecordingModel()
    trainer = quiet_trainer(max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    for epoch in (0, 1):
        seen = [i for record in model.records if record["epoch"] == epoch for i in record["indices"]]
        assert sorted(seen) == list(range(40))
    assert len({pid for record in model.records for pid in record["pids"]}) == 2


def test_a_link_cut_mid_epoch_loses_and_repeats_nothing_and_the_worker_rejoins(cluster, with_token):
    dataset = rpcdl.RPCDataset(cluster.workers, helpers.RangeDataset, 120, 0.03)
    loader = rpcdl.RPCDataloader(dataset, batch_size=2, timeout=2.0)
    cut_host = cluster.hosts[0]
    seen = []
    try:
        for step, batch in enumerate(loader):
            seen.extend(batch.tolist())
            if step == 10:
                cut_host.cut()
        assert seen == list(range(120))  # in order, each once
        assert loader.worker_states()[cluster.workers[0]] != "active"  # the epoch outlasted its timeout
    finally:
        cut_host.restore()

    served_before = loader.batches_served[cluster.workers[0]]

    def rejoined() -> bool:
        assert batch_indices(loader) == list(range(120))
        return loader.batches_served[cluster.workers[0]] > served_before

    helpers.eventually(
        rejoined, f"worker {cluster.workers[0]} to serve batches again once its link is back", timeout=60
    )


def test_a_link_throttled_mid_epoch_is_treated_as_a_straggler(cluster, with_token):
    # 160 batches: calls carry up to 4 of these 64 KiB batches, and the ratio needs calls enough to show.
    dataset = rpcdl.RPCDataset(cluster.workers, helpers.ArrayDataset, 640, 16 * 1024)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, timeout=30.0)
    slow_host = cluster.hosts[0]
    seen = []
    try:
        for step, batch in enumerate(loader):
            seen.extend(int(i) for i in batch[:, 0])
            if step == 4:
                slow_host.shape("1mbit")  # a 64 KiB batch now takes half a second on that link
                throttled = dict(loader.batches_served)
        assert seen == list(range(640))
    finally:
        slow_host.shape("1gbit")
    served = {address: loader.batches_served[address] - throttled[address] for address in cluster.workers}
    assert served[cluster.workers[1]] > 3 * served[cluster.workers[0]], served  # since the throttle


def test_tls_across_the_cluster(cluster, with_token, tmp_path, monkeypatch):
    from pki import make_ca, make_certificate

    make_ca(tmp_path, "ca")
    host = cluster.hosts[1]
    make_certificate(tmp_path, "ca", "worker", f"IP:{host.address}")
    address = cluster.start_worker(
        1,
        "--token-file",
        str(_token_file(tmp_path)),
        "--tls-cert",
        str(tmp_path / "worker.pem"),
        "--tls-key",
        str(tmp_path / "worker.key"),
        "--log-level",
        "WARNING",
    )
    monkeypatch.setenv("RPCDL_TLS_CA", str(tmp_path / "ca.pem"))
    assert rpcdl.stats(address)["tls"] is True
    dataset = rpcdl.RPCDataset([address], helpers.RangeDataset, 50)
    assert batch_indices(rpcdl.RPCDataloader(dataset, batch_size=5)) == list(range(50))


def _token_file(directory):
    path = directory / "token"
    path.write_text(TOKEN)
    return path


def test_namespaces_are_gone_after_the_cluster_closes():
    skip_without_namespaces()
    with Cluster(1, rate=None) as box:
        namespace = box.hosts[0].namespace
        assert namespace in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert namespace not in listed
    assert not any(name.startswith(f"rd{box.tag}") for name in _links())


def test_two_clusters_alive_at_once_take_different_subnets():
    skip_without_namespaces()
    first, second = Cluster(1, rate=None), Cluster(1, rate=None)
    second._first_subnet = first._first_subnet  # as two test processes whose ids point to the same subnet
    with first, second:
        assert first.subnet != second.subnet
        assert first.hosts[0].gateway.startswith(f"{first.subnet}.")
        assert second.hosts[0].gateway.startswith(f"{second.subnet}.")


def _links() -> list[str]:
    out = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    return [line.split()[0].split("@")[0] for line in out.splitlines() if line.strip()]
