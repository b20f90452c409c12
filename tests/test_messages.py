"""Messages users see: no torch internals, no false promise of a retry, the argument that does not pickle,
remote tracebacks without stray carets, and torch DataLoader options that describe what rpcdl does."""

from __future__ import annotations

import logging
import socket
import threading
import traceback

import pytest
from helpers import RangeDataset

import rpcdl

pytestmark = pytest.mark.timeout(60)


def _refused_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


@pytest.fixture
def http_server():
    """A server that answers everything with an HTTP error: not an rpcdl worker."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except OSError:
                return
            with connection:
                connection.recv(64)
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    thread = threading.Thread(target=answer, name="test-http-server", daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    server.shutdown(socket.SHUT_RDWR)  # wakes the accept (closing alone does not, on Linux)
    thread.join(10)
    server.close()
    assert not thread.is_alive()


def test_an_error_in_a_then_callback_is_raised_as_it_is(http_server):
    future = rpcdl.rpc_async(http_server, len, ([1],)).then(lambda done: done.value())
    with pytest.raises(rpcdl.ProtocolError) as raised:
        future.wait()
    assert "is not an rpcdl worker" in str(raised.value)
    assert "Got the following error when running the callback" not in str(raised.value)


def test_then_still_chains_results(embedded_worker):
    worker = embedded_worker()
    assert rpcdl.rpc_async(worker.address, len, ([1, 2],)).then(lambda done: done.value() * 10).wait() == 20


def test_no_retry_is_promised_when_no_worker_built_the_dataset(monkeypatch, caplog, embedded_worker):
    monkeypatch.setenv("RPCDL_CONNECT_GRACE", "0")
    dead = [_refused_address(), _refused_address()]
    with caplog.at_level(logging.WARNING, logger="rpcdl"), pytest.raises(rpcdl.WorkerUnavailable, match="waited"):
        rpcdl.RPCDataset(dead, RangeDataset, 4, rpcdl_start_timeout=1.5)  # a fleet not up: waited for, then not
    assert "retried" not in caplog.text
    caplog.clear()
    worker = embedded_worker()
    with caplog.at_level(logging.WARNING, logger="rpcdl"):
        dataset = rpcdl.RPCDataset([worker.address, dead[0]], RangeDataset, 4)
    assert len(dataset) == 4
    assert f"not yet on {dead[0]}" in caplog.text and "asks them again in the background" in caplog.text


def test_the_argument_that_does_not_pickle_is_named(embedded_worker):
    worker = embedded_worker()
    with pytest.raises(TypeError) as raised:
        rpcdl.RPCDataset([worker.address], RangeDataset, 4, delay=threading.Lock())
    message = str(raised.value)
    assert "RangeDataset" in message and "keyword argument 'delay' (a _thread.lock)" in message
    assert "_build" not in message
    with pytest.raises(TypeError, match=r"cannot send len\(\) .*argument 0 \(a _thread\.lock\)"):
        rpcdl.rpc_sync(worker.address, len, (threading.Lock(),))


def fails_remotely(mapping: dict) -> int:
    return mapping["missing"] + 1


def test_remote_frames_carry_no_stray_carets(embedded_worker):
    worker = embedded_worker()
    with pytest.raises(KeyError) as raised:
        rpcdl.rpc_sync(worker.address, fails_remotely, ({},))
    lines = "".join(traceback.format_exception(raised.value)).splitlines()
    at = next(i for i, line in enumerate(lines) if line.endswith("in fails_remotely"))
    assert lines[at + 1].strip() == 'return mapping["missing"] + 1'
    assert set(lines[at + 2].strip()) - {"^", "~"}, lines[at + 2]  # the next line is no caret line
    assert "^" in raised.value.remote_traceback  # the text formatted on the worker keeps its own (right) carets


def test_torch_options_that_describe_rpcdl_are_accepted(embedded_worker):
    worker = embedded_worker()
    dataset = rpcdl.RPCDataset([worker.address], RangeDataset, 8)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, num_workers=0, persistent_workers=False)
    assert [batch.tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(TypeError, match=r"num_workers=2 \(only num_workers=0 is accepted\)"):
        rpcdl.RPCDataloader(dataset, num_workers=2)
    with pytest.raises(TypeError, match=r"persistent_workers=True \(only persistent_workers=False is accepted\)"):
        rpcdl.RPCDataloader(dataset, persistent_workers=True)
