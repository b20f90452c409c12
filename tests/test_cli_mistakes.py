"""Mistakes on the command line get one clear ``error:`` line and exit code 2, never a traceback."""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

WORKER_COMMANDS = {"rpcdl worker": ["-m", "rpcdl", "worker"], "launch": ["-m", "rpcdl.launch"]}


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=50, env=environment)


def assert_clean_mistake(result: subprocess.CompletedProcess, *phrases: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stdout == ""  # no worker started: no address reported
    error_lines = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert len(error_lines) == 1, result.stderr
    for phrase in phrases:
        assert phrase in error_lines[0], error_lines[0]


def _mistakes(tmp: Path) -> dict[str, tuple[list[str], dict[str, str], tuple[str, ...]]]:
    junk = tmp / "junk.pem"
    junk.write_text("not a certificate\n")
    missing = str(tmp / "missing")
    return {
        "token-file": (["--token-file", missing], {}, ("--token-file", "cannot be read", missing)),
        "token-file-env": ([], {"RPCDL_TOKEN_FILE": missing}, ("RPCDL_TOKEN_FILE", "cannot be read")),
        "tls-cert-missing": (["--tls-cert", missing], {}, ("--tls-cert", "cannot load", missing)),
        "tls-cert-junk": (["--tls-cert", str(junk)], {}, ("--tls-cert", "cannot load", str(junk))),
        "tls-cert-env": ([], {"RPCDL_TLS_CERT": missing}, ("RPCDL_TLS_CERT", "cannot load")),
        "tls-key-alone": (["--tls-key", str(junk)], {}, ("--tls-key needs --tls-cert",)),
        "log-level": (["--log-level", "chatty"], {}, ("--log-level", "expected a logging level", "'chatty'")),
        "host": (["--host", "no-such-host.invalid"], {}, ("--host", "no-such-host.invalid", "does not resolve")),
        "address-file": (["--address-file", f"{missing}/workers.txt"], {}, ("--address-file", "does not exist")),
        "procs": (["--procs", "2", "--token-file", missing], {}, ("--token-file", "cannot be read")),
        "start-method": (["--start-method", "spawn"], {}, ("--start-method", "with --procs 2 or more")),
    }


@pytest.mark.parametrize(
    "mistake",
    [
        "token-file",
        "token-file-env",
        "tls-cert-missing",
        "tls-cert-junk",
        "tls-cert-env",
        "tls-key-alone",
        "log-level",
        "host",
        "address-file",
        "procs",
        "start-method",
    ],
)
@pytest.mark.parametrize("command", list(WORKER_COMMANDS))
def test_a_worker_option_mistake_is_one_error_line_and_exit_2(tmp_path, command, mistake):
    args, env, phrases = _mistakes(tmp_path)[mistake]
    assert_clean_mistake(run([*WORKER_COMMANDS[command], "--port", "0", *args], env), *phrases)


@pytest.mark.parametrize("command", list(WORKER_COMMANDS))
def test_a_port_in_use_is_one_line_and_exit_1_not_a_usage_error(command):
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        result = run([*WORKER_COMMANDS[command], "--port", str(port), "--log-level", "warning"])
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()  # no usage block, no traceback
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in line


@pytest.mark.parametrize("command", list(WORKER_COMMANDS))
def test_the_worker_port_defaults_to_the_seeds_6543(command):
    from rpcdl.cli import build_parser
    from rpcdl.launch import main as launch_main

    if command == "launch":
        result = run(["-m", "rpcdl.launch", "--help"])
        assert "default: 6543" in result.stdout
        assert launch_main.__module__ == "rpcdl.launch"
    else:
        assert build_parser().parse_args(["worker"]).port == 6543


def test_renamed_options_still_work_and_say_their_new_spelling(capsys):
    from rpcdl.cli import build_parser

    parser = build_parser()
    bench = parser.parse_args(["bench", "--local", "3"])
    assert bench.local_workers == 3
    assert "rpcdl bench: warning: --local is deprecated; use --local-workers" in capsys.readouterr().err
    demo = parser.parse_args(["demo", "--summary-json", "summary.json"])
    assert demo.json == "summary.json"
    assert "rpcdl demo: warning: --summary-json is deprecated; use --json" in capsys.readouterr().err
    assert parser.parse_args(["bench", "--local-workers", "3"]).local_workers == 3
    assert capsys.readouterr().err == ""


def test_workers_take_the_same_forms_in_every_command(tmp_path):
    from rpcdl.cli import build_parser

    listed = tmp_path / "workers"
    listed.write_text("c:3\n")
    parser = build_parser()
    forms = ["--workers", "a:1", "b:2,dns://workers.example", str(listed)]
    expected = ["a:1", "b:2", "dns://workers.example", "c:3"]
    for command in ("demo", "bench", "status"):
        assert parser.parse_args([command, *forms]).workers == expected, command
    assert parser.parse_args(["status", "a:1,b:2", str(listed)]).addresses == [["a:1", "b:2"], ["c:3"]]


@pytest.mark.parametrize(
    ("args", "phrases"),
    [
        (["demo", "--config", "{tmp}/missing.yaml"], ("--config", "no such file")),
        (["demo", "--json", "{tmp}/missing/summary.json"], ("--json", "does not exist")),
        (["bench", "--json", "{tmp}/missing/bench.json"], ("--json", "does not exist")),
        (["bench", "--plot", "{tmp}/missing/bench.png"], ("--plot", "does not exist")),
    ],
    ids=["demo-config", "demo-summary", "bench-json", "bench-plot"],
)
def test_file_options_of_the_other_commands_are_checked_before_anything_runs(tmp_path, args, phrases):
    assert_clean_mistake(run(["-m", "rpcdl", *(arg.format(tmp=tmp_path) for arg in args)]), *phrases)


@pytest.mark.parametrize("command", [["-m", "rpcdl"], ["-m", "rpcdl.launch"]], ids=["rpcdl", "launch"])
def test_version_is_the_installed_distribution_version(command):
    result = run([*command, "--version"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"rpcdl {importlib.metadata.version('rpcdl')}"
