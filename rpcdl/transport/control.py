"""The payloads of control frames, encoded and decoded here only, for both sides. Nothing here unpickles.

- ``RELEASE`` (client -> worker): the RRef ids to free, one big-endian u64 each;
- ``SEGMENT_RELEASE`` (client -> worker): the offsets of shared-memory spans to free, one u64 each;
- ``STATS_REPLY`` (worker -> client): the worker's counters, a JSON object in UTF-8;
- ``REJECTED`` (worker -> client): why the call was not run, UTF-8 text;
- ``PING``, ``PONG`` and ``STATS``: empty.

A payload that breaks this format raises :class:`~rpcdl.errors.ProtocolError`
(a broken peer): a worker closes that client's connection, a client fails
the call the answer was for.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ProtocolError

_UID = struct.Struct("!Q")
_MAX_UID = 2**64 - 1
DEFAULT_REJECTION = "the worker is shutting down"


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
    uids = tuple(uids)
    if any(not 0 <= uid <= _MAX_UID for uid in uids):
        raise ValueError(f"RRef ids must be in 0..{_MAX_UID}, got {uids}")
    return struct.pack(f"!{len(uids)}Q", *uids)


def decode_release(payload: bytes | bytearray | memoryview) -> tuple[int, ...]:
    """Decode the payload of a ``RELEASE`` frame into RRef ids.

    Raises:
        ProtocolError: its length is not a multiple of 8.

    Example::

        >>> decode_release(encode_release([7, 8]))
        (7, 8)
    """
    size = len(payload)
    if size % _UID.size:
        raise ProtocolError(f"a RELEASE payload holds whole 8-byte RRef ids, got {size} bytes")
    return struct.unpack(f"!{size // _UID.size}Q", payload)


def encode_span_release(offsets: Iterable[int]) -> bytes:
    """Encode the payload of a ``SEGMENT_RELEASE`` frame: offsets of spans of the shared segment to free.

    Example::

        >>> encode_span_release([4096]).hex()
        '0000000000001000'
    """
    return encode_release(offsets)


def decode_span_release(payload: bytes | bytearray | memoryview) -> tuple[int, ...]:
    """Decode the payload of a ``SEGMENT_RELEASE`` frame into span offsets.

    Raises:
        ProtocolError: its length is not a multiple of 8.

    Example::

        >>> decode_span_release(encode_span_release([4096, 8192]))
        (4096, 8192)
    """
    size = len(payload)
    if size % _UID.size:
        raise ProtocolError(f"a SEGMENT_RELEASE payload holds whole 8-byte offsets, got {size} bytes")
    return struct.unpack(f"!{size // _UID.size}Q", payload)


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
