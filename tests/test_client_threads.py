"""A client's threads do not grow with its workers: one event loop owns every connection."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

import rpcdl
from rpcdl.local import child_environment
from rpcdl.processes import stop_process

pytestmark = pytest.mark.timeout(120)

# Sixteen real workers in one other process: this process is only their client.
SIXTEEN_WORKERS = """
import sys
import rpcdl

workers = [rpcdl.Worker(timeout=30).start() for _ in range(16)]
print(" ".join(worker.address for worker in workers), flush=True)
sys.stdin.read()  # until the test closes its end
"""


def _rpcdl_threads() -> list[str]:
    return sorted(thread.name for thread in threading.enumerate() if thread.name.startswith("rpcdl-"))


def test_a_client_runs_the_same_threads_with_one_worker_as_with_sixteen():
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SIXTEEN_WORKERS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=child_environment(),
        text=True,
    )
    try:
        addresses = process.stdout.readline().split()
        assert len(addresses) == 16, f"the workers' process printed {addresses!r}"
        rpcdl.shutdown()
        assert rpcdl.rpc_sync(addresses[0], pow, (2, 5)) == 32
        with_one = _rpcdl_threads()
        futures = [rpcdl.rpc_async(address, pow, (k, 2)) for k, address in enumerate(addresses) for _ in range(4)]
        assert [future.wait() for future in futures] == [k * k for k in range(16) for _ in range(4)]
        with_sixteen = _rpcdl_threads()
        assert with_sixteen == with_one, f"threads with one worker: {with_one}; with sixteen: {with_sixteen}"
        assert len(with_sixteen) <= 4
    finally:
        rpcdl.shutdown()
        process.stdin.close()
        stop_process(process, grace=5.0)
