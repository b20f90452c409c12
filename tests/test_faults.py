"""Faults during an epoch: a worker process SIGKILLed or SIGSTOPped, a connection reset mid-transfer.

Whatever fails, every index of the epoch is yielded exactly once; a worker that
comes back with a dataset of another length is kept out with an error naming it.
The workers that fail are processes; those that only stand by run in this process.
"""

from __future__ import annotations

import logging
import selectors
import signal
import socket
import struct
import threading
import time
from pathlib import Path

import helpers
import pytest
import torch
from torch.utils.data import Dataset

import rpcdl

# ---------------------------------------------------------------------------- datasets (imported by the workers)


class FileLengthDataset(Dataset):
    """Sample ``i`` is ``tensor(i)``; the length is read from a file when the dataset is built."""

    def __init__(self, path: str, delay: float = 0.0):
        self.n = int(Path(path).read_text())
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.tensor(index)


class WideDataset(Dataset):
    """Sample ``i`` is ``width`` copies of ``i``: batches large enough to be cut mid-transfer."""

    def __init__(self, n: int, width: int):
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((self.width,), index, dtype=torch.int32)


# ---------------------------------------------------------------------------- a proxy that can cut the network


class TcpProxy:
    """Forwards loopback TCP connections to ``upstream``; can reset them mid-stream.

    One thread multiplexes every connection. ``cut_after`` bytes into the
    worker-to-client stream (all connections together), it forwards the bytes
    up to that point and resets both sides of every connection (RST, as a
    network failure does). Connections made afterwards are forwarded again.

    Args:
        upstream: ``"host:port"`` of the worker.
        cut_after: bytes of worker-to-client traffic after which to cut, or ``None``.
        record: keep a copy of all the bytes forwarded (both directions).
    """

    def __init__(self, upstream: str, cut_after: int | None = None, record: bool = False):
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._cut_after = cut_after
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._stop = threading.Event()
        self.downstream_bytes = 0
        self.connections = 0
        self.cuts = 0
        self.recorded = bytearray() if record else None
        self._thread = threading.Thread(target=self._loop, name="test-proxy", daemon=True)

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for pair in list(self._pairs):
            self._close(pair, reset=False)
        self._selector.close()
        self._listener.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.05):
                if key.fileobj is self._listener:
                    self._accept()
                    continue
                source, target, pair, downstream = key.data
                try:
                    data = source.recv(1 << 16)
                except OSError:
                    data = b""
                if not data:
                    self._close(pair, reset=False)
                    continue
                if downstream and self._cut_after is not None and self.downstream_bytes + len(data) >= self._cut_after:
                    keep = self._cut_after - self.downstream_bytes
                    self._forward(target, data[:keep], downstream, pair)
                    self._cut_after = None
                    self.cuts += 1
                    for each in list(self._pairs):
                        self._close(each, reset=True)
                    continue
                self._forward(target, data, downstream, pair)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        worker = socket.create_connection(self._upstream, timeout=10)
        client.settimeout(10)
        pair = (client, worker)
        self._pairs.append(pair)
        self.connections += 1
        self._selector.register(client, selectors.EVENT_READ, (client, worker, pair, False))
        self._selector.register(worker, selectors.EVENT_READ, (worker, client, pair, True))

    def _forward(self, target: socket.socket, data: bytes, downstream: bool, pair) -> None:
        if downstream:
            self.downstream_bytes += len(data)
        if self.recorded is not None:
            self.recorded += data
        try:
            target.sendall(data)
        except OSError:
            self._close(pair, reset=True)

    def _close(self, pair: tuple[socket.socket, socket.socket], reset: bool) -> None:
        if pair not in self._pairs:
            return
        self._pairs.remove(pair)
        for sock in pair:
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            if reset:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()


# ---------------------------------------------------------------------------- helpers


def _indices(batch: torch.Tensor) -> list[int]:
    return batch.reshape(len(batch), -1)[:, 0].tolist()


def _epoch(loader: rpcdl.RPCDataloader) -> list[int]:
    return [index for batch in loader for index in _indices(batch)]


def _epochs_until(loader: rpcdl.RPCDataloader, n: int, condition, deadline_s: float = 30.0) -> int:
    """Run epochs (each checked exactly-once) until ``condition()``; return how many ran."""
    deadline = time.monotonic() + deadline_s
    epochs = 0
    while not condition():
        assert time.monotonic() < deadline, f"condition not met; worker states: {loader.worker_states()}"
        assert sorted(_epoch(loader)) == list(range(n))
        epochs += 1
    return epochs


# ---------------------------------------------------------------------------- tests


def test_a_worker_down_when_the_dataset_is_built_is_built_there_once_it_is_back(spawn_workers):
    """Its first rebuilds fail (refused at once: it served this process before, so it is not awaited; a
    transient failure): it stays down, probed again, and serves once restarted. (torch's ``future.then()``
    turned such a failure into a RuntimeError, which kept it out for good.)"""
    workers = spawn_workers(2)
    workers.kill(1)
    dataset = rpcdl.RPCDataset(list(workers), helpers.RangeDataset, 64, 0.002)
    assert dataset.rref(workers[1]) is None
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, timeout=5)
    until = time.monotonic() + 1.5  # long enough for its first probes to fail
    _epochs_until(loader, 64, lambda: time.monotonic() > until)
    assert loader.worker_states()[workers[1]] in ("down", "probing")  # not excluded: its failures are transient
    workers.restart(1)
    _epochs_until(loader, 64, lambda: loader.batches_served[workers[1]] > 0)
    assert loader.worker_states()[workers[1]] == "active" and dataset.rref(workers[1]) is not None


@pytest.mark.timeout(90)
def test_a_worker_killed_between_epochs_costs_the_next_epoch_no_wait(spawn_workers, monkeypatch, caplog):
    """Killed while it had no call in flight, a worker is found gone by the next epoch's first call to it:
    refused, and not awaited as a worker not started yet, since it served before. (It was awaited for the
    connect grace, and every batch it was given waited that long.)

    The first epoch after the kill need not call it: a worker measured much slower than the best is passed
    over until it idled one of its service times, and an epoch of this size may end sooner. So epochs run
    until one called it; none may wait."""
    caplog.set_level(logging.WARNING, logger="rpcdl")
    monkeypatch.setenv("RPCDL_CONNECT_GRACE", "100")  # an epoch that waited for it would hit the test's timeout
    workers = spawn_workers(3)
    dataset = rpcdl.RPCDataset(list(workers), helpers.RangeDataset, 400)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, timeout=100)
    assert sorted(_epoch(loader)) == list(range(400))
    assert loader.worker_windows()[workers[1]]["in_flight"] == 0  # an ended pass lets its calls go
    workers.kill(1)
    started = time.monotonic()
    _epochs_until(loader, 400, lambda: loader.worker_states()[workers[1]] != "active", deadline_s=50)
    assert time.monotonic() - started < 50, "an epoch waited for the connect grace"
    assert loader.worker_states()[workers[1]] in ("down", "probing")
    down = [r.getMessage() for r in caplog.records if " is down: " in r.getMessage()]
    assert any(workers[1] in m and "served this process before" in m for m in down), down


def test_sigkill_mid_epoch_then_restarts_with_same_and_other_length(spawn_workers, embedded_worker, tmp_path, caplog):
    """A worker killed in the middle of an epoch restarts with the same dataset
    and rejoins, though the epoch in which it died is over. Killed again, it
    restarts with a dataset of another length and is kept out, named in the
    error. Every epoch yields each index once.

    On one core, the victim may have answered all its calls of the epoch
    before the kill: then the next epoch finds it gone, at once (it served
    before, so it is not awaited as a worker not started yet)."""
    caplog.set_level(logging.WARNING, logger="rpcdl")
    length_file = tmp_path / "length"
    length_file.write_text("96")
    survivor = embedded_worker()
    victims = spawn_workers(1)
    victim = victims[0]
    dataset = rpcdl.RPCDataset([survivor.address, victim], FileLengthDataset, str(length_file), 0.005)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, timeout=2)

    def epoch_killing_the_victim(at: int) -> list[int]:
        seen = []
        for i, batch in enumerate(loader):
            seen.extend(batch.tolist())
            if i == at:  # batches of the victim are in flight
                victims.kill(0, signal.SIGKILL)
        return sorted(seen)

    assert epoch_killing_the_victim(at=3) == list(range(96))
    if loader.worker_states()[victim] == "active":
        assert sorted(_epoch(loader)) == list(range(96))
    assert loader.worker_states()[victim] != "active"

    served = loader.batches_served[victim]
    victims.restart(0)
    _epochs_until(loader, 96, lambda: loader.batches_served[victim] > served)
    assert loader.worker_states()[victim] == "active"

    assert epoch_killing_the_victim(at=3) == list(range(96))
    length_file.write_text("80")
    victims.restart(0)
    _epochs_until(loader, 96, lambda: loader.worker_states()[victim] == "excluded")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(victim in m and "length 80" in m and "96" in m for m in errors), errors
    served = loader.batches_served[victim]
    assert sorted(_epoch(loader)) == list(range(96))
    assert loader.batches_served[victim] == served

    # When the other one is gone too, the final error names it and why it was kept out.
    survivor.stop(grace=0)
    with pytest.raises(rpcdl.NoWorkersLeft) as info:
        _epoch(loader)
    message = str(info.value)
    assert f"{victim} (excluded: " in message and "length 80" in message


def test_hung_worker_sigstop_is_caught_by_timeout(spawn_workers, embedded_worker, caplog):
    """A worker stopped with SIGSTOP holds batches forever: after ``timeout`` they go elsewhere."""
    caplog.set_level(logging.WARNING, logger="rpcdl")
    hung = spawn_workers(1)
    other = embedded_worker()
    n = 160  # 1.6 s of work for one worker: longer than the timeout
    dataset = rpcdl.RPCDataset([hung[0], other.address], helpers.RangeDataset, n, 0.01)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, timeout=1.0, prefetch_factor=3)
    seen = []
    try:
        for i, batch in enumerate(loader):
            seen.extend(batch.tolist())
            if i == 5:
                hung.kill(0, signal.SIGSTOP)
        assert sorted(seen) == list(range(n))
        assert loader.worker_states()[hung[0]] in ("down", "probing")
        down = [r.getMessage() for r in caplog.records if " is down: " in r.getMessage()]
        assert any(hung[0] in m and "did not answer" in m for m in down), down
    finally:
        hung.processes[0].send_signal(signal.SIGCONT)
    # Resumed, it answers probes again and rejoins.
    served = loader.batches_served[hung[0]]
    _epochs_until(loader, n, lambda: loader.batches_served[hung[0]] > served)
    assert loader.worker_states()[hung[0]] == "active"


def test_connection_reset_mid_transfer(embedded_worker, caplog):
    """The network between trainer and worker resets in the middle of a batch:
    no torn batch is yielded, the lost batches are loaded again, the worker rejoins."""
    caplog.set_level(logging.WARNING, logger="rpcdl")
    workers = [embedded_worker(shared_memory=0).address for _ in range(2)]  # the batches cross the proxy
    n, width, batch_size = 192, 16384, 8  # 512 KiB batches
    with TcpProxy(workers[0], cut_after=(1 << 18) + 12345) as proxy:  # in its first batch, which it always gets
        dataset = rpcdl.RPCDataset([proxy.address, workers[1]], WideDataset, n, width)
        loader = rpcdl.RPCDataloader(dataset, batch_size=batch_size, timeout=10)
        seen = []
        for batch in loader:
            assert batch.shape == (batch_size, width)
            assert torch.equal(batch, batch[:, :1].expand_as(batch)), "a torn batch was yielded"
            seen.extend(_indices(batch))
        assert sorted(seen) == list(range(n))
        assert proxy.cuts == 1
        down = [r.getMessage() for r in caplog.records if " is down: " in r.getMessage()]
        assert any(proxy.address in m for m in down), down
        # Through a new connection, the worker (its dataset rebuilt: the old one
        # went with the connection that held it) serves batches again.
        served = loader.batches_served[proxy.address]
        _epochs_until(loader, n, lambda: loader.batches_served[proxy.address] > served)
        assert proxy.connections >= 2
