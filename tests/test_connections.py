"""Connections: remote stages composed in any depth, workers that refuse, peers that are not rpcdl workers.

Everything is real: worker processes and embedded workers on loopback, an HTTP
server, an rpcdataloader 0.2.1 worker process, sockets that refuse or stay silent.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import helpers
import pytest
import torch
from torch.utils.data.datapipes.iter import IterableWrapper as IterableWrapperPipe
from torchdata.nodes import BaseNode, IterableWrapper, Loader

import rpcdl
import rpcdl.rpc.dial
from rpcdl.errors import ProtocolError, WorkerUnavailable
from rpcdl.integrations.torchdata import RPCMapper
from rpcdl.transport.security import client_tls_context, server_tls_context


def affine(x: int) -> int:
    return 3 * x + 1


def double(x: int) -> int:
    return 2 * x


def negate(x: int) -> int:
    return -x


def add_half(x: float) -> float:
    return x + 0.5


# ---------------------------------------------------------------------------- stages over stages


@pytest.mark.timeout(60)
def test_two_nested_rpc_mappers_flow_in_order(two_workers):
    node = RPCMapper(RPCMapper(IterableWrapper(range(40)), two_workers, affine), two_workers, double)
    assert list(Loader(node)) == [2 * (3 * x + 1) for x in range(40)]


@pytest.mark.timeout(60)
def test_three_nested_rpc_mappers_flow_in_order_for_two_epochs(two_workers):
    inner = RPCMapper(IterableWrapper(range(30)), two_workers, affine, prefetch_factor=3)
    node = RPCMapper(RPCMapper(inner, two_workers[:1], double), two_workers[::-1], negate, prefetch_factor=1)
    loader = Loader(node)
    expected = [-2 * (3 * x + 1) for x in range(30)]
    assert list(loader) == expected
    assert list(loader) == expected


@pytest.mark.timeout(60)
def test_rpc_map_over_rpc_map_flows_in_order(two_workers):
    pipe = IterableWrapperPipe(range(25)).rpc_map(two_workers, affine).rpc_map(two_workers, add_half)
    assert list(pipe) == [3 * x + 1.5 for x in range(25)]


@pytest.mark.timeout(60)
def test_rpc_mapper_over_an_rpc_dataloader_flows_in_order(two_workers):
    loader = rpcdl.RPCDataloader(rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 24), batch_size=4)
    node = RPCMapper(IterableWrapper(loader), two_workers, torch.sum)
    assert [int(total) for total in Loader(node)] == [sum(range(k, k + 4)) for k in range(0, 24, 4)]


class _WaitsForItsOwnCalls(BaseNode):
    """A source that makes a call per item and waits for it with torch's own ``wait_all``, not rpcdl's."""

    def __init__(self, worker: str, count: int):
        super().__init__()
        self.worker, self.count, self.position = worker, count, 0

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self.position = 0

    def next(self):
        if self.position >= self.count:
            raise StopIteration
        self.position += 1
        (future,) = torch.futures.wait_all([rpcdl.rpc_async(self.worker, negate, (self.position,))])
        return future

    def get_state(self):
        return {"position": self.position}


@pytest.mark.timeout(60)
def test_a_source_that_waits_for_its_own_calls_by_any_means_flows(two_workers):
    node = RPCMapper(_WaitsForItsOwnCalls(two_workers[0], 12), two_workers, double)
    assert list(Loader(node)) == [-2 * k for k in range(1, 13)]


# ---------------------------------------------------------------------------- refused connections


@contextlib.contextmanager
def refused_address():
    """An address whose port is bound but not listening: connecting is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.timeout(30)
def test_rpc_sync_to_a_refused_port_warns_then_fails_within_the_grace(monkeypatch, caplog):
    monkeypatch.setenv("RPCDL_CONNECT_GRACE", "2")
    monkeypatch.setattr(rpcdl.rpc.dial, "WARN_AFTER", 0.5)
    caplog.set_level(logging.WARNING, logger="rpcdl.client")
    with refused_address() as address:
        started = time.monotonic()
        with pytest.raises(WorkerUnavailable) as raised:
            rpcdl.rpc_sync(address, abs, (-1,), timeout=120)
        elapsed = time.monotonic() - started
    assert 1.5 < elapsed < 10
    message = str(raised.value)
    assert address in message and "connection refused" in message
    assert "2s" in message and "RPCDL_CONNECT_GRACE" in message and "last error" in message
    warnings = [r.getMessage() for r in caplog.records if r.name == "rpcdl.client" and r.levelno == logging.WARNING]
    assert any(address in text and "connection refused" in text for text in warnings), warnings


@pytest.mark.timeout(30)
def test_rpc_dataset_over_a_refused_worker_fails_after_the_start_timeout(monkeypatch):
    """A dataset waits for its fleet up to RPCDL_START_TIMEOUT, trying again when a connection's grace ends: the
    one deadline its message names."""
    monkeypatch.setenv("RPCDL_CONNECT_GRACE", "1")
    monkeypatch.setenv("RPCDL_START_TIMEOUT", "2")
    with refused_address() as address:
        started = time.monotonic()
        with pytest.raises(WorkerUnavailable, match="RPCDL_START_TIMEOUT") as info:
            rpcdl.RPCDataset([address], helpers.RangeDataset, 4)
    assert "RPCDL_CONNECT_GRACE" not in str(info.value) and f"{address} (connection refused)" in str(info.value)
    assert time.monotonic() - started < 20


@pytest.mark.timeout(60)
def test_a_refused_worker_is_named_on_stderr_without_any_logging_setup():
    with refused_address() as address:
        code = f"import rpcdl; rpcdl.rpc_sync({address!r}, abs, (-1,))"
        environment = {**os.environ, "RPCDL_CONNECT_GRACE": "4"}
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=environment
        )
    assert result.returncode == 1
    assert f"waiting for rpcdl worker {address}: connection refused" in result.stderr
    assert "WorkerUnavailable" in result.stderr and "RPCDL_CONNECT_GRACE" in result.stderr


@pytest.mark.timeout(60)
def test_a_worker_that_served_and_died_is_not_awaited(spawn_workers, monkeypatch):
    """The connect grace is for workers not started yet: one that served this process and now refuses
    has stopped or died, and a call to it fails at once, saying so."""
    monkeypatch.setenv("RPCDL_CONNECT_GRACE", "100")
    workers = spawn_workers(1)
    assert rpcdl.rpc_sync(workers[0], abs, (-1,)) == 1
    workers.kill(0)
    started = time.monotonic()
    with pytest.raises(WorkerUnavailable, match="served this process before") as raised:
        rpcdl.rpc_sync(workers[0], abs, (-1,), timeout=120)
    assert time.monotonic() - started < 10
    assert workers[0] in str(raised.value) and "connection refused" in str(raised.value)
    workers.restart(0)  # a worker serving there again is reached as before
    assert rpcdl.rpc_sync(workers[0], abs, (-2,)) == 2


def test_a_bad_connect_grace_is_refused_with_what_it_should_be(monkeypatch):
    monkeypatch.setenv("RPCDL_CONNECT_GRACE", "soon")
    with refused_address() as address, pytest.raises(ValueError, match=r"RPCDL_CONNECT_GRACE must be .*'soon'"):
        rpcdl.rpc_sync(address, abs, (-1,), timeout=5)


@pytest.mark.timeout(60)
def test_a_worker_started_within_the_grace_after_the_first_call_still_gets_it(monkeypatch):
    monkeypatch.setenv("RPCDL_CONNECT_GRACE", "5")
    port = helpers.port_for_a_late_worker()  # free now (it could be taken meanwhile: a small race)
    started: list[rpcdl.Worker] = []
    timer = threading.Timer(1.0, lambda: started.append(rpcdl.Worker(port=port, timeout=10).start()))
    timer.start()
    try:
        assert rpcdl.rpc_sync(f"127.0.0.1:{port}", abs, (-3,), timeout=30) == 3
    finally:
        timer.join()
        rpcdl.shutdown()
        for worker in started:
            worker.stop(grace=1)


# ---------------------------------------------------------------------------- peers that are not rpcdl workers


@contextlib.contextmanager
def serving_thread(server):
    thread = threading.Thread(target=server.serve_forever, name="test-http-server", daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.timeout(30)
def test_an_http_server_is_named_within_seconds():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    server.timeout = 20
    with serving_thread(server) as address:
        started = time.monotonic()
        with pytest.raises(ProtocolError, match=f"{address} is not an rpcdl worker"):
            rpcdl.rpc_sync(address, abs, (-1,), timeout=120)
        assert time.monotonic() - started < rpcdl.rpc.dial.HELLO_ANSWER_TIMEOUT + 5


class _AnswersLikeHTTP(http.server.BaseHTTPRequestHandler):
    """Answers whatever it is sent with an HTTP error at once, as an HTTP server does to a bad request line."""

    def handle(self):
        self.request.recv(1024)
        self.request.sendall(b"HTTP/1.0 400 Bad request\r\nContent-Length: 0\r\n\r\n")


@pytest.mark.timeout(30)
def test_a_peer_that_answers_http_is_named_as_an_http_server_at_once():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AnswersLikeHTTP)
    with serving_thread(server) as address:
        started = time.monotonic()
        with pytest.raises(ProtocolError, match=r"is not an rpcdl worker \(it answered 'HTTP/1.0 400 Bad request'"):
            rpcdl.rpc_sync(address, abs, (-1,), timeout=120)
        assert time.monotonic() - started < 3


@pytest.mark.timeout(30)
def test_a_peer_that_accepts_and_never_speaks_is_named_within_seconds():
    with socket.socket() as listener:  # the kernel accepts into the backlog; nobody ever answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(ProtocolError, match="did not answer rpcdl's hello within 5s"):
            rpcdl.rpc_sync(address, abs, (-1,), timeout=120)
        assert time.monotonic() - started < rpcdl.rpc.dial.HELLO_ANSWER_TIMEOUT + 5


@pytest.mark.timeout(90)
def test_an_rpcdataloader_worker_is_named_within_seconds():
    pytest.importorskip("rpcdataloader")
    port = helpers.free_port()  # rpcdataloader.launch cannot pick a port itself: a small race
    process = subprocess.Popen(
        [sys.executable, "-m", "rpcdataloader.launch", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            with socket.socket() as client:
                if client.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        assert process.poll() is None, "the rpcdataloader worker did not start"
        started = time.monotonic()
        with pytest.raises(ProtocolError, match=f"127.0.0.1:{port} is not an rpcdl worker"):
            rpcdl.rpc_sync(f"127.0.0.1:{port}", abs, (-1,), timeout=120)
        assert time.monotonic() - started < rpcdl.rpc.dial.HELLO_ANSWER_TIMEOUT + 5  # it reads on, waiting for more
    finally:
        process.kill()
        process.wait()


# ---------------------------------------------------------------------------- slow workers


@pytest.mark.timeout(60)
def test_a_worker_slower_than_the_hello_limit_keeps_the_calls_full_timeout(embedded_worker, monkeypatch):
    monkeypatch.setattr(rpcdl.rpc.dial, "HELLO_ANSWER_TIMEOUT", 0.5)
    worker = embedded_worker()  # a fresh connection, opened under the short hello limit
    assert rpcdl.rpc_sync(worker.address, helpers.sleep_and_return, (1.5, "late"), timeout=30) == "late"


@pytest.mark.timeout(60)
def test_tls_on_one_side_only_is_named_at_once(embedded_worker, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "w.key",
            "-out",
            "w.pem",
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=50,
    )
    tls_worker = embedded_worker(ssl_context=server_tls_context(tmp_path / "w.pem", tmp_path / "w.key"))
    plain_worker = embedded_worker()
    trusted = client_tls_context(tmp_path / "w.pem")
    assert rpcdl.rpc_sync(tls_worker.address, abs, (-2,), ssl_context=trusted) == 2
    started = time.monotonic()
    with pytest.raises(ProtocolError, match=f"{tls_worker.address} is not an rpcdl worker.*RPCDL_TLS_CA"):
        rpcdl.rpc_sync(tls_worker.address, abs, (-1,), timeout=120)
    with pytest.raises(ProtocolError, match=f"{plain_worker.address} is not an rpcdl worker with TLS"):
        rpcdl.rpc_sync(plain_worker.address, abs, (-1,), timeout=120, ssl_context=trusted)
    assert time.monotonic() - started < 10
