"""One way to stop child processes (rpcdl.processes), and the sliding window of calls the bench systems share."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

import rpcdl
from rpcdl.cli.bench.systems import calls_in_a_window
from rpcdl.processes import stop_process, stop_processes

IGNORES_SIGTERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
    "time.sleep(120)"
)
EXITS_ON_SIGTERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(3)); print('ready', flush=True); "
    "time.sleep(120)"
)


def started(code: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"  # its signal handler is installed
    return process


@pytest.mark.timeout(30)
def test_a_process_that_exits_on_sigterm_is_reaped_with_its_code_and_its_pipes_closed():
    process = started(EXITS_ON_SIGTERM)
    assert stop_process(process, grace=20) == 3
    assert process.stdout.closed and process.stderr.closed


@pytest.mark.timeout(30)
def test_a_process_that_ignores_sigterm_is_killed_after_the_grace():
    process = started(IGNORES_SIGTERM)
    assert stop_process(process, grace=0.5) == -9


@pytest.mark.timeout(30)
def test_stopping_a_process_that_has_exited_reaps_it_only():
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"], stdout=subprocess.PIPE)
    process.wait()
    assert stop_process(process) == 5 and process.stdout.closed


@pytest.mark.timeout(30)
def test_several_processes_get_sigterm_together_and_the_stubborn_ones_sigkill():
    processes = [started(EXITS_ON_SIGTERM), started(IGNORES_SIGTERM), started(EXITS_ON_SIGTERM)]
    assert stop_processes(processes, grace=1.0) == [3, -9, 3]


_running = 0
_most_running = 0
_lock = threading.Lock()


def running_for_a_moment() -> None:
    global _running, _most_running
    with _lock:
        _running += 1
        _most_running = max(_most_running, _running)
    time.sleep(0.01)
    with _lock:
        _running -= 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("window", [1, 3])
def test_calls_in_a_window_keeps_at_most_window_calls_in_flight_and_makes_them_all(embedded_worker, window):
    global _most_running
    _most_running = 0
    address = embedded_worker(parallel=8).address
    made = []

    def call():
        made.append(1)
        return rpcdl.rpc_async(address, running_for_a_moment)

    calls_in_a_window(20, window, call)
    assert len(made) == 20 and _running == 0
    assert 1 <= _most_running <= window
