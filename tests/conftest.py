"""Shared fixtures: real worker processes on loopback, started and stopped by the tests."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

import rpcdl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py for the workers too
# Tests start local workers minutes apart: each pytest process keeps its fork server (and its import of
# torch) between them, rather than the 30 s a script gets (RPCDL_FORK_SERVER_IDLE, docs/environment.rst).
os.environ.setdefault("RPCDL_FORK_SERVER_IDLE", "600")


@pytest.fixture(autouse=True)
def _clean_credentials(monkeypatch):
    """Tests run without the developer's tokens or TLS settings."""
    for name in ("RPCDL_TOKEN", "RPCDL_TOKEN_FILE", "RPCDL_TLS_CA", "RPCDL_TLS_CERT", "RPCDL_TLS_KEY", "RPCDL_WORKERS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def two_workers():
    """Two worker processes shared by the tests that do not break them."""
    saved = {k: os.environ.pop(k) for k in ("RPCDL_TOKEN", "RPCDL_TOKEN_FILE") if k in os.environ}
    try:
        with rpcdl.local_workers(2) as workers:
            yield list(workers)
    finally:
        os.environ.update(saved)
        rpcdl.shutdown()


@pytest.fixture
def spawn_workers():
    """Start worker processes that the test may kill: ``spawn_workers(n, **options)``."""
    contexts = []

    def spawn(n: int, **options):
        context = rpcdl.local_workers(n, **options)
        workers = context.__enter__()
        contexts.append(context)
        return workers

    yield spawn
    for context in reversed(contexts):
        context.__exit__(None, None, None)
    rpcdl.shutdown()


@pytest.fixture
def embedded_worker():
    """Workers in this process (threads), for what no test kills: ``embedded_worker(**options)``."""
    started: list[rpcdl.Worker] = []

    def start(**options) -> rpcdl.Worker:
        worker = rpcdl.Worker(**{"timeout": 10, **options}).start()
        started.append(worker)
        return worker

    yield start
    rpcdl.shutdown()
    for worker in started:
        worker.stop(grace=1)


@pytest.fixture
def switching_often():
    """Threads switch every microsecond: the interleavings of many cores, on two."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


@pytest.fixture
def thread_errors(monkeypatch) -> list[str]:
    """Exceptions that escaped any thread during the test (a crashed service or worker thread shows here)."""
    errors: list[str] = []
    previous = threading.excepthook

    def hook(args) -> None:
        errors.append(f"{args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: {args.exc_value}")
        previous(args)

    monkeypatch.setattr(threading, "excepthook", hook)
    return errors
