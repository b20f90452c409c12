"""``rpcdl worker --procs N`` supervises: a child that dies is logged with why and started again.

Real processes: the supervisor and its children are ``rpcdl worker`` processes;
the tests kill children with real signals and stop the supervisor with SIGTERM.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys

import psutil
import pytest
from helpers import eventually, stop_supervisor

import rpcdl
from rpcdl.data.sources import FileSource
from rpcdl.local import child_environment, read_ready_line
from rpcdl.server.process import process_exists
from rpcdl.server.supervisor import Backoff, Supervisor, describe_exit

_WAIT = 30.0


def test_backoff_doubles_while_a_child_dies_young_and_starts_over_once_it_ran_well():
    backoff = Backoff(initial=0.5, cap=4.0, healthy_after=10.0)
    waits, wait = [], 0.0
    for _ in range(5):
        wait = backoff.next(wait, ran_for=0.1)
        waits.append(wait)
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert backoff.next(4.0, ran_for=10.0) == 0.5


def test_describe_exit_names_the_signal_or_the_code():
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert describe_exit(1) == "exited with code 1"


def test_a_child_that_cannot_be_started_stops_the_supervisor_unless_it_served_before(caplog):
    def cannot_start(index: int):
        raise RuntimeError("the fork server exited before it answered")

    supervisor = Supervisor(cannot_start, 2, drain_timeout=1.0, out=io.StringIO())
    assert supervisor.run(lambda: False, lambda: False) == 1  # would fail the same way again
    assert "process 0 could not be started: the fork server exited before it answered" in caplog.text

    attempts: list[int] = []

    def second_start_fails(index: int):
        attempts.append(index)
        if len(attempts) == 2:
            raise RuntimeError("fork failed")
        ready_then_exit = "print('127.0.0.1:1', flush=True); import time; time.sleep(0.2)"
        return subprocess.Popen([sys.executable, "-c", ready_then_exit], stdout=subprocess.PIPE)

    restarting = Supervisor(
        second_start_fails, 1, drain_timeout=1.0, backoff=Backoff(initial=0.05, cap=0.1), out=io.StringIO()
    )
    assert restarting.run(lambda: len(attempts) >= 3, lambda: False) == 0  # tried again after its backoff
    assert "could not be started again: fork failed; trying in" in caplog.text


@pytest.mark.parametrize("how", [signal.SIGKILL, "exit"])
def test_procs_restarts_a_child_that_dies_says_why_and_drains_all_on_sigterm(tmp_path, how):
    address_file = tmp_path / "workers"
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "rpcdl", "worker", "--procs", "2", "--port", "0", "--address-file", str(address_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_environment(),
        text=True,
    )
    pids: list[int] = []
    try:
        first = {read_ready_line(supervisor, 60.0), read_ready_line(supervisor, 60.0)}
        pids = [rpcdl.stats(address)["pid"] for address in sorted(first)]
        victim_address = sorted(first)[0]
        if how == "exit":
            rpcdl.rpc_async(victim_address, os._exit, (3,))  # the child ends itself, with a code
        else:
            os.kill(pids[0], how)
        replacement = read_ready_line(supervisor, 60.0)  # started again, on a new port (--port 0)
        assert replacement not in first
        new_pid = rpcdl.stats(replacement)["pid"]
        assert new_pid not in pids and rpcdl.rpc_sync(replacement, min, (1, 2)) == 1
        pids.append(new_pid)
        survivor = (first - {victim_address}).pop()
        assert address_file.read_text().split() == [survivor, replacement]  # the dead child's line is gone
        assert supervisor.poll() is None  # a child dying does not end the supervisor

        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(_WAIT) == 0
        log = supervisor.stderr.read()
        cause = "killed by SIGKILL" if how == signal.SIGKILL else "exited with code 3"
        assert re.search(rf"rpcdl worker process [01] \(pid {pids[0]}\) {cause} after [0-9.]+s; starting it again", log)
        assert "started again" in log
        assert log.count("drained") == 2  # both children drained on the supervisor's SIGTERM
        assert FileSource(address_file).addresses() == []  # and removed their lines
        eventually(lambda: not any(process_exists(pid) for pid in pids), "the children to exit", timeout=_WAIT)
    finally:
        stop_supervisor(supervisor, pids)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_procs_children_start_as_asked_each_in_a_process_group_of_its_own(start_method):
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "rpcdl", "worker", "--procs", "2", "--port", "0", "--start-method", start_method],
        stdout=subprocess.PIPE,
        env=child_environment(),
        text=True,
    )
    pids: list[int] = []
    try:
        addresses = [read_ready_line(supervisor, 60.0), read_ready_line(supervisor, 60.0)]
        pids = [rpcdl.stats(address)["pid"] for address in addresses]
        for pid in pids:
            assert os.getpgid(pid) == pid != os.getpgid(supervisor.pid)  # a Ctrl-C reaches the supervisor only
            parent = psutil.Process(pid).ppid()
            if start_method == "spawn":
                assert parent == supervisor.pid
            else:  # forked by the fork server, which the supervisor started
                assert parent != supervisor.pid and psutil.Process(parent).ppid() == supervisor.pid
        assert rpcdl.rpc_sync(addresses[1], min, (1, 2)) == 1
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(_WAIT) == 0
        eventually(lambda: not any(process_exists(pid) for pid in pids), "the children to exit", timeout=_WAIT)
    finally:
        stop_supervisor(supervisor, pids)
