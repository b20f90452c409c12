"""Same-host shared memory for answers (rpcdl.transport.shm): real workers, real sockets, real segments."""

from __future__ import annotations

import gc
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import helpers
import pytest
import torch
from blocking_wire import client_negotiate, server_negotiate

import rpcdl
from rpcdl.rpc import client
from rpcdl.transport import shm

SAMPLE = 128 * 1024  # bytes per sample: batches of a few are well past MIN_SPAN_BYTES


def _connection(address: str):
    connection = client.connection_to(address)
    assert not connection.closed, f"no open connection to {address}"
    return connection


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def make_tensor(size: int, value: int) -> torch.Tensor:
    return torch.full((size,), value, dtype=torch.uint8)


# ---------------------------------------------------------------------------- pure logic


def test_span_allocator_first_fit_merges_and_reuses():
    spans = shm.SpanAllocator(4096, 4096 * 9)
    a, b, c = spans.take(4096), spans.take(5000), spans.take(4096)
    assert (a, b, c) == (4096, 8192, 16384)
    assert spans.take(4096 * 6) is None  # 4 pages left
    spans.give(b)
    assert spans.take(4096) == 8192  # first fit, in the freed span
    spans.give(a)
    spans.give(8192)
    spans.give(c)
    assert spans.spans_in_use == 0 and spans.take(4096 * 8) == 4096  # all merged back into one span
    with pytest.raises(KeyError):
        spans.give(12345)


def test_segment_size_is_checked_with_a_clear_error(monkeypatch):
    assert shm.resolve_bytes(0) == 0
    monkeypatch.setenv(shm.SHM_BYTES_ENV, "lots")
    with pytest.raises(ValueError, match="RPCDL_SHM_BYTES must be a whole number"):
        shm.resolve_bytes()
    monkeypatch.setenv(shm.SHM_BYTES_ENV, "100")
    with pytest.raises(ValueError, match="at least"):
        shm.resolve_bytes()
    with pytest.raises(ValueError, match="shared_memory must be 0"):
        rpcdl.Worker(shared_memory=-1)


def test_a_client_maps_the_segment_only_with_the_right_nonce():
    segment = shm.WorkerSegment(shm.MIN_BYTES)
    try:
        offer = segment.offer()
        mapped = shm.ClientSegment.open(offer)
        assert mapped is not None and mapped.size == shm.MIN_BYTES
        assert shm.ClientSegment.open(shm.Offer(offer.pid, offer.fd, offer.size, bytes(32))) is None
        assert shm.ClientSegment.open(shm.Offer(offer.pid, 999_999, offer.size, offer.nonce)) is None
        # copied out (the pinned path) and released at once
        into = torch.empty(8192, dtype=torch.uint8).numpy()
        array = segment.empty(8192)
        array[:] = 7
        offset = array.ctypes.data - segment._base
        assert (mapped.copy_out(offset, 8192, into) == 7).all()
        gc.collect()
        assert [f.kind.name for f in mapped.release_frames()] == ["SEGMENT_RELEASE"]
    finally:
        segment.close()


# ---------------------------------------------------------------------------- through workers


def test_loader_batches_arrive_in_the_segment_from_worker_processes(two_workers):
    remote = rpcdl.RPCDataset(two_workers, helpers.ArrayDataset, 24, SAMPLE)
    loader = rpcdl.RPCDataloader(remote, batch_size=4)
    seen = []
    for batch in loader:
        assert batch.shape == (4, SAMPLE // 8)
        seen.extend(batch[:, 0].tolist())
        assert all((row == row[0]).all() for row in batch)
        assert any(_connection(a).segment.contains(batch.data_ptr()) for a in two_workers)
    assert sorted(seen) == list(range(24))
    stats = [rpcdl.stats(address) for address in two_workers]
    assert [s["transport"] for s in stats] == ["shm", "shm"]
    assert sum(s["shared_memory"]["answers_in_segment"] for s in stats) >= 6  # one per batch
    assert sum(s["shared_memory"]["buffers_in_place"] for s in stats) >= 6  # collated there: no copy


def test_an_answer_shares_memory_with_the_segment_and_spans_are_reused(embedded_worker):
    worker = embedded_worker(shared_memory=shm.MIN_BYTES)  # 255 pages of data
    for i in range(200):  # far more than fit at once: released spans are reused
        tensor = rpcdl.rpc_sync(worker.address, make_tensor, (3 * SAMPLE, i % 256))
        assert _connection(worker.address).segment.contains(tensor.data_ptr())
        assert tensor[0] == tensor[-1] == i % 256
        del tensor
    state = rpcdl.stats(worker.address)["shared_memory"]
    assert state["answers_in_segment"] == 200 and state["buffers_on_socket"] == 0
    assert state["buffers_in_place"] == 0  # torch.full's tensors are copied in


def test_a_full_segment_sends_the_rest_over_the_socket(embedded_worker):
    worker = embedded_worker(shared_memory=shm.MIN_BYTES)
    held = [rpcdl.rpc_sync(worker.address, make_tensor, (3 * SAMPLE, i)) for i in range(6)]
    segment = _connection(worker.address).segment
    inside = [segment.contains(t.data_ptr()) for t in held]
    assert inside[:2] == [True, True] and not all(inside)  # 384 KiB each: two fit in 1 MiB
    assert [int(t[0]) for t in held] == list(range(6)) and all((t == t[0]).all() for t in held)
    state = rpcdl.stats(worker.address)["shared_memory"]
    assert state["buffers_on_socket"] >= 1 and state["bytes_in_use"] <= shm.MIN_BYTES
    del held
    gc.collect()
    helpers.eventually(lambda: rpcdl.stats(worker.address)["shared_memory"]["spans_in_use"] == 0, "spans released")


@pytest.mark.parametrize("where", ["client", "worker"])
def test_shared_memory_off_on_either_side_uses_the_socket(embedded_worker, monkeypatch, where):
    if where == "client":
        monkeypatch.setenv(shm.SHM_BYTES_ENV, "0")
        worker = embedded_worker()
    else:
        worker = embedded_worker(shared_memory=0)
    tensor = rpcdl.rpc_sync(worker.address, make_tensor, (3 * SAMPLE, 5))
    assert (tensor == 5).all()
    assert _connection(worker.address).segment is None
    assert rpcdl.stats(worker.address)["transport"] == "socket"


def test_the_old_handshake_still_works_with_a_worker_offering_shared_memory(embedded_worker):
    worker = embedded_worker()
    host, port = worker.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        agreed = client_negotiate(sock, None, worker.address)  # offers no shared memory, as clients before it
    assert agreed.compression in ("off", "auto", "on") and agreed.segment is None


def test_a_worker_that_offers_no_shared_memory_leaves_a_new_client_on_the_socket():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.settimeout(5)
        theirs.settimeout(5)
        worker = threading.Thread(target=server_negotiate, args=(theirs, None, "client"), name="test-old-worker")
        worker.start()
        agreed = client_negotiate(ours, None, "worker", shared_memory=True)
        worker.join(5)
    assert agreed.segment is None


def test_the_clients_pages_of_a_span_leave_its_rss_with_the_last_tensor(embedded_worker):
    worker = embedded_worker()
    tensor = rpcdl.rpc_sync(worker.address, make_tensor, (8 << 20, 1))
    assert int(tensor.sum()) == 8 << 20  # touches every page
    touched = _shmem_kib()
    del tensor
    gc.collect()
    assert touched - _shmem_kib() >= 7 << 10  # at once, not with the next message sent


def _shmem_kib() -> int:
    with open("/proc/self/status") as status:
        return int(re.search(r"RssShmem:\s+(\d+)", status.read()).group(1))


def test_with_a_token_the_segment_is_offered_after_both_sides_proved_it(embedded_worker, monkeypatch):
    worker = embedded_worker(token="shm-secret")
    monkeypatch.setenv("RPCDL_TOKEN", "shm-secret")
    tensor = rpcdl.rpc_sync(worker.address, make_tensor, (3 * SAMPLE, 6))
    assert (tensor == 6).all() and _connection(worker.address).segment.contains(tensor.data_ptr())
    assert rpcdl.stats(worker.address)["transport"] == "shm"


def test_a_worker_in_another_network_namespace_uses_the_socket(tmp_path, monkeypatch):
    from cluster_box import cluster_of_workers

    with cluster_of_workers(tmp_path, "shm-secret", [()]) as box:
        monkeypatch.setenv("RPCDL_TOKEN", "shm-secret")
        (address,) = box.workers
        tensor = rpcdl.rpc_sync(address, make_tensor, (3 * SAMPLE, 8), timeout=30)
        assert (tensor == 8).all() and _connection(address).segment is None
        assert rpcdl.stats(address)["transport"] == "socket"


# ---------------------------------------------------------------------------- SIGKILL


def test_sigkill_of_a_worker_mid_stream_leaves_nothing_and_the_loader_fails_over(spawn_workers):
    before = _dev_shm()
    workers = spawn_workers(2)
    remote = rpcdl.RPCDataset(list(workers), helpers.ArrayDataset, 48, SAMPLE)
    seen = []
    for step, batch in enumerate(rpcdl.RPCDataloader(remote, batch_size=4)):
        seen.extend(batch[:, 0].tolist())
        if step == 2:
            workers.kill(0, signal.SIGKILL)
    assert sorted(seen) == list(range(48))
    helpers.eventually(lambda: _dev_shm() <= before, "/dev/shm as before")  # others' entries may come and go


_CLIENT = textwrap.dedent(
    """
    import sys, rpcdl, helpers
    remote = rpcdl.RPCDataset([sys.argv[1]], helpers.ArrayDataset, 10**6, int(sys.argv[2]))
    for i, batch in enumerate(rpcdl.RPCDataloader(remote, batch_size=4)):
        if i == 5:
            print("streaming", flush=True)
    """
)


def test_sigkill_of_a_client_mid_stream_leaves_nothing_and_the_worker_serves_on(spawn_workers):
    before = _dev_shm()
    (address,) = workers = spawn_workers(1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(helpers.__file__), *sys.path])}
    victim = subprocess.Popen(
        [sys.executable, "-c", _CLIENT, address, str(SAMPLE)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert victim.stdout.readline().strip() == "streaming"
        assert rpcdl.stats(address)["clients"] == 2
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(10)
        victim.stdout.close()
    helpers.eventually(lambda: rpcdl.stats(address)["clients"] == 1, "the worker to forget the killed client")
    tensor = rpcdl.rpc_sync(address, make_tensor, (3 * SAMPLE, 9))
    assert (tensor == 9).all() and _connection(address).segment.contains(tensor.data_ptr())
    assert workers.processes[0].poll() is None
    helpers.eventually(lambda: _dev_shm() <= before, "/dev/shm as before")  # others' entries may come and go


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_calls_get_pinned_memory_outside_the_segment(embedded_worker):
    worker = embedded_worker()
    tensor = rpcdl.rpc_sync(worker.address, make_tensor, (3 * SAMPLE, 4), pin_memory=True)
    assert tensor.is_pinned() and (tensor == 4).all()
    assert not _connection(worker.address).segment.contains(tensor.data_ptr())


def test_a_client_held_up_past_the_workers_handshake_deadline_dials_again_and_loses_no_call(spawn_workers, monkeypatch):
    # The client's loop stalls (a starved process) after it read the segment offer, past the worker's deadline
    # for the handshake: the worker gives up and closes. The worker's ready byte ends the handshake for both, so
    # the client reads the end of the stream, dials again, and its call goes over the new connection. (Without
    # it, the client took the handshake for done and the call failed with ConnectionLost.)
    monkeypatch.setenv("RPCDL_HANDSHAKE_TIMEOUT", "1")  # the worker's: it reads it as it starts
    [address] = spawn_workers(1)
    monkeypatch.delenv("RPCDL_HANDSHAKE_TIMEOUT")  # the client's new connections keep their own, longer deadline
    refused_before = rpcdl.stats(address)["connections_refused"]
    rpcdl.shutdown()  # the call below dials anew
    opened = shm.ClientSegment.open.__func__
    maps: list[float] = []

    def held_up_the_first_time(cls, offer):
        maps.append(time.monotonic())
        if len(maps) == 1:
            time.sleep(2.0)  # on the loop's thread: nothing of this process reads or writes meanwhile
        return opened(cls, offer)

    monkeypatch.setattr(shm.ClientSegment, "open", classmethod(held_up_the_first_time))
    tensor = rpcdl.rpc_sync(address, make_tensor, (3 * SAMPLE, 5), timeout=30)
    assert (tensor == 5).all()
    assert len(maps) == 2  # the stalled handshake, and the one that served the call
    assert rpcdl.stats(address)["connections_refused"] == refused_before + 1  # the worker gave up on the first
