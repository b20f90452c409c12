"""TLSStream over real loopback TLS connections: large reads gather records, ends are ends."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import pytest
from pki import make_ca, make_certificate

from rpcdl.transport.tls_stream import TLSStream

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def tls_pair(tmp_path):
    """A connected (client TLSStream, server SSLSocket) pair on loopback."""
    make_ca(tmp_path, "ca")
    make_certificate(tmp_path, "ca", "server", "IP:127.0.0.1")
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(tmp_path / "server.pem", tmp_path / "server.key")
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[ssl.SSLSocket] = []
    acceptor = threading.Thread(
        target=lambda: accepted.append(server_context.wrap_socket(listener.accept()[0], server_side=True)),
        name="test-tls-accept",
    )
    acceptor.start()
    client_context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    client = client_context.wrap_socket(socket.create_connection(listener.getsockname()), server_hostname="127.0.0.1")
    acceptor.join(10)
    listener.close()
    stream = TLSStream(client, receive_timeout=5.0, send_timeout=5.0)
    yield stream, accepted[0]
    stream.close()
    accepted[0].close()


def test_a_large_read_gathers_the_records_that_arrived(tls_pair):
    stream, server = tls_pair
    data = bytes(range(256)) * 512  # 128 KiB: 8 records of 16 KiB
    sender = threading.Thread(target=server.sendall, args=(data,), name="test-tls-send")
    sender.start()
    sender.join(5)  # all in the kernel's buffers, as a rule: then the reads find many records there
    target = bytearray(len(data))
    received = 0
    calls = 0
    deadline = time.monotonic() + 10
    while received < len(data) and time.monotonic() < deadline:
        received += stream.recv_into(memoryview(target)[received:])
        calls += 1
    sender.join(5)
    assert bytes(target) == data
    assert calls < 8  # more than one 16 KiB record per call


def test_nbytes_bounds_a_read(tls_pair):
    stream, server = tls_pair
    server.sendall(b"x" * 50_000)
    target = bytearray(100_000)
    got = stream.recv_into(target, 1000)
    assert 0 < got <= 1000
    assert target[got:] == bytes(len(target) - got)


def test_a_peer_that_closes_without_close_notify_ends_the_stream(tls_pair):
    stream, server = tls_pair
    server.sendall(b"last words")
    socket.socket.shutdown(server, socket.SHUT_RDWR)  # TCP end, no TLS close_notify
    target = bytearray(64)
    got = stream.recv_into(target)
    assert bytes(target[:got]) == b"last words"
    assert stream.recv_into(target) == 0


def test_a_read_with_nothing_to_read_times_out(tls_pair):
    stream, _ = tls_pair
    stream.receive_timeout = 0.2
    with pytest.raises(BlockingIOError):
        stream.recv_into(bytearray(10))
