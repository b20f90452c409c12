"""The command line: rpcdl worker / status, python -m rpcdl.launch, the address file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import helpers
import pytest

import rpcdl


def child_environment() -> dict[str, str]:
    """This environment, with this process's import path for a child Python."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def run_python(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=child_environment()
    )


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return run_python("-m", "rpcdl", *args, timeout=timeout)


@pytest.mark.parametrize("command", [["--help"], ["worker", "--help"], ["status", "--help"]])
def test_help_is_complete(command):
    result = run_cli(*command)
    assert result.returncode == 0
    if command == ["worker", "--help"]:
        for option in (
            "--host",
            "--port",
            "--timeout",
            "--parallel",
            "--procs",
            "--address-file",
            "--token-file",
            "--insecure",
            "--tls-cert",
            "--tls-key",
            "--advertise",
            "--threads",
            "--grace",
        ):
            assert option in result.stdout, option


def test_launch_module_help_matches_the_seed():
    result = subprocess.run([sys.executable, "-m", "rpcdl.launch", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for option in ("--host", "--port", "--timeout", "--parallel"):
        assert option in result.stdout
    assert "6543" in result.stdout


def test_bad_arguments_are_explained():
    result = run_cli("worker", "--parallel", "-1")
    assert result.returncode == 2 and "expected a positive integer" in result.stderr
    result = run_cli("status", "not-an-address")
    assert result.returncode == 2 and "malformed worker address" in result.stderr


def test_procs_and_address_file_then_status_table(tmp_path):
    address_file = tmp_path / "workers"
    process = subprocess.Popen(
        [sys.executable, "-m", "rpcdl", "worker", "--port", "0", "--procs", "3", "--address-file", str(address_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_environment(),
    )
    try:
        printed = [process.stdout.readline().strip() for _ in range(3)]
        deadline = time.monotonic() + 30
        while len(address_file.read_text().split()) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        listed = address_file.read_text().split()
        assert sorted(listed) == sorted(printed) and len(set(listed)) == 3
        for address in listed:
            assert rpcdl.rpc_sync(address, os.getpid) != os.getpid()
        table = run_cli("status", *listed)
        assert table.returncode == 0
        header, *rows = table.stdout.strip().splitlines()
        assert header.split()[:3] == ["worker", "state", "pid"] and len(rows) == 3
        assert all(any(address in row for row in rows) for address in listed)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        process.stdout.close()
        process.stderr.close()
        rpcdl.shutdown()


def test_status_of_an_unreachable_worker_fails():
    result = run_cli("status", f"127.0.0.1:{helpers.free_port()}", "--answer-timeout", "1")
    assert result.returncode == 1 and "refused" in result.stdout


def test_the_command_skips_the_collections_at_exit_and_not_before():
    """The command freezes the collector at exit (its last collections would walk all of torch), not while the
    process that called it goes on."""
    address = f"127.0.0.1:{helpers.free_port()}"
    script = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0, flush=True))\n"
        "from rpcdl.cli import main\n"
        f"status = main(['status', {address!r}, '--answer-timeout', '1'])\n"
        "print('after the command:', status, gc.get_freeze_count(), flush=True)\n"
    )
    result = run_python("-c", script)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-2:] == ["after the command: 1 0", "frozen at exit: True"], result.stdout


def test_local_workers_stop_when_their_parent_dies():
    code = (
        "import rpcdl, os, sys\n"
        "ctx = rpcdl.local_workers(1)\n"
        "workers = ctx.__enter__()\n"
        "print(workers.processes[0].pid, flush=True)\n"
        "os._exit(0)\n"
    )
    result = run_python("-c", code, timeout=120)
    pid = int(result.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("the local worker outlived its parent")
