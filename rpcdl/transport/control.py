"""The payloads of control frames, encoded and decoded here only, for both sides. Nothing here unpickles.

- ``RELEASE`` (client -> worker): the RRef ids to free, one big-endian u64 each;
- ``SEGMENT_RELEASE`` (client -> worker): the offsets of shared-memory spans to free, one u64 each;
- ``STATS_REPLY`` (worker -> client): the worker's counters, a JSON object in UTF-8;
- ``REJECTED`` (worker -> client): why the call was not run, UTF-8 text;
- ``STREAM`` (client -> worker): the marker ``rpcdl-stream`` (so that no stray payload starts a
  stream), then a frame size and a count, u64 and u32, big-endian: the worker
  answers with that many ``STREAM_DATA`` frames, each one out-of-band buffer of that many
  incompressible bytes and no payload (a link's raw rate; ``REJECTED`` with the reason if out of bounds);
- ``LEAVING`` (worker -> client, call id 0): the worker drains and then exits (SIGTERM, a
  spot-instance notice, ``kubectl delete pod``): a big-endian f64, the seconds it gives the calls
  in flight, then why, UTF-8 text. Sent once to every client as the drain begins; calls that
  reach the worker later are answered ``REJECTED``, calls in flight are answered as usual;
- ``PING``, ``PONG``, ``STATS`` and ``STREAM_DATA``: empty.

A payload that breaks this format raises :class:`~rpcdl.errors.ProtocolError`
(a broken peer): a worker closes that client's connection, a client fails
the call the answer was for.
"""

from __future__ import annotations

import collections
import json
import struct
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ProtocolError

_UID = struct.Struct("!Q")
_SECONDS = struct.Struct("!d")
_STREAM = struct.Struct("!12sQI")
_STREAM_MARKER = b"rpcdl-stream"
MAX_STREAM_FRAME_BYTES = 256 << 20  #: largest frame a STREAM request may ask for
MAX_STREAM_BYTES = 64 << 30  #: most bytes one STREAM request may ask for
_MAX_UID = 2**64 - 1
DEFAULT_REJECTION = "the worker is shutting down"
DEFAULT_LEAVING = "the worker was told to stop"


def _pack_u64s(values: Iterable[int], what: str) -> bytes:
    values = tuple(values)
    if any(not 0 <= value <= _MAX_UID for value in values):
        raise ValueError(f"{what} must be in 0..{_MAX_UID}, got {values}")
    return struct.pack(f"!{len(values)}Q", *values)


def _unpack_u64s(payload: bytes | bytearray | memoryview, holds: str) -> tuple[int, ...]:
    size = len(payload)
    if size % _UID.size:
        raise ProtocolError(f"{holds}, got {size} bytes")
    return struct.unpack(f"!{size // _UID.size}Q", payload)


def drain(queue: collections.deque) -> list:
    """Take what ``queue`` holds now, oldest first, while other threads (finalizers) may still append to it.

    Example::

        >>> drain(collections.deque([3, 1, 2]))
        [3, 1, 2]
    """
    taken = []
    while queue:
        try:
            taken.append(queue.popleft())
        except IndexError:  # emptied by another thread draining it
            break
    return taken


def encode_release(uids: Iterable[int]) -> bytes:
    """Encode the payload of a ``RELEASE`` frame: the RRef ids to free on the worker.

    Args:
        uids: RRef ids, each in ``0 .. 2**64 - 1``.

    Returns:
        8 bytes per id.

    Example::

        >>> encode_release([1, 2]).hex()
        '00000000000000010000000000000002'
    """
    return _pack_u64s(uids, "RRef ids")


def decode_release(payload: bytes | bytearray | memoryview) -> tuple[int, ...]:
    """Decode the payload of a ``RELEASE`` frame into RRef ids.

    Raises:
        ProtocolError: its length is not a multiple of 8.

    Example::

        >>> decode_release(encode_release([7, 8]))
        (7, 8)
    """
    return _unpack_u64s(payload, "a RELEASE payload holds whole 8-byte RRef ids")


def encode_span_release(offsets: Iterable[int]) -> bytes:
    """Encode the payload of a ``SEGMENT_RELEASE`` frame: offsets of spans of the shared segment to free.

    Example::

        >>> encode_span_release([4096]).hex()
        '0000000000001000'
    """
    return _pack_u64s(offsets, "span offsets")


def decode_span_release(payload: bytes | bytearray | memoryview) -> tuple[int, ...]:
    """Decode the payload of a ``SEGMENT_RELEASE`` frame into span offsets.

    Raises:
        ProtocolError: its length is not a multiple of 8.

    Example::

        >>> decode_span_release(encode_span_release([4096, 8192]))
        (4096, 8192)
    """
    return _unpack_u64s(payload, "a SEGMENT_RELEASE payload holds whole 8-byte offsets")


def encode_stats(counters: Mapping[str, Any]) -> bytes:
    """Encode the payload of a ``STATS_REPLY`` frame: a worker's counters as a JSON object.

    Example::

        >>> encode_stats({"calls_served": 3})
        b'{"calls_served": 3}'
    """
    return json.dumps(dict(counters)).encode()


def decode_stats(payload: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Decode the payload of a ``STATS_REPLY`` frame into the worker's counters.

    Raises:
        ProtocolError: it is not a JSON object in UTF-8.

    Example::

        >>> decode_stats(encode_stats({"clients": 1}))
        {'clients': 1}
    """
    try:
        counters = json.loads(bytes(payload))
    except ValueError as exc:  # UnicodeDecodeError and json.JSONDecodeError alike
        raise ProtocolError(f"a STATS_REPLY payload is a JSON object, got bytes that do not parse: {exc}") from None
    if not isinstance(counters, dict):
        raise ProtocolError(f"a STATS_REPLY payload is a JSON object, got a {type(counters).__name__}")
    return counters


def encode_rejected(reason: str = DEFAULT_REJECTION) -> bytes:
    """Encode the payload of a ``REJECTED`` frame: why the worker did not run a call.

    Example::

        >>> encode_rejected("the worker is shutting down")
        b'the worker is shutting down'
    """
    return reason.encode("utf-8")


def decode_rejected(payload: bytes | bytearray | memoryview) -> str:
    """Decode the payload of a ``REJECTED`` frame; an empty one means the worker is shutting down.

    Bytes that are not UTF-8 are replaced, not refused: the text only explains.

    Example::

        >>> decode_rejected(b"")
        'the worker is shutting down'
    """
    return bytes(payload).decode("utf-8", "replace") or DEFAULT_REJECTION


def encode_leaving(drain_timeout: float, reason: str = DEFAULT_LEAVING) -> bytes:
    """Encode the payload of a ``LEAVING`` frame: how long the worker drains, and why it leaves.

    Args:
        drain_timeout: seconds the calls in flight get to finish (``>= 0``).
        reason: why the worker leaves, for messages.

    Raises:
        ValueError: ``drain_timeout`` is negative or not finite.

    Example::

        >>> encode_leaving(30.0, "SIGTERM").hex()
        '403e0000000000005349475445524d'
    """
    if not 0.0 <= drain_timeout < float("inf"):
        raise ValueError(f"drain_timeout must be a finite number of seconds >= 0, got {drain_timeout!r}")
    return _SECONDS.pack(drain_timeout) + reason.encode("utf-8")


def decode_leaving(payload: bytes | bytearray | memoryview) -> tuple[float, str]:
    """Decode the payload of a ``LEAVING`` frame into ``(drain_timeout, reason)``.

    Bytes of the reason that are not UTF-8 are replaced: the text only explains.

    Raises:
        ProtocolError: it is shorter than its 8-byte drain timeout, or that is not a finite number >= 0.

    Example::

        >>> decode_leaving(encode_leaving(2.5, "SIGTERM"))
        (2.5, 'SIGTERM')
    """
    if len(payload) < _SECONDS.size:
        raise ProtocolError(f"a LEAVING payload starts with an 8-byte drain timeout, got {len(payload)} bytes")
    (seconds,) = _SECONDS.unpack(bytes(payload[: _SECONDS.size]))
    if not 0.0 <= seconds < float("inf"):
        raise ProtocolError(f"a LEAVING payload's drain timeout is a finite number >= 0, got {seconds!r}")
    return seconds, bytes(payload[_SECONDS.size :]).decode("utf-8", "replace") or DEFAULT_LEAVING


def encode_stream(size: int, count: int) -> bytes:
    """Encode the payload of a ``STREAM`` frame: ``count`` frames of ``size`` bytes, please.

    Raises:
        ValueError: ``size`` or ``count`` is out of bounds (see :func:`stream_problem`).

    Example::

        >>> encode_stream(1024, 2)[12:].hex()
        '000000000000040000000002'
    """
    problem = stream_problem(size, count)
    if problem:
        raise ValueError(problem)
    return _STREAM.pack(_STREAM_MARKER, size, count)


def decode_stream(payload: bytes | bytearray | memoryview) -> tuple[int, int]:
    """Decode the payload of a ``STREAM`` frame into ``(size, count)``, not yet checked against bounds.

    Raises:
        ProtocolError: it is not a marker, a u64 and a u32.

    Example::

        >>> decode_stream(encode_stream(1024, 2))
        (1024, 2)
    """
    if len(payload) != _STREAM.size or bytes(payload[: len(_STREAM_MARKER)]) != _STREAM_MARKER:
        raise ProtocolError(
            f"a STREAM payload is {_STREAM.size} bytes ({_STREAM_MARKER!r}, a u64 size, a u32 count), got "
            f"{len(payload)} bytes that are not"
        )
    _, size, count = _STREAM.unpack(payload)
    return size, count


def stream_problem(size: int, count: int, max_message_bytes: int = MAX_STREAM_FRAME_BYTES) -> str | None:
    """Why a ``STREAM`` request of ``count`` frames of ``size`` bytes cannot be served, or ``None``.

    Example::

        >>> stream_problem(0, 1)
        'a STREAM frame size must be 1..268435456 bytes, got 0'
    """
    largest = min(MAX_STREAM_FRAME_BYTES, max_message_bytes)
    if not 1 <= size <= largest:
        return f"a STREAM frame size must be 1..{largest} bytes, got {size}"
    if not 1 <= count <= 2**32 - 1:
        return f"a STREAM count must be 1..{2**32 - 1}, got {count}"
    if size * count > MAX_STREAM_BYTES:
        return f"a STREAM request may ask for {MAX_STREAM_BYTES} bytes at most, got {size} x {count}"
    return None
