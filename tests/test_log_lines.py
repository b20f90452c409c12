"""Log lines a user reads: each says a thing once."""

from __future__ import annotations

import logging
import re
import socket
import time

import pytest

import rpcdl
from rpcdl.address import parse_address

pytestmark = pytest.mark.timeout(60)


def _refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused connection from")]


def test_a_refused_connection_names_its_peer_once(embedded_worker, caplog):
    caplog.set_level(logging.WARNING, logger="rpcdl")
    worker = embedded_worker(token="the-right-token")
    with pytest.raises(rpcdl.AuthenticationError, match="token mismatch"):
        rpcdl.rpc_sync(worker.address, min, (1, 2), token="another-token", timeout=10)
    with socket.create_connection(parse_address(worker.address)) as stranger:  # not rpcdl at all
        stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")
        stranger.recv(1024)
    for _ in range(200):  # the worker's handshake threads log as they end
        if len(_refusals(caplog)) >= 2:
            break
        time.sleep(0.05)
    refusals = _refusals(caplog)
    assert any("token mismatch" in line for line in refusals), refusals
    assert any("not an rpcdl client" in line for line in refusals), refusals
    for line in refusals:
        peer = re.match(r"refused connection from (\S+): ", line).group(1)
        assert line.count(peer) == 1, line
        assert "refused" not in line[len("refused connection from ") :], line
