"""``rpcdl bench --workers ... --link``: the link to a user's own workers, and the STREAM request under it.

Real workers: local processes on loopback, and a worker on a cluster-in-a-box host
(a network namespace behind a shaped veth; skipped where namespaces cannot be made).
These tests check the report's structure and sanity, never its speed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from blocking_wire import FrameReader, io_stream, send_frame
from cluster_box import cluster_of_workers

import rpcdl
from rpcdl.cli.bench.link import LinkSizes, RawStream, format_link, measure_link
from rpcdl.errors import ProtocolError
from rpcdl.transport import control
from rpcdl.transport.wire import Frame, Kind, Limits

pytestmark = pytest.mark.timeout(180)

TOKEN = "bench-workers-token"
CASES = ["raw", "images", "compression off", "compression on", "compression auto"]


def check_report(report, workers: list[str]) -> None:
    document = report.as_dict()
    json.dumps(document)  # it is what --json writes
    assert document["workers"] == workers
    assert set(document["latency_ms"]) == set(workers)
    for figures in document["latency_ms"].values():
        assert 0 < figures["p50"] <= figures["p99"] < 10_000
    assert list(document["median"]) == CASES
    for name, rate in document["median"].items():
        assert rate["mb_s"] > 0 and rate["cpu_s_per_gb"] >= 0, name
    assert set(document["ratio_to_raw"]) == set(CASES[1:])
    assert all(ratio > 0 for ratio in document["ratio_to_raw"].values())
    for case in CASES[1:]:
        assert set(document["chosen"][case]) == set(workers)
        for choice in document["chosen"][case].values():
            assert choice["window"]["window"] >= 1
    modes = {case: {c["compression"]["mode"] for c in document["chosen"][case].values()} for case in CASES[2:]}
    assert modes["compression off"] == {"off"}
    assert modes["compression on"] == {"on"}
    assert set(document["verdicts"]) == {"latency", "raw", "images", "compression", "tls"}
    assert all(isinstance(line, str) and line for line in document["verdicts"].values())
    text = format_link(report)
    assert all(name in text for name in CASES) and "verdicts:" in text


def test_link_report_against_local_workers(two_workers):
    report = measure_link(two_workers, LinkSizes.quick(), progress=lambda line: None)
    check_report(report, two_workers)
    assert report.chosen["tls"] == dict.fromkeys(two_workers)
    assert report.verdicts["tls"].startswith("plain TCP")


def test_link_command_writes_its_report(two_workers, tmp_path):
    output = tmp_path / "link.json"
    command = [sys.executable, "-m", "rpcdl", "bench", "--workers", ",".join(two_workers), "--link", "--quick"]
    done = subprocess.run([*command, "--json", str(output)], capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr
    assert "verdicts:" in done.stdout and "raw" in done.stdout
    link = json.loads(output.read_text())["link"]
    assert link["workers"] == two_workers
    assert link["median"]["raw"]["mb_s"] > 0


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--link"], "name them with --workers"),
        (["--link", "--workers", "127.0.0.1:1", "--token-file", "{empty}"], "--token-file"),
        (["--link", "--workers", "127.0.0.1:1", "--tls-ca", "{empty}"], "--tls-ca"),
    ],
)
def test_link_command_mistakes_are_named(tmp_path, options, says):
    empty = tmp_path / "empty"
    empty.write_text("")
    options = [option.replace("{empty}", str(empty)) for option in options]
    done = subprocess.run(
        [sys.executable, "-m", "rpcdl", "bench", *options], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert says in done.stderr


def test_the_link_report_across_a_cluster_host_with_tls(tmp_path, monkeypatch):
    from pki import make_ca, make_certificate

    with cluster_of_workers(tmp_path, TOKEN, [()]) as box:
        host = box.hosts[0]
        make_ca(tmp_path, "ca")
        make_certificate(tmp_path, "ca", "worker", f"IP:{host.address}")
        tls_worker = box.start_worker(
            0,
            "--token-file",
            str(tmp_path / "token"),
            "--tls-cert",
            str(tmp_path / "worker.pem"),
            "--tls-key",
            str(tmp_path / "worker.key"),
            "--log-level",
            "WARNING",
        )
        monkeypatch.setenv("RPCDL_TOKEN", TOKEN)
        report = measure_link(box.workers, LinkSizes.quick(), progress=lambda line: None)
        check_report(report, box.workers)
        assert not box.workers[0].startswith("127.")
        rpcdl.shutdown()
        monkeypatch.setenv("RPCDL_TLS_CA", str(tmp_path / "ca.pem"))
        secure = measure_link([tls_worker], LinkSizes.quick(), progress=lambda line: None)
        check_report(secure, [tls_worker])
        assert secure.chosen["tls"][tls_worker]["version"].startswith("TLS")
        assert "TLS on" in secure.verdicts["tls"]


def test_a_stream_streams_the_bytes_asked_for(two_workers):
    stream = RawStream(two_workers[0])
    try:
        assert stream.receive(3) == 3 * (8 << 20)
        assert stream.receive(1) == 8 << 20  # the connection serves the next request too
    finally:
        stream.close()
    assert rpcdl.ping(two_workers[0]) > 0  # and the worker serves others meanwhile and after


def test_raw_streams_are_received_on_the_loop_without_a_thread_per_worker(two_workers, switching_often):
    from helpers import threads_started

    from rpcdl.cli.bench.link import raw_rate

    streams = [RawStream(address) for address in two_workers]
    try:
        with threads_started() as started:
            rate = raw_rate(streams, 2)
    finally:
        for stream in streams:
            stream.close()
    assert rate.mb_s > 0
    assert started == [], f"raw_rate started threads {started}: the loop reads every stream"


def _raw_connection(address: str):
    import socket

    from blocking_wire import client_negotiate

    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    client_negotiate(sock, None, address, compression="off")
    sock = io_stream(sock, receive=10, send=10)
    return sock, FrameReader(sock, Limits(), stall_timeout=10)


def test_a_stream_out_of_bounds_is_rejected_with_the_reason(two_workers):
    sock, reader = _raw_connection(two_workers[0])
    try:
        too_large = control._STREAM.pack(control._STREAM_MARKER, control.MAX_STREAM_FRAME_BYTES + 1, 1)
        send_frame(sock, Frame(Kind.STREAM, 5, payload=too_large))
        answer = reader.read_frame()
        assert answer.kind == Kind.REJECTED and answer.call_id == 5
        assert "STREAM frame size" in control.decode_rejected(answer.payload)
        send_frame(sock, Frame(Kind.PING, 6))  # the connection stays open
        assert reader.read_frame().kind == Kind.PONG
    finally:
        sock.close()


def test_a_malformed_stream_request_closes_the_connection(two_workers):
    sock, reader = _raw_connection(two_workers[0])
    try:
        send_frame(sock, Frame(Kind.STREAM, 7, payload=b"\0" * 20))
        with pytest.raises((rpcdl.errors.ConnectionLost, ConnectionResetError)):
            reader.read_frame()
    finally:
        sock.close()


def test_stream_payloads_round_trip_and_bounds_are_named():
    assert control.decode_stream(control.encode_stream(1 << 20, 7)) == (1 << 20, 7)
    with pytest.raises(ValueError, match="frame size"):
        control.encode_stream(0, 1)
    with pytest.raises(ValueError, match="count"):
        control.encode_stream(1024, 0)
    with pytest.raises(ValueError, match="at most"):
        control.encode_stream(control.MAX_STREAM_FRAME_BYTES, 2**32 - 1)
    with pytest.raises(ProtocolError, match="STREAM payload"):
        control.decode_stream(b"x" * 20)
    assert "1..1024" in control.stream_problem(2048, 1, max_message_bytes=1024)
