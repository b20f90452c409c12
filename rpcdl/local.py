"""Worker processes on this machine, for development, tests and single-node jobs."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from .checks import check_positive_int
from .errors import ForkServerExited
from .forkserver import ForkedProcess, fork_server_supported, shared_fork_server
from .processes import stop_process, stop_processes

__all__ = [
    "LOG_LEVELS",
    "START_METHODS",
    "LocalWorkers",
    "child_environment",
    "local_workers",
    "read_ready_line",
    "resolve_start_method",
    "start_worker_process",
    "stop_process",
]

#: The logging levels a worker accepts (``rpcdl worker --log-level``).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

#: How :func:`local_workers` may start its processes.
START_METHODS = ("forkserver", "spawn")

#: What a worker process imports before it serves: a fork server imports them once for all its workers.
_WORKER_MODULES = ("torch", "rpcdl.server.worker", "rpcdl.cli.commands")


def resolve_start_method(start_method: str | None) -> str:
    """The way to start worker processes: ``start_method``, checked, or this platform's default.

    Args:
        start_method: ``"forkserver"``, ``"spawn"``, or ``None`` for the default: ``"forkserver"``
            where :func:`~rpcdl.forkserver.fork_server_supported`, else ``"spawn"``.

    Returns:
        ``"forkserver"`` or ``"spawn"``.

    Raises:
        ValueError: another name, or ``"forkserver"`` where this platform has none.

    Example::

        >>> resolve_start_method("spawn")
        'spawn'
        >>> resolve_start_method(None) in START_METHODS
        True
    """
    if start_method is None:
        return "forkserver" if fork_server_supported() else "spawn"
    if start_method not in START_METHODS:
        raise ValueError(
            f"start_method must be one of {', '.join(START_METHODS)} (or None: the default), got {start_method!r}"
        )
    if start_method == "forkserver" and not fork_server_supported():
        raise ValueError("start_method='forkserver' needs Linux 5.3 or later (fork and pidfds): use 'spawn'")
    return start_method


def start_worker_process(
    args: Sequence[str],
    env: Mapping[str, str],
    start_method: str | None = None,
    timeout: float = 60.0,
    process_group: int | None = None,
    stderr: int | None = None,
) -> subprocess.Popen | ForkedProcess:
    """Start ``rpcdl ARGS`` (say ``["worker", "--port", "0"]``), its standard output a pipe to this process.

    Args:
        args: the arguments after ``python -m rpcdl``.
        env: its environment.
        start_method: ``"spawn"``: a new interpreter (:class:`subprocess.Popen`); ``"forkserver"``:
            forked from this process's fork server for ``env``, which imported torch and rpcdl's
            worker once (see :func:`~rpcdl.forkserver.shared_fork_server`); ``None``: this
            platform's default (:func:`resolve_start_method`).
        timeout: seconds the fork server may take to answer (its first request waits for its imports).
        process_group: as ``subprocess.Popen``'s (``0``: a process group of its own).
        stderr: ``None``: this process's standard error; ``subprocess.PIPE``: a pipe to this process.

    Returns:
        the process: a :class:`subprocess.Popen` or a :class:`~rpcdl.forkserver.ForkedProcess`,
        its standard output text.

    Raises:
        ValueError: an unknown ``start_method`` (see :func:`resolve_start_method`).

    Example::

        >>> process = start_worker_process(["worker", "--port", "0"], os.environ)  # doctest: +SKIP
        >>> read_ready_line(process, timeout=60)  # doctest: +SKIP
        '127.0.0.1:40123'
    """
    if resolve_start_method(start_method) == "spawn":
        command = [sys.executable, "-m", "rpcdl", *args]
        return subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, env=env, text=True, process_group=process_group
        )

    def fork() -> ForkedProcess:
        server = shared_fork_server(_WORKER_MODULES, env)
        return server.start("rpcdl", args, env, timeout, process_group, stderr)

    try:
        return fork()
    except ForkServerExited as exc:
        if exc.code != 0:
            raise
    return fork()  # it left, idle, as the request came: a new one serves it


class LocalWorkers(list):
    """The addresses of worker processes started by :func:`~rpcdl.local_workers`.

    It is a plain list of ``"host:port"`` strings, with the processes and a few
    methods to stop and restart them (handy to rehearse failures). It pickles
    as the plain list of addresses (the processes stay with this object), so it
    can be handed to anything that sends its arguments elsewhere.

    Attributes:
        processes: each worker's process, in the order of the addresses: a
            :class:`subprocess.Popen`, or with ``start_method="forkserver"`` a
            :class:`~rpcdl.forkserver.ForkedProcess`, which has the same ``pid``,
            ``stdout``, ``poll``, ``wait``, ``send_signal``, ``terminate`` and ``kill``.
    """

    def __init__(self, args: list[str], env: dict[str, str], startup_timeout: float, start_method: str):
        super().__init__()
        self._args = args
        self._env = env
        self._startup_timeout = startup_timeout
        self._start_method = start_method
        self.processes: list[subprocess.Popen | ForkedProcess] = []

    def __reduce__(self) -> tuple[type, tuple[list[str]]]:
        return list, (list(self),)

    def _spawn(self, port: int = 0) -> subprocess.Popen | ForkedProcess:
        args = [*self._args, "--port", str(port)]
        return start_worker_process(args, self._env, self._start_method, self._startup_timeout)

    def _launch(self, port: int = 0) -> tuple[subprocess.Popen | ForkedProcess, str]:
        process = self._spawn(port)
        try:
            return process, read_ready_line(process, self._startup_timeout)
        except BaseException:
            stop_process(process, grace=1.0)
            raise

    def start(self, count: int) -> None:
        """Start ``count`` more workers at once and wait until each answers."""
        started = [self._spawn() for _ in range(count)]
        self.processes.extend(started)
        for process in started:
            self.append(read_ready_line(process, self._startup_timeout))
        for address in self:
            _ping(address, self._env, timeout=self._startup_timeout)

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to worker ``index`` (SIGKILL by default) and reap it if it exits.

        This process's connections to a worker that exited are closed: a call
        made next opens a new one (to whatever listens there then).
        """
        process = self.processes[index]
        if process.poll() is None:
            process.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
                process.wait(timeout=60)
        if process.poll() is not None:
            _forget_connections(self[index], f"the worker process {process.pid} exited")

    def restart(self, index: int) -> str:
        """Start worker ``index`` again on its old port (after :meth:`kill`); return its address."""
        self.kill(index)
        port = int(self[index].rpartition(":")[2])
        deadline = time.monotonic() + self._startup_timeout
        while True:
            try:
                process, address = self._launch(port)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)  # the port may linger for a moment
        self.processes[index] = process
        self[index] = address
        # A call made while the new process started (a loader's probe, say) may have opened a
        # connection whose connect was refused before it listened: that connection fails its calls
        # at once (the worker served before, see rpcdl.rpc.dial), the ping's too if it joined them.
        _forget_connections(address, "a new worker process listens there now")
        _ping(address, self._env, timeout=self._startup_timeout)
        return address

    def stop(self, grace: float = 10.0) -> None:
        """Stop every worker: SIGTERM, then SIGKILL after ``grace`` seconds."""
        stop_processes(self.processes, grace)


def _ping(address: str, env: dict[str, str], timeout: float) -> None:
    """Ping a worker with the credentials it was started with, whatever this process's environment holds."""
    from .rpc.client import ping  # here: the command line imports this module without torch

    ping(address, timeout=timeout, token=_token_of(env))


def _token_of(env: dict[str, str]) -> str | bytes:
    """The token of workers started with the environment ``env`` (``""``: none)."""
    if env.get("RPCDL_TOKEN"):
        return env["RPCDL_TOKEN"]
    if env.get("RPCDL_TOKEN_FILE"):
        from .transport.security import read_token_file

        return read_token_file(env["RPCDL_TOKEN_FILE"]).secret
    return ""


def _forget_connections(address: str, reason: str) -> None:
    from .rpc.pool import close_connections_to  # here: as for _ping

    close_connections_to(address, reason)


def read_ready_line(process: subprocess.Popen | ForkedProcess, timeout: float) -> str:
    """The next non-empty line of ``process``'s standard output (a worker's ``HOST:PORT`` once it is ready).

    The pipe is read a byte at a time, never past the line: what follows stays in the pipe for the next
    call, so that the wait for it sees it (a buffered read would take two lines written at once, such as
    the ready lines of ``rpcdl worker --procs``, and the second one's wait would not see it).

    Args:
        process: a child whose standard output is a pipe, read only through this function.
        timeout: seconds to wait for the line.

    Returns:
        the line, stripped.

    Raises:
        RuntimeError: the process exited, or no line came within ``timeout``.
    """
    fd = process.stdout.fileno()
    deadline = time.monotonic() + timeout
    line = bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not selector.select(timeout=0.1):
                if process.poll() is not None:
                    raise RuntimeError(
                        f"an rpcdl worker process exited with code {process.returncode} before it was ready"
                    )
                continue
            byte = os.read(fd, 1)
            if not byte:  # the pipe closed: the process ends, or closed its standard output
                try:
                    code = process.wait(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(
                        "an rpcdl worker process closed its standard output before it was ready"
                    ) from None
                raise RuntimeError(f"an rpcdl worker process exited with code {code} before it was ready")
            if byte != b"\n":
                line += byte
            elif line.strip():
                return line.decode("utf-8", "replace").strip()
            else:
                line.clear()
    raise RuntimeError(f"an rpcdl worker process did not report ready within {timeout:g}s")


def child_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with this process's ``sys.path`` in ``PYTHONPATH``,
    so a child process imports the same modules."""
    environment = dict(os.environ if env is None else env)
    environment["PYTHONPATH"] = os.pathsep.join(p for p in [*sys.path, environment.get("PYTHONPATH", "")] if p)
    return environment


@contextmanager
def local_workers(
    n: int,
    *,
    parallel: int = 1,
    timeout: float = 120.0,
    token: str | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    startup_timeout: float = 60.0,
    log_level: str = "WARNING",
    start_method: str | None = None,
) -> Iterator[LocalWorkers]:
    """Start ``n`` worker processes on loopback; yield their addresses; stop them on exit.

    The workers inherit this process's ``sys.path`` (so they import the same
    modules) and environment. Each listens on a free port chosen by the system
    and is known to answer before this yields. They stop on exit from the
    context, and by themselves if this process dies.

    Args:
        n: how many worker processes.
        parallel: calls each runs at once.
        timeout: the workers' network timeout.
        token: a token for the workers (``RPCDL_TOKEN`` in their environment); defaults to
            ``env``'s. The workers are pinged with it, so this process's own environment
            needs none; calls made from this process pass it (``token=``) or find it there.
        extra_args: more ``rpcdl worker`` arguments.
        env: environment of the workers (default: this process's).
        startup_timeout: seconds each worker has to become ready.
        log_level: the workers' logging level on this process's standard
            error: ``"WARNING"`` (the default) shows warnings and errors only;
            ``"INFO"`` adds a line per worker started and stopped, ``"DEBUG"``
            more. ``--log-level`` in ``extra_args`` overrides it.
        start_method: ``"forkserver"`` (the default on Linux): the workers are forked from one
            process that imported torch already (see :mod:`rpcdl.forkserver`), so each starts
            in a fraction of the CPU and shares torch's memory; the process stays while workers
            run and for ``RPCDL_FORK_SERVER_IDLE`` seconds (30 by default) after, and serves later
            calls in this process too. ``"spawn"`` (the default elsewhere): each worker is a
            new interpreter, ``python -m rpcdl worker``.

    Yields:
        a :class:`~rpcdl.local.LocalWorkers`: the list of ``"127.0.0.1:port"`` addresses.

    Example::

        >>> with rpcdl.local_workers(2) as workers:  # doctest: +SKIP
        ...     dataset = rpcdl.RPCDataset(workers, MyDataset, root="/data")
        ...     for batch in rpcdl.RPCDataloader(dataset, batch_size=32):
        ...         ...
    """
    check_positive_int(n, "n", "the number of workers")
    start_method = resolve_start_method(start_method)
    level = log_level.upper() if isinstance(log_level, str) else None
    if level not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    environment = child_environment(env)
    if token is not None:
        environment["RPCDL_TOKEN"] = token
    args = [
        "worker",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--parallel",
        str(parallel),
        "--timeout",
        str(timeout),
        "--watch-pid",
        str(os.getpid()),
        "--log-level",
        level,
        *extra_args,
    ]
    workers = LocalWorkers(args, environment, startup_timeout, start_method)
    try:
        workers.start(n)
        yield workers
    finally:
        workers.stop()
