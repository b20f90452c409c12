"""The worker: a server that runs the functions clients send it; its lifecycle.

Threads of a worker:

* the process loop (``rpcdl-loop``, :mod:`rpcdl.transport.event_loop`) takes
  connections, has the admission (:mod:`rpcdl.server.admission`) admit or
  refuse each, and runs the handshake of each admitted
  (:mod:`rpcdl.transport.handshake_server`, TLS included); a connection that
  passes its handshake, within one deadline counted from the accept, becomes
  a session, which the loop reads and writes (:mod:`rpcdl.server.session`): it
  answers pings, releases and requests for counters itself, queues calls for
  the executors, posts the ``LEAVING`` frames as the worker drains, and every
  second closes the sessions whose client stalled in the middle of a frame;
* ``parallel`` executor threads (``rpcdl-executor-N``, :mod:`rpcdl.server.slots`)
  run every call and prepare its answer, which the loop writes;
* the thread that calls :meth:`Worker.start`, :meth:`Worker.drain` and
  :meth:`Worker.stop` (and the exit hook, which stops the workers still running).

So a worker's threads are the same with one client as with a thousand.

Who owns what: the worker's lock (``_lock``) guards its :class:`Phase`, its
set of sessions, the count of clients among them and of the places reserved
by handshakes past their verdict (``max_sessions`` bounds the two together),
for every read and write, so that a session is admitted only while the worker
serves, a stop sees every session admitted, and no more clients are taken
than the limit. ``_stop_lock`` is held by the one thread that stops the
worker (a second stop waits for it). The admission guards its own table of
connections in their handshake (see its module). A session owns its own
state (its module says how); the worker reaches it through its public
methods: :meth:`~rpcdl.server.session.ClientConnection.drain` and
:meth:`~rpcdl.server.session.ClientConnection.announce_leaving` as it drains,
``close`` at the end. The slots, the counters and the RRef store
(:class:`rpcdl.rpc.rref.RRefStore`) each guard their state with their own
lock; the fields set in the constructor do not change, and the staging buffer
sessions receive small frames into is the loop thread's
(:mod:`rpcdl.transport.frame_protocol`). Locks nest in one order only, and no
deeper: the slots' and the exit hook's registry inside the worker's
(:meth:`Worker.start`), each session's inside the worker's (its drain, as the
worker starts draining), the compressor's inside a session's (an answer
written). No lock is held while a call runs.

No client can stop the worker: a connection that misbehaves is logged in one
line and closed.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .._lifecycle import ExitPhase, at_exit
from ..address import format_address, is_loopback, parse_address
from ..checks import check_int, check_positive_int, check_timeout
from ..errors import ProtocolError, SessionsFull
from ..open_files import raise_open_file_limit
from ..registry import RegistryURL
from ..rpc import client as _client  # noqa: F401  (user code here may fetch an RRef from another worker)
from ..rpc.rref import RRefStore
from ..transport.compression import Compressor, resolve_mode
from ..transport.control import DEFAULT_LEAVING, decode_release, encode_leaving, encode_rejected, encode_stats
from ..transport.event_loop import call_soon, in_loop_thread, process_loop
from ..transport.handshake import Agreement, Deadline, send_refusal
from ..transport.handshake_server import accept_handshake
from ..transport.security import Token, default_server_tls, resolve_token
from ..transport.shm import WorkerSegment, resolve_bytes
from ..transport.wire import Frame, Kind, Limits
from .admission import DEFAULT_MAX_SESSIONS, MAX_HANDSHAKES_ENV, Admission, Full, Pending, QuietLog, max_handshakes
from .call_runner import CallRunner
from .counters import Counters
from .draining import ANNOUNCE_WAIT, serve_until_stopped
from .registration import Registration
from .session import ClientConnection, shutdown_socket
from .slots import Slots
from .streaming import stream
from .worker_metrics import serve_worker_metrics

log = logging.getLogger("rpcdl.worker")

_WILDCARDS = {"", "0.0.0.0", "::"}
_STALL_TICK = 1.0  # seconds between two looks for clients stalled in the middle of a frame
_ACCEPTS_PER_TURN = 64  # connections accepted before the loop serves the sessions again
_ACCEPT_RETRY = 0.05  # seconds before accepting again after the system refused (out of descriptors, say)
_CLOSE_WAIT = 2.0  # seconds a stop waits for the loop to close the sessions


class Phase(enum.Enum):
    """Where a worker is in its life."""

    NEW = "new"
    SERVING = "serving"
    DRAINING = "draining"  #: leaving: not accepting, clients told; calls arriving are rejected, calls in flight finish
    STOPPED = "stopped"


class Worker:
    """An rpcdl worker to embed in a process: serves calls from background threads.

    Args:
        host: interface to listen on. Loopback by default; listening elsewhere
            requires a token unless ``insecure=True``.
        port: port to listen on; ``0`` lets the system pick a free one.
        timeout: seconds a client may stall in the middle of a message, and
            that a call may wait for the RRef it uses.
        parallel: how many calls run at once.
        token: shared secret clients must prove they hold; defaults to
            ``RPCDL_TOKEN`` / ``RPCDL_TOKEN_FILE``; ``""`` for none.
        insecure: allow a non-loopback ``host`` without a token.
        ssl_context: serve TLS with this context (see
            :func:`rpcdl.transport.security.server_tls_context`); defaults to one from
            ``RPCDL_TLS_CERT`` / ``RPCDL_TLS_KEY`` when set.
        limits: bounds on one message, received or sent (default
            :class:`~rpcdl.transport.wire.Limits` from ``RPCDL_MAX_MESSAGE_BYTES`` and
            ``RPCDL_MAX_BUFFERS``). A result past them fails its call with
            :class:`~rpcdl.errors.LimitExceeded`.
        advertise: the host name clients should use, when it differs from
            ``host`` (by default the machine's name when ``host`` is a wildcard).
        compression: ``"off"``, ``"on"`` or ``"auto"``: lz4 compression of large
            answers, negotiated with each client (see :mod:`rpcdl.transport.compression`);
            default ``RPCDL_COMPRESSION``, else ``"auto"``.
        shared_memory: bytes of the shared segment offered to each client on
            this host (see :mod:`rpcdl.transport.shm`); ``0`` turns it off; default
            ``RPCDL_SHM_BYTES``, else 256 MiB.
        max_sessions: the most clients served at once (default
            ``DEFAULT_MAX_SESSIONS``, 1024). A client past it is refused in
            its handshake, once it proved its token, with
            :class:`~rpcdl.errors.SessionsFull`: its loader takes its other
            workers and probes this one later. ``rpcdl status`` is no client:
            it is never refused so.

    A new connection has ``limits.handshake_timeout`` seconds from its accept
    (``RPCDL_HANDSHAKE_TIMEOUT``, default 10) for its whole handshake, TLS
    included; at most ``RPCDL_MAX_HANDSHAKES`` (default 256) are in their
    handshake at once (see ``rpcdl.server.admission`` and SECURITY.md).

    Attributes:
        address: the ``"host:port"`` clients reach this worker at, known as
            soon as it is constructed (the port chosen with ``port=0`` included).

    Example::

        >>> with rpcdl.Worker() as worker:  # doctest: +SKIP
        ...     rpcdl.rpc_sync(worker.address, sum, ([1, 2, 3],))
        6
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        timeout: float = 120.0,
        parallel: int = 1,
        token: str | bytes | Token | None = None,
        insecure: bool = False,
        ssl_context: ssl.SSLContext | None = None,
        limits: Limits | None = None,
        advertise: str | None = None,
        compression: str | None = None,
        shared_memory: int | None = None,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ):
        if not isinstance(host, str):
            raise TypeError(f"host must be a string such as '127.0.0.1' or '0.0.0.0', got {host!r}")
        check_int(port, "port", minimum=0, maximum=65535, meaning="0 picks a free port")
        self.parallel = check_positive_int(parallel, "parallel", "calls run at once")
        self.max_sessions = check_positive_int(max_sessions, "max_sessions", "clients served at once")
        self.timeout = check_timeout(timeout)
        self.limits = limits or Limits()
        self.compression = resolve_mode(compression)
        self.shared_memory = resolve_bytes(shared_memory)
        self._token = resolve_token(token)
        if self._token is None and not insecure and not is_loopback(host or "0.0.0.0"):
            raise PermissionError(
                f"refusing to listen on {host or '0.0.0.0'} without a token: anyone who can reach this port "
                "could run code as this user. Set RPCDL_TOKEN (or RPCDL_TOKEN_FILE, or --token-file) on the "
                "workers and the trainers, or pass insecure=True (--insecure) on a network you trust"
            )
        self._ssl = ssl_context if ssl_context is not None else default_server_tls()
        self._listener = socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=512
        )
        bound_port = self._listener.getsockname()[1]
        if advertise is None:
            advertise = socket.gethostname() if host in _WILDCARDS else host
        self.address = format_address(advertise, bound_port)
        self.store = RRefStore(self._token.secret if self._token is not None else None)  # shared objects: per token
        self.counters = Counters()
        self.calls = CallRunner(self.store, self.limits, self.counters)
        self.slots = Slots(self.parallel, self.calls.run, self.store)
        self._lock = threading.Lock()
        self._phase = Phase.NEW
        self._connections: set[ClientConnection] = set()
        self._clients = 0  # sessions among _connections that are not observers
        self._reserved = 0  # clients past the verdict of their handshake, not yet sessions: they count as clients
        self._stop_lock = threading.Lock()
        self._admission = Admission(max_handshakes(), self.limits.handshake_timeout)
        self._quiet_log = QuietLog(log)  # refusals a flood repeats: one warning per 10 s, with a count
        self._handshakes: set[asyncio.Task] = set()  # the loop's: handshakes in progress, kept from the collector
        self._stopped = threading.Event()
        self._started_at = time.monotonic()

    # ------------------------------------------------------------------ lifecycle

    @property
    def phase(self) -> Phase:
        """Where the worker is in its life (it may change as soon as it is read)."""
        with self._lock:
            return self._phase

    def start(self) -> Worker:
        """Start serving from background threads; return ``self``.

        Example::

            >>> worker = rpcdl.Worker().start()  # doctest: +SKIP
            >>> worker.phase  # doctest: +SKIP
            <Phase.SERVING: 'serving'>
        """
        with self._lock:  # started under the lock: a stop() from another thread finds them all started
            if self._phase is not Phase.NEW:
                return self
            self._phase = Phase.SERVING
            raise_open_file_limit()  # once per process: a worker holds a socket per client
            self.slots.start()
            loop = process_loop()
            loop.call_soon_threadsafe(self._listen)
            loop.call_soon_threadsafe(self._close_stalled)
            _running.add(self)  # before any stop() can discard it
        return self

    def drain(self, grace: float = 30.0, reason: str = DEFAULT_LEAVING) -> bool:
        """Begin leaving, and return at once: stop accepting, tell every client, reject the calls that arrive.

        Each client gets a ``LEAVING`` frame (see :mod:`rpcdl.transport.control`)
        and stops sending calls here (they fail at once on its side with
        :class:`~rpcdl.errors.WorkerLeaving`); the calls in flight go on running
        and are answered. :meth:`stop` then waits for them and closes.

        Args:
            grace: the seconds the calls in flight will get (what clients are told).
            reason: why the worker leaves, for the clients' messages.

        Returns:
            whether this call began the drain (``False``: it drains already, stops, or never started).

        Example::

            >>> worker = rpcdl.Worker().start()  # doctest: +SKIP
            >>> worker.drain(grace=5.0)  # doctest: +SKIP
            True
            >>> worker.stop(grace=5.0)  # doctest: +SKIP
            True
        """
        payload = encode_leaving(grace, reason)
        with self._lock:
            if self._phase is not Phase.SERVING:
                return False
            self._phase = Phase.DRAINING
            connections = list(self._connections)
            for connection in connections:  # with the phase: no call is admitted once it drains
                connection.drain()
        for connection in connections:  # posted: the loop writes them, a client that does not read holds nothing
            connection.announce_leaving(payload)
        call_soon(self._stop_listening)
        log.info("rpcdl worker %s is leaving (%s): %d client(s) told", self.address, reason, len(connections))
        return True

    @property
    def calls_in_flight(self) -> int:
        """How many calls run or wait for a slot now (a hint, which may change as soon as it is read)."""
        return max(0, self.counters.outstanding)

    def stop(self, grace: float = 30.0) -> bool:
        """Drain (see :meth:`drain`), let calls in flight finish for up to ``grace`` seconds, close.

        Calls arriving meanwhile are rejected, so clients retry them elsewhere.
        A second call (from another thread, say) waits for the first to finish.

        Args:
            grace: seconds the calls in flight get to finish (``0``: close now).

        Returns:
            whether every call in flight finished within ``grace``.

        Example::

            >>> worker = rpcdl.Worker().start()  # doctest: +SKIP
            >>> worker.stop(grace=5.0)  # doctest: +SKIP
            True
        """
        with self._stop_lock:
            with self._lock:
                previous = self._phase
                if previous is Phase.NEW:
                    self._phase = Phase.STOPPED
            if previous is Phase.NEW:  # never started: no thread, no session
                self._listener.close()
                self.slots.stop(timeout=0.0)
                self._stopped.set()
                return True
            if previous is Phase.STOPPED:
                return True
            self.drain(grace)
            deadline = time.monotonic() + grace
            while self.counters.outstanding > 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            finished = self.counters.outstanding <= 0
            with self._lock:
                connections = list(self._connections)
            told_by = time.monotonic() + max(ANNOUNCE_WAIT, deadline - time.monotonic())
            # the clients hear LEAVING (and the last answers) before their connections close, even at once
            while any(connection.unwritten for connection in connections) and time.monotonic() < told_by:
                time.sleep(0.01)
            for connection in connections:
                connection.close()
            with self._lock:
                self._phase = Phase.STOPPED
            self.slots.stop(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
            closed_by = time.monotonic() + _CLOSE_WAIT
            while self._connections_left() and time.monotonic() < closed_by and not in_loop_thread():
                time.sleep(0.01)
            self._stopped.set()
            _running.discard(self)
            return finished

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the worker has stopped (:meth:`stop`, from another thread); return whether it has.

        Args:
            timeout: seconds to wait at most; ``None``: until it stops.
        """
        return self._stopped.wait(timeout)

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def stats(self) -> dict[str, Any]:
        """The worker's counters, as :func:`rpcdl.stats` returns them.

        Returns:
            calls served, failed, rejected and in flight, batches made, bytes in
            and out, busy seconds, clients (``rpcdl status`` is an observer, not
            a client) and the most it takes (``max_sessions``), connections, RRefs held, whether it drains, and how it
            serves (TLS, token, compression).

        Example::

            >>> with rpcdl.Worker() as worker:  # doctest: +SKIP
            ...     worker.stats()["calls_served"]
            0
        """
        with self._lock:
            connections = list(self._connections)
            draining = self._phase is not Phase.SERVING
        compressing = sum(connection.compressor.active for connection in connections)
        observers = sum(connection.observer for connection in connections)
        c = self.counters.totals()
        return {
            "address": self.address,
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - self._started_at, 3),
            "parallel": self.parallel,
            "calls_served": c["calls_served"],
            "calls_failed": c["calls_failed"],
            "calls_rejected": c["calls_rejected"],
            "calls_in_flight": c["outstanding"],
            "busy_s": round(c["busy_seconds"], 6),
            "batches": c["batches"],
            "bytes_in": c["bytes_in"],
            "bytes_out": c["bytes_out"],
            "clients": len(connections) - observers,
            "max_sessions": self.max_sessions,
            "observers": observers,
            "connections_total": c["connections_total"],
            "connections_refused": c["connections_refused"],
            "rrefs": len(self.store),
            "rrefs_shared": self.store.shared_count(),
            "draining": draining,
            "tls": self._ssl is not None,
            "authenticated": self._token is not None,
            "compression_mode": self.compression,
            "connections_compressing": compressing,
        }

    # ------------------------------------------------------------------ threads

    def _listen(self) -> None:
        """On the loop: take connections as they come, while the worker serves."""
        if self.phase is not Phase.SERVING:
            return
        self._listener.setblocking(False)
        process_loop().add_reader(self._listener.fileno(), self._accept)

    def _stop_listening(self) -> None:
        """On the loop: take no more connections, and close the listening socket."""
        if self._listener.fileno() >= 0:
            process_loop().remove_reader(self._listener.fileno())
        shutdown_socket(self._listener)

    def _accept(self) -> None:
        """On the loop, when connections wait: admit or refuse each, and start the handshake of those admitted."""
        loop = process_loop()
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: try again shortly
                if self.phase is not Phase.SERVING:
                    return
                self._quiet_log.warning("accept", "could not accept a connection: %s", _why(exc))
                loop.remove_reader(self._listener.fileno())
                loop.call_later(_ACCEPT_RETRY, self._listen)
                return
            peer = format_address(address[0], address[1])
            pending = self._admission.admit(sock, peer)
            if isinstance(pending, Full):
                self.counters.add(connections_refused=1)
                self._quiet_log.warning(
                    "full",
                    "refused connection from %s: %d connections are in their handshake (%s), none for long "
                    "enough to be evicted",
                    peer,
                    pending.pending,
                    f"the limit, {MAX_HANDSHAKES_ENV}" if pending.pending >= pending.limit else "an early random drop",
                )
                send_refusal(sock, pending.pending, pending.limit, tls=self._ssl is not None)
                continue
            task = loop.create_task(self._handshake(pending, sock, peer))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    def _refuse(self, sock: socket.socket, peer: str, reason: str) -> None:
        self.counters.add(connections_refused=1)
        log.warning("refused connection from %s: %s", peer, reason)
        shutdown_socket(sock)

    def _evicted(self, sock: socket.socket, peer: str) -> None:
        self.counters.add(connections_refused=1)
        self._quiet_log.warning(
            "evicted", "evicted connection from %s: the oldest in its handshake, to make room for a newer one", peer
        )
        shutdown_socket(sock)

    async def _handshake(self, pending: Pending, sock: socket.socket, peer: str) -> None:
        """On the loop: run a handshake within its deadline from the accept, TLS included; serve the
        connection if it passes.

        The socket is closed, or handed to a session, only once the admission let it go (it may evict it).
        """
        deadline = Deadline(self.limits.handshake_timeout, start=pending.accepted_at)
        agreed = Agreement("off")
        reserved: list[bool] = []  # whether the verdict reserved a client's place (the one call of admit)
        current = [sock]  # the socket to close on failure: its TLS socket once wrapped

        def admit(observer: bool) -> str:
            full = self._reserve(observer)
            reserved.append(not full and not observer)
            return full

        def wrapped(tls_sock: socket.socket) -> bool:
            current[0] = tls_sock
            return self._admission.rebind(pending, tls_sock)

        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock, agreed = await accept_handshake(
                sock,
                self._token,
                peer,
                deadline,
                tls=self._ssl,
                compression=self.compression,
                shared_memory=self.shared_memory,
                admit=admit,
                wrapped=wrapped,
            )
            if not self._admission.leave(pending):  # evicted as it passed: its socket is shut down
                raise ConnectionAbortedError("evicted")
        except Exception as exc:
            sock = current[0]
            if reserved and reserved[0]:
                self._unreserve()
            if agreed.segment is not None:
                agreed.segment.close()
            if not self._admission.leave(pending):
                self._evicted(sock, peer)
            elif isinstance(exc, SessionsFull):  # trainers retry a full worker: one warning per 10 s
                self.counters.add(connections_refused=1)
                self._quiet_log.warning("sessions", "refused connection from %s: %s", peer, exc)
                shutdown_socket(sock)
            else:
                self._refuse(sock, peer, _why(exc))
            return
        compressor = Compressor(agreed.compression, loopback=is_loopback(parse_address(peer)[0]))
        self.serve_socket(
            sock, peer, compressor, agreed.segment, observer=agreed.observer, reserved=bool(reserved and reserved[0])
        )

    def _reserve(self, observer: bool) -> str:
        """Reserve a client's place for a connection past its token check; ``""``, or why the worker is full."""
        with self._lock:
            if observer:
                return ""
            taken = self._clients + self._reserved
            if taken < self.max_sessions:
                self._reserved += 1
                return ""
        return (
            f"it serves {taken} client(s), its limit (max_sessions={self.max_sessions}; rpcdl worker "
            "--max-sessions N): use other workers, or start this one with a higher limit"
        )

    def _unreserve(self) -> None:
        with self._lock:
            self._reserved -= 1

    def serve_socket(
        self,
        sock: socket.socket,
        peer: str,
        compressor: Compressor | None = None,
        segment: WorkerSegment | None = None,
        observer: bool = False,
        reserved: bool = False,
    ) -> ClientConnection:
        """Serve a client on ``sock``, connected and past the handshake; return its session.

        Args:
            sock: the connection (a plain or a TLS socket); the loop reads and writes it from now on.
            peer: the client's address, for messages.
            compressor: what compresses answers on it (default: none).
            segment: the shared segment agreed with a client on this host (default: answers on the socket).
            observer: the client only asks for counters (``rpcdl status``): not counted among the clients.
            reserved: its handshake reserved its place among the clients (see ``max_sessions``); a session
                served without that counts too, even past the limit.
        """
        connection = ClientConnection(self, sock, peer, compressor, segment, observer=observer)
        with self._lock:
            self._reserved -= reserved
            admitted = self._phase is Phase.SERVING
            if admitted:
                self._connections.add(connection)
                self._clients += not observer
        if not admitted:  # the worker stops: closed at once, its socket and segment with it
            connection.close()
            return connection
        self.counters.add(connections_total=1)
        log.log(logging.DEBUG if observer else logging.INFO, "client %s connected", peer)
        connection.start()
        return connection

    def forget(self, connection: ClientConnection) -> None:
        """Drop a closed session, and the RRefs it held."""
        with self._lock:
            if connection not in self._connections:
                return
            self._connections.discard(connection)
            self._clients -= not connection.observer
        self.store.release_holder(connection)
        log.log(logging.DEBUG if connection.observer else logging.INFO, "client %s left", connection.peer)

    def dispatch(self, connection: ClientConnection, frame: Frame) -> None:
        """Handle a frame just read from ``connection``, on the loop: queue a call, answer anything else.

        Raises:
            ProtocolError: a frame a client may not send, or a malformed one.
        """
        kind = frame.kind
        if kind is Kind.CALL:
            if not connection.serving:  # it drains: the client retries the call elsewhere
                self.counters.add(calls_rejected=1)
                connection.send(Frame(Kind.REJECTED, frame.call_id, payload=encode_rejected()), answers_call=True)
                return
            if frame.ref:  # before any later call that uses the RRef is read: it waits for this one
                self.store.expect(frame.ref, connection)
            self.slots.enqueue(connection, frame)
        elif kind is Kind.RELEASE:
            for uid in decode_release(frame.payload):
                self.store.release(uid)
        elif kind is Kind.SEGMENT_RELEASE:
            connection.release_spans(frame.payload)
        elif kind is Kind.PING:
            connection.send(Frame(Kind.PONG, frame.call_id))
        elif kind is Kind.STATS:
            stats = {**self.stats(), "compression": connection.compressor.state(), **connection.transport_state()}
            connection.send(Frame(Kind.STATS_REPLY, frame.call_id, payload=encode_stats(stats)))
        elif kind is Kind.STREAM:
            stream(connection, frame, self.limits)
        else:
            raise ProtocolError(f"a client may not send {kind.name} frames")

    def _connections_left(self) -> int:
        with self._lock:
            return len(self._connections)

    def _close_stalled(self) -> None:
        """On the loop, every tick while the worker runs: close the sessions whose client stalled mid-frame."""
        with self._lock:
            if self._phase is Phase.STOPPED:
                return
            connections = list(self._connections)
        now = time.monotonic()
        for connection in connections:
            if connection.stalled(now):
                log.warning(
                    "closed connection from %s: it sent nothing for %gs in the middle of a message",
                    connection.peer,
                    self.timeout,
                )
                connection.close()
        process_loop().call_later(_STALL_TICK, self._close_stalled)


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class _RunningWorkers:
    """The workers started and not stopped in this process, for the exit hook; one lock guards the set.

    Plain references: a running worker's own threads keep it alive anyway, and a
    weak set would change under a garbage collection, on any thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workers: set[Worker] = set()

    def add(self, worker: Worker) -> None:
        with self._lock:
            self._workers.add(worker)

    def discard(self, worker: Worker) -> None:
        with self._lock:
            self._workers.discard(worker)

    def stop_all(self) -> None:
        """Stop every worker still running (at exit, before the interpreter finalizes under their threads)."""
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            worker.stop(grace=1.0)


_running = _RunningWorkers()
at_exit(ExitPhase.WORKERS, _running.stop_all)


def run_worker(
    host: str,
    port: int,
    timeout: float = 120,
    parallel: int = 1,
    *,
    token: str | bytes | None = None,
    insecure: bool = False,
    ssl_context: ssl.SSLContext | None = None,
    num_threads: int | None = 1,
    address_file: str | os.PathLike | None = None,
    grace: float = 30.0,
    advertise: str | None = None,
    compression: str | None = None,
    on_ready: Callable[[Worker], Any] | None = None,
    watch_pid: int | None = None,
    metrics_port: int | None = None,
    register: str | None = None,
    max_sessions: int = DEFAULT_MAX_SESSIONS,
) -> None:
    """Listen and serve calls until SIGTERM or SIGINT (blocks).

    When ready, prints the worker's ``host:port`` on one line of standard
    output and appends it to ``address_file`` if given. On SIGTERM or SIGINT it
    leaves well (:meth:`Worker.drain`): it stops accepting, tells every client
    it is leaving, lets calls in flight finish for up to ``grace`` seconds and
    returns; a second signal meanwhile ends the drain at once.

    Args:
        host: interface to bind to (``"0.0.0.0"`` for all; requires a token or
            ``insecure=True``).
        port: port to bind to; ``0`` picks a free one.
        timeout: seconds a client may stall in the middle of a transfer.
        parallel: how many calls run at once.
        token, insecure, ssl_context, advertise, compression: as for :class:`Worker`.
        num_threads: ``torch.set_num_threads`` for this process (``None`` leaves it).
        address_file: file to append the address to, under a lock.
        grace: seconds calls in flight get to finish on shutdown (``--drain-timeout``).
        on_ready: called with the started worker instead of printing the address.
        watch_pid: stop as SIGTERM would when the process with this pid is gone
            (local workers follow the process that started them).
        metrics_port: serve Prometheus metrics at ``http://HOST:PORT/metrics`` on
            ``host``, this port (``0`` picks one; see :mod:`rpcdl.server.worker_metrics`);
            ``None``: no metrics.
        register: a Redis registry to join while serving,
            ``redis://HOST:PORT[/DB]?key=KEY[&ttl=SECONDS]`` (see :mod:`rpcdl.registry`):
            the worker beats there until it drains, when it leaves it.
        max_sessions: the most clients served at once (default 1024; see :class:`Worker`).

    Example::

        $ python -c "import rpcdl; rpcdl.run_worker('127.0.0.1', 6543)"
        127.0.0.1:6543
    """
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    worker = Worker(
        host,
        port,
        timeout=timeout,
        parallel=parallel,
        token=token,
        insecure=insecure,
        ssl_context=ssl_context,
        advertise=advertise,
        compression=compression,
        max_sessions=max_sessions,
    ).start()
    registration = Registration(RegistryURL.parse(register), worker.address) if register is not None else None
    announce_ready = on_ready if on_ready is not None else lambda started: print(started.address, flush=True)
    if metrics_port is None:
        serve_until_stopped(worker, grace, address_file, announce_ready, registration, watch_pid)
        return
    try:
        metrics = serve_worker_metrics(worker, metrics_port, host)
    except BaseException:
        worker.stop(0)  # it never served: nothing to drain
        raise
    log.info("rpcdl worker %s serves metrics at %s", worker.address, metrics.url)
    try:
        serve_until_stopped(worker, grace, address_file, announce_ready, registration, watch_pid)
    finally:
        metrics.stop()
