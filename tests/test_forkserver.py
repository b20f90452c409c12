"""The fork server (rpcdl.forkserver): forked commands get their request's streams, environment and
directory, report their exit, take signals, and the server leaves when idle or when its client exits.

The servers here preload numpy, not torch, to stay quick; local_workers' use of one (with torch) is
covered by every test that starts local workers, and by the tests at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import eventually

import rpcdl
from rpcdl import forkserver
from rpcdl.errors import ForkServerExited
from rpcdl.forkserver import ForkServer, shared_fork_server, start_variables
from rpcdl.local import child_environment, start_worker_process
from rpcdl.server.process import process_exists

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    started = ForkServer(["numpy"], child_environment(), idle_timeout=10.0)
    yield started
    started.close()


def report(process) -> dict:
    return json.loads(process.stdout.readline())


def test_a_command_gets_its_arguments_environment_directory_and_streams(server, tmp_path, capfd, monkeypatch):
    env = {**child_environment(), "FORKSERVER_PROBE": "seen"}
    monkeypatch.chdir(tmp_path)
    process = server.start("forkserver_probe", ["3"], env)
    seen = report(process)
    assert (seen["argv"], seen["cwd"], seen["variable"], seen["pid"]) == (["3"], str(tmp_path), "seen", process.pid)
    assert process.wait(timeout=10) == 3 and process.poll() == 3 and process.returncode == 3
    assert "probe" in capfd.readouterr().err  # this process's standard error, as Popen would give it


def test_a_command_writes_its_standard_error_to_a_pipe_on_request(server, capfd):
    process = server.start("forkserver_probe", ["0"], child_environment(), stderr=subprocess.PIPE)
    assert report(process)["argv"] == ["0"]
    assert process.stderr.read() == "probe\n"  # to the end: the pipe's only writer was the command
    assert process.wait(timeout=10) == 0
    assert "probe" not in capfd.readouterr().err
    with pytest.raises(ValueError, match=r"subprocess\.PIPE"):
        server.start("forkserver_probe", ["0"], child_environment(), stderr=subprocess.DEVNULL)


def test_two_commands_draw_different_random_numbers(server):
    first, second = (server.start("forkserver_probe", ["0"], child_environment()) for _ in range(2))
    assert report(first)["random"] != report(second)["random"]  # numpy reseeded in each, as in a new interpreter
    assert [first.wait(10), second.wait(10)] == [0, 0]


def test_signals_reach_the_command_and_its_code_says_so(server):
    process = server.start("forkserver_probe", ["0", "60"], child_environment())
    report(process)
    comm = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in (process.pid, server.pid)}
    assert comm == {process.pid: "forkserver_prob", server.pid: "rpcdl forkserve"}  # top shows what runs
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.2)
    assert process.poll() is None
    process.terminate()
    assert process.wait(timeout=10) == -signal.SIGTERM
    process.kill()  # it ended: nothing is sent, nothing raises


def test_threads_starting_commands_at_once_each_get_their_own(server, switching_often):
    processes: dict[int, object] = {}

    def start(index: int) -> None:
        processes[index] = server.start("forkserver_probe", [str(index)], child_environment())

    threads = [threading.Thread(target=start, args=(i,), name=f"starter-{i}") for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, process in processes.items():
        assert report(process)["argv"] == [str(index)]
    waiters = [threading.Thread(target=p.wait, name=f"waiter-{i}") for i, p in processes.items()]
    for thread in waiters:
        thread.start()
    for thread in waiters:
        thread.join(timeout=20)
    assert {index: process.returncode for index, process in processes.items()} == {i: i for i in range(6)}


def test_a_request_that_disagrees_on_a_start_variable_is_refused(server):
    with pytest.raises(ValueError, match="read at start"):
        server.start("forkserver_probe", ["0"], {**child_environment(), "PYTHONHASHSEED": "7"})
    assert start_variables({"PYTHONHASHSEED": "7", "HOME": "/"}) == {"PYTHONHASHSEED": "7"}


def test_an_idle_server_leaves_and_a_shared_one_is_started_again():
    env = {**child_environment(), "PYTHON_FORKSERVER_TEST": "idle"}  # a server of this test's own
    server = ForkServer(["json"], env, idle_timeout=0.5)
    process = server.start("forkserver_probe", ["0"], env)
    assert process.wait(timeout=10) == 0
    eventually(lambda: not server.running, "the idle server to leave")
    with pytest.raises(ForkServerExited) as raised:
        server.start("forkserver_probe", ["0"], env)
    assert raised.value.code == 0
    shared = shared_fork_server(["json"], env)
    assert shared is shared_fork_server(["json"], {**env, "HOME": "/elsewhere"})  # only start variables count
    assert shared.start("forkserver_probe", ["0"], env).wait(timeout=10) == 0
    shared.close()


def test_the_idle_time_of_a_shared_server_comes_from_the_environment(monkeypatch):
    env = {**child_environment(), "PYTHON_FORKSERVER_TEST": "idle-env"}  # a server of this test's own
    monkeypatch.setenv("RPCDL_FORK_SERVER_IDLE", "never")
    with pytest.raises(ValueError, match="RPCDL_FORK_SERVER_IDLE"):
        shared_fork_server(["json"], env)
    monkeypatch.setenv("RPCDL_FORK_SERVER_IDLE", "0.5")
    shared = shared_fork_server(["json"], env)
    assert shared.start("forkserver_probe", ["0"], env).wait(timeout=10) == 0
    eventually(lambda: not shared.running, "the server to leave after half a second, not the default 30")


def test_a_request_that_waits_for_the_servers_imports_says_so(monkeypatch, caplog):
    monkeypatch.setattr(forkserver, "NOTICE_AFTER", 0.3)
    server = ForkServer(["forkserver_slow_import"], child_environment())
    try:
        assert server.start("forkserver_probe", ["0"], child_environment()).wait(timeout=10) == 0
    finally:
        server.close()
    (notice,) = [record.getMessage() for record in caplog.records if record.name == "rpcdl.forkserver"]
    assert f"waiting for the fork server (pid {server.pid}) to answer" in notice
    assert "it imports forkserver_slow_import before its first fork (up to 60s)" in notice


def test_a_server_that_cannot_preload_says_so():
    server = ForkServer(["no_such_module_for_rpcdl"], child_environment())
    with pytest.raises(ForkServerExited, match="exited before it answered") as raised:
        server.start("forkserver_probe", ["0"], child_environment())
    assert raised.value.code == 1


CLIENT_THEN_EXIT = """
import sys
from rpcdl.forkserver import ForkServer
from rpcdl.local import child_environment
server = ForkServer(["json"], child_environment())
process = server.start("forkserver_probe", ["0"], child_environment())
process.wait(timeout=10)
print(server.pid, flush=True)
"""


def test_the_server_leaves_when_its_client_exits():
    result = subprocess.run(
        [sys.executable, "-c", CLIENT_THEN_EXIT], capture_output=True, text=True, env=child_environment(), timeout=30
    )
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout)
    eventually(lambda: not process_exists(pid), "the server to leave with its client")


def test_local_workers_start_from_one_fork_server_and_spawn_on_request():
    with rpcdl.local_workers(2) as forked, rpcdl.local_workers(1, start_method="spawn") as spawned:
        assert all(type(p).__name__ == "ForkedProcess" for p in forked.processes)
        assert isinstance(spawned.processes[0], subprocess.Popen)
        parents = {_parent(p.pid) for p in forked.processes}
        assert len(parents) == 1 and parents != {os.getpid()}  # both from the same server
        assert all(rpcdl.ping(address) > 0 for address in [*forked, *spawned])


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().split(")")[-1].split()[1])


@pytest.mark.parametrize("start_method", ["fork", 1])
def test_local_workers_refuse_an_unknown_start_method(start_method):
    with (
        pytest.raises(ValueError, match="start_method must be one of forkserver, spawn"),
        rpcdl.local_workers(1, start_method=start_method),
    ):
        pass
    with pytest.raises(ValueError, match="start_method must be one of forkserver, spawn"):
        start_worker_process(["worker"], child_environment(), start_method)


def test_threads_waiting_on_one_command_all_get_its_code(switching_often):
    server = ForkServer(["numpy"], child_environment())
    process = server.start("forkserver_probe", ["5", "0.3"], child_environment())
    codes: list[int] = []
    waiters = [threading.Thread(target=lambda: codes.append(process.wait()), name=f"waiter-{i}") for i in range(4)]
    for thread in waiters:
        thread.start()
    for thread in waiters:
        thread.join(timeout=20)
    assert codes == [5, 5, 5, 5]  # none took the code from the others
    process.send_signal(signal.SIGTERM)  # it ended: nothing is sent
    assert process.poll() == 5
    server.close()
