"""Load on real worker processes: many client processes at once, and a storm of aborted handshakes.

Correctness only: every answer is checked, no speed is asserted.
"""

from __future__ import annotations

import json
import multiprocessing
import operator
import os
import socket
import struct
import subprocess
import sys
import time

import psutil
import pytest
import torch

import rpcdl
from rpcdl.transport.handshake import MAGIC, VERSION

CLIENTS = 32
CALLS = 500
ASYNC_WINDOW = 25
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def load_workers():
    with rpcdl.local_workers(2, parallel=2) as workers:
        yield workers
    rpcdl.shutdown()


# ---------------------------------------------------------------------------- 32 client processes


def _client(index: int, workers: list[str], calls: int, results) -> None:
    """One client process: ``calls`` calls alternating between the workers, half sync, half async."""
    wrong, errors = [], []
    base = index * 1_000_000

    def check(i: int, value) -> None:
        if i % 10 == 9:
            expected = (torch.arange(4) * (base + i)).tolist()
            value = value.tolist()
        else:
            expected = base + i
        if value != expected and len(wrong) < 5:
            wrong.append((i, repr(value), repr(expected)))

    def call(i: int):
        host = workers[(index + i) % len(workers)]
        if i % 10 == 9:  # a tensor each way, every tenth call
            return host, torch.mul, (torch.arange(4), base + i)
        return host, operator.add, (base, i)

    try:
        for i in range(calls // 2):
            host, func, args = call(i)
            check(i, rpcdl.rpc_sync(host, func, args, timeout=60))
        for start in range(calls // 2, calls, ASYNC_WINDOW):
            window = range(start, min(start + ASYNC_WINDOW, calls))
            futures = []
            for i in window:
                host, func, args = call(i)
                futures.append((i, rpcdl.rpc_async(host, func, args, timeout=60)))
            for i, future in futures:
                check(i, future.wait())
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    results.put((index, wrong, errors))
    rpcdl.shutdown()


def drive(workers: list[str], clients: int, calls: int) -> dict:
    """Fork ``clients`` processes that each make ``calls`` calls; gather what went wrong.

    Runs in its own process (see the test): forking from a process without
    threads or connections is safe, and the children share its imports.
    """
    context = multiprocessing.get_context("fork")
    results = context.SimpleQueue()
    processes = [context.Process(target=_client, args=(i, workers, calls, results)) for i in range(clients)]
    started = time.monotonic()
    for process in processes:
        process.start()
    reports = [results.get() for _ in processes]
    for process in processes:
        process.join(timeout=60)
    return {
        "seconds": round(time.monotonic() - started, 2),
        "reported": len(reports),
        "wrong": [item for _, wrong, _ in reports for item in wrong],
        "errors": [item for _, _, errors in reports for item in errors],
        "exit_codes": [process.exitcode for process in processes],
    }


def test_32_client_processes_500_calls_each(load_workers):
    before = [rpcdl.stats(address)["calls_served"] for address in load_workers]
    code = f"import json, sys, test_load; print(json.dumps(test_load.drive(sys.argv[1:], {CLIENTS}, {CALLS})))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", code, *load_workers], capture_output=True, text=True, timeout=110, env=env, cwd=TESTS
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{CLIENTS} processes x {CALLS} calls against 2 workers: {report['seconds']} s")
    assert report["errors"] == [] and report["wrong"] == []
    assert report["reported"] == CLIENTS and report["exit_codes"] == [0] * CLIENTS
    after = [rpcdl.stats(address)["calls_served"] for address in load_workers]
    # Calls alternate between the workers: each served exactly half of them (and this test's two stats calls).
    assert [b - a for a, b in zip(before, after, strict=True)] == [CLIENTS * CALLS // 2] * 2


# ---------------------------------------------------------------------------- aborted handshakes


def _hello() -> bytes:
    return struct.pack("!6sHB32s", MAGIC, VERSION, 0, os.urandom(32))


def _abort(sock: socket.socket, reset: bool) -> None:
    if reset:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _drop_handshakes(address: str, count: int, at_once: int = 50) -> None:
    """Open ``count`` connections, ``at_once`` at a time, each left at a different point of the handshake."""
    host, _, port = address.rpartition(":")
    for first in range(0, count, at_once):
        opened = []
        for n in range(first, min(first + at_once, count)):
            sock = socket.create_connection((host, int(port)), timeout=10)
            stage = n % 5
            if stage in (1, 4):
                sock.sendall(_hello()[:20])  # half a hello
            elif stage in (2, 3):
                sock.sendall(_hello())
            opened.append((sock, stage))
        for sock, stage in opened:
            if stage in (2, 3):
                welcome = b""
                while len(welcome) < 73:  # the worker answered: leave before sending the proof
                    chunk = sock.recv(73 - len(welcome))
                    assert chunk, "the worker closed before its welcome"
                    welcome += chunk
            _abort(sock, reset=stage in (3, 4))


def _usage(process: psutil.Process) -> tuple[int, int, int]:
    return process.num_fds(), process.num_threads(), process.memory_info().rss


def _settled(process: psutil.Process, fds: int, threads: int, timeout: float = 15.0) -> tuple[int, int, int]:
    """The process's usage once its descriptors and threads are back to ``fds`` and ``threads`` (or at timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        usage = _usage(process)
        if (usage[0] <= fds and usage[1] <= threads) or time.monotonic() > deadline:
            return usage
        time.sleep(0.05)


def _alone(address: str, timeout: float = 15.0) -> None:
    """Wait until this process is the worker's only client (earlier tests' clients are gone)."""
    deadline = time.monotonic() + timeout
    while rpcdl.stats(address)["clients"] > 1 and time.monotonic() < deadline:
        time.sleep(0.05)


def _refused_once_counted(address: str, expected: int, timeout: float = 15.0) -> int:
    """The worker's count of refused connections, once it reached ``expected`` (or at timeout).

    A connection the client dropped may still wait in the kernel's accept queue, where it holds none of the
    worker's descriptors: its refusal is counted only once the worker's loop takes it.
    """
    deadline = time.monotonic() + timeout
    while True:
        count = rpcdl.stats(address)["connections_refused"]
        if count >= expected or time.monotonic() > deadline:
            return count
        time.sleep(0.05)


def test_500_connections_dropped_mid_handshake_leave_nothing_behind(load_workers):
    address = load_workers[0]
    worker = psutil.Process(rpcdl.stats(address)["pid"])
    _alone(address)
    before = _usage(worker)
    refused = rpcdl.stats(address)["connections_refused"]
    _drop_handshakes(address, 100)  # warm up: the first threads, arenas and caches are not a leak
    base = _settled(worker, before[0], before[1])
    refused = _refused_once_counted(address, refused + 100)

    _drop_handshakes(address, 500)
    fds, threads, rss = _settled(worker, base[0], base[1])
    print(
        f"worker after 500 aborted handshakes: descriptors {base[0]} -> {fds}, threads {base[1]} -> {threads}, "
        f"RSS {base[2] / 2**20:.1f} -> {rss / 2**20:.1f} MiB"
    )
    assert fds <= base[0], "the worker kept descriptors of aborted connections"
    assert threads <= base[1], "the worker kept threads of aborted connections"
    assert rss - base[2] < 16 * 2**20, "the worker's memory grew by more than 16 MiB"
    assert _refused_once_counted(address, refused + 500) - refused == 500
    assert rpcdl.rpc_sync(address, operator.mul, (6, 7)) == 42  # and it serves
