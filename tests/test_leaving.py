"""A worker leaving well: the LEAVING frame, clients that stop sending at once, calls in flight answered.

Real workers on loopback: embedded ones (threads of this process) for the rpc
level, ``rpcdl worker`` processes sent real signals for the command line.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time

import helpers
import pytest
from blocking_wire import FrameReader, client_negotiate, io_stream

import rpcdl
from rpcdl.errors import ConnectionLost, ProtocolError, WorkerLeaving, WorkerUnavailable, is_transient
from rpcdl.local import child_environment, read_ready_line
from rpcdl.processes import stop_process
from rpcdl.rpc.answers import outcome
from rpcdl.rpc.client import add_leaving_listener, connection_to, is_leaving, remove_leaving_listener
from rpcdl.server.draining import SAME_SIGNAL_WINDOW, DrainEnd, drain_process
from rpcdl.server.process import StopSignals
from rpcdl.server.worker import Phase
from rpcdl.transport.control import decode_leaving, encode_leaving
from rpcdl.transport.wire import Frame, Kind, Limits, encode_frame

_WAIT = 10.0


def sleep_and_return(seconds: float, value):
    time.sleep(seconds)
    return value


# ---------------------------------------------------------------------------- the frame


def test_leaving_payload_round_trips_and_a_broken_one_is_a_protocol_error():
    assert decode_leaving(encode_leaving(12.5, "SIGTERM")) == (12.5, "SIGTERM")
    assert decode_leaving(encode_leaving(0.0, "")) == (0.0, "the worker was told to stop")
    with pytest.raises(ProtocolError, match="8-byte drain timeout"):
        decode_leaving(b"\x00\x01")
    with pytest.raises(ProtocolError, match="finite"):
        decode_leaving(b"\xff" * 8)
    with pytest.raises(ValueError, match="drain_timeout"):
        encode_leaving(-1.0)


def test_drain_process_ends_when_idle_on_a_second_signal_or_at_its_timeout():
    class Busy:
        calls_in_flight = 1

    class Idle:
        calls_in_flight = 0

    assert drain_process(Idle(), 5.0, lambda: False) is DrainEnd.FINISHED
    looks = iter([False, False, True])
    assert drain_process(Busy(), 5.0, lambda: next(looks), tick=0.001) is DrainEnd.INTERRUPTED
    assert drain_process(Busy(), 0.01, lambda: False, tick=0.001) is DrainEnd.TIMED_OUT


def test_a_second_signal_counts_only_once_the_same_notice_window_has_passed():
    signals = StopSignals()
    assert not signals.received and not signals.again(SAME_SIGNAL_WINDOW)
    signals.times += [10.0, 10.2]  # SIGTERM from Slurm and from a supervisor: one notice
    assert signals.received and not signals.again(SAME_SIGNAL_WINDOW)
    signals.times.append(10.0 + SAME_SIGNAL_WINDOW)  # a person pressing Ctrl-C again
    assert signals.again(SAME_SIGNAL_WINDOW)


def _voluntary_switches(thread_id: int) -> int:
    with open(f"/proc/self/task/{thread_id}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))


@pytest.mark.timeout(30)
def test_the_main_thread_waits_for_a_stop_signal_asleep_and_wakes_when_it_comes():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed by the main thread only")
    before, handler = signal.set_wakeup_fd(-1), signal.getsignal(signal.SIGTERM)
    signal.set_wakeup_fd(before)
    signals = StopSignals().install()
    try:
        switches = _voluntary_switches(threading.get_native_id())
        assert not signals.wait(1.0)
        assert _voluntary_switches(threading.get_native_id()) - switches < 8  # woken for its timeout, not in naps
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        started = time.monotonic()
        assert signals.wait(20.0)
        assert time.monotonic() - started < 10.0
        assert signals.describe() == "SIGTERM"
    finally:
        signals.restore()
    assert signal.set_wakeup_fd(before) == before  # the process's own wakeup fd is back
    assert signal.getsignal(signal.SIGTERM) == handler


# ---------------------------------------------------------------------------- the rpc level


@pytest.mark.parametrize("switching", [False, True])
def test_a_leaving_worker_answers_its_calls_in_flight_and_new_calls_fail_at_once(embedded_worker, switching, request):
    if switching:
        request.getfixturevalue("switching_often")
    worker = embedded_worker(parallel=2)
    address = worker.address
    heard: list[str] = []
    add_leaving_listener(heard.append)
    try:
        assert rpcdl.rpc_sync(address, min, (1, 2)) == 1
        in_flight = [rpcdl.rpc_async(address, sleep_and_return, (1.5, i)) for i in range(3)]  # 2 run, 1 queued
        helpers.eventually(lambda: worker.calls_in_flight == 3, "the calls to reach the worker")
        stopper = threading.Thread(target=worker.stop, kwargs={"grace": 30.0}, name="test-stopper")
        stopper.start()
        helpers.eventually(lambda: is_leaving(address), "the client to hear LEAVING")
        assert heard == [address]
        assert worker.phase is Phase.DRAINING

        refused = rpcdl.rpc_async(address, min, (3, 4))
        with pytest.raises(WorkerLeaving, match="is leaving") as caught:
            refused.wait()
        assert caught.value.address == address and is_transient(caught.value)
        with pytest.raises(WorkerLeaving):
            rpcdl.rpc_sync(address, min, (3, 4))
        with pytest.raises(WorkerLeaving):
            rpcdl.remote(address, min, (3, 4)).to_here()
        assert not any(future.done() for future in in_flight), "the new calls failed only after the old ones"

        assert [future.wait() for future in in_flight] == [0, 1, 2]  # queued one included: in flight is in flight
        stopper.join(_WAIT)
        assert not stopper.is_alive() and worker.phase is Phase.STOPPED
        assert worker.stats()["calls_rejected"] == 0  # nothing was sent to it once it said it leaves
    finally:
        remove_leaving_listener(heard.append)


def test_a_worker_that_left_is_not_awaited_and_one_back_at_its_address_is_used(embedded_worker, monkeypatch):
    monkeypatch.setenv("RPCDL_CONNECT_GRACE", "100")  # a call that waited for the grace would hit the test timeout
    worker = embedded_worker()
    address = worker.address
    assert rpcdl.rpc_sync(address, min, (1, 2)) == 1
    connection = connection_to(address)
    worker.stop(grace=5.0)
    helpers.eventually(lambda: is_leaving(address), "the idle client to hear LEAVING")
    helpers.eventually(lambda: connection.closed, "the idle client to see the connection closed")
    started = time.monotonic()
    with pytest.raises(WorkerUnavailable, match="not reachable") as caught:  # refused, and not retried
        rpcdl.rpc_sync(address, min, (1, 2), timeout=60.0)
    assert type(caught.value) is WorkerUnavailable
    assert time.monotonic() - started < 50.0, "the call waited for the connect grace"

    port = int(address.rpartition(":")[2])
    back = embedded_worker(port=port)
    assert rpcdl.rpc_sync(address, min, (5, 6)) == 5
    assert not is_leaving(address)
    back.stop(grace=1.0)


def test_a_draining_worker_says_leaving_first_then_rejects_calls_as_worker_leaving(embedded_worker):
    """A call sent before its client read LEAVING, that reached the worker after it began to drain."""
    worker = embedded_worker()
    host, _, port = worker.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=_WAIT) as sock:
        client_negotiate(sock, None, worker.address, compression="off")
        stream = io_stream(sock, receive=_WAIT, send=_WAIT)
        helpers.eventually(lambda: worker.stats()["clients"] == 1, "the session to start")
        assert worker.drain(grace=7.0, reason="a test") and not worker.drain()  # once
        reader = FrameReader(stream, Limits(), stall_timeout=_WAIT)
        notice = reader.read_frame()
        assert (notice.kind, decode_leaving(notice.payload)) == (Kind.LEAVING, (7.0, "a test"))
        payload = pickle.dumps((min, (1, 2), {}), protocol=5)
        stream.sendall(b"".join(bytes(piece) for piece in encode_frame(Frame(Kind.CALL, 9, 0, payload))))
        rejected = reader.read_frame()
        assert (rejected.kind, rejected.call_id) == (Kind.REJECTED, 9)
    _, error = outcome(worker.address, None, rejected, min)
    assert isinstance(error, WorkerLeaving) and error.address == worker.address
    assert worker.stop(grace=1.0)


# ---------------------------------------------------------------------------- worker processes and signals


def test_sigterm_drains_a_worker_process_which_exits_zero():
    process, address = helpers.start_worker_process("--parallel", "2", "--drain-timeout", "30")
    try:
        in_flight = [rpcdl.rpc_async(address, sleep_and_return, (2.0, i)) for i in range(2)]
        helpers.eventually(lambda: rpcdl.stats(address)["calls_in_flight"] == 2, "the calls to run")
        process.send_signal(signal.SIGTERM)
        helpers.eventually(lambda: is_leaving(address), "the client to hear LEAVING")
        with pytest.raises(WorkerLeaving):
            rpcdl.rpc_sync(address, min, (1, 2))
        assert [future.wait() for future in in_flight] == [0, 1]
        assert process.wait(_WAIT) == 0
        log = process.stderr.read()
        assert "stopping (SIGTERM)" in log and "drained" in log
    finally:
        stop_process(process, grace=1.0)
        rpcdl.shutdown()


def test_a_second_signal_stops_a_draining_worker_at_once():
    process, address = helpers.start_worker_process("--drain-timeout", "100")
    try:
        long_call = rpcdl.rpc_async(address, sleep_and_return, (100.0, "never"))
        helpers.eventually(lambda: rpcdl.stats(address)["calls_in_flight"] == 1, "the call to run")
        process.send_signal(signal.SIGINT)
        helpers.eventually(lambda: is_leaving(address), "the client to hear LEAVING")
        time.sleep(SAME_SIGNAL_WINDOW + 0.2)  # a second signal at once would be the same notice
        assert process.poll() is None  # draining: the call has 100 s
        process.send_signal(signal.SIGINT)
        assert process.wait(_WAIT) == 0
        with pytest.raises(ConnectionLost):
            long_call.wait()
        assert "second signal" in process.stderr.read()
    finally:
        stop_process(process, grace=1.0)
        rpcdl.shutdown()


def test_launch_and_run_worker_drain_on_sigterm_too():
    process = subprocess.Popen(
        [sys.executable, "-m", "rpcdl.launch", "--port", "0", "--drain-timeout", "5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_environment(),
        text=True,
    )
    try:
        address = read_ready_line(process, 60.0)
        assert rpcdl.rpc_sync(address, os.getpid) == process.pid
        process.send_signal(signal.SIGTERM)
        helpers.eventually(lambda: is_leaving(address), "the client to hear LEAVING")
        assert process.wait(_WAIT) == 0
    finally:
        stop_process(process, grace=1.0)
        rpcdl.shutdown()


# ---------------------------------------------------------------------------- a loader over a worker that leaves


@pytest.mark.parametrize("in_order", [True, False])
def test_a_worker_sent_sigterm_mid_epoch_drains_and_the_epoch_ends_exactly_once_without_a_timeout(
    spawn_workers, in_order
):
    workers = spawn_workers(2)
    dataset = rpcdl.RPCDataset(list(workers), helpers.RangeDataset, 96, 0.01)
    loader = rpcdl.RPCDataloader(dataset, batch_size=4, timeout=60, in_order=in_order)
    assert sorted(i for batch in loader for i in batch.tolist()) == list(range(96))  # warm
    seen, waits = [], []
    last = time.monotonic()
    for index, batch in enumerate(loader):
        now = time.monotonic()
        waits.append(now - last)
        seen.extend(batch.tolist())
        if index == 3:  # batches of both workers in flight
            # Not workers.kill(), which closes this process's connections once the worker exits: a LEAVING
            # frame the client had not read yet (its connection idle, read every tick) would go with them.
            workers.processes[0].send_signal(signal.SIGTERM)
        last = time.monotonic()
    assert sorted(seen) == list(range(96))
    assert max(waits) < 30, f"a batch waited for the timeout: {max(waits):.1f}s"  # 60 s: none comes near
    assert workers.processes[0].wait(_WAIT) == 0  # drained, exit 0
    helpers.eventually(lambda: is_leaving(workers[0]), "the client to hear LEAVING")
    assert sorted(i for batch in loader for i in batch.tolist()) == list(range(96))  # the next epoch, on one


def test_a_worker_sent_sigterm_mid_epoch_answers_its_calls_in_flight_itself(spawn_workers):
    """Its calls in flight are awaited (it drains them), not sent again elsewhere: the batches they make are
    its own, and every sample comes once. Out of order, so that no copy of a late batch goes elsewhere."""
    workers = spawn_workers(2)
    n = 96
    dataset = rpcdl.RPCDataset(list(workers), helpers.RangeDataset, n, 0.04)  # 0.16 s a batch
    loader = rpcdl.RPCDataloader(
        dataset, batch_size=4, timeout=60, in_order=False, max_batches_per_call=1, prefetch_factor=4
    )
    leaving = workers[0]
    before: dict[str, int] = {}

    def signal_when_busy(index: int) -> None:
        if index == 5:  # a window of 4 calls in flight at each worker
            before["served"] = loader.batches_served[leaving]
            before["in_flight"] = loader.worker_windows()[leaving]["in_flight"]
            workers.processes[0].send_signal(signal.SIGTERM)

    seen = []
    for index, batch in enumerate(loader):
        seen.extend(batch.tolist())
        signal_when_busy(index)
    assert sorted(seen) == list(range(n))
    assert before["in_flight"] >= 2, before
    assert loader.batches_served[leaving] - before["served"] >= before["in_flight"], (before, loader.batches_served)
    assert workers.processes[0].wait(_WAIT) == 0  # drained, exit 0
    assert loader.worker_states()[leaving] in ("down", "probing")
