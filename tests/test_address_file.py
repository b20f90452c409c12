"""``rpcdl worker --address-file``: one line per live worker, whatever starts, drains, dies and restarts.

Real worker processes (``rpcdl worker`` and ``--procs``) write a real file;
the pure functions are tested beside them, many threads at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from helpers import free_port, start_worker_process, stop_supervisor

import rpcdl
from rpcdl.data.sources import FileSource, Fleet
from rpcdl.local import child_environment, read_ready_line
from rpcdl.processes import stop_process
from rpcdl.server.process import NO_WORKER_LINE, add_address, remove_address

pytestmark = pytest.mark.timeout(120)

_WAIT = 30.0


def test_add_lists_an_address_once_and_remove_keeps_the_other_lines(tmp_path):
    path = tmp_path / "workers.txt"
    path.write_text("# my fleet\n10.0.0.1:7000\n")
    assert add_address(path, "10.0.0.2:7000") is True
    assert add_address(path, "10.0.0.2:7000") is False  # a worker restarted on its port: still one line
    assert path.read_text() == "# my fleet\n10.0.0.1:7000\n10.0.0.2:7000\n"
    inode = os.stat(path).st_ino
    assert remove_address(path, "10.0.0.1:7000") is True
    assert path.read_text() == "# my fleet\n10.0.0.2:7000\n"
    assert os.stat(path).st_ino != inode  # rewritten beside it and renamed: a reader never sees half of it
    assert remove_address(path, "10.0.0.1:7000") is False
    assert remove_address(tmp_path / "missing.txt", "10.0.0.1:7000") is False
    assert not (tmp_path / "missing.txt").exists()
    assert [name for name in os.listdir(tmp_path)] == ["workers.txt"]  # no temporary file left behind


def test_the_last_address_removed_leaves_a_file_that_lists_no_worker(tmp_path):
    path = tmp_path / "workers.txt"
    add_address(path, "10.0.0.1:7000")
    fleet = Fleet(FileSource(path), interval=3600.0)
    assert fleet.membership().addresses == ("10.0.0.1:7000",)
    assert remove_address(path, "10.0.0.1:7000") is True
    assert path.read_text() == NO_WORKER_LINE + "\n"  # not empty: an empty file is one being rewritten
    assert fleet.refresh().addresses == () and fleet.why_empty() is None  # read, and it lists nobody: news
    fleet.close()
    assert add_address(path, "10.0.0.2:7000") is True
    assert path.read_text() == "10.0.0.2:7000\n"  # the note goes as a worker comes


def test_concurrent_adds_and_removes_lose_no_line(tmp_path, switching_often):
    path = tmp_path / "workers.txt"
    stays = [f"10.0.0.{i}:7000" for i in range(8)]
    goes = [f"10.0.1.{i}:7000" for i in range(8)]
    torn: list[str] = []
    done = threading.Event()

    def churn(address: str, keep: bool) -> None:
        for _ in range(5):
            add_address(path, address)
            remove_address(path, address)
        if keep:
            add_address(path, address)

    def read_while_they_write() -> None:
        while not done.is_set():
            if path.exists():
                text = path.read_text()
                if text and not text.endswith("\n"):
                    torn.append(text)

    reader = threading.Thread(target=read_while_they_write, name="test-reader")
    reader.start()
    threads = [
        threading.Thread(target=churn, args=(address, keep), name=f"test-writer-{address}")
        for addresses, keep in ((stays, True), (goes, False))
        for address in addresses
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    done.set()
    reader.join(10)
    assert sorted(path.read_text().split()) == sorted(stays)
    assert torn == []


def test_a_worker_lists_itself_once_and_removes_its_line_when_it_drains(tmp_path):
    path = tmp_path / "workers.txt"
    port = free_port()
    address = f"127.0.0.1:{port}"
    path.write_text(f"# fleet\n{address}\n")  # left by a worker killed with SIGKILL on this port
    process, ready = start_worker_process("--port", str(port), "--address-file", str(path))
    try:
        assert ready == address
        assert path.read_text() == f"# fleet\n{address}\n"  # restarted on its port: not a second line
        process.send_signal(signal.SIGTERM)
        assert process.wait(_WAIT) == 0
        assert path.read_text() == "# fleet\n"  # drained: its line is gone, the comment stays
    finally:
        stop_process(process, grace=1.0)
        rpcdl.shutdown()


@contextlib.contextmanager
def socket_listening() -> Iterator[int]:
    """A loopback port held by a listening socket for the block."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


def _supervisor(*options: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rpcdl", "worker", "--procs", "2", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_environment(),
        text=True,
    )


def test_procs_removes_a_killed_childs_line_and_a_restart_on_its_port_adds_one(tmp_path):
    path = tmp_path / "workers.txt"
    port = free_port()
    supervisor = _supervisor("--port", str(port), "--address-file", str(path))
    pids: list[int] = []
    try:
        first = sorted([read_ready_line(supervisor, 60.0), read_ready_line(supervisor, 60.0)])
        pids = [rpcdl.stats(address)["pid"] for address in first]
        assert sorted(path.read_text().split()) == first
        os.kill(pids[0], signal.SIGKILL)
        again = read_ready_line(supervisor, 60.0)  # the same port: the same address
        assert again == first[0]
        pids.append(rpcdl.stats(again)["pid"])
        assert sorted(path.read_text().split()) == first  # one line each, not two for the restarted one
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(_WAIT) == 0
        assert FileSource(path).addresses() == []  # every child drained and removed its line
    finally:
        stop_supervisor(supervisor, pids)


def test_procs_on_a_port_in_use_stops_with_that_error_instead_of_restarting_forever():
    with socket_listening() as port:
        supervisor = _supervisor("--port", str(port))
        try:
            assert supervisor.wait(60) == 1
            error = supervisor.stderr.read()
        finally:
            stop_process(supervisor, grace=1.0)
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in error
    assert "before it was ready" in error and "starting it again" not in error


def test_a_busy_metrics_port_is_one_error_line_and_exit_1():
    with socket_listening() as port:
        process = subprocess.run(
            [sys.executable, "-m", "rpcdl", "worker", "--port", "0", "--metrics-port", str(port)],
            capture_output=True,
            env=child_environment(),
            text=True,
            timeout=60,
        )
    assert process.returncode == 1, process.stderr
    errors = [line for line in process.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0], process.stderr
    assert "usage:" not in process.stderr


def test_read_ready_line_reads_two_lines_written_at_once():
    code = "import sys, time; sys.stdout.write('a:1\\n\\nb:2\\n'); sys.stdout.flush(); time.sleep(30)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert read_ready_line(process, 10.0) == "a:1"
        assert read_ready_line(process, 10.0) == "b:2"  # it was in the pipe with the first, not lost to a buffer
    finally:
        stop_process(process, grace=1.0)
