"""The flags byte of a client's frames: only the bits that change a frame's layout, and only when the
connection negotiated them. A call's frame is the same whether its caller blocks for the answer or not."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest
from blocking_wire import FrameReader, server_negotiate

import rpcdl
from rpcdl.serialization.pickling import dumps
from rpcdl.transport.control import encode_stats
from rpcdl.transport.wire import Frame, Kind, Limits, encode_frame

pytestmark = pytest.mark.timeout(20)


def _answer_to(frame: Frame) -> Frame:
    if frame.kind is Kind.PING:
        return Frame(Kind.PONG, frame.call_id)
    if frame.kind is Kind.STATS:
        return Frame(Kind.STATS_REPLY, frame.call_id, payload=encode_stats({"calls_served": 0}))
    payload, _ = dumps(42)
    return Frame(Kind.RESULT, frame.call_id, payload=payload)


@contextlib.contextmanager
def _recording_peer():
    """A peer that runs the worker's handshake (no compression, no shared memory), then answers every frame
    and records each one's kind and flags."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[tuple[Kind, int]] = []

    def serve() -> None:
        sock, _ = listener.accept()
        with sock:
            sock.settimeout(10)
            server_negotiate(sock, None, "client")
            reader = FrameReader(sock, Limits(), stall_timeout=10)
            while True:
                try:
                    frame = reader.read_frame()
                except OSError:  # ConnectionLost included
                    return  # the client closed its connection
                seen.append((frame.kind, frame.flags))
                sock.sendall(b"".join(bytes(piece) for piece in encode_frame(_answer_to(frame))))

    thread = threading.Thread(target=serve, name="recording-peer", daemon=True)
    thread.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        yield address, seen
    finally:
        rpcdl.shutdown()
        thread.join(5)
        listener.close()


def test_no_frame_of_a_connection_without_compression_or_segment_sets_a_flag():
    with _recording_peer() as (address, seen):
        assert rpcdl.rpc_sync(address, abs, (-1,)) == 42
        assert rpcdl.rpc_sync(address, abs, (-1,), pin_memory=False) == 42  # the path that takes options
        assert rpcdl.rpc_async(address, abs, (-1,)).wait() == 42
        assert rpcdl.ping(address) >= 0
        assert rpcdl.stats(address) == {"calls_served": 0}
        assert [kind for kind, _ in seen] == [Kind.CALL, Kind.CALL, Kind.CALL, Kind.PING, Kind.STATS]
        assert [flags for _, flags in seen] == [0] * 5, seen
