"""Coverage-guided fuzzing of rpcdl's wire layer with atheris (libFuzzer).

Two targets, chosen with ``--target``:

* ``frames``: the bytes are everything a peer sends after the handshake; a
  :class:`rpcdl.transport.frame_protocol.FrameProtocol` (read by ``tests/blocking_wire.py``) with small
  limits must return frames within
  them or raise :class:`~rpcdl.errors.ProtocolError` /
  :class:`~rpcdl.errors.ConnectionLost`, and never allocate a buffer past them.
* ``handshake``: the bytes are everything a client sends to a worker holding a
  token; the worker's steps (:func:`rpcdl.transport.handshake.server_steps`) must refuse it with one of rpcdl's
  errors.

Any other exception, a hang or a crash is a finding. Usage (see README.md)::

    python tests/fuzz/fuzz_wire.py --target frames -max_total_time=600 corpus/frames
    python tests/fuzz/fuzz_wire.py --seed-corpus corpus/frames   # write seed inputs, then exit
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: blocking_wire

from blocking_wire import FrameReader, server_negotiate

from rpcdl.errors import AuthenticationError, ConnectionLost, ProtocolError
from rpcdl.serialization.pickling import dumps
from rpcdl.transport.handshake import MAGIC, VERSION
from rpcdl.transport.security import Token
from rpcdl.transport.wire import Frame, Kind, Limits, encode_frame

LIMITS = Limits(max_message_bytes=4096, max_buffers=4, handshake_timeout=1.0)
TOKEN = Token(b"fuzz-token")


class Finding(AssertionError):
    """A property of the wire layer does not hold for this input."""


def _checked_allocate(call_id: int, size: int) -> bytearray:
    if size > LIMITS.max_message_bytes:
        raise Finding(f"the reader asked for a {size}-byte buffer, past the {LIMITS.max_message_bytes}-byte limit")
    return bytearray(size)


def _socket_pair_with(data: bytes) -> tuple[socket.socket, socket.socket]:
    ours, peer = socket.socketpair()
    ours.settimeout(1.0)
    peer.sendall(data)  # inputs stay far below the socket buffer (libFuzzer's -max_len)
    peer.shutdown(socket.SHUT_WR)
    return ours, peer


def fuzz_frames(data: bytes) -> None:
    """Read frames from ``data`` until the reader stops; check every frame against the limits."""
    ours, peer = _socket_pair_with(data)
    with ours, peer:
        reader = FrameReader(ours, LIMITS, stall_timeout=1.0, chunk_size=1024)
        while True:
            try:
                frame = reader.read_frame(_checked_allocate)
            except (ProtocolError, ConnectionLost):
                return
            if frame is None:
                raise Finding("the reader waited for more although the peer had closed")
            size = len(frame.payload) + sum(len(b) for b in frame.buffers)
            if size > LIMITS.max_message_bytes or len(frame.buffers) > LIMITS.max_buffers:
                raise Finding(f"a frame of {size} bytes in {len(frame.buffers)} buffers passed the limits")


def fuzz_handshake(data: bytes) -> None:
    """A client that sends ``data`` must be refused by a worker holding a token."""
    ours, peer = _socket_pair_with(data)
    with ours, peer:
        try:
            server_negotiate(ours, TOKEN, "fuzz")
        except (ProtocolError, AuthenticationError, ConnectionLost):
            return
    raise Finding("a client that does not hold the token passed the handshake")


TARGETS = {"frames": fuzz_frames, "handshake": fuzz_handshake}


def _frame_bytes(frame: Frame) -> bytes:
    return b"".join(bytes(memoryview(piece).cast("B")) for piece in encode_frame(frame))


def seeds() -> dict[str, bytes]:
    """Inputs that reach deep into each target: valid frames and a valid hello."""
    payload, buffers = dumps((max, (1, 2), {}))
    hello = struct.pack("!6sHB32s", MAGIC, VERSION, 1, bytes(32))
    return {
        "ping": _frame_bytes(Frame(Kind.PING, 7)),
        "call": _frame_bytes(Frame(Kind.CALL, 8, payload=payload, buffers=buffers)),
        "buffers": _frame_bytes(Frame(Kind.CALL, 9, payload=b"p" * 100, buffers=[b"a" * 10, b"b" * 3000])),
        "release": _frame_bytes(Frame(Kind.RELEASE, payload=struct.pack("!2Q", 1, 2))),
        "stream": _frame_bytes(Frame(Kind.PING, 1)) + _frame_bytes(Frame(Kind.STATS, 2)),
        "hello": hello + bytes(32),
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--target", choices=sorted(TARGETS), default="frames")
    parser.add_argument("--seed-corpus", metavar="DIR", help="write the seed inputs into DIR and exit")
    options, libfuzzer_args = parser.parse_known_args(argv[1:])
    if options.seed_corpus:
        os.makedirs(options.seed_corpus, exist_ok=True)
        for name, data in seeds().items():
            with open(os.path.join(options.seed_corpus, name), "wb") as handle:
                handle.write(data)
        return

    import atheris  # the fuzz extra: pip install 'rpcdl[fuzz]'

    from rpcdl.transport import frame_protocol, handshake, wire

    for function in (
        frame_protocol.FrameProtocol.get_buffer,
        frame_protocol.FrameProtocol.buffer_updated,
        wire.Limits.check_incoming,
        handshake.server_steps,
    ):
        atheris.instrument_func(function)
    atheris.Setup([argv[0], *libfuzzer_args], TARGETS[options.target])
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
