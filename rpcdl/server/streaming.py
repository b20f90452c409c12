"""The worker's answer to a ``STREAM`` request: incompressible bytes in large frames, no pickle.

It is the closest thing to a raw socket on the path between a client and a
worker that needs nothing but the worker: ``rpcdl bench --workers ... --link``
divides rpcdl's own rates by it. The bytes are drawn once per size and reused.

Threading: runs on the process loop, which read the request: it posts every
frame to the connection's outbox at once (each a view of the same drawn bytes,
nothing copied), and the loop writes them as the socket takes them. The
cache of drawn bytes (``_drawn``) is shared by every session: ``_drawn_lock``
guards every access to it, and the arrays it hands out are never written again.
"""

from __future__ import annotations

import threading

import numpy as np

from ..transport.control import decode_stream, encode_rejected, stream_problem
from ..transport.wire import Frame, Kind, Limits
from .session import ClientConnection

_KEPT_SIZES = 2
_drawn: dict[int, np.ndarray] = {}
_drawn_lock = threading.Lock()


def _random_bytes(size: int) -> np.ndarray:
    with _drawn_lock:
        data = _drawn.get(size)
        if data is None:
            if len(_drawn) >= _KEPT_SIZES:
                _drawn.clear()
            data = _drawn[size] = np.random.default_rng().integers(0, 256, size, dtype=np.uint8)
        return data


def stream(connection: ClientConnection, frame: Frame, limits: Limits) -> None:
    """Answer the ``STREAM`` request ``frame`` on ``connection``.

    A request out of bounds is answered ``REJECTED`` with the reason.

    Raises:
        ProtocolError: the payload is malformed.
    """
    size, count = decode_stream(frame.payload)
    problem = stream_problem(size, count, limits.max_message_bytes)
    if problem:
        connection.send(Frame(Kind.REJECTED, frame.call_id, payload=encode_rejected(problem)))
        return
    data = _random_bytes(size)
    for _ in range(count):
        if connection.closed:
            return
        connection.send(Frame(Kind.STREAM_DATA, frame.call_id, buffers=[data]))
