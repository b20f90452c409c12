"""Fuzzing the wire layer: the frame parser, the handshake, and a real worker fed hostile bytes.

Hypothesis generates arbitrary and mutated frames and handshakes. The parser
only ever returns frames within its limits or raises a protocol error; a
worker (an in-process :class:`rpcdl.Worker` on a real socket, with limits small
enough that a violation would show) never crashes, never allocates past its
limits, never lets an unauthenticated peer through, closes a connection that
breaks the limits without waiting for its body, and still answers a well-formed
client after every example.

CI runs a bounded slice: ``RPCDL_FUZZ_EXAMPLES`` examples per worker test
(default 30) and twice as many per parser test. A longer run::

    RPCDL_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz.py -p no:timeout

and the atheris harness in ``tests/fuzz/`` (see its README).
"""

from __future__ import annotations

import collections
import importlib.util
import operator
import os
import pickle
import socket
import struct
import threading
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from blocking_wire import FrameReader, client_negotiate, io_stream, server_negotiate
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import rpcdl
from rpcdl.errors import AuthenticationError, ConnectionLost, ProtocolError
from rpcdl.serialization.pickling import dumps, loads
from rpcdl.transport.control import decode_stats, encode_release
from rpcdl.transport.handshake import MAGIC, VERSION
from rpcdl.transport.security import Token
from rpcdl.transport.wire import COMPRESSED, IN_SEGMENT, Frame, Kind, Limits, encode_frame

EXAMPLES = int(os.environ.get("RPCDL_FUZZ_EXAMPLES", "30"))
PARSER_EXAMPLES = 2 * EXAMPLES
LIMITS = Limits(max_message_bytes=64 * 1024, max_buffers=8, handshake_timeout=2.0)
# What one frame may make a reader allocate: its payload and buffers, and the buffer lengths.
FRAME_ALLOWANCE = LIMITS.max_message_bytes + 8 * LIMITS.max_buffers
# Violations are announced at 1 MiB and more, so an allocation past the limits
# stands out from the allowance and from the bookkeeping of threads and sockets.
VIOLATION_FLOOR = 4 << 20
SLACK = 512 * 1024
ANSWER_TIMEOUT = 5.0

_HEADER = struct.Struct("!BBHIQQQ")
_HELLO = struct.Struct("!6sHB32s")
_WELCOME_SIZE = 73
CLIENT_KINDS = {Kind.CALL, Kind.RELEASE, Kind.PING, Kind.STATS}
WORKER_KINDS = {Kind.RESULT, Kind.ERROR, Kind.REJECTED, Kind.PONG, Kind.STATS_REPLY}
FUZZ_TOKEN = "fuzz-token-4f1c9e"

fuzz_settings = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
        HealthCheck.function_scoped_fixture,  # thread_errors gathers across examples, as meant
    ],
)


class CreatesFile:
    """Unpickling this creates a file: proof that something was unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


# ---------------------------------------------------------------------------- generated streams


@dataclass
class Piece:
    """Bytes for the wire and what a correct worker does with them.

    ``outcome``: ``"ok"`` (a whole frame a client may send), ``"closes"`` (the
    worker must close the connection without reading further), ``"stalls"``
    (a frame left incomplete) or ``"unknown"`` (junk: anything but a crash).
    """

    data: bytes
    outcome: str
    kind: int = 0
    call_id: int = 0
    expected: object = None
    parses: bool = False  # a whole frame the parser reads, though a worker refuses its kind


@dataclass
class Stream:
    pieces: list[Piece] = field(default_factory=list)

    @property
    def data(self) -> bytes:
        return b"".join(piece.data for piece in self.pieces)

    def modelled(self, parser: bool = False) -> tuple[list[Piece], str]:
        """The pieces a correct worker (or frame parser) reads before it stops, and why it stops."""
        read = []
        for piece in self.pieces:
            read.append(piece)
            if piece.outcome != "ok" and not (parser and piece.parses):
                return read, piece.outcome
        return read, "ok"


def _join(frame: Frame) -> bytes:
    return b"".join(bytes(memoryview(piece).cast("B")) for piece in encode_frame(frame))


call_ids = st.integers(0, 2**64 - 1)


@st.composite
def valid_frames(draw) -> Piece:
    """A well-formed frame a client may send, within the limits."""
    call_id = draw(call_ids)
    choice = draw(st.sampled_from(["call", "tensor_call", "ping", "stats", "release"]))
    if choice == "call":
        a, b = draw(st.integers(-(2**40), 2**40)), draw(st.integers(-(2**40), 2**40))
        payload, buffers = dumps((operator.add, (a, b), {}))
        frame = Frame(Kind.CALL, call_id, payload=payload, buffers=buffers)
        return Piece(_join(frame), "ok", Kind.CALL, call_id, a + b)
    if choice == "tensor_call":
        n, c = draw(st.integers(0, 512)), draw(st.integers(-100, 100))
        payload, buffers = dumps((torch.add, (torch.arange(n), c), {}))
        frame = Frame(Kind.CALL, call_id, payload=payload, buffers=buffers)
        return Piece(_join(frame), "ok", Kind.CALL, call_id, torch.arange(n) + c)
    if choice == "ping":
        return Piece(_join(Frame(Kind.PING, call_id)), "ok", Kind.PING, call_id)
    if choice == "stats":
        return Piece(_join(Frame(Kind.STATS, call_id)), "ok", Kind.STATS, call_id)
    uids = draw(st.lists(st.integers(0, 2**64 - 1), max_size=8))
    return Piece(_join(Frame(Kind.RELEASE, call_id, payload=encode_release(uids))), "ok", Kind.RELEASE, call_id)


def _sizes(limit: int):
    """Announced sizes: small, up to the limit, just past it, far past it, absurd."""
    return st.one_of(
        st.integers(0, 256),
        st.integers(0, limit),
        st.integers(limit + 1, limit + 64),
        st.integers(VIOLATION_FLOOR, 64 << 20),
        st.integers(1 << 32, 2**64 - 1),
    )


@st.composite
def raw_frames(draw) -> Piece:
    """A header with arbitrary fields, its buffer lengths, and all or part of the body it announces."""
    kind = draw(st.one_of(st.sampled_from(list(Kind)), st.integers(0, 255)))
    count = draw(
        st.one_of(st.integers(0, 3), st.integers(0, LIMITS.max_buffers), st.integers(LIMITS.max_buffers + 1, 2**32 - 1))
    )
    payload_size = draw(_sizes(LIMITS.max_message_bytes))
    call_id, ref, flags = draw(call_ids), draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 255))
    data = _HEADER.pack(kind, flags, draw(st.integers(0, 65535)), count, call_id, ref, payload_size)
    if kind not in set(Kind):
        return Piece(data, "closes", kind, call_id)
    if count > LIMITS.max_buffers or payload_size > LIMITS.max_message_bytes:
        return Piece(data, "closes", kind, call_id)
    if flags & (COMPRESSED | IN_SEGMENT):  # for answers, on connections that negotiated compression / a segment
        return Piece(data, "closes", kind, call_id)
    sizes = [draw(_sizes(LIMITS.max_message_bytes // 4)) for _ in range(count)]
    data += struct.pack(f"!{count}Q", *sizes)
    total = payload_size + sum(sizes)
    if total > LIMITS.max_message_bytes:
        return Piece(data, "closes", kind, call_id)
    head = draw(st.binary(max_size=min(total, 64)))
    body_size = draw(st.one_of(st.just(total), st.integers(0, total)))
    body = (head + bytes(total))[:body_size]
    if body_size < total:
        return Piece(data + body, "stalls", kind, call_id)
    if kind in CLIENT_KINDS:
        return Piece(data + body, "ok", kind, call_id)
    return Piece(data + body, "closes", kind, call_id, parses=True)


@st.composite
def mutated_frames(draw) -> Piece:
    """A valid frame with bytes flipped, cut short or spliced in."""
    data = bytearray(draw(valid_frames()).data)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "truncate", "insert"]))
        position = draw(st.integers(0, max(len(data) - 1, 0)))
        if action == "flip" and data:
            data[position] ^= 1 << draw(st.integers(0, 7))
        elif action == "truncate":
            del data[position:]
        else:
            data[position:position] = draw(st.binary(min_size=1, max_size=16))
    return Piece(bytes(data), "unknown")


junk = st.binary(min_size=1, max_size=512).map(lambda data: Piece(data, "unknown"))
pieces = st.one_of(valid_frames(), raw_frames(), mutated_frames(), junk)
streams = st.lists(pieces, min_size=1, max_size=4).map(Stream)


# ---------------------------------------------------------------------------- helpers


class _Allocations:
    """The most memory traced while a block runs, above what was traced when it started."""

    def __enter__(self):
        tracemalloc.reset_peak()
        self._start = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc_info):
        self.peak = tracemalloc.get_traced_memory()[1] - self._start


@pytest.fixture(scope="module")
def traced():
    tracemalloc.start()
    yield
    tracemalloc.stop()


def _connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=ANSWER_TIMEOUT)


def _read_until_closed(sock: socket.socket) -> list[Frame]:
    """Every frame the worker sends until it closes the connection; fail if it neither answers nor closes."""
    sock = io_stream(sock, receive=ANSWER_TIMEOUT, send=ANSWER_TIMEOUT)
    reader = FrameReader(sock, Limits(), stall_timeout=ANSWER_TIMEOUT, chunk_size=4096)
    frames = []
    while True:
        try:
            frame = reader.read_frame()
        except (ConnectionLost, ConnectionResetError):
            return frames
        if frame is None:
            raise AssertionError(f"the worker neither answered nor closed the connection within {ANSWER_TIMEOUT}s")
        frames.append(frame)


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # the worker may close before it has read everything


def _shutdown_write(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the worker closed first


def _read_stream(data: bytes) -> tuple[list[Frame], BaseException | None, list[int]]:
    """Feed ``data`` to a FrameReader through a socket pair; return its frames, how it ended, the peaks."""
    writer, reading = socket.socketpair()

    def send() -> None:
        _send_quietly(writer, data)
        try:
            writer.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    with writer, reading:
        reading = io_stream(reading, receive=5.0, send=5.0)
        sender = threading.Thread(target=send)
        sender.start()
        reader = FrameReader(reading, LIMITS, stall_timeout=5.0, chunk_size=4096)
        frames, peaks, ended = [], [], None
        while ended is None:
            with _Allocations() as allocations:
                try:
                    frame = reader.read_frame()
                except (ProtocolError, ConnectionLost) as exc:
                    ended = exc
                    frame = None
            peaks.append(allocations.peak)
            assert frame is not None or ended is not None, "the reader waited although the stream had ended"
            if frame is not None:
                frames.append(frame)
        reading.shutdown(socket.SHUT_RDWR)  # a sender blocked on a full socket gives up
        sender.join()
    return frames, ended, peaks


# ---------------------------------------------------------------------------- the parser


@settings(fuzz_settings, max_examples=PARSER_EXAMPLES)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(list(Kind)),
            call_ids,
            call_ids,
            st.binary(max_size=3000),
            st.lists(st.binary(max_size=500), max_size=3),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_reader_reads_back_every_frame_written(frames):
    # flags without a meaning (bits 0 and 1, COMPRESSED and IN_SEGMENT, need a negotiation) come back as sent
    written = [Frame(kind, call_id, ref, payload, buffers, flags=12) for kind, call_id, ref, payload, buffers in frames]
    read, ended, _ = _read_stream(b"".join(_join(frame) for frame in written))
    assert isinstance(ended, ConnectionLost)
    assert len(read) == len(written)
    for got, sent in zip(read, written, strict=True):
        assert (got.kind, got.call_id, got.ref, got.flags) == (sent.kind, sent.call_id, sent.ref, sent.flags)
        assert bytes(got.payload) == sent.payload
        assert [bytes(b) for b in got.buffers] == sent.buffers


@settings(fuzz_settings, max_examples=PARSER_EXAMPLES)
@given(streams)
def test_reader_on_arbitrary_and_mutated_streams(traced, stream):
    frames, ended, peaks = _read_stream(stream.data)
    assert isinstance(ended, (ProtocolError, ConnectionLost))
    for frame in frames:
        assert len(frame.buffers) <= LIMITS.max_buffers
        assert len(frame.payload) + sum(len(b) for b in frame.buffers) <= LIMITS.max_message_bytes
    assert max(peaks) <= FRAME_ALLOWANCE + SLACK, f"a frame made the reader allocate {max(peaks)} bytes"
    read, outcome = stream.modelled(parser=True)
    if outcome == "ok":
        assert isinstance(ended, ConnectionLost) and len(frames) == len(read)
    elif outcome == "closes":
        assert isinstance(ended, ProtocolError) and len(frames) == len(read) - 1


hellos = st.one_of(
    st.binary(max_size=80),
    st.builds(
        _HELLO.pack,
        st.one_of(st.just(MAGIC), st.binary(min_size=6, max_size=6)),
        st.one_of(st.just(VERSION), st.integers(0, 65535)),
        st.integers(0, 255),
        st.binary(min_size=32, max_size=32),
    ),
)
proofs = st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=40))


def _handshake_against(data: bytes, handshake) -> BaseException | None:
    """Run ``handshake(sock)`` with ``data`` as everything the peer says; return what it raised."""
    ours, peer = socket.socketpair()
    with ours, peer:
        ours.settimeout(5)
        peer.sendall(data)
        peer.shutdown(socket.SHUT_WR)
        try:
            handshake(ours)
        except (ProtocolError, AuthenticationError, ConnectionLost) as exc:
            return exc
    return None


@settings(fuzz_settings, max_examples=PARSER_EXAMPLES)
@given(hellos, proofs, st.binary(max_size=64))
def test_server_handshake_never_admits_a_fuzzed_client(hello, proof, rest):
    error = _handshake_against(hello + proof + rest, lambda sock: server_negotiate(sock, Token(b"k"), "fuzz"))
    assert error is not None, "a client without the token passed the handshake"


welcomes = st.one_of(
    st.binary(max_size=100),
    st.builds(
        lambda magic, version, flags, nonce, proof: magic + struct.pack("!HB", version, flags) + nonce + proof,
        st.one_of(st.just(MAGIC), st.binary(min_size=6, max_size=6)),
        st.one_of(st.just(VERSION), st.integers(0, 65535)),
        st.integers(0, 255),
        st.binary(min_size=32, max_size=32),
        st.one_of(st.just(bytes(32)), st.binary(min_size=32, max_size=32)),
    ),
)
verdicts = st.one_of(
    st.binary(max_size=40),
    st.builds(
        lambda status, message: struct.pack("!BH", status, len(message)) + message,
        st.integers(0, 255),
        st.binary(max_size=40),
    ),
)


@settings(fuzz_settings, max_examples=PARSER_EXAMPLES)
@given(welcomes, verdicts, st.booleans())
def test_client_handshake_trusts_no_fuzzed_worker(welcome, verdict, with_token):
    token = Token(b"k") if with_token else None
    error = _handshake_against(welcome + verdict, lambda sock: client_negotiate(sock, token, "fuzz"))
    if error is None:  # only a well-formed, tokenless, accepting worker gets through, and only without a token
        assert token is None
        assert welcome[:6] == MAGIC and struct.unpack("!H", welcome[6:8])[0] == VERSION
        assert not welcome[8] & 1 and welcome[41:73] == bytes(32) and verdict[0] == 0


# ---------------------------------------------------------------------------- a worker


@pytest.fixture(scope="module")
def fuzz_worker():
    worker = rpcdl.Worker(timeout=5.0, parallel=2, limits=LIMITS, token="").start()
    yield worker
    rpcdl.shutdown()
    worker.stop(grace=1)


@pytest.fixture(scope="module")
def token_worker():
    worker = rpcdl.Worker(timeout=5.0, limits=LIMITS, token=FUZZ_TOKEN).start()
    yield worker
    rpcdl.shutdown()
    worker.stop(grace=1)


def _check_answers(stream: Stream, answers: list[Frame]) -> None:
    assert all(frame.kind in WORKER_KINDS for frame in answers), [frame.kind for frame in answers]
    read, outcome = stream.modelled()
    if outcome != "ok":
        return
    calls = collections.defaultdict(list)
    for piece in read:
        if piece.kind == Kind.CALL:
            calls[piece.call_id].append(piece)
    pings = sorted(piece.call_id for piece in read if piece.kind == Kind.PING)
    stats = sorted(piece.call_id for piece in read if piece.kind == Kind.STATS)
    assert sorted(f.call_id for f in answers if f.kind == Kind.PONG) == pings
    assert sorted(f.call_id for f in answers if f.kind == Kind.STATS_REPLY) == stats
    for frame in answers:
        if frame.kind == Kind.STATS_REPLY:
            assert decode_stats(frame.payload)["address"]
        elif frame.kind == Kind.RESULT:
            value = loads(frame.payload, frame.buffers)
            assert any(_same(value, piece.expected) for piece in calls[frame.call_id]), value
    answered = collections.Counter(f.call_id for f in answers if f.kind in (Kind.RESULT, Kind.ERROR, Kind.REJECTED))
    assert all(count <= len(calls[call_id]) for call_id, count in answered.items())  # at most one answer per call


def _same(value: object, expected: object) -> bool:
    if isinstance(value, torch.Tensor) or isinstance(expected, torch.Tensor):
        return isinstance(value, torch.Tensor) and isinstance(expected, torch.Tensor) and torch.equal(value, expected)
    return value == expected


@fuzz_settings
@given(stream=streams, check=st.integers(-(2**31), 2**31))
def test_worker_survives_fuzzed_frames(fuzz_worker, traced, thread_errors, stream, check):
    address = fuzz_worker.address
    _, outcome = stream.modelled()
    event(f"stream: {outcome}")
    data = stream.data
    with _Allocations() as allocations, _connect(address) as sock:
        client_negotiate(sock, None, address)
        _send_quietly(sock, data)
        if outcome != "closes":
            _shutdown_write(sock)
        # Where the stream breaks the limits, the worker closes by itself, without waiting for a body.
        answers = _read_until_closed(sock)
    _check_answers(stream, answers)
    assert allocations.peak <= 2 * FRAME_ALLOWANCE + SLACK, f"the worker allocated {allocations.peak} bytes"
    assert not thread_errors
    assert rpcdl.rpc_sync(address, operator.add, (check, 1), timeout=10) == check + 1


@pytest.fixture(scope="module")
def marker(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "unpickled"


@fuzz_settings
@given(hello=hellos, proof=proofs, frames=st.lists(st.sampled_from(["call", "ping"]), max_size=2))
def test_worker_refuses_fuzzed_handshakes_and_unpickles_nothing(
    token_worker, marker, thread_errors, hello, proof, frames
):
    address = token_worker.address
    refused = rpcdl.stats(address, token=FUZZ_TOKEN)["connections_refused"]
    after = b""
    for kind in frames:
        if kind == "call":
            after += _join(Frame(Kind.CALL, 1, payload=pickle.dumps(CreatesFile(str(marker)), protocol=5)))
        else:
            after += _join(Frame(Kind.PING, 2))
    with _connect(address) as sock:
        _send_quietly(sock, hello + proof + after)
        _shutdown_write(sock)
        received = bytearray()
        while chunk := _recv_or_empty(sock):
            received += chunk
    # At most a welcome and a refusal came back: never an answer to a frame.
    assert len(received) <= _WELCOME_SIZE + 3 + 1024
    if len(received) > _WELCOME_SIZE:
        assert received[_WELCOME_SIZE] == 1, "the worker accepted a client that does not hold its token"
    assert not marker.exists()
    assert not thread_errors
    counters = rpcdl.stats(address, token=FUZZ_TOKEN)
    assert counters["connections_refused"] == refused + 1


def _recv_or_empty(sock: socket.socket) -> bytes:
    try:
        return sock.recv(4096)
    except ConnectionResetError:
        return b""
    except TimeoutError:
        raise AssertionError(f"the worker kept a refused connection open for {ANSWER_TIMEOUT}s") from None


def test_pickle_used_by_the_fuzzer_creates_its_file(token_worker, marker, tmp_path):
    """The control: past a real handshake, the same frame is unpickled and creates the file."""
    target = tmp_path / "created"
    with _connect(token_worker.address) as sock:
        client_negotiate(sock, Token(FUZZ_TOKEN.encode()), token_worker.address)
        sock.sendall(_join(Frame(Kind.CALL, 1, payload=pickle.dumps(CreatesFile(str(target)), protocol=5))))
        sock = io_stream(sock, receive=ANSWER_TIMEOUT, send=ANSWER_TIMEOUT)
        answer = FrameReader(sock, Limits(), stall_timeout=ANSWER_TIMEOUT).read_frame()
    assert answer is not None and answer.kind == Kind.ERROR  # what it unpickled is no (func, args, kwargs)
    assert target.exists()


def test_fuzzed_worker_holds_nothing_afterwards(fuzz_worker):
    """Every fuzzing connection is gone and nothing it made the worker keep is left.

    It fuzzes the worker itself first: under pytest-xdist the fuzzing tests of this module may have run in
    another process, against that process's worker."""
    address = fuzz_worker.address
    made = rpcdl.stats(address)["connections_total"]
    for junk in (b"\x00" * 64, b"rpcdl" * 40, bytes(range(256))):
        with _connect(address) as sock:
            client_negotiate(sock, None, address)
            _send_quietly(sock, junk)
            _shutdown_write(sock)
            _read_until_closed(sock)
    deadline = time.monotonic() + 10
    while True:
        counters = rpcdl.stats(fuzz_worker.address)
        if (counters["clients"] <= 1 and counters["rrefs"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert counters["clients"] <= 1 and counters["rrefs"] == 0, counters
    assert counters["connections_total"] >= made + 3


def _atheris_harness():
    spec = importlib.util.spec_from_file_location("fuzz_wire", Path(__file__).parent / "fuzz" / "fuzz_wire.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_atheris_harness_targets_accept_their_seeds_and_junk():
    """The atheris targets (tests/fuzz/fuzz_wire.py) hold on their seeds, so a long run starts from a sound base."""
    harness = _atheris_harness()
    for data in [*harness.seeds().values(), b"", os.urandom(300), bytes(200)]:
        harness.fuzz_frames(data)
        harness.fuzz_handshake(data)
