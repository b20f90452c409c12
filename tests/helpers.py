"""Datasets and functions the tests send to workers (importable on both sides)."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import Dataset

import rpcdl
from rpcdl import local
from rpcdl.forkserver import ForkedProcess
from rpcdl.local import child_environment, read_ready_line
from rpcdl.processes import stop_process
from rpcdl.rpc.dial import served_before
from rpcdl.server.process import process_exists

#: The gates :func:`gated` calls wait on, by name; the test makes and opens them.
GATES: dict[str, threading.Event] = {}


def gated(name: str, value: int) -> int:
    """Return ``value`` once the test opens the gate ``name`` (at most 10 s)."""
    GATES[name].wait(10)
    return value


@contextlib.contextmanager
def gated_workers(count: int) -> Iterator[list[rpcdl.Worker]]:
    """``count`` workers in this process, two slots each, for :func:`gated` calls.

    On exit every gate opens (no call stays blocked), the client's connections
    close (the next test opens fresh ones) and the workers stop.
    """
    GATES.clear()
    started = [rpcdl.Worker(timeout=10, parallel=2).start() for _ in range(count)]
    try:
        yield started
    finally:
        for gate in GATES.values():
            gate.set()
        rpcdl.shutdown()
        for worker in started:
            worker.stop(grace=1.0)


class RangeDataset(Dataset):
    """Sample ``i`` is ``torch.tensor(i)``; optionally slow."""

    def __init__(self, n: int, delay: float = 0.0):
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return torch.tensor(index)


SLOWDOWN = 1.0  # set per worker process with set_slowdown()


def set_slowdown(factor: float) -> None:
    """Make this worker's ScaledDelayDataset that many times slower."""
    global SLOWDOWN
    SLOWDOWN = factor


class ScaledDelayDataset(RangeDataset):
    """Sleeps ``delay * SLOWDOWN`` per sample: one worker can be made slower than the others."""

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.delay * SLOWDOWN)
        return torch.tensor(index)


class FailingDataset(RangeDataset):
    """Raises ``ValueError`` for one index."""

    def __init__(self, n: int, bad_index: int):
        super().__init__(n)
        self.bad_index = bad_index

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.bad_index:
            raise ValueError(f"index {index} is broken")
        return super().__getitem__(index)


def worker_calls(workers: list[str]) -> tuple[int, int]:
    """Calls served and calls failed, summed over ``workers`` (from their stats)."""
    stats = [rpcdl.stats(w) for w in workers]
    return sum(s["calls_served"] for s in stats), sum(s["calls_failed"] for s in stats)


def values_and_errors(iterator: Iterator, errors: type[BaseException] = Exception) -> tuple[list, list]:
    """Everything ``iterator`` yields, and every error of type ``errors`` raised in its place, until it ends."""
    iterator = iter(iterator)
    values, raised = [], []
    while True:
        try:
            values.append(next(iterator))
        except StopIteration:
            return values, raised
        except errors as exc:
            raised.append(exc)


def worker_pid() -> int:
    return os.getpid()


def sleep_and_return(seconds: float, value):
    time.sleep(seconds)
    return value


def worker_pid_and(value):
    """``(value, the pid of the process that ran this)``."""
    return value, os.getpid()


class ArrayDataset(RangeDataset):
    """Sample ``i`` is ``size`` bytes: ``size // 8`` int64 copies of ``i``."""

    def __init__(self, n: int, size: int):
        super().__init__(n)
        self.size = size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((self.size // 8,), index, dtype=torch.int64)


class SlowBuildDataset(RangeDataset):
    """A :class:`RangeDataset` whose build, while the file ``slow_flag`` exists, first writes the file
    ``building`` (the test then knows a build is under way) and sleeps ``build_delay`` seconds."""

    def __init__(self, n: int, delay: float, slow_flag: str, building: str, build_delay: float):
        if os.path.exists(slow_flag):
            with open(building, "a") as marker:
                marker.write(f"{os.getpid()}\n")
            time.sleep(build_delay)
        super().__init__(n, delay)


class Allocates(Dataset):
    """Holds ``megabytes`` of memory it wrote (resident, not just reserved); item ``i`` is ``i``."""

    def __init__(self, megabytes: int, n: int = 10):
        self.block = bytearray(b"\x01") * (megabytes << 20)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index

    def grow(self) -> int:
        self.n += 1
        return self.n


def start_worker_process(*options: str) -> tuple[subprocess.Popen | ForkedProcess, str]:
    """An ``rpcdl worker`` process on a free loopback port with ``options``, and its address once it is ready.

    It is started as local_workers starts its own (on Linux, forked from a process that imported torch:
    tests/test_cli.py and others run ``python -m rpcdl worker`` itself). Its standard error is a pipe the
    test may read; stop it with :func:`rpcdl.processes.stop_process`.
    """
    process = local.start_worker_process(
        ["worker", "--port", "0", *options], child_environment(), stderr=subprocess.PIPE
    )
    try:
        return process, read_ready_line(process, 60.0)
    except BaseException:
        stop_process(process, grace=1.0)
        raise


def read_stderr_until(process: subprocess.Popen | ForkedProcess, text: str, timeout: float = 30.0) -> str:
    """Read the process's standard error (a pipe) until it holds ``text``; return what was read.

    It reads the pipe's bytes as they come (``os.read``): a buffered ``readline`` may take two lines from the
    pipe at once and leave the second in its buffer, where ``select`` does not see it.
    """
    read = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(process.stderr, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if selector.select(timeout=0.1):
                chunk = os.read(process.stderr.fileno(), 65536)
                read += chunk
                if text.encode() in read:
                    return read.decode(errors="replace")
                if not chunk:
                    break
    raise AssertionError(f"no line with {text!r} within {timeout}s: {read.decode(errors='replace')}")


def stop_supervisor(supervisor: subprocess.Popen, children: list[int]) -> None:
    """Stop an ``rpcdl worker --procs`` supervisor, SIGKILL any of its ``children`` (pids) still there, and
    close this process's connections."""
    stop_process(supervisor, grace=1.0)
    for pid in children:
        if process_exists(pid):
            os.kill(pid, signal.SIGKILL)
    rpcdl.shutdown()


def eventually(condition: Callable[[], object], what: str, timeout: float = 10.0, interval: float = 0.01) -> None:
    """Poll ``condition`` every ``interval`` seconds until it holds; after ``timeout`` seconds, fail naming ``what``.

    Example::

        eventually(lambda: worker.stats()["clients"] == 0, "the session to be forgotten")
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g}s for {what}")
        time.sleep(interval)


def free_port() -> int:
    """A loopback port the OS says is free now (another process could take it before the test binds it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def port_for_a_late_worker() -> int:
    """A free loopback port from the OS at which no worker served this process yet.

    A call to a worker that served this process before is not awaited when
    refused (it stopped or died), so a test that calls before its worker
    listens needs a port no earlier test's worker had.
    """
    while True:
        port = free_port()
        if not served_before(f"127.0.0.1:{port}"):
            return port


@contextlib.contextmanager
def threads_started() -> Iterator[list[str]]:
    """The names of the threads started (through :mod:`threading`) inside the ``with`` block, as they start.

    Each new thread records its own name as it begins to run (``threading.settrace``), so none is missed,
    however short its life.
    """
    names: list[str] = []

    def record(frame, event, arg):  # runs first in each new thread
        names.append(threading.current_thread().name)
        sys.settrace(None)  # once per thread
        return None

    threading.settrace(record)
    try:
        yield names
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
