"""A worker caps its sessions and refuses honestly when full; both sides raise their open-file limit.

Real workers (a process started with ``rpcdl worker --max-sessions``, workers
embedded here), real handshakes on real sockets, and a loader that goes to
its other worker when one is full.
"""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import threading
import time

import pytest
from blocking_wire import client_negotiate
from helpers import RangeDataset, start_worker_process

import rpcdl
from rpcdl.address import parse_address
from rpcdl.errors import SessionsFull
from rpcdl.local import child_environment, read_ready_line
from rpcdl.processes import stop_process


def _handshake(address: str, observer: bool = False) -> socket.socket:
    """A connection to ``address`` past its handshake (a client the worker counts, unless ``observer``)."""
    sock = socket.create_connection(parse_address(address), timeout=10)
    try:
        client_negotiate(sock, None, address, observer=observer)
    except BaseException:
        sock.close()
        raise
    return sock


def test_a_full_worker_refuses_a_client_saying_why_and_still_answers_status():
    process, address = start_worker_process("--max-sessions", "2")
    held = []
    try:
        held = [_handshake(address) for _ in range(2)]
        started = time.monotonic()
        with pytest.raises(SessionsFull, match=r"is full: it serves 2 client\(s\), its limit \(max_sessions=2; rpcdl "):
            _handshake(address)
        assert time.monotonic() - started < 5  # refused at once, not left to time out
        assert rpcdl.errors.is_transient(SessionsFull("full"))
        _handshake(address, observer=True).close()  # rpcdl status is no client: never refused
        held.pop().close()  # a client leaves: the next one is taken
        deadline = time.monotonic() + 10
        while True:
            try:
                held.append(_handshake(address))
                break
            except SessionsFull:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        for sock in held:
            sock.close()
        stop_process(process, grace=5.0)


def test_a_call_to_a_full_worker_fails_at_once_and_a_loader_goes_to_its_other_worker(embedded_worker):
    full = embedded_worker(max_sessions=1)
    spare = embedded_worker()
    holder = _handshake(full.address)  # another trainer holds the full worker's one session
    try:
        started = time.monotonic()
        with pytest.raises(rpcdl.WorkerUnavailable, match=r"is full: it serves 1 client\(s\)"):
            rpcdl.rpc_sync(full.address, min, (1, 2), timeout=30)
        assert time.monotonic() - started < 5
        dataset = rpcdl.RPCDataset([full.address, spare.address], RangeDataset, 40)
        loader = rpcdl.RPCDataloader(dataset, batch_size=4, shuffle=True, timeout=30)
        seen = sorted(int(i) for batch in loader for i in batch)
        assert seen == list(range(40))  # every sample once
        assert full.stats()["clients"] == 1
    finally:
        holder.close()


def test_clients_racing_for_the_last_places_never_exceed_the_limit(embedded_worker, switching_often):
    worker = embedded_worker(max_sessions=2)
    outcomes: list = [None] * 6

    def connect(i: int) -> None:
        try:
            outcomes[i] = _handshake(worker.address)
        except SessionsFull as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=connect, args=(i,), name=f"test-client-{i}") for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    held = [outcome for outcome in outcomes if isinstance(outcome, socket.socket)]
    try:
        assert len(held) == 2 and sum(isinstance(outcome, SessionsFull) for outcome in outcomes) == 4
        deadline = time.monotonic() + 10
        while worker.stats()["clients"] != 2:  # the two sessions start as their handshakes end
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        for sock in held:
            sock.close()


def test_max_sessions_is_checked():
    with pytest.raises(ValueError, match="max_sessions"):
        rpcdl.Worker(max_sessions=0)
    with pytest.raises(ValueError, match="max_sessions must be a positive integer"):
        rpcdl.Worker(max_sessions="8")


def _lowered_open_files() -> None:
    """In the child before exec: a soft open-file limit below the hard one."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))


def _soft_open_files(pid: int) -> tuple[str, str]:
    with open(f"/proc/{pid}/limits") as limits:
        line = next(line for line in limits if line.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return soft, hard


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(240)  # a worker and a client process import torch
def test_worker_and_client_raise_their_open_file_limit_to_the_hard_limit(tmp_path):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip("the hard open-file limit is too low to lower the soft one below it")
    worker = subprocess.Popen(
        [sys.executable, "-m", "rpcdl", "worker", "--port", "0", "--log-level", "DEBUG"],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "worker.log").open("w"),
        env=child_environment(),
        text=True,
        preexec_fn=_lowered_open_files,
    )
    try:
        address = read_ready_line(worker, 60.0)
        soft, limit = _soft_open_files(worker.pid)
        assert soft == limit != "256"
        client = subprocess.run(
            [
                sys.executable,
                "-c",
                "import logging, resource, sys, rpcdl; logging.basicConfig(level=logging.DEBUG); "
                "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0]); "
                "assert rpcdl.rpc_sync(sys.argv[1], min, (1, 2)) == 1; "
                "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])",
                address,
            ],
            capture_output=True,
            text=True,
            env=child_environment(),
            preexec_fn=_lowered_open_files,
            timeout=60,
        )
        assert client.returncode == 0, client.stderr
        assert client.stdout.split() == ["256", str(hard)]
        assert "open-file limit raised from 256 to the hard limit" in client.stderr
    finally:
        stop_process(worker, grace=5.0)
    assert "open-file limit raised from 256 to the hard limit" in (tmp_path / "worker.log").read_text()
