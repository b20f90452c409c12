"""The RPC core on real worker processes and sockets: calls, RRefs, errors, auth, robustness."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import helpers
import pytest
import torch
from blocking_wire import client_negotiate, send_frame

import rpcdl
import rpcdl.rpc.client
from rpcdl.errors import RemoteError
from rpcdl.processes import stop_process
from rpcdl.rpc.calls import Call
from rpcdl.rpc.dial import refusing
from rpcdl.rpc.pool import connection_to
from rpcdl.transport.handshake import MAGIC, VERSION
from rpcdl.transport.wire import Frame, Kind

TESTS = Path(__file__).resolve().parent


def start_worker_process(*args: str, env: dict | None = None, code: str | None = None) -> tuple[subprocess.Popen, str]:
    """A worker in its own process (the CLI, or ``code``); returns it and its address."""
    environment = dict(os.environ if env is None else env)
    environment["PYTHONPATH"] = os.pathsep.join(sys.path)
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "rpcdl", "worker", "--port", "0", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment, text=True)
    address = process.stdout.readline().strip()
    if not address:
        process.kill()
        raise RuntimeError(f"worker did not start: {process.stderr.read()}")
    return process, address


def do(a):
    return a, torch.rand(1024)


# ---------------------------------------------------------------------------- rpcdataloader's own examples


@pytest.fixture
def seed_style_worker():
    process, address = start_worker_process(code="import rpcdl; rpcdl.run_worker('127.0.0.1', 0, 10)")
    yield address
    assert stop_process(process, grace=30) == 0


def test_seed_example_rpc_async_returns_arguments_and_tensor(seed_style_worker):
    a = os.urandom(1000)
    b, c = rpcdl.rpc_async(seed_style_worker, do, (a,)).wait()
    assert a == b
    assert isinstance(c, torch.Tensor) and len(c) == 1024


def test_seed_example_pin_memory_is_accepted_without_cuda(seed_style_worker):
    _, c = rpcdl.rpc_async(seed_style_worker, do, (b"x",), pin_memory=True).wait()
    assert c.shape == (1024,)
    assert c.is_pinned() == torch.cuda.is_available()


def test_seed_example_rref_used_on_its_owner(seed_style_worker):
    a, b = torch.randn(10), torch.randn(10)
    rref = rpcdl.rpc_async(seed_style_worker, torch.add, (a, b), rref=True).wait()
    assert isinstance(rref, rpcdl.RRef)
    total = rpcdl.rpc_async(seed_style_worker, torch.sum, (rref,)).wait()
    assert torch.allclose(total, (a + b).sum())


# ---------------------------------------------------------------------------- calls and RRefs


def test_lambdas_and_closures_run_remotely(two_workers):
    offset = torch.arange(4)

    def shifted(x):
        return x + offset

    assert rpcdl.rpc_sync(two_workers[0], lambda x: x * 3, (7,)) == 21
    assert torch.equal(rpcdl.rpc_sync(two_workers[0], shifted, (torch.ones(4, dtype=torch.long),)), offset + 1)


def test_a_call_future_behaves_as_torchs_through_every_way_of_waiting(two_workers):
    tensor = torch.arange(4)
    future = rpcdl.rpc_async(two_workers[0], torch.neg, (tensor,))
    value = future.wait()
    assert torch.equal(value, -tensor) and future.done()
    assert future.value() is value and future.wait() is value  # kept in Python, the same object as torch's
    assert torch.futures.Future.wait(future) is value and torch.futures.Future.value(future) is value
    assert torch.futures.wait_all([future])[0] is value
    assert future.then(lambda done: done.wait() + 1).wait().tolist() == [1, 0, -1, -2]
    failing = rpcdl.rpc_async(two_workers[0], int, ("not a number",))
    for wait in (failing.wait, failing.value, failing.wait):  # an error raises each time, as with torch
        with pytest.raises(ValueError, match="not a number"):
            wait()


def test_kwargs_lists_and_rpc_sync(two_workers):
    assert rpcdl.rpc_sync(two_workers[1], sorted, [[3, 1, 2]], {"reverse": True}) == [3, 2, 1]


def test_tensor_dtypes_and_views_roundtrip(two_workers):
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    values = [
        base[:, 1:4],  # non-contiguous view
        base[2],  # view into a larger storage
        torch.tensor(3.5),  # zero-dimensional
        torch.empty(0, 5),
        torch.randn(3, 3).to(torch.bfloat16),
        torch.tensor([True, False]),
        torch.randn(2, 2, dtype=torch.complex64),
        torch.randn(3, requires_grad=True),
    ]
    back = rpcdl.rpc_sync(two_workers[0], lambda xs: xs, (values,))
    for original, received in zip(values, back, strict=True):
        assert received.dtype == original.dtype and received.shape == original.shape
        assert torch.equal(received.detach(), original.detach())
        assert received.requires_grad == original.requires_grad


def test_remote_returns_rref_at_once(two_workers):
    address = two_workers[0]
    rref = rpcdl.remote(address, helpers.sleep_and_return, (0.2, torch.ones(3)))
    assert rref.owner() == address and not rref.is_owner()
    with pytest.raises(RuntimeError, match="to_here"):
        rref.local_value()
    assert rpcdl.rpc_sync(address, torch.sum, (rref,)) == 3  # waits for the creating call
    assert torch.equal(rref.to_here(), torch.ones(3))


def test_local_rref():
    rref = rpcdl.RRef([1, 2])
    assert rref.is_owner() and rref.local_value() == [1, 2] and rref.to_here() == [1, 2]


def test_rref_returned_by_a_worker_stays_there(two_workers):
    rref = rpcdl.rpc_sync(two_workers[0], lambda: rpcdl.RRef(torch.zeros(5)))
    assert isinstance(rref, rpcdl.RRef) and rref.owner() == two_workers[0]
    assert rpcdl.rpc_sync(two_workers[0], len, (rref,)) == 5


def test_an_rref_sent_to_another_worker_is_fetched_there_from_its_owner(two_workers):
    rref = rpcdl.remote(two_workers[0], torch.arange, (4,))
    fetched = rpcdl.rpc_sync(two_workers[1], lambda r: (r.owner(), r.to_here()), (rref,))
    assert fetched[0] == two_workers[0]
    assert torch.equal(fetched[1], torch.arange(4))


def test_remote_error_is_raised_by_to_here(two_workers):
    rref = rpcdl.remote(two_workers[0], int, ("not a number",))
    with pytest.raises(ValueError, match="invalid literal"):
        rref.to_here()


def _rrefs_held(address: str) -> int:
    return rpcdl.stats(address)["rrefs"]


def test_dropped_rref_is_freed_on_its_owner(spawn_workers):
    (address,) = spawn_workers(1)
    rrefs = [rpcdl.remote(address, torch.zeros, (1000,)) for _ in range(5)]
    rpcdl.rpc_sync(address, len, (rrefs[-1],))
    assert _rrefs_held(address) == 5
    del rrefs
    gc.collect()
    deadline = time.monotonic() + 10
    while _rrefs_held(address) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _rrefs_held(address) == 0


def test_rref_freed_when_its_client_disconnects(spawn_workers):
    (address,) = spawn_workers(1)
    code = (
        f"import rpcdl, torch; r = rpcdl.remote('{address}', torch.zeros, (10,)); r.to_here(); import os; os._exit(0)"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    )
    deadline = time.monotonic() + 10
    while _rrefs_held(address) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _rrefs_held(address) == 0


# ---------------------------------------------------------------------------- errors


def raise_value_error():
    raise ValueError("bad value from the worker")


def test_remote_exception_keeps_type_traceback_and_worker(two_workers):
    address = two_workers[0]
    with pytest.raises(ValueError, match="bad value from the worker") as info:
        rpcdl.rpc_sync(address, raise_value_error)
    error = info.value
    assert error.rpcdl_worker == address
    assert any(address in note for note in error.__notes__)
    assert "raise_value_error" in error.remote_traceback
    frames = [frame.name for frame in __import__("traceback").extract_tb(error.__traceback__)]
    assert "raise_value_error" in frames  # the remote frames are part of the traceback


class _Marker:
    pass


def _wait_for_a_failed_call(address: str) -> tuple[weakref.ref, torch.futures.Future]:
    """Wait, in a frame of its own holding a marker, for a call that fails (it outlives its timeout); return the
    marker weakly, and the future."""
    marker = _Marker()
    future = rpcdl.rpc_async(address, time.sleep, (0.5,), timeout=0.05)
    try:
        future.wait()
    except rpcdl.WorkerTimeout:
        pass
    return weakref.ref(marker), future


def test_a_frame_that_waited_for_a_failed_call_is_freed_when_it_returns(two_workers):
    """The future keeps its error where the cyclic collector cannot see it: raised itself, that error would
    hold (through its traceback) every frame that waited for it, and all they hold, for ever."""
    gc.disable()  # freed by reference counting alone: no reference cycle either
    try:
        marker, future = _wait_for_a_failed_call(two_workers[0])
        assert marker() is None
    finally:
        gc.enable()
    for _ in range(2):  # the error is raised again, whole, as often as asked
        with pytest.raises(rpcdl.WorkerTimeout, match=r"did not answer sleep\(\) within 0.05s"):
            future.wait()


def _read_a_remote_error_here(address: str) -> tuple[weakref.ref, torch.futures.Future]:
    """Unpickle, in a frame of its own holding a marker, the answer of a call that raises on the worker."""
    marker = _Marker()
    future = rpcdl.rpc_async(address, raise_value_error)
    with pytest.raises(ValueError):
        future.wait()  # this thread unpickles the answer
    return weakref.ref(marker), future


def test_the_frames_that_read_a_remote_error_are_freed_with_its_future(two_workers):
    """A remote error's traceback (rebuilt by tblib) holds the frames of the thread that read it, which hold
    the future: the future's error must not hold them where the collector cannot see."""
    marker, future = _read_a_remote_error_here(two_workers[0])
    with pytest.raises(ValueError, match="bad value from the worker") as info:
        future.wait()
    frames = [frame.name for frame in __import__("traceback").extract_tb(info.value.__traceback__)]
    assert "raise_value_error" in frames  # the remote frames are still there
    del future, info
    gc.collect()
    assert marker() is None


def test_exception_of_a_type_the_client_lacks_becomes_remote_error(two_workers, tmp_path):
    def raise_private():
        import importlib
        import sys as worker_sys

        (tmp_path / "worker_only_module.py").write_text("class PrivateError(Exception):\n    pass\n")
        worker_sys.path.insert(0, str(tmp_path))
        module = importlib.import_module("worker_only_module")
        raise module.PrivateError("only the worker knows this type")

    (tmp_path / "unused").mkdir()
    with pytest.raises(RemoteError, match="PrivateError: only the worker knows this type") as info:
        rpcdl.rpc_sync(two_workers[1], raise_private)
    assert info.value.rpcdl_worker == two_workers[1]


def test_unpicklable_result_is_an_error_and_the_worker_goes_on(two_workers):
    with pytest.raises(TypeError, match="could not be pickled"):
        rpcdl.rpc_sync(two_workers[0], threading.Lock)
    assert rpcdl.rpc_sync(two_workers[0], min, (4, 2)) == 2


def test_bad_arguments_get_clear_errors(two_workers):
    with pytest.raises(ValueError, match="malformed worker address 'localhost'"):
        rpcdl.rpc_async("localhost", min, (1, 2))
    with pytest.raises(ValueError, match="HOST:PORT"):
        rpcdl.rpc_async("127.0.0.1:99999", min, (1, 2))
    with pytest.raises(TypeError, match="func must be callable"):
        rpcdl.rpc_async(two_workers[0], 42)
    with pytest.raises(TypeError, match="args must be a tuple or list"):
        rpcdl.rpc_async(two_workers[0], min, {"a": 1})
    with pytest.raises(ValueError, match="timeout must be a positive"):
        rpcdl.rpc_async(two_workers[0], min, (1, 2), timeout=-1)
    with pytest.raises(TypeError, match="cannot send"):
        rpcdl.rpc_async(two_workers[0], min, (threading.Lock(), 2))
    with pytest.raises(ValueError, match="parallel must be a positive integer"):
        rpcdl.Worker(parallel=-1)
    for sync_mistake, error, text in [  # rpc_sync checks its arguments on its own path too
        (lambda: rpcdl.rpc_sync("localhost", min, (1, 2)), ValueError, "malformed worker address"),
        (lambda: rpcdl.rpc_sync(two_workers[0], 42), TypeError, "func must be callable"),
        (lambda: rpcdl.rpc_sync(two_workers[0], min, (1, 2), timeout=0), ValueError, "timeout must be a positive"),
        (lambda: rpcdl.rpc_sync(two_workers[0], min, (1, 2), pin_memroy=True), TypeError, "'pin_memroy'; it takes"),
    ]:
        with pytest.raises(error, match=text):
            sync_mistake()


def test_unreachable_worker_fails_after_timeout_naming_it():
    address = f"127.0.0.1:{helpers.free_port()}"
    started = time.monotonic()
    with pytest.raises(rpcdl.WorkerUnavailable, match=address.replace(".", r"\.")):
        rpcdl.rpc_sync(address, min, (1, 2), timeout=1.0)
    assert time.monotonic() - started < 10


def test_client_retries_until_the_worker_listens():
    port = helpers.port_for_a_late_worker()
    address = f"127.0.0.1:{port}"
    future = rpcdl.rpc_async(address, min, (5, 3), timeout=30)
    deadline = time.monotonic() + 10
    while refusing(address) is None:  # refused once at least: from now on it retries
        assert time.monotonic() < deadline, "the call did not try to connect within 10 s"
        time.sleep(0.01)
    process, _ = start_worker_process(code=f"import rpcdl; rpcdl.run_worker('127.0.0.1', {port})")
    try:
        assert future.wait() == 3
    finally:
        assert stop_process(process, grace=30) == 0


# ---------------------------------------------------------------------------- load and size


def test_thousand_calls_in_flight_from_eight_threads(two_workers):
    address = two_workers[0]
    results: dict[int, list] = {}

    def client(thread_index: int) -> None:
        futures = [rpcdl.rpc_async(address, pow, (thread_index, k)) for k in range(125)]
        results[thread_index] = [f.wait() for f in futures]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {i: [i**k for k in range(125)] for i in range(8)}


def test_256_mib_tensor_roundtrip(two_workers):
    tensor = torch.randint(0, 2**31 - 1, (64 * 1024 * 1024,), dtype=torch.int32)
    back = rpcdl.rpc_sync(two_workers[1], lambda t: t, (tensor,), timeout=300)
    assert back.shape == tensor.shape and torch.equal(back, tensor)


def test_numpy_arrays_roundtrip(two_workers):
    import numpy as np

    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    back = rpcdl.rpc_sync(two_workers[0], lambda a: (a * 2, np.asfortranarray(a)), (array,))
    assert np.array_equal(back[0], array * 2) and np.array_equal(back[1], array)


# ---------------------------------------------------------------------------- authentication


class CreatesFile:
    """Unpickling this object creates a file: proof that something was unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture
def token_worker(tmp_path):
    env = {**os.environ, "RPCDL_TOKEN": "s3cret-token-value"}
    process, address = start_worker_process(env=env)
    yield address
    assert stop_process(process, grace=30) == 0
    stderr_path = tmp_path / "unused"
    assert not stderr_path.exists()


def test_client_without_or_with_another_token_is_refused(token_worker, tmp_path, monkeypatch):
    marker = tmp_path / "unpickled"
    with pytest.raises(rpcdl.AuthenticationError, match="requires a token"):
        rpcdl.rpc_sync(token_worker, print, (CreatesFile(str(marker)),), timeout=10)
    with pytest.raises(rpcdl.AuthenticationError, match="token mismatch"):
        rpcdl.rpc_sync(token_worker, print, (CreatesFile(str(marker)),), timeout=10, token="another")
    assert rpcdl.rpc_sync(token_worker, min, (1, 2), token="s3cret-token-value") == 1
    monkeypatch.setenv("RPCDL_TOKEN", "s3cret-token-value")
    assert rpcdl.rpc_sync(token_worker, max, (1, 2)) == 2
    assert not marker.exists()


def test_worker_unpickles_nothing_before_authentication(token_worker, tmp_path):
    """A raw client that skips the proof and sends a pickle: it is never loaded."""
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(CreatesFile(str(marker)), protocol=5)
    host, port = token_worker.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(struct.pack("!6sHB32s", MAGIC, VERSION, 1, os.urandom(32)))
        raw.recv(73)
        raw.sendall(os.urandom(32))  # a wrong proof
        try:
            send_frame(raw, Frame(Kind.CALL, 1, 0, payload))
            raw.recv(100)
        except OSError:
            pass
    time.sleep(0.5)
    assert not marker.exists()
    assert rpcdl.rpc_sync(token_worker, min, (1, 2), token="s3cret-token-value") == 1


def test_client_with_a_token_refuses_a_worker_without_one(two_workers):
    with pytest.raises(rpcdl.AuthenticationError, match="runs without a token"):
        rpcdl.rpc_sync(two_workers[0], min, (1, 2), token="mine", timeout=10)


def test_non_loopback_bind_without_token_is_refused():
    with pytest.raises(PermissionError, match=r"refusing to listen on 0\.0\.0\.0 without a token"):
        rpcdl.Worker("0.0.0.0", 0)
    result = subprocess.run(
        [sys.executable, "-m", "rpcdl", "worker", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--insecure" in result.stderr


# ---------------------------------------------------------------------------- robustness


def _raw_authenticated_socket(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), timeout=5)
    client_negotiate(raw, None, address)
    return raw


def test_worker_survives_hostile_clients(spawn_workers):
    (address,) = spawn_workers(1)
    host, port = address.rsplit(":", 1)

    with socket.create_connection((host, int(port)), timeout=5) as raw:  # random bytes
        raw.sendall(os.urandom(4096))
    with _raw_authenticated_socket(address) as raw:  # a length prefix of 2**60
        raw.sendall(struct.pack("!BBHIQQQ", Kind.CALL, 0, 0, 0, 1, 0, 2**60))
        assert raw.recv(10) == b""  # the worker closed this connection
    with _raw_authenticated_socket(address) as raw:  # closed in the middle of a message
        raw.sendall(struct.pack("!BBHIQQQ", Kind.CALL, 0, 0, 0, 1, 0, 1000) + b"x" * 10)
    with _raw_authenticated_socket(address) as raw:  # a well-formed frame that is not a pickle
        send_frame(raw, Frame(Kind.CALL, 7, 0, b"not a pickle"))
        raw.settimeout(5)
        assert raw.recv(1)  # it answered (with an error) rather than dying
    with pytest.raises(ValueError):
        rpcdl.rpc_sync(address, raise_value_error)

    assert rpcdl.rpc_sync(address, pow, (2, 10)) == 1024
    counters = rpcdl.stats(address)
    assert counters["connections_refused"] >= 1 and counters["calls_failed"] >= 2


def test_sigterm_lets_the_running_call_finish(tmp_path):
    process, address = start_worker_process()
    future = rpcdl.rpc_async(address, helpers.sleep_and_return, (1.5, "finished"))
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    assert future.wait() == "finished"
    try:
        code = process.wait(timeout=60)  # by itself, after the one SIGTERM
    except subprocess.TimeoutExpired:
        stacks = subprocess.run(
            [str(Path(sys.executable).with_name("py-spy")), "dump", "--pid", str(process.pid)],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        process.kill()
        raise AssertionError(f"the worker did not exit:\n{stacks}\n{process.stderr.read()}") from None
    assert code == 0, process.stderr.read()
    stop_process(process, grace=30)


def _in_a_forked_child(check: Callable[[], bool]) -> bool:
    """Whether ``check()`` holds when run in a child forked now (which exits at once after)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.write(write_end, b"1" if check() else b"0")
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        return os.read(read_end, 1) == b"1"
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)


def test_fork_child_uses_its_own_connection(two_workers):
    address = two_workers[0]
    assert rpcdl.rpc_sync(address, min, (1, 2)) == 1
    assert _in_a_forked_child(lambda: rpcdl.rpc_sync(address, max, (1, 2), timeout=20) == 2)
    assert rpcdl.rpc_sync(address, min, (3, 4)) == 3


def test_fork_child_refuses_its_parents_connection(two_workers):
    address = two_workers[0]
    assert rpcdl.rpc_sync(address, min, (1, 2)) == 1
    parents = connection_to(address)

    def refused_and_reconnected() -> bool:
        refused = not parents.submit(Kind.PING, Call(parents, 5.0, "a ping"))
        own = connection_to(address)
        return refused and own is not parents and rpcdl.rpc_sync(address, max, (1, 2), timeout=20) == 2

    assert _in_a_forked_child(refused_and_reconnected)
    assert connection_to(address) is parents and rpcdl.rpc_sync(address, min, (3, 4)) == 3


def test_ping_and_stats(two_workers):
    assert 0 < rpcdl.ping(two_workers[0]) < 5
    counters = rpcdl.stats(two_workers[0])
    for key in ("calls_served", "calls_failed", "bytes_in", "bytes_out", "busy_s", "clients"):
        assert key in counters
    assert counters["clients"] >= 1 and counters["calls_served"] > 0


def test_shutdown_closes_connections_and_calls_reconnect(two_workers):
    assert rpcdl.rpc_sync(two_workers[0], min, (1, 2)) == 1
    rpcdl.shutdown()
    assert rpcdl.rpc_sync(two_workers[0], min, (5, 6)) == 5


def test_embedded_worker_in_a_thread():
    with rpcdl.Worker(parallel=2) as worker:
        assert rpcdl.rpc_sync(worker.address, sum, ([1, 2, 3],)) == 6
        assert worker.stats()["calls_served"] == 1
    rpcdl.shutdown()


_running_now = {"now": 0, "most": 0}
_running_lock = threading.Lock()


def _count_while_sleeping(seconds: float) -> None:
    with _running_lock:
        _running_now["now"] += 1
        _running_now["most"] = max(_running_now["most"], _running_now["now"])
    time.sleep(seconds)
    with _running_lock:
        _running_now["now"] -= 1


@pytest.mark.parametrize("parallel", [1, 3])
def test_a_worker_runs_parallel_calls_at_once_and_no_more(parallel):
    _running_now.update(now=0, most=0)
    with rpcdl.Worker(parallel=parallel) as worker:
        futures = [rpcdl.rpc_async(worker.address, _count_while_sleeping, (0.2,)) for _ in range(2 * parallel + 1)]
        for future in futures:
            future.wait()
        assert worker.stats()["calls_served"] == len(futures)
    rpcdl.shutdown()
    assert _running_now["most"] == parallel
