"""The pool of large receive buffers: reuse, its bound, and tensors received through it."""

from __future__ import annotations

import gc
import os
import threading

import torch

import rpcdl
from rpcdl.transport import buffers
from rpcdl.transport.buffers import BufferPool


def test_a_dropped_buffer_is_reused_with_its_memory():
    pool = BufferPool(free_per_size=2)
    first = pool.take(1 << 20)
    first[:4] = [1, 2, 3, 4]
    address = first.ctypes.data
    del first
    gc.collect()
    assert pool.free_buffers() == 1
    second = pool.take(1 << 20)
    assert second.ctypes.data == address  # the same mapping, pages already there
    assert second.flags.writeable and second.nbytes == 1 << 20
    assert pool.free_buffers() == 0


def test_the_pool_keeps_a_bounded_number_of_free_buffers():
    pool = BufferPool(free_per_size=2)
    taken = [pool.take(1 << 20) for _ in range(5)]
    other = pool.take(2 << 20)
    del taken, other
    gc.collect()
    assert pool.free_buffers(1 << 20) == 2 and pool.free_buffers(2 << 20) == 1
    assert pool.free_buffers() == 3


def test_a_buffer_lives_as_long_as_a_tensor_built_on_it():
    pool = BufferPool()
    array = pool.take(1 << 20)
    tensor = torch.from_numpy(array).view(torch.float32)
    tensor.fill_(2.0)
    del array
    gc.collect()
    assert pool.free_buffers() == 0  # the tensor still uses it
    assert float(tensor.sum()) == 2.0 * (1 << 18)
    del tensor
    gc.collect()
    assert pool.free_buffers() == 1


def test_a_buffer_dropped_while_its_pool_is_locked_comes_back_without_waiting_for_the_lock():
    # A garbage collection may run an array's finalizer at any allocation, on any thread, one inside take()
    # holding the pool's lock among them: the finalizer must not wait for that lock.
    pool = BufferPool()
    held = [pool.take(1 << 20)]
    held.append(held)  # a cycle: only the collector frees it, whenever it runs
    address = held[0].ctypes.data

    def collect_while_locked() -> None:
        nonlocal held
        with pool._lock:
            held = None
            gc.collect()

    collector = threading.Thread(target=collect_while_locked, name="collector", daemon=True)
    collector.start()
    collector.join(10)
    assert not collector.is_alive(), "the finalizer waited for the lock its own thread held"
    assert pool.free_buffers() == 1
    assert pool.take(1 << 20).ctypes.data == address


def test_big_answers_arrive_intact_through_the_pool(embedded_worker):
    worker = embedded_worker(shared_memory=0)  # answers on the socket, received into the pool
    size = 3 * buffers.MIN_BYTES // 4  # float32 elements: 3 MiB tensors
    results = [rpcdl.rpc_sync(worker.address, torch.arange, (size,), {"dtype": torch.float32}) for _ in range(4)]
    for result in results:
        assert result.shape == (size,) and float(result[-1]) == size - 1
    del results, result
    gc.collect()
    assert 1 <= buffers._pool.free_buffers(size * 4) <= buffers.FREE_PER_SIZE


def test_a_forked_child_starts_with_an_empty_pool():
    kept = buffers.take(1 << 20)
    del kept
    gc.collect()
    assert buffers._pool.free_buffers() >= 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.write(write, bytes([buffers._pool.free_buffers()]))
        os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"\x00"
    os.close(read)
    os.waitpid(pid, 0)
