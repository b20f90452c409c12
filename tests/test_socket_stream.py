"""SocketStream: a plain socket the loop reads and any thread writes, over real loopback sockets.

And the connection's use of it: a call over plain TCP is sent by the thread
that makes it, so it reaches a worker in another process while this process's
loop is busy.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import pytest
import torch
from helpers import start_worker_process

import rpcdl
from rpcdl.processes import stop_process
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


def test_a_call_over_plain_tcp_is_sent_by_its_caller_while_the_loop_is_busy(worker_process, tmp_path):
    """The frame goes out from the calling thread: a worker in another process runs the call while this
    process's loop is held by a callback."""
    held, release = threading.Event(), threading.Event()
    try:
        assert rpcdl.rpc_sync(worker_process, pow, (2, 3), timeout=30) == 8  # connected
        marker = tmp_path / "ran"
        event_loop.call_soon(lambda: (held.set(), release.wait(20)))
        assert held.wait(10)
        future = rpcdl.rpc_async(worker_process, marker.mkdir, timeout=30)
        for _ in range(100):
            if marker.exists():
                break
            release.wait(0.05)
        ran_while_held = marker.exists()
        release.set()
        future.wait()
        assert ran_while_held, "the call did not reach the worker while the client's loop was busy"
    finally:
        release.set()


def test_an_answer_with_a_payload_larger_than_its_first_memory_arrives_whole(worker_process):
    """A large pickled answer is received into memory that grows as its bytes arrive, over the stream."""
    size = 24 << 20  # far above GROWN_PAYLOAD_BYTES: the memory grows several times
    answer = rpcdl.rpc_sync(worker_process, bytes, (size,), timeout=60)
    assert len(answer) == size and answer.count(0) == size


def test_a_tensor_may_change_once_its_call_returns_while_another_call_is_in_flight(worker_process):
    """With a call in flight the frame goes to the loop, which writes it later: its tensor is copied first."""
    held, release = threading.Event(), threading.Event()
    try:
        assert rpcdl.rpc_sync(worker_process, pow, (2, 3), timeout=30) == 8  # connected
        slow = rpcdl.rpc_async(worker_process, time.sleep, (0.5,), timeout=30)
        event_loop.call_soon(lambda: (held.set(), release.wait(20)))
        assert held.wait(10)
        tensor = torch.ones(1000)
        future = rpcdl.rpc_async(worker_process, torch.sum, (tensor,), timeout=30)
        tensor.zero_()  # allowed once rpc_async returned; the loop has not written the call yet
        release.set()
        assert future.wait().item() == 1000.0
        slow.wait()
    finally:
        release.set()
