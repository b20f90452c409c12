"""Python commands forked from a process that imported their heavy modules once.

``python -m rpcdl worker`` spends most of its start importing torch: 2 to 3 s
of CPU, and 100 MB or so of memory that each worker holds on its own. A
:class:`ForkServer` is one process that imports a list of modules once, then
forks a command on request, as ``python -m MODULE ARGS`` would run it: the
fork shares the imported modules' memory with its server until it writes to
it, and starts in a tenth of the CPU. It is what
:func:`~rpcdl.local_workers` starts its workers from on Linux, as PyTorch's
DataLoader forks its workers from a process that imported torch already.

A forked command gets what ``subprocess.Popen`` would give it: this process's
standard input and error as they are when it starts, a pipe for its standard
output, the environment and the working directory of the request. What a
fork cannot change is what the server read as it started: its interpreter
and the variables that Python and torch read at import (``PYTHON*``,
``TORCH*``, ``OMP_*``, ...): :func:`start_variables` names them, and a server
serves only requests that agree with it on all of them.

A request waits for the server's imports before its first fork (seconds
for torch, more on a cold, busy node); after ``NOTICE_AFTER`` seconds a
warning on the ``rpcdl.forkserver`` logger says what it waits for.

The server and its commands name themselves for ``top``, ``ps -o comm``
and ``pgrep`` (``rpcdl forkserve``, ``rpcdl worker``); ``ps aux`` shows the
server's command line for all of them, which a fork cannot change.

The server exits when the process that started it exits, and when it has
had no live command and no request for ``idle_timeout`` seconds; its
commands outlive it (rpcdl's workers stop when the process they watch
exits).

Protocol: one ``SOCK_SEQPACKET`` Unix socket pair, a pickled message per
packet. The client sends ``("start", module, args, env, cwd, process_group)``
with the command's standard input, output and error as three file descriptors; the
server answers ``("started", pid, serial)`` with a pidfd of the command, or
``("failed", message)``, and reports ``("exited", serial, code)`` when a command
ends (a serial names one command for good; a pid is used again). The server
handles one message at a time on one thread, so it forks with no other
thread of Python's in it.

Ownership: a :class:`ForkServer`'s socket, its reports and its state are
guarded by its ``_lock`` (waits on the socket happen outside it). A
:class:`ForkedProcess`'s ``returncode`` is guarded by its own ``_lock``; its pidfd
stays open as long as the object lives, so no thread waits on a number reused.
"""

from __future__ import annotations

import enum
import importlib
import logging
import os
import pickle
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import IO, Any

from ._lifecycle import in_forked_child
from .checks import environment_number
from .errors import ForkServerExited

log = logging.getLogger("rpcdl.forkserver")

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "IDLE_TIMEOUT_ENV",
    "NOTICE_AFTER",
    "ForkServer",
    "ForkedProcess",
    "fork_server_supported",
    "shared_fork_server",
    "start_variables",
]

#: Prefixes of the environment variables read as the interpreter and the preloaded modules start.
_START_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "OPENBLAS", "GOMP_", "LD_", "CUDA", "NCCL")

#: Seconds a shared fork server with no live command and no request stays (:func:`shared_fork_server`).
IDLE_TIMEOUT_ENV = "RPCDL_FORK_SERVER_IDLE"
DEFAULT_IDLE_TIMEOUT = 30.0

#: Seconds a request waits for the server's answer before a warning says what it waits for.
NOTICE_AFTER = 5.0

_MAX_MESSAGE = 1 << 20
_SLICE = 0.05  # seconds a thread waits on the socket before it looks whether another thread read its news
# Not ``-m rpcdl.forkserver``: importing rpcdl imports this module first, and runpy would warn of that.
_SERVER_COMMAND = "import sys; from rpcdl.forkserver import _main; _main(sys.argv[1:])"
_UNKNOWN_CODE = 255  # a command's exit code when its server died before it could report it


def fork_server_supported() -> bool:
    """Whether this platform can run a :class:`ForkServer` (Linux: ``fork`` and pidfds).

    Returns:
        ``True`` on Linux 5.3 and later.

    Example::

        >>> isinstance(fork_server_supported(), bool)
        True
    """
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")


def start_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that a process reads as it starts, so a fork cannot change them.

    Two environments with the same start variables can share one :class:`ForkServer`.

    Args:
        env: an environment.

    Returns:
        the variables whose names begin with ``PYTHON``, ``TORCH``, ``PYTORCH``,
        ``OMP_``, ``MKL_``, ``KMP_``, ``OPENBLAS``, ``GOMP_``, ``LD_``, ``CUDA``
        or ``NCCL``.

    Example::

        >>> start_variables({"PYTHONPATH": "/src", "HOME": "/root", "OMP_NUM_THREADS": "1"})
        {'OMP_NUM_THREADS': '1', 'PYTHONPATH': '/src'}
    """
    return {name: env[name] for name in sorted(env) if name.startswith(_START_PREFIXES)}


class _State(enum.Enum):
    RUNNING = "running"
    GONE = "gone"  # the server exited (idle, or killed); no request reaches it


class ForkServer:
    """A process that imported ``preload`` once and forks ``python -m MODULE`` commands from it.

    Args:
        preload: modules to import before the first fork (say ``["torch"]``).
        env: the server's environment; every request must agree with it on
            :func:`start_variables`.
        idle_timeout: seconds without a live command or a request after which the server exits.

    Raises:
        RuntimeError: the platform has no fork server (see :func:`fork_server_supported`).

    Example::

        >>> server = ForkServer(["json"], dict(os.environ))  # doctest: +SKIP
        >>> child = server.start("json.tool", ["--help"], dict(os.environ))  # doctest: +SKIP
        >>> child.wait(timeout=10)  # doctest: +SKIP
        0
    """

    def __init__(self, preload: Sequence[str], env: Mapping[str, str], idle_timeout: float = DEFAULT_IDLE_TIMEOUT):
        if not fork_server_supported():
            raise RuntimeError("a fork server needs Linux 5.3 or later (fork and pidfds); start processes with Popen")
        self.start_variables = start_variables(env)
        self._preload = list(preload)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _SERVER_COMMAND, str(theirs.fileno()), repr(float(idle_timeout)), *preload],
                pass_fds=[theirs.fileno()],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        ours.setblocking(False)  # every read here must not wait (socket.recv_fds drops its flags on 3.11)
        self._socket = ours
        self._start_lock = threading.Lock()  # one request at a time, so each reply goes to its request
        self._lock = threading.Lock()
        self._state = _State.RUNNING
        self._reports: dict[int, int] = {}  # serial -> exit code (an int per command started)
        self._replies: list[tuple] = []  # start replies, until the starting thread takes them

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self._process.pid

    @property
    def running(self) -> bool:
        """Whether the server can still take a request (it has not exited, as far as this process knows)."""
        with self._lock:
            self._drain()
            return self._state is _State.RUNNING

    def start(
        self,
        module: str,
        args: Sequence[str],
        env: Mapping[str, str],
        timeout: float = 60.0,
        process_group: int | None = None,
        stderr: int | None = None,
    ) -> ForkedProcess:
        """Fork ``python -m module args`` with ``env``, its standard output a pipe to this process.

        Args:
            module: the module run as ``__main__``.
            args: its command-line arguments.
            env: its environment; its :func:`start_variables` must be the server's.
            timeout: seconds to wait for the fork (the server may still be importing ``preload``).
            process_group: as ``subprocess.Popen``'s: ``0`` puts the command in a process group
                of its own; ``None`` (the default) leaves it in the server's, which is this process's.
            stderr: ``None`` (the default): this process's standard error; ``subprocess.PIPE``: a
                pipe to this process, :attr:`ForkedProcess.stderr`.

        Returns:
            the process, with ``Popen``'s methods.

        Raises:
            ValueError: ``env`` disagrees with the server's on a start variable.
            ForkServerExited: the server has exited.
            RuntimeError: the server failed to fork, or did not answer within ``timeout`` (then this side
                closes it: a new server serves the next request).
        """
        if start_variables(env) != self.start_variables:
            raise ValueError("env differs from the fork server's on a variable read at start: start another server")
        if stderr not in (None, subprocess.PIPE):
            raise ValueError(f"stderr must be None (this process's) or subprocess.PIPE, got {stderr!r}")
        command = (module, list(args), dict(env), os.getcwd(), process_group)
        with self._start_lock:
            pid, serial, pidfd, pipes = self._fork(command, stderr == subprocess.PIPE, timeout)
        return ForkedProcess(self, [sys.executable, "-m", module, *args], pid, serial, pidfd, *pipes)

    def _fork(self, command: tuple, pipe_stderr: bool, timeout: float) -> tuple:
        """Send the request with the command's streams; return its pid, serial, pidfd and (stdout, stderr)."""
        pipes = [os.pipe() for _ in range(2 if pipe_stderr else 1)]  # (read end, write end) each
        stdin = _stdin_fd()
        streams = [stdin, pipes[0][1], pipes[1][1] if pipe_stderr else 2]
        try:
            message = pickle.dumps(("start", *command))
            try:
                socket.send_fds(self._socket, [message], streams)
            except OSError as exc:
                self._lost(f"could not be reached: {exc}")
            reply = self._await_reply(timeout)
            if reply[0] == "failed":
                raise RuntimeError(f"the fork server could not start python -m {command[0]}: {reply[1]}")
        except BaseException:
            for read_end, _ in pipes:
                os.close(read_end)
            raise
        finally:
            for _, write_end in pipes:
                os.close(write_end)
            if stdin != 0:
                os.close(stdin)
        _, pid, serial, pidfd = reply
        files = [os.fdopen(read_end, "r") for read_end, _ in pipes]
        return pid, serial, pidfd, (files[0], files[1] if pipe_stderr else None)

    # The client side of the protocol. Every read of the socket happens under _lock; what a read brings is
    # kept for the thread it belongs to. A thread that waits for news on the socket may find that another
    # read its news first, so it waits in slices of _SLICE and looks again.

    def exit_code(self, serial: int, pidfd: int) -> int | None:
        """The exit code of the command ``serial`` (whose pidfd is ``pidfd``); ``None`` while it runs."""
        with self._lock:
            self._drain()
            if serial in self._reports:
                return self._reports[serial]
            running = self._state is _State.RUNNING
        if running or not _readable(pidfd, 0.0):
            return None
        return _UNKNOWN_CODE  # it ended after the server: nobody can tell how

    def wait_for_exit(self, serial: int, pidfd: int, timeout: float | None) -> int | None:
        """Wait up to ``timeout`` seconds (``None``: for ever) for the command's exit code; ``None`` if it runs on."""
        if not _readable(pidfd, timeout):  # readable once the command has ended
            return None
        while True:  # its report follows: the server sees the same pidfd readable
            code = self.exit_code(serial, pidfd)
            if code is not None:
                return code
            self._wait_for_news(_SLICE)

    def _await_reply(self, timeout: float) -> tuple:
        started = time.monotonic()
        deadline, said = started + timeout, False
        while True:
            with self._lock:
                self._drain()
                reply = self._replies.pop(0) if self._replies else None
                gone = self._state is _State.GONE
            if reply is not None:
                return reply
            if gone:
                self._lost("exited before it answered")
            now = time.monotonic()
            if not said and now - started >= NOTICE_AFTER:
                said = True
                log.warning(
                    "waiting for the fork server (pid %d) to answer for %.0fs: it imports %s before its first "
                    "fork (up to %gs)",
                    self.pid,
                    now - started,
                    ", ".join(self._preload),
                    timeout,
                )
            left = deadline - now
            if left <= 0:
                self.close()  # a late answer must not be taken for the next request's
                raise RuntimeError(f"the fork server did not answer within {timeout:g}s (still importing?)")
            self._wait_for_news(min(left, _SLICE))

    def _wait_for_news(self, timeout: float) -> None:
        with self._lock:
            if self._state is _State.GONE:
                return
            fd = self._socket.fileno()
        _readable(fd, timeout)

    def _drain(self) -> None:
        """Read what the server sent, without waiting: exit reports and start replies, kept for their threads."""
        while self._state is _State.RUNNING:
            try:
                data, fds, _, _ = socket.recv_fds(self._socket, _MAX_MESSAGE, 1)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            if not data:
                self._mark_gone()
                return
            message = pickle.loads(data)
            if message[0] == "exited":
                self._reports[message[1]] = message[2]
            elif message[0] == "started":
                self._replies.append((*message, fds[0]))
            else:
                self._replies.append(message)

    def _lost(self, why: str) -> None:
        with self._lock:
            self._mark_gone()
        code = self._reap_server()
        raise ForkServerExited(f"the fork server {why} (exit code {code}; its error, if any, is above)", code)

    def close(self) -> None:
        """Close this side's socket: the server exits once its live commands have ended.

        Those run on, but their exit codes are lost (:meth:`ForkedProcess.wait` then gives 255).
        """
        with self._lock:
            self._mark_gone()

    def _drop_after_fork(self) -> None:
        """In a forked child, which has one thread: new locks (another thread may have held one), this copy closed."""
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._mark_gone()

    def _mark_gone(self) -> None:
        """Under ``_lock``: no request reaches the server any more; this side's socket is closed."""
        if self._state is _State.RUNNING:
            self._state = _State.GONE
            self._socket.close()

    def _reap_server(self) -> int | None:
        try:
            return self._process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return None


_shared_lock = threading.Lock()
_shared: dict[tuple, ForkServer] = {}  # (preload, start variables) -> the server; guarded by _shared_lock


def shared_fork_server(preload: Sequence[str], env: Mapping[str, str]) -> ForkServer:
    """This process's fork server for ``preload`` and ``env``'s :func:`start_variables`, started if need be.

    A server started here exits after ``RPCDL_FORK_SERVER_IDLE`` seconds (default 30) with no
    live command and no request; the next call starts another.

    Args:
        preload: the modules the server imports.
        env: an environment the server's commands may have.

    Returns:
        a running server, shared with every caller that asks for the same.

    Example::

        >>> server = shared_fork_server(["torch"], dict(os.environ))  # doctest: +SKIP
        >>> server is shared_fork_server(["torch"], {**os.environ, "RPCDL_TOKEN": "t"})  # doctest: +SKIP
        True
    """
    key = (tuple(preload), tuple(start_variables(env).items()))
    idle_timeout = environment_number(
        IDLE_TIMEOUT_ENV,
        DEFAULT_IDLE_TIMEOUT,
        float,
        "a number of seconds > 0 (how long an idle fork server stays)",
        lambda seconds: seconds > 0,
    )
    with _shared_lock:
        server = _shared.get(key)
        if server is None or not server.running:
            server = _shared[key] = ForkServer(preload, env, idle_timeout)
        return server


def _after_fork_in_child() -> None:
    """A forked child drops its copies of the servers' sockets (a server exits when no copy is left)."""
    global _shared_lock
    _shared_lock = threading.Lock()  # another thread may have held it at the fork
    for server in _shared.values():
        server._drop_after_fork()
    _shared.clear()


in_forked_child(_after_fork_in_child)


class ForkedProcess:
    """A command forked by a :class:`ForkServer`, with the methods of ``subprocess.Popen`` that rpcdl uses.

    Signals go through a pidfd, so they never reach another process that
    took the pid after this one ended.

    Attributes:
        args: the command as ``python -m`` would run it.
        pid: its process id.
        stdout: its standard output (text), read by this process.
        stderr: its standard error (text), read by this process, when it was started with
            ``stderr=subprocess.PIPE``; else ``None``: it shares this process's.
        stdin: ``None``: it shares this process's.
        returncode: its exit code once known (negative: the signal that ended it), else ``None``.
    """

    stdin: IO[str] | None = None

    def __init__(
        self,
        server: ForkServer,
        args: list[str],
        pid: int,
        serial: int,
        pidfd: int,
        stdout: IO[str],
        stderr: IO[str] | None = None,
    ):
        self.args = args
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._server = server
        self._serial = serial
        self._pidfd = pidfd
        self._lock = threading.Lock()
        weakref.finalize(self, os.close, pidfd)

    def poll(self) -> int | None:
        """Its exit code if it has ended, else ``None``."""
        with self._lock:
            if self.returncode is None:
                self._settle(self._server.exit_code(self._serial, self._pidfd))
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to end; return its exit code.

        Raises:
            subprocess.TimeoutExpired: it runs on after ``timeout`` seconds.
        """
        with self._lock:
            if self.returncode is not None:
                return self.returncode
        code = self._server.wait_for_exit(self._serial, self._pidfd, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        with self._lock:
            self._settle(code)
            return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` unless it has ended."""
        with self._lock:
            if self.returncode is None:
                self._settle(self._server.exit_code(self._serial, self._pidfd))
            if self.returncode is None:
                try:
                    signal.pidfd_send_signal(self._pidfd, sig)
                except ProcessLookupError:
                    pass  # it ended a moment ago

    def terminate(self) -> None:
        """Send SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """Send SIGKILL."""
        self.send_signal(signal.SIGKILL)

    def _settle(self, code: int | None) -> None:
        """Under ``_lock``: keep the exit code once known."""
        if code is not None and self.returncode is None:
            self.returncode = code

    def __repr__(self) -> str:
        return f"<ForkedProcess pid={self.pid} returncode={self.returncode}>"


def _readable(fileobj: Any, timeout: float | None) -> bool:
    """Whether ``fileobj`` is readable within ``timeout``; ``True`` too if another thread closed it (look again)."""
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(fileobj, selectors.EVENT_READ)
            return bool(selector.select(timeout))
    except (OSError, ValueError):
        return True


def _stdin_fd() -> int:
    try:
        os.fstat(0)
    except OSError:
        return os.open(os.devnull, os.O_RDONLY)  # no standard input here: the command reads an empty one
    return 0


# The server's side.


def _serve(channel: socket.socket, idle_timeout: float, preload: Sequence[str]) -> None:
    """Import ``preload``, then fork a command per request until the client leaves or nothing happens."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the commands; the server waits for the client
    _name_process("rpcdl forkserver")
    for name in preload:
        importlib.import_module(name)
    selector = selectors.DefaultSelector()
    selector.register(channel, selectors.EVENT_READ)
    children: dict[int, tuple[int, int]] = {}  # pidfd -> (pid, serial)
    started = 0
    while True:
        events = selector.select(None if children else idle_timeout)
        if not events:
            return  # idle
        for key, _ in events:
            if key.fileobj is channel:
                try:
                    data, fds, _, _ = socket.recv_fds(channel, _MAX_MESSAGE, 3)
                except ConnectionError:
                    data, fds = b"", []
                if not data:
                    return  # the client closed its side or exited
                request = pickle.loads(data)
                started += 1
                pidfd = _fork(request, started, fds, channel, selector, children)
                if pidfd is not None:
                    selector.register(pidfd, selectors.EVENT_READ)
            else:
                pid, serial = children.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                _send(channel, ("exited", serial, os.waitstatus_to_exitcode(status)))


def _fork(
    request: tuple,
    serial: int,
    fds: list[int],
    channel: socket.socket,
    selector: selectors.BaseSelector,
    children: dict[int, tuple[int, int]],
) -> int | None:
    _, module, args, env, cwd, process_group = request
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        _send(channel, ("failed", f"fork failed: {exc}"))
        return None
    if pid == 0:
        selector.close()
        channel.close()
        for pidfd in children:
            os.close(pidfd)
        _become(module, args, env, cwd, process_group, fds)  # never returns
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    children[pidfd] = (pid, serial)
    _send(channel, ("started", pid, serial), [pidfd])
    return pidfd


def _become(
    module: str, args: list[str], env: dict[str, str], cwd: str, process_group: int | None, fds: list[int]
) -> None:
    """In the fork: take the request's streams, environment, directory and group; run the module as ``__main__``."""
    if process_group is not None:
        os.setpgid(0, process_group)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _name_process(" ".join([module.rpartition(".")[2], *args[:1]]))  # "rpcdl worker"
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # as a fresh interpreter would: its own stream, not the server's
    sys.argv = [module, *args]
    # SystemExit ends the interpreter here as it would a fresh one: exit hooks run, streams are flushed.
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    sys.exit(0)


def _name_process(name: str) -> None:
    """Name this process in ``top``, ``ps -o comm`` and ``pgrep`` (the kernel keeps 15 bytes); ``ps aux`` still
    shows the server's command line, which a fork cannot change."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass  # no /proc: the name is cosmetic


def _send(channel: socket.socket, message: tuple, fds: Sequence[int] = ()) -> None:
    try:
        socket.send_fds(channel, [pickle.dumps(message)], list(fds))
    except OSError:
        pass  # the client is gone: the next read of the channel says so


def _main(argv: list[str]) -> None:
    _serve(socket.socket(fileno=int(argv[0])), float(argv[1]), argv[2:])
