"""Stopping child processes: one way for every process rpcdl, its command line and its benchmarks start.

A process is asked to stop with SIGTERM (an rpcdl worker then lets its calls
in flight finish), killed with SIGKILL if it has not exited within a grace
period, reaped, and its pipes closed. Nothing here imports the rest of rpcdl.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Sequence


def stop_process(process: subprocess.Popen, grace: float = 10.0) -> int:
    """Stop ``process``: SIGTERM, then SIGKILL after ``grace`` seconds; reap it and close its pipes.

    A process that has exited already is only reaped.

    Args:
        process: a child process.
        grace: seconds it gets to exit after SIGTERM.

    Returns:
        its exit code (negative: the signal that ended it).

    Example::

        >>> import sys
        >>> child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        >>> stop_process(child, grace=5.0)
        -15
    """
    return stop_processes([process], grace)[0]


def stop_processes(processes: Sequence[subprocess.Popen], grace: float = 10.0) -> list[int]:
    """Stop several processes as :func:`stop_process` does, with SIGTERM to all of them first.

    So they stop at the same time, within one grace period for them all.

    Args:
        processes: child processes.
        grace: seconds each gets to exit after SIGTERM.

    Returns:
        their exit codes, in order.

    Example::

        >>> import sys
        >>> children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
        >>> stop_processes(children, grace=5.0)
        [-15, -15]
    """
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    codes = []
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
        codes.append(process.returncode)
    return codes
