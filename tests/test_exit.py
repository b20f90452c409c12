"""A process that used rpcdl exits cleanly, whatever its connections' threads are doing at that moment.

The abort this guards against ("terminate called without an active exception",
exit 134) came from a connection's thread still inside torch's C++ future code
when the interpreter finalized: the thread was killed as it took the GIL back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

# The connection's thread fails the call (the port refuses), and the call's callback keeps
# that thread busy while the main thread, woken by the failure, reaches the end of the program.
# Exit must wait for that thread: a thread killed at finalization inside torch's C++ code aborts.
FAILED_CALL_THEN_EXIT = """
import socket, time
import rpcdl

unused = socket.socket()
unused.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
address = "127.0.0.1:%d" % unused.getsockname()[1]
future = rpcdl.rpc_async(address, time.time, timeout=1.0)


def slow_callback(_):
    time.sleep(1.0)
    print("callback finished", flush=True)


future.add_done_callback(slow_callback)
try:
    future.wait()
except Exception as exc:
    print("failed as expected:", type(exc).__name__, flush=True)
"""


def run_script(source: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True, timeout=50, env=env
    )


def test_exit_waits_for_a_connection_thread_still_completing_a_call():
    result = run_script(FAILED_CALL_THEN_EXIT)
    assert "terminate called" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    assert "failed as expected: WorkerUnavailable" in result.stdout
    # The interpreter did not finalize under the thread: it waited for the thread to finish its work.
    assert "callback finished" in result.stdout


# A worker embedded and never stopped, its reference dropped and the garbage collected: it serves on
# (its own threads hold it, no finalizer stops it), and at exit the exit hook stops it, a call in flight.
WORKER_DROPPED_THEN_EXIT = """
import gc, time
import rpcdl

address = rpcdl.Worker(parallel=2).start().address
gc.collect()
print("served:", rpcdl.rpc_sync(address, sum, ([1, 2, 3],), timeout=10), flush=True)
pending = rpcdl.rpc_async(address, time.sleep, (0.5,))
time.sleep(0.1)  # the call runs as the program ends
"""


def test_a_worker_never_stopped_serves_until_exit_and_exit_stops_it():
    result = run_script(WORKER_DROPPED_THEN_EXIT)
    assert "terminate called" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    assert "served: 6" in result.stdout


# A fork while another thread registers a hook: here that thread holds the registry's lock for
# 0.3 s (a registration holds it a few bytecodes) while the main thread forks. The fork waits for
# the lock, so the child starts with it free, may register hooks itself and ran the fork hooks.
FORK_WHILE_REGISTERING = """
import os, signal, threading, time
from rpcdl import _lifecycle

forked = []
_lifecycle.in_forked_child(lambda: forked.append(True))
holding = threading.Event()

def register_slowly():
    with _lifecycle._lock:
        holding.set()
        time.sleep(0.3)

threading.Thread(target=register_slowly, name="test-registering").start()
holding.wait(10)
pid = os.fork()
if pid == 0:
    signal.alarm(5)  # a child that found the lock held would wait forever: it dies of SIGALRM instead
    _lifecycle.at_exit(_lifecycle.ExitPhase.FLUSH, lambda: None)
    os._exit(0 if forked else 3)
print("child:", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


def test_a_child_forked_while_a_hook_is_registered_starts_with_the_registry_free():
    result = run_script(FORK_WHILE_REGISTERING)
    assert result.returncode == 0, result.stderr
    assert "child: 0" in result.stdout, result.stdout + result.stderr
