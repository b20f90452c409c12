"""``rpcdl status``: JSON, the table's shape, the states it names, --watch, and no torch on its path."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from helpers import RangeDataset, free_port, read_stderr_until, start_worker_process

import rpcdl
from rpcdl.cli.probe import Reach, ask_stats
from rpcdl.processes import stop_process

pytestmark = pytest.mark.timeout(120)


def run_status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "rpcdl", "status", *args], capture_output=True, text=True, timeout=60, env=environment
    )


def start_watch(*args: str) -> subprocess.Popen:
    """``rpcdl status --watch *args`` in a process of its own, stopped by SIGINT as by Ctrl-C.

    A shell that starts pytest in the background (``&``, no job control) has it ignore SIGINT, its children
    too, and Python then installs no handler for it: the watcher puts it back, as a terminal's process has it.
    """
    code = (
        "import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"from rpcdl.cli import main\nsys.exit(main(['status', '--watch', *{list(args)!r}]))\n"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment
    )


def remote_pid() -> int:
    return os.getpid()


def test_json_parses_and_status_is_not_one_of_the_clients(spawn_workers):
    (address,) = spawn_workers(1)
    assert rpcdl.rpc_sync(address, remote_pid) != os.getpid()  # this process: one client
    result = run_status("--json", address)
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)["workers"]
    assert (row["address"], row["state"], row["clients"], row["observers"]) == (address, "up", 1, 1)
    assert row["calls_served"] >= 1 and row["pid"] != os.getpid()
    assert rpcdl.stats(address)["clients"] == 1  # a trainer asking on its own connection still counts


def test_a_refused_port_and_a_token_mismatch_are_named_and_the_table_keeps_its_shape(
    spawn_workers, tmp_path, monkeypatch
):
    monkeypatch.setenv("RPCDL_TOKEN", "right-token")  # this process pings the workers it starts
    (address,) = spawn_workers(1, token="right-token")
    wrong, right = tmp_path / "wrong", tmp_path / "right"
    wrong.write_text("wrong-token\n")
    right.write_text("right-token\n")
    refused = f"127.0.0.1:{free_port()}"
    result = run_status(address, refused, "--token-file", str(wrong), "--answer-timeout", "30")
    assert result.returncode == 1
    header, *rows = result.stdout.splitlines()
    assert len(rows) == 2
    note_at = header.index("note")
    assert header.split()[:2] == ["worker", "state"]
    for row, (where, state, reason) in zip(
        rows, [(address, "token mismatch", "token"), (refused, "refused", "connection refused")], strict=True
    ):
        assert row.startswith(where) and row[header.index("state") : header.index("pid")].strip() == state
        assert reason in row[note_at:]  # every row has every column: the note starts under its header
        cells = row[header.index("pid") : note_at].split()
        assert set(cells) == {"-"} and len(cells) == 11  # pid .. transport: each column has its cell
    good = run_status(address, "--token-file", str(right), "--json")
    assert good.returncode == 0 and json.loads(good.stdout)["workers"][0]["authenticated"] is True


def test_the_worker_counts_the_batches_it_makes(spawn_workers):
    (address,) = spawn_workers(1)
    before = rpcdl.stats(address)["batches"]
    loader = rpcdl.RPCDataloader(rpcdl.RPCDataset([address], RangeDataset, 10), batch_size=4)
    assert len(list(loader)) == 3
    assert rpcdl.stats(address)["batches"] - before == 3


def test_a_refused_port_is_not_retried():
    answer = ask_stats(f"127.0.0.1:{free_port()}", None, timeout=30.0)
    assert (answer.reach, answer.reason) == (Reach.REFUSED, "connection refused")


def test_many_workers_are_asked_at_once_on_the_loop_without_a_thread_each(switching_often):
    from helpers import threads_started

    from rpcdl.cli.status import ask_all
    from rpcdl.transport.event_loop import process_loop

    process_loop()  # started before: the loop is the one thread the probes use
    refused = [f"127.0.0.1:{free_port()}" for _ in range(6)]
    with threads_started() as started:
        answers = ask_all(refused, None, None, 10.0)
    assert [answer.address for answer in answers] == refused
    assert {answer.reach for answer in answers} == {Reach.REFUSED}
    assert started == [], f"asking {len(refused)} workers started threads {started}"


def test_a_malformed_address_is_named_before_anything_is_asked():
    from rpcdl.cli.probe import ask_many

    with pytest.raises(ValueError, match="no-port"):
        ask_many(["127.0.0.1:1", "no-port"], None, timeout=1.0)
    with pytest.raises(ValueError, match="positive"):
        ask_many(["127.0.0.1:1"], None, timeout=0)


def test_something_else_on_the_port_is_not_rpcdl():
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"

        def answer_http() -> None:
            connection, _ = server.accept()
            with connection:
                connection.recv(64)
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        import threading

        thread = threading.Thread(target=answer_http, name="test-http", daemon=True)
        thread.start()
        answer = ask_stats(address, None, timeout=10.0)
        thread.join(10)
    assert answer.reach is Reach.NOT_RPCDL and "HTTP server" in answer.reason


def test_the_status_path_imports_no_torch(spawn_workers):
    (address,) = spawn_workers(1)
    code = (
        "import sys\nfrom rpcdl.cli import main\n"
        f"code = main(['status', '--json', {address!r}])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "import rpcdl\nassert rpcdl.RPCDataset.__name__ == 'RPCDataset'\nsys.exit(code)\n"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=environment)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["workers"][0]["state"] == "up"


def test_workers_come_as_lists_files_and_the_option(spawn_workers, tmp_path):
    first, second = spawn_workers(2)
    listed = tmp_path / "workers.txt"
    listed.write_text(f"# written by rpcdl worker --address-file\n{second}\n")
    for args in ([f"{first},{second}"], [first, str(listed)], ["--workers", first, second], ["--workers", str(listed)]):
        result = run_status("--json", *args)
        assert result.returncode == 0, (args, result.stderr)
        addresses = [row["address"] for row in json.loads(result.stdout)["workers"]]
        assert set(addresses) <= {first, second} and second in addresses, args
    result = run_status("no-such-file")
    assert result.returncode == 2 and "no such file: 'no-such-file'" in result.stderr
    missing = run_status("--workers", str(tmp_path / "workers.txt.old"))
    assert missing.returncode == 2 and f"no such file: '{tmp_path / 'workers.txt.old'}'" in missing.stderr
    assert "malformed worker address" not in missing.stderr.split("(")[0]  # missing, said first
    assert run_status().returncode == 2


def test_a_file_listing_a_worker_twice_shows_it_once(spawn_workers, tmp_path):
    (address,) = spawn_workers(1)
    listed = tmp_path / "workers.txt"
    listed.write_text(f"{address}\n{address}\n")
    result = run_status("--json", str(listed), "--workers", address)
    assert result.returncode == 0, result.stderr
    assert [row["address"] for row in json.loads(result.stdout)["workers"]] == [address]


def test_a_dns_source_is_asked_for_its_workers(spawn_workers):
    (address,) = spawn_workers(1)
    port = address.rsplit(":", 1)[1]
    result = run_status("--json", f"dns://127.0.0.1:{port}")
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = json.loads(result.stdout)["workers"]
    assert (row["address"], row["state"]) == (address, "up")
    for json_option in ([], ["--json"]):  # a source listing no worker is one that did not answer: exit 1
        result = run_status(*json_option, address, "dns://no-such-host.invalid:6543", "--answer-timeout", "20")
        assert result.returncode == 1, result.stdout
        assert "no-such-host.invalid does not resolve" in result.stdout


def test_a_redis_registry_is_asked_for_its_workers(tmp_path):
    redis_server_module = pytest.importorskip("rpcdl.data.cache.redis_server")
    try:
        redis_server_module.find_redis_server()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    with redis_server_module.RedisServer() as server:
        url = f"redis://{server.host}:{server.port}/0?key=status-{os.getpid()}"
        worker, address = start_worker_process("--register", url)
        try:
            joined = read_stderr_until(worker, "joined registry")  # it says it joined, as it says it left
            assert address in joined
            result = run_status("--json", url)
            assert result.returncode == 0, result.stdout + result.stderr
            assert [(row["address"], row["state"]) for row in json.loads(result.stdout)["workers"]] == [(address, "up")]
        finally:
            stop_process(worker, grace=5.0)
        result = run_status(url)  # drained: it left the registry, which now lists no worker
        assert result.returncode == 1 and "lists no worker" in result.stdout


def test_timeout_is_a_deprecated_spelling_of_answer_timeout():
    result = run_status(f"127.0.0.1:{free_port()}", "--timeout", "3")
    assert result.returncode == 1
    assert "--timeout is deprecated; use --answer-timeout" in result.stderr


def test_watch_reports_rates_over_the_interval_and_stops_on_ctrl_c(spawn_workers):
    (address,) = spawn_workers(1)
    watch = start_watch("--interval", "0.3", "--json", address)
    try:
        loader = rpcdl.RPCDataloader(rpcdl.RPCDataset([address], RangeDataset, 64), batch_size=4)
        readings = []
        for _ in range(200):  # the batches below are made while it watches: some interval sees them
            assert len(list(loader)) == 16
            (row,) = json.loads(watch.stdout.readline())["workers"]
            readings.append(row)
            if len(readings) >= 3 and row["batches_per_second"] > 0:
                break
        last = readings[-1]
        assert {"busy_percent", "batches_per_second", "calls_per_second", "mb_per_second", "clients"} <= set(last)
        assert last["batches_per_second"] > 0 and last["mb_per_second"] > 0 and 0 <= last["busy_percent"] <= 100
        assert last["clients"] == 1  # this process; not the watcher
    finally:
        watch.send_signal(signal.SIGINT)
        code = watch.wait(30)
        watch.stdout.close()
        watch.stderr.close()
    assert code == 0


def test_watch_ends_with_1_when_a_worker_did_not_answer_its_last_reading():
    watch = start_watch("--interval", "0.2", "--json", f"127.0.0.1:{free_port()}")
    try:
        (row,) = json.loads(watch.stdout.readline())["workers"]
        assert row["state"] == "refused"
    finally:
        watch.send_signal(signal.SIGINT)
        code = watch.wait(30)
        watch.stdout.close()
        watch.stderr.close()
    assert code == 1
