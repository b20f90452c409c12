"""Who may connect: the token, TLS, the refusal to listen openly without a token, and secrecy of the token.

See SECURITY.md for the threat model these tests hold rpcdl to.
"""

from __future__ import annotations

import ipaddress
import logging
import operator
import os
import pickle
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback

import psutil
import pytest
import torch
from blocking_wire import client_negotiate
from pki import make_ca, make_certificate
from test_faults import TcpProxy

import rpcdl
from rpcdl.cli import main as rpcdl_main
from rpcdl.transport.handshake import MAGIC, VERSION
from rpcdl.transport.security import Token, client_tls_context, server_tls_context
from rpcdl.transport.wire import Frame, Kind, Limits, encode_frame

_WELCOME_SIZE = 73


class CreatesFile:
    """Unpickling this creates a file: proof that something was unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _call_frame(path) -> bytes:
    frame = Frame(Kind.CALL, 1, payload=pickle.dumps(CreatesFile(str(path)), protocol=5))
    return b"".join(bytes(piece) for piece in encode_frame(frame))


def _connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _everything_until_closed(sock: socket.socket) -> bytes:
    received = bytearray()
    while True:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            return bytes(received)
        if not chunk:
            return bytes(received)
        received += chunk


# ---------------------------------------------------------------------------- the token


def test_token_mismatch_is_refused_before_anything_is_unpickled(embedded_worker, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="rpcdl")
    token = "the-right-token"
    worker = embedded_worker(token=token)
    marker = tmp_path / "unpickled"
    attempts = {
        # A client that claims a token and sends a random proof with its call, not waiting for any answer.
        "random proof, pipelined": struct.pack("!6sHB32s", MAGIC, VERSION, 1, os.urandom(32)) + os.urandom(32),
        # A client that says it has no token.
        "no token": struct.pack("!6sHB32s", MAGIC, VERSION, 0, os.urandom(32)) + bytes(32),
        # No handshake at all: the call straight away.
        "no handshake": b"",
    }
    for name, handshake in attempts.items():
        with _connect(worker.address) as sock:
            try:
                sock.sendall(handshake + _call_frame(marker))
            except OSError:
                pass
            received = _everything_until_closed(sock)
        assert len(received) <= _WELCOME_SIZE + 3 + 1024, f"{name}: the worker answered more than a refusal"
        if len(received) > _WELCOME_SIZE:
            assert received[_WELCOME_SIZE] == 1, f"{name}: the worker accepted the handshake"
        assert not marker.exists(), f"{name}: the worker unpickled the call"

    # A client with a real proof made from another token: the worker's check, not the format, refuses it.
    with _connect(worker.address) as sock:
        with pytest.raises(rpcdl.AuthenticationError, match="token mismatch"):
            client_negotiate(sock, Token(b"another-token"), worker.address)
        try:
            sock.sendall(_call_frame(marker))
        except OSError:
            pass
        assert _everything_until_closed(sock) == b""
    with pytest.raises(rpcdl.AuthenticationError, match="token mismatch"):
        rpcdl.rpc_sync(worker.address, print, (CreatesFile(str(marker)),), token="another-token", timeout=10)
    with pytest.raises(rpcdl.AuthenticationError, match="requires a token"):
        rpcdl.rpc_sync(worker.address, print, (CreatesFile(str(marker)),), timeout=10)
    assert not marker.exists()

    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert sum("token mismatch" in m for m in refusals) >= 2, refusals
    assert rpcdl.stats(worker.address, token=token)["connections_refused"] >= 6

    # The control: with the token, the very same frame is unpickled (so the refusals above mean something).
    with _connect(worker.address) as sock:
        client_negotiate(sock, Token(token.encode()), worker.address)
        sock.sendall(_call_frame(marker))
        assert sock.recv(1)  # its answer (an error: a file object is no call)
    assert marker.exists()


def test_a_short_request_in_another_protocol_is_refused_at_once_not_at_the_handshake_timeout(embedded_worker):
    worker = embedded_worker(limits=Limits(handshake_timeout=30))
    started = time.monotonic()
    with _connect(worker.address) as sock:
        sock.sendall(b"GET / HTTP/1.0\r\n\r\n")  # fewer bytes than an rpcdl hello, then it waits for an answer
        assert _everything_until_closed(sock) == b""
    assert time.monotonic() - started < 15, "the worker waited for the rest of a hello that was never coming"
    assert rpcdl.rpc_sync(worker.address, operator.add, (1, 2)) == 3


# ---------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A self-signed CA, a worker certificate it signed for 127.0.0.1, and decoys."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    directory = tmp_path_factory.mktemp("pki")
    make_ca(directory, "ca")
    make_ca(directory, "other-ca")
    make_certificate(directory, "ca", "worker", "IP:127.0.0.1,DNS:localhost")
    make_certificate(directory, "ca", "elsewhere", "DNS:elsewhere.invalid")
    return directory


def test_tls_with_a_self_signed_ca_verified_by_the_client(embedded_worker, pki, monkeypatch):
    token = "tls-test-token"
    worker = embedded_worker(token=token, ssl_context=server_tls_context(pki / "worker.pem", pki / "worker.key"))
    trusted = client_tls_context(pki / "ca.pem")
    assert rpcdl.rpc_sync(worker.address, operator.add, (1, 2), token=token, ssl_context=trusted) == 3
    assert rpcdl.stats(worker.address, token=token, ssl_context=trusted)["tls"] is True

    # A CA the worker's certificate does not come from.
    with pytest.raises(rpcdl.AuthenticationError, match=f"certificate of worker {worker.address} failed verification"):
        rpcdl.rpc_sync(worker.address, min, (1, 2), token=token, ssl_context=client_tls_context(pki / "other-ca.pem"))
    # The right CA, but a certificate for another host.
    elsewhere = server_tls_context(pki / "elsewhere.pem", pki / "elsewhere.key")
    impostor = embedded_worker(token=token, ssl_context=elsewhere)
    with pytest.raises(rpcdl.AuthenticationError, match="failed verification"):
        rpcdl.rpc_sync(impostor.address, min, (1, 2), token=token, ssl_context=trusted)
    # Plain TCP to a TLS worker, and TLS to a plain worker: no call goes through.
    with pytest.raises(rpcdl.RPCDLError):
        rpcdl.rpc_sync(worker.address, min, (1, 2), token=token, timeout=1)
    plain = embedded_worker(token=token)
    with pytest.raises(rpcdl.RPCDLError):
        rpcdl.rpc_sync(plain.address, min, (1, 2), token=token, ssl_context=trusted, timeout=1)
    assert rpcdl.rpc_sync(worker.address, max, (1, 2), token=token, ssl_context=trusted) == 2

    # On the wire, neither the token nor the data can be read; without TLS the data can.
    secret_data = "payload-" + secrets.token_hex(8)
    for target, context, visible in ((worker, trusted, False), (plain, None, True)):
        with TcpProxy(target.address, record=True) as proxy:
            echoed = rpcdl.rpc_sync(proxy.address, str.upper, (secret_data,), token=token, ssl_context=context)
            assert echoed == secret_data.upper()
            rpcdl.shutdown()
        assert (secret_data.encode() in proxy.recorded) is visible
        assert (secret_data.upper().encode() in proxy.recorded) is visible
        assert token.encode() not in proxy.recorded  # the token never crosses the wire, even in clear

    # The same from the environment, as `rpcdl worker --tls-cert` and trainers configure it.
    monkeypatch.setenv("RPCDL_TLS_CERT", str(pki / "worker.pem"))
    monkeypatch.setenv("RPCDL_TLS_KEY", str(pki / "worker.key"))
    monkeypatch.setenv("RPCDL_TLS_CA", str(pki / "ca.pem"))
    monkeypatch.setenv("RPCDL_TOKEN", token)
    from_env = embedded_worker()
    assert rpcdl.rpc_sync(from_env.address, operator.mul, (6, 7)) == 42
    assert rpcdl.stats(from_env.address)["tls"] is True


# ---------------------------------------------------------------------------- listening openly


def _non_loopback_addresses() -> list[str]:
    """This machine's own non-loopback addresses (bound to, never contacted)."""
    found = []
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            address = ipaddress.ip_address(entry.address.split("%")[0])
            if not (address.is_loopback or address.is_link_local):
                found.append(str(address))
    return found


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "interface"])
def test_listening_beyond_loopback_without_a_token_is_refused(host, monkeypatch):
    if host == "interface":
        addresses = _non_loopback_addresses()
        if not addresses:
            pytest.skip("this machine has no non-loopback address")
        host = addresses[0]
    if host == "::" and not socket.has_ipv6:
        pytest.skip("no IPv6")
    with pytest.raises(PermissionError) as refused:
        rpcdl.Worker(host, 0)
    message = str(refused.value)
    assert f"refusing to listen on {host} without a token" in message
    assert "RPCDL_TOKEN" in message and "insecure" in message
    # With a token (given or from the environment), or insecure=True on a trusted network, it listens.
    for worker in (rpcdl.Worker(host, 0, token="t"), rpcdl.Worker(host, 0, insecure=True)):
        worker.stop(grace=0)
    monkeypatch.setenv("RPCDL_TOKEN", "from-the-environment")
    rpcdl.Worker(host, 0).stop(grace=0)


# ---------------------------------------------------------------------------- secrecy of the token


def _texts_of(error: BaseException) -> str:
    return "\n".join([str(error), repr(error), *traceback.format_exception(error)])


def test_token_never_appears_in_logs_errors_or_status(pki, tmp_path, caplog, capsys, monkeypatch):
    caplog.set_level(logging.DEBUG, logger="rpcdl")
    token = "tok-" + secrets.token_hex(16)
    wrong = "wrong-" + secrets.token_hex(16)
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    stderr_path = tmp_path / "worker.stderr"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPCDL_")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rpcdl",
                "worker",
                "--port",
                "0",
                "--token-file",
                str(token_file),
                "--tls-cert",
                str(pki / "worker.pem"),
                "--tls-key",
                str(pki / "worker.key"),
                "--log-level",
                "DEBUG",
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
    try:
        address = process.stdout.readline().strip()
        assert address, stderr_path.read_text()
        tls = client_tls_context(pki / "ca.pem")
        errors: list[BaseException] = []
        assert rpcdl.rpc_sync(address, operator.add, (1, 2), token=token, ssl_context=tls, timeout=30) == 3
        counters = rpcdl.stats(address, token=token, ssl_context=tls)
        for options in ({"token": wrong, "ssl_context": tls}, {"ssl_context": tls}, {"token": token}):
            with pytest.raises(rpcdl.RPCDLError) as failed:
                rpcdl.rpc_sync(address, min, (1, 2), timeout=1, **options)
            errors.append(failed.value)
        with pytest.raises(ZeroDivisionError) as remote_error:
            rpcdl.rpc_sync(address, operator.truediv, (1, 0), token=token, ssl_context=tls)
        errors.append(remote_error.value)
        with pytest.raises(rpcdl.RPCDLError) as failed:  # a whole dataset, built with the wrong token
            monkeypatch.setenv("RPCDL_TOKEN", wrong)
            monkeypatch.setenv("RPCDL_TLS_CA", str(pki / "ca.pem"))
            rpcdl.RPCDataset([address], list, range(3))
        errors.append(failed.value)

        capsys.readouterr()
        monkeypatch.setenv("RPCDL_TOKEN", token)
        assert rpcdl_main(["status", address]) == 0
        monkeypatch.setenv("RPCDL_TOKEN", wrong)
        assert rpcdl_main(["status", address]) == 1
        status = capsys.readouterr()
        assert address in status.out and "token mismatch" in status.out  # named, not "unreachable"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        process.stdout.close()
        rpcdl.shutdown()
    worker_log = stderr_path.read_text()
    assert "refused connection" in worker_log and "token mismatch" in worker_log  # the log does speak of it
    everything = {
        "worker log": worker_log,
        "client log": caplog.text + "\n".join(r.getMessage() for r in caplog.records),
        "errors": "\n".join(_texts_of(error) for error in errors),
        "status": status.out + status.err,
        "stats": repr(counters),
        "token object": repr(Token(token.encode())),
    }
    for where, text in everything.items():
        for secret in (token, wrong):
            assert secret not in text, f"a token appears in the {where}"
    with pytest.raises(TypeError, match="never pickled"):
        pickle.dumps(Token(token.encode()))


@pytest.mark.timeout(60)
def test_a_tls_connection_survives_idling_between_calls(embedded_worker, pki):
    """A worker reads its TLS connection in one thread while it answers from another: with one SSL
    object used by both at once, a read that only timed out looked like the end of the stream, and
    the connection dropped after a second or so without a call."""
    token = "tls-idle-token"
    worker = embedded_worker(token=token, ssl_context=server_tls_context(pki / "worker.pem", pki / "worker.key"))
    trusted = client_tls_context(pki / "ca.pem")
    for size in (10, 3_000_000, 10):
        answer = rpcdl.rpc_sync(worker.address, torch.zeros, (size,), token=token, ssl_context=trusted)
        assert answer.shape == (size,)
        time.sleep(1.5)
    assert rpcdl.stats(worker.address, token=token, ssl_context=trusted)["connections_total"] == 1


def test_runs_of_small_tensors_cross_a_tls_connection_whole(embedded_worker, pki):
    """Asyncio's TLS transport hands the frame receiver's memory to the SSL object: a run of small
    buffers (one block, each tensor a view of it) comes back byte for byte both ways."""
    token = "tls-run-token"
    worker = embedded_worker(token=token, ssl_context=server_tls_context(pki / "worker.pem", pki / "worker.key"))
    trusted = client_tls_context(pki / "ca.pem")
    sent = [torch.randn(32, 128) for _ in range(14)] + [torch.arange(5, dtype=torch.int8), torch.randn(300_000)]
    for _ in range(3):
        got = rpcdl.rpc_sync(worker.address, list, (sent,), token=token, ssl_context=trusted)
        assert len(got) == len(sent) and all(torch.equal(a, b) for a, b in zip(got, sent, strict=True))
