"""Logging: only the ``rpcdl`` logger is configured; what a worker says at INFO; JSON lines; trainer warnings."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys

import pytest
from helpers import RangeDataset

import rpcdl

pytestmark = pytest.mark.timeout(120)

_TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) rpcdl[.\w]*: ")


def chatter() -> int:
    """Runs on the worker: another library's debug message, as PIL logs its PNG chunks."""
    logging.getLogger("PIL.PngImagePlugin").debug("STREAM b'IHDR' 16 13")
    return 1


def _start_worker(*args: str) -> tuple[subprocess.Popen, str]:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    worker = subprocess.Popen(
        [sys.executable, "-m", "rpcdl", "worker", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
    )
    return worker, worker.stdout.readline().strip()


def _stop(worker: subprocess.Popen) -> list[str]:
    rpcdl.shutdown()
    worker.send_signal(signal.SIGTERM)
    _, err = worker.communicate(timeout=60)
    worker.stdout.close()
    return err.splitlines()


def test_a_worker_at_debug_configures_only_rpcdl_and_says_what_an_operator_wants():
    worker, address = _start_worker("--log-level", "debug")
    try:
        assert rpcdl.rpc_sync(address, chatter) == 1
        dataset = rpcdl.RPCDataset([address], RangeDataset, 5)
        assert len(dataset) == 5
    finally:
        lines = _stop(worker)
    text = "\n".join(lines)
    assert "IHDR" not in text  # the root logger was left alone: another library's debug stays off
    assert all(_TEXT_LINE.match(line) for line in lines), text
    for phrase in ("ready", "client 127.0.0.1:", "connected", "dataset RangeDataset built (5 items)", "draining"):
        assert phrase in text, phrase
    assert re.search(r"client 127\.0\.0\.1:\d+ left", text), text
    assert lines[-1].endswith(f"rpcdl worker {address} left")


def test_log_format_json_is_one_object_per_line():
    worker, address = _start_worker("--log-format", "json")
    try:
        assert rpcdl.rpc_sync(address, chatter) == 1
    finally:
        lines = _stop(worker)
    records = [json.loads(line) for line in lines]
    assert {"time", "level", "logger", "message"} <= set(records[0])
    assert any(r["message"].startswith("client ") and r["message"].endswith(" connected") for r in records)
    assert {r["logger"] for r in records} == {"rpcdl.worker"} and records[-1]["level"] == "INFO"


def test_status_probes_are_not_logged_as_clients_at_info():
    worker, address = _start_worker()
    try:
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        status = subprocess.run(
            [sys.executable, "-m", "rpcdl", "status", address], capture_output=True, text=True, env=environment
        )
        assert status.returncode == 0, status.stderr
    finally:
        lines = _stop(worker)
    assert not [line for line in lines if "client " in line], lines  # a liveness probe every 30 s says nothing


@pytest.mark.parametrize("configured", [False, True], ids=["no-logging-configured", "app-configured"])
def test_trainer_warnings_carry_time_level_and_logger_name(configured):
    code = (
        "import logging, rpcdl\n"
        + ("logging.basicConfig(format='APP %(name)s %(message)s')\n" if configured else "")
        + "logging.getLogger('rpcdl.dataloader').warning('the loader waits for data')\n"
        "logging.getLogger('rpcdl.dataloader').info('not shown at the default level')\n"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=environment)
    lines = result.stderr.splitlines()
    if configured:  # the program's own handler alone: no second copy from rpcdl's
        assert lines == ["APP rpcdl.dataloader the loader waits for data"]
    else:
        (line,) = lines
        assert _TEXT_LINE.match(line) and line.endswith("WARNING rpcdl.dataloader: the loader waits for data")
