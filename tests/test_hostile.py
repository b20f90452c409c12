"""Hostile and careless clients (issue 30): slow handshakes, floods, huge headers, and the local workers' tools.

Real worker processes (``spawn_workers``) or embedded workers, real loopback sockets.
See SECURITY.md ("What a worker guarantees") for the promises these tests hold.
"""

from __future__ import annotations

import logging
import operator
import resource
import select
import shutil
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest
from blocking_wire import client_negotiate
from pki import make_ca, make_certificate

import rpcdl
from rpcdl.errors import WorkerFull
from rpcdl.local import child_environment
from rpcdl.rpc import dial
from rpcdl.server.admission import Admission, Full, Pending, PendingState, QuietLog
from rpcdl.transport.handshake import MAGIC, VERSION, tls_refusal
from rpcdl.transport.security import client_tls_context, server_tls_context
from rpcdl.transport.wire import Frame, Kind, encode_frame

_HELLO_SIZE = struct.calcsize("!6sHB32s")
_HEADER = struct.Struct("!BBHIQQQ")
_DRIP_EVERY = 2.0  # seconds between the bytes of a slow client


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA and a worker certificate for 127.0.0.1 it signed."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    directory = tmp_path_factory.mktemp("pki")
    make_ca(directory, "ca")
    make_certificate(directory, "ca", "worker", "IP:127.0.0.1")
    return directory


@pytest.fixture
def many_descriptors():
    """Room for a few hundred sockets in this process (restored after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, 4096) if hard != resource.RLIM_INFINITY else 4096
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    if wanted < 1024:
        pytest.skip(f"this process may open {wanted} files, fewer than the test's sockets need")
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _hello() -> bytes:
    return struct.pack("!6sHB32s", MAGIC, VERSION, 0, bytes(32))


@contextmanager
def _sockets(count: int, address: str) -> Iterator[list[socket.socket]]:
    """``count`` connections to ``address``, opened at once and closed after."""
    opened: list[socket.socket] = []
    try:
        for _ in range(count):
            opened.append(_connect(address))
        yield opened
    finally:
        for sock in opened:
            sock.close()


def _closed_by_peer(sock: socket.socket | ssl.SSLSocket) -> bool:
    """Whether the peer has closed ``sock``, a non-blocking socket it sent nothing else on."""
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError, ssl.SSLEOFError):
        return True
    except (BlockingIOError, ssl.SSLWantReadError):
        return False


def _answered(sock: socket.socket) -> bool:
    """Whether the worker sent anything, or closed: all it does to a connection that sent nothing refused."""
    return bool(select.select([sock], [], [], 0)[0])


def _drip_until_cut(sock: socket.socket | ssl.SSLSocket, data: bytes, started: float, give_up_after: float) -> float:
    """Send ``data`` a byte every 2 s until the peer cuts the connection; return when it did (seconds from
    ``started``, a ``time.monotonic()``)."""
    for byte in data:
        try:
            sock.send(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            return time.monotonic() - started
        next_byte = time.monotonic() + _DRIP_EVERY
        while (left := next_byte - time.monotonic()) > 0:
            select.select([sock], [], [], min(left, 0.05))
            if _closed_by_peer(sock):
                return time.monotonic() - started
            if time.monotonic() - started > give_up_after:
                return float("inf")
    return float("inf")


# ---------------------------------------------------------------------------- one deadline for the whole handshake

_DEADLINE = 5.0  # the workers' handshake timeout in these tests: longer than a drip's gap, as 10 s is by default


@pytest.mark.parametrize("mode", ["plain", "inside TLS", "TLS hello"])
def test_a_drip_of_one_byte_every_2s_is_cut_at_the_handshake_deadline(spawn_workers, pki, monkeypatch, mode):
    env = {**child_environment(), "RPCDL_HANDSHAKE_TIMEOUT": str(_DEADLINE)}
    if mode != "plain":
        env.update(RPCDL_TLS_CERT=str(pki / "worker.pem"), RPCDL_TLS_KEY=str(pki / "worker.key"))
        monkeypatch.setenv("RPCDL_TLS_CA", str(pki / "ca.pem"))  # for the workers' start-up ping
    (address,) = spawn_workers(1, env=env)
    connected_at = time.monotonic()  # the worker accepts after this: its deadline ends after _DEADLINE from here
    sock = _connect(address)
    data = _hello()
    if mode == "inside TLS":  # the TLS handshake at full speed, then the rpcdl hello a byte at a time
        sock = client_tls_context(pki / "ca.pem").wrap_socket(sock, server_hostname="127.0.0.1")
    elif mode == "TLS hello":  # the TLS client hello itself a byte at a time
        data = _client_hello_of_tls()
    sock.setblocking(False)
    try:
        cut_after = _drip_until_cut(sock, data, connected_at, give_up_after=3 * _DEADLINE)
    finally:
        sock.close()
    # Each byte came within 2 s, well within the 5 s a read may wait: only a deadline for the whole
    # handshake, counted from the accept, cuts the drip, at 5 s (plus the moments the accept and the
    # worker's wake-up took).
    assert _DEADLINE - 0.05 <= cut_after <= _DEADLINE + 2.0, cut_after
    assert rpcdl.rpc_sync(address, operator.add, (1, 2), timeout=30) == 3  # the worker serves on


def _client_hello_of_tls() -> bytes:
    """The first bytes a TLS client sends (its ClientHello record), taken from a real TLS client."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    context = ssl.create_default_context()
    tls = context.wrap_socket(client, server_hostname="127.0.0.1", do_handshake_on_connect=False)
    tls.setblocking(False)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    accepted.settimeout(5)
    hello = accepted.recv(65536)
    for sock in (tls, accepted, listener):
        sock.close()
    assert hello[:1] == b"\x16", hello[:8]  # a TLS handshake record
    return hello


# ---------------------------------------------------------------------------- floods: a trainer still gets in


def _trainer_is_served(address: str) -> float:
    """A new connection, a call and a small loader pass to ``address``; return the seconds it took."""
    rpcdl.shutdown()  # a fresh connection: it has to pass its handshake during the flood
    started = time.monotonic()
    assert rpcdl.rpc_sync(address, operator.mul, (6, 7), timeout=20) == 42
    dataset = rpcdl.RPCDataset([address], _Squares)
    assert [int(x) for batch in rpcdl.RPCDataloader(dataset, batch_size=4) for x in batch] == [i * i for i in range(8)]
    return time.monotonic() - started


class _Squares:
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return index * index


def test_a_trainer_is_served_during_a_flood_of_400_idle_connections(spawn_workers, many_descriptors, caplog):
    (address,) = spawn_workers(1)
    caplog.set_level(logging.WARNING, logger="rpcdl.client")
    with _sockets(400, address) as flood:
        time.sleep(1.5)  # the flood settles: the worker holds as many as it admits, refused the rest
        took = _trainer_is_served(address)
        stats = rpcdl.stats(address)
        refused = sum(map(_answered, flood))
    assert "not an rpcdl worker" not in caplog.text
    assert stats["connections_refused"] >= 400 - 256  # at most 256 in their handshake at once
    assert refused >= 400 - 256
    print(f"served in {took:.2f}s during the flood; {refused} of 400 idle connections refused or evicted")


def test_a_trainer_is_served_during_256_drippers(spawn_workers, many_descriptors, caplog):
    (address,) = spawn_workers(1)
    caplog.set_level(logging.WARNING, logger="rpcdl.client")
    stop = threading.Event()
    with _sockets(256, address) as drippers:

        def drip() -> None:
            position = 0
            while not stop.wait(_DRIP_EVERY):
                for sock in drippers:
                    try:
                        sock.send(_hello()[position : position + 1])
                    except OSError:
                        pass
                position += 1

        thread = threading.Thread(target=drip, name="test-drippers")
        thread.start()
        try:
            time.sleep(2.5)  # a byte each came; all are in their handshake, none near the deadline
            open_before = sum(not _answered(sock) for sock in drippers)
            took = _trainer_is_served(address)
        finally:
            stop.set()
            thread.join()
    assert "not an rpcdl worker" not in caplog.text
    assert open_before >= 64  # the drippers held the worker's handshakes while the trainer came
    print(f"served in {took:.2f}s beside {open_before} drippers")


def test_a_full_worker_says_so_and_the_client_retries(embedded_worker, pki, monkeypatch, caplog):
    """With room for one handshake, a second client arriving at once is refused honestly, then gets in."""
    monkeypatch.setenv("RPCDL_MAX_HANDSHAKES", "1")
    caplog.set_level(logging.WARNING, logger="rpcdl.client")
    for tls in (False, True):
        context = server_tls_context(pki / "worker.pem", pki / "worker.key") if tls else None
        worker = embedded_worker(ssl_context=context)
        client_context = client_tls_context(pki / "ca.pem") if tls else None
        with _sockets(1, worker.address):  # holds the one handshake; evictable after a second
            refused = _connect(worker.address)
            if tls:
                with pytest.raises(ssl.SSLError) as caught:
                    client_context.wrap_socket(refused, server_hostname="127.0.0.1")
                assert "full of pending handshakes (it refused the TLS handshake" in str(
                    tls_refusal(caught.value, worker.address)
                )
            else:
                with pytest.raises(WorkerFull, match=r"full of pending handshakes \(1 of its limit of 1"):
                    client_negotiate(refused, None, worker.address, answer_timeout=5)
            refused.close()
            # The client's own dial retries a refusal until the idle connection may be evicted.
            assert rpcdl.rpc_sync(worker.address, operator.add, (2, 3), ssl_context=client_context, timeout=20) == 5
        assert "not an rpcdl worker" not in caplog.text
        rpcdl.shutdown()


# ---------------------------------------------------------------------------- memory only as bytes arrive


def _resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def test_a_header_announcing_1_gib_moves_the_workers_memory_by_less_than_1_mib(spawn_workers):
    workers = spawn_workers(1)
    pid = workers.processes[0].pid
    sock = _connect(workers[0])
    try:
        client_negotiate(sock, None, workers[0], answer_timeout=5)
        sock.sendall(b"".join(encode_frame(Frame(Kind.PING, 1))))
        assert sock.recv(_HEADER.size)[0] == Kind.PONG  # the session is up: its threads and buffers exist
        time.sleep(0.5)
        before = _resident_bytes(pid)
        sock.sendall(_HEADER.pack(Kind.CALL, 0, 0, 0, 2, 0, 1 << 30) + bytes(64 * 1024))
        time.sleep(1.0)
        after = _resident_bytes(pid)
        assert workers.processes[0].poll() is None
        assert not _answered(sock)  # still waiting for the rest of the frame
    finally:
        sock.close()
    assert after - before < 1 << 20, f"the worker's resident memory grew by {(after - before) >> 10} KiB"


# ---------------------------------------------------------------------------- the local workers' tools


def test_local_workers_with_a_token_start_without_one_in_the_callers_environment(spawn_workers):
    workers = spawn_workers(1, token="local-token-30")
    assert rpcdl.rpc_sync(workers[0], operator.add, (1, 1), token="local-token-30") == 2
    with pytest.raises(rpcdl.AuthenticationError):
        rpcdl.rpc_sync(workers[0], operator.add, (1, 1), timeout=5)
    env = {**child_environment(), "RPCDL_TOKEN": "token-in-env-only"}
    workers = spawn_workers(1, env=env)
    assert rpcdl.rpc_sync(workers[0], operator.add, (2, 2), token="token-in-env-only") == 4


def test_restart_right_after_kill(spawn_workers):
    workers = spawn_workers(2)
    assert rpcdl.rpc_sync(workers[0], operator.add, (1, 2)) == 3  # a pooled connection to the process killed next
    old_pid = workers.processes[0].pid
    workers.kill(0)
    address = workers.restart(0)
    assert workers.processes[0].pid != old_pid
    assert rpcdl.rpc_sync(address, operator.add, (3, 4)) == 7
    assert rpcdl.rpc_sync(workers[1], operator.add, (5, 6)) == 11  # the other worker's connection was kept


def test_restart_while_calls_are_refused_by_the_port_it_reuses(spawn_workers, monkeypatch):
    """A call made while the new process starts opens a connection whose connect is refused; the
    thread dialing it may be descheduled before it fails that connection's calls (as in the torture
    test of CI, one run in many). restart() must not join that connection for its own ping."""
    workers = spawn_workers(1)
    assert rpcdl.rpc_sync(workers[0], operator.add, (1, 2)) == 3  # it served this process: no connect grace
    workers.kill(0)
    refusal = dial.refusal

    def refusal_then_descheduled(exc: BaseException) -> str | None:
        why = refusal(exc)
        if why is not None:
            time.sleep(1.0)
        return why

    monkeypatch.setattr(dial, "refusal", refusal_then_descheduled)
    calling = threading.Event()
    stop = threading.Event()

    def call_meanwhile() -> None:
        while not stop.is_set():
            calling.set()
            with suppress(rpcdl.WorkerUnavailable, rpcdl.ConnectionLost):
                rpcdl.rpc_sync(workers[0], operator.add, (0, 0), timeout=10)

    caller = threading.Thread(target=call_meanwhile, name="test-caller", daemon=True)
    caller.start()
    calling.wait(5)
    try:
        address = workers.restart(0)
    finally:
        stop.set()
        caller.join(10)
    assert rpcdl.rpc_sync(address, operator.add, (3, 4)) == 7


# ---------------------------------------------------------------------------- the admission policy, alone


@pytest.fixture
def pair():
    """Makes sockets for the admission to hold (their peers kept open), closed after the test."""
    made: list[socket.socket] = []

    def make() -> socket.socket:
        first, second = socket.socketpair()
        made.extend((first, second))
        first.settimeout(5)
        return first

    yield make
    for sock in made:
        sock.close()


def test_admission_admits_below_start_then_evicts_the_oldest_past_its_grace(pair):
    admission = Admission(limit=8, handshake_timeout=4.0, seed=1)
    assert (admission.start, admission.grace) == (4, 1.0)
    entries = [admission.admit(pair(), f"peer-{i}", now=float(i) / 100) for i in range(2)]
    assert all(isinstance(entry, Pending) for entry in entries) and len(admission) == 2
    # Full table, everyone young: the newcomer is refused.
    for i in range(6):
        admission.admit(pair(), f"more-{i}", now=0.1)
    assert len(admission) <= 8
    while len(admission) < 8:
        admission.admit(pair(), "filler", now=0.1)
    assert admission.admit(pair(), "young", now=0.5) == Full(pending=8, limit=8)
    # Past the grace, the oldest is evicted for the newcomer, and its socket shut down.
    oldest = entries[0]
    newcomer = admission.admit(pair(), "late", now=1.5)
    assert isinstance(newcomer, Pending) and len(admission) == 8
    assert oldest.state is PendingState.EVICTED
    assert oldest.sock.recv(1) == b""  # shut down (its peer is open): its handshake thread would wake
    assert entries[1].state is PendingState.IN_HANDSHAKE
    entries[1].sock.settimeout(0.1)
    with pytest.raises(TimeoutError):  # the next oldest is left alone: nothing to read, no end
        entries[1].sock.recv(1)
    assert not admission.leave(oldest) and not admission.rebind(oldest, pair())
    assert admission.leave(newcomer) and len(admission) == 7


def test_admission_drops_early_and_at_random_between_start_and_limit(pair):
    admission = Admission(limit=100, handshake_timeout=10.0, seed=7)
    held_at_refusals = [len(admission) for i in range(300) if isinstance(admission.admit(pair(), f"p{i}", 0.0), Full)]
    assert held_at_refusals and held_at_refusals[0] < 100  # dropped before the limit...
    assert min(held_at_refusals) >= admission.start  # ...never below its start...
    assert len(held_at_refusals) == 300 - len(admission)  # ...on newcomers, none held being past its grace
    assert len(admission) <= 100


def test_quiet_log_logs_a_flood_once_per_period_with_a_count(caplog):
    caplog.set_level(logging.WARNING, logger="test.quiet")
    quiet = QuietLog(logging.getLogger("test.quiet"), every=0.3)
    for i in range(5):
        quiet.warning("full", "refused connection from %s", f"peer-{i}")
    quiet.warning("evicted", "evicted connection from %s", "peer-x")  # another kind: its own period
    assert caplog.messages == ["refused connection from peer-0", "evicted connection from peer-x"]
    time.sleep(0.35)
    quiet.warning("full", "refused connection from %s", "peer-5")
    assert caplog.messages[-1] == "refused connection from peer-5 (and 4 more like it in the last 0.3s)"
