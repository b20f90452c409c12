"""``rpcdl.local_workers``: what it yields, and what its workers print in the user's terminal."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import rpcdl

pytestmark = pytest.mark.timeout(90)

# Starts one local worker, sends it bytes that are not rpcdl (the worker logs a warning and goes on),
# makes a call, and stops it: what the worker prints lands on this script's standard error.
SCRIPT = textwrap.dedent(
    """
    import json, socket, sys
    import rpcdl

    options = json.loads(sys.argv[1])
    with rpcdl.local_workers(1, **options) as workers:
        host, port = workers[0].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as raw:
            raw.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
            while raw.recv(4096):
                pass  # until the worker closes it: its warning is written by then
        assert rpcdl.rpc_sync(workers[0], sum, ([1, 2],)) == 3
    print("done", flush=True)
    """
)


def run_script(options: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(options)], capture_output=True, text=True, timeout=80, env=env
    )


def test_what_local_workers_yields_pickles_as_the_plain_list_of_addresses():
    with rpcdl.local_workers(2) as workers:
        copy = pickle.loads(pickle.dumps(workers))
        assert copy == list(workers) and type(copy) is list
        assert all(isinstance(address, str) and address.startswith("127.0.0.1:") for address in copy)
        assert rpcdl.rpc_sync(copy[1], len, (copy,)) == 2  # and crosses to a worker like any list


def test_local_workers_print_warnings_but_no_info_lines_by_default():
    result = run_script({})
    assert result.returncode == 0 and result.stdout == "done\n", result.stderr[-3000:]
    assert " INFO " not in result.stderr and "ready" not in result.stderr, result.stderr
    assert "refused connection" in result.stderr and " WARNING " in result.stderr  # warnings still show


def test_local_workers_log_level_shows_their_info_lines():
    result = run_script({"log_level": "info"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ready (pid" in result.stderr and "draining" in result.stderr and "left" in result.stderr


def test_local_workers_refuse_an_unknown_log_level_before_starting_anything():
    with (
        pytest.raises(ValueError, match="log_level must be one of DEBUG, INFO, WARNING"),
        rpcdl.local_workers(1, log_level="chatty"),
    ):
        pass
