"""SocketStream: a plain socket the loop reads and any thread writes, over real loopback sockets.

And the connection's use of it: a call over plain TCP is sent by the thread
that makes it, so it reaches a worker in another process while this process's
loop is busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from helpers import eventually, start_worker_process

import rpcdl
from rpcdl.processes import stop_process
from rpcdl.rpc import connection
from rpcdl.transport import event_loop
from rpcdl.transport.socket_stream import SocketStream

pytestmark = pytest.mark.timeout(30)


class _Received(asyncio.Protocol):
    """Collects what a stream receives (on the loop) and how it ended."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.ended = threading.Event()
        self.error: Exception | None = None

    def data_received(self, data: bytes) -> None:
        self.data += data

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.error = exc
        self.ended.set()


def _stream_pair() -> tuple[SocketStream, _Received, socket.socket]:
    """A stream on one end of a loopback TCP connection, and the other end (blocking)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        near = socket.create_connection(listener.getsockname())
        far, _ = listener.accept()
    received = _Received()

    async def make() -> SocketStream:
        return SocketStream(near, received)

    return event_loop.run_coroutine(make(), timeout=10), received, far


def _abort(stream: SocketStream) -> None:
    done = threading.Event()
    event_loop.call_soon(lambda: (stream.abort(), done.set()))
    assert done.wait(10)


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(1 << 20, size - len(data)))
        assert chunk, f"the stream ended after {len(data)} of {size} bytes"
        data += chunk
    return bytes(data)


def test_writes_from_many_threads_arrive_whole_and_each_threads_in_order(switching_often):
    stream, _, far = _stream_pair()
    threads, per_thread = 8, 300
    record = struct.Struct("!II")

    def write(index: int) -> None:
        for sequence in range(per_thread):
            stream.write(record.pack(index, sequence))

    writers = [threading.Thread(target=write, args=(i,), name=f"test-writer-{i}") for i in range(threads)]
    try:
        for writer in writers:
            writer.start()
        data = _read_exactly(far, threads * per_thread * record.size)
        for writer in writers:
            writer.join(10)
        next_of = [0] * threads
        for index, sequence in record.iter_unpack(data):
            assert sequence == next_of[index], f"thread {index} wrote {sequence} after {next_of[index] - 1}"
            next_of[index] += 1
        assert next_of == [per_thread] * threads
    finally:
        _abort(stream)
        far.close()


def test_what_the_socket_cannot_take_is_copied_and_written_by_the_loop_in_order():
    stream, _, far = _stream_pair()
    size = 32 << 20  # more than loopback's socket buffers hold while nobody reads
    first = bytearray(b"a" * size)
    try:
        stream.write(first)  # returns at once: the rest is copied
        assert stream.unwritten > 0, "the socket took everything: the loop's part is not tested"
        first[:] = b"x" * size  # the caller may change its memory now
        stream.writelines([b"b" * 1000, memoryview(b"c" * 1000)])
        data = _read_exactly(far, size + 2000)
        assert data == b"a" * size + b"b" * 1000 + b"c" * 1000
    finally:
        _abort(stream)
        far.close()


def test_the_end_of_the_stream_reaches_the_protocol_and_later_writes_are_dropped():
    stream, received, far = _stream_pair()
    try:
        far.sendall(b"hello")
        far.close()
        assert received.ended.wait(10), "the stream did not tell its protocol of the end"
        assert bytes(received.data) == b"hello"
        assert received.error is None
        assert stream.closed
        stream.write(b"nobody reads this")  # dropped, no error
    finally:
        _abort(stream)


@pytest.fixture(scope="module")
def worker_process():
    """An ``rpcdl worker`` process on loopback (plain TCP), its address."""
    process, address = start_worker_process()
    try:
        yield address
    finally:
        rpcdl.shutdown()
        stop_process(process, grace=5.0)


@contextlib.contextmanager
def _loop_held() -> Iterator[threading.Event]:
    """Hold this process's loop with a callback until the block ends, or until the event it gives is set."""
    held, release = threading.Event(), threading.Event()
    event_loop.call_soon(lambda: (held.set(), release.wait(20)))
    try:
        assert held.wait(10)
        yield release
    finally:
        release.set()


def test_a_call_over_plain_tcp_is_sent_by_its_caller_while_the_loop_is_busy(worker_process, tmp_path):
    """The frame goes out from the calling thread: a worker in another process runs the call while this
    process's loop is held by a callback."""
    assert rpcdl.rpc_sync(worker_process, pow, (2, 3), timeout=30) == 8  # connected
    marker = tmp_path / "ran"
    with _loop_held():
        future = rpcdl.rpc_async(worker_process, marker.mkdir, timeout=30)
        eventually(
            marker.exists, "the call to reach the worker while the client's loop was busy", timeout=5, interval=0.05
        )
    future.wait()


def test_an_answer_with_a_payload_larger_than_its_first_memory_arrives_whole(worker_process):
    """A large pickled answer is received into memory that grows as its bytes arrive, over the stream."""
    size = 24 << 20  # far above GROWN_PAYLOAD_BYTES: the memory grows several times
    answer = rpcdl.rpc_sync(worker_process, bytes, (size,), timeout=60)
    assert len(answer) == size and answer.count(0) == size


def test_a_call_made_while_another_is_in_flight_is_sent_by_its_caller_too(worker_process, tmp_path):
    """A pipeline's calls do not wait for the loop either: with a call in flight, whose answer the held loop
    cannot read, the next call still reaches the worker."""
    assert rpcdl.rpc_sync(worker_process, pow, (2, 3), timeout=30) == 8  # connected
    marker = tmp_path / "ran"
    slow = rpcdl.rpc_async(worker_process, time.sleep, (0.2,), timeout=30)
    with _loop_held():
        future = rpcdl.rpc_async(worker_process, marker.mkdir, timeout=30)
        eventually(marker.exists, "the call made with another in flight to reach the worker", timeout=5, interval=0.05)
    slow.wait()
    future.wait()


def test_calls_made_while_connecting_and_as_it_opens_reach_the_worker_in_the_order_made(worker_process, monkeypatch):
    """The calls queued while connecting go first: none made as the connection opens, which its caller may
    write itself, overtakes them (the worker runs one call at a time, in the order received). The loop is
    slowed for 0.3 s between opening the connection and writing what was queued, where a caller's write
    would overtake."""
    serves = connection.worker_serves
    monkeypatch.setattr(connection, "worker_serves", lambda address: (time.sleep(0.3), serves(address)))
    rpcdl.shutdown()  # the connection to this worker is made again, below, while the loop is held
    with _loop_held() as release:
        futures = [rpcdl.rpc_async(worker_process, time.monotonic_ns, timeout=30) for _ in range(50)]
        release.set()
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            futures.append(rpcdl.rpc_async(worker_process, time.monotonic_ns, timeout=30))
            time.sleep(0.002)
    times = [future.wait() for future in futures]
    assert times == sorted(times), "a call reached the worker before one made earlier"


def test_a_tensor_may_change_once_its_call_returns_while_its_connection_opens(worker_process):
    """A call made while connecting goes to the loop, which writes it once open: its tensor is copied first."""
    rpcdl.shutdown()  # the connection to this worker is made again, below, while the loop is held
    with _loop_held():
        tensor = torch.ones(1000)
        future = rpcdl.rpc_async(worker_process, torch.sum, (tensor,), timeout=30)
        tensor.zero_()  # allowed once rpc_async returned; the loop has not even dialed yet
    assert future.wait().item() == 1000.0
