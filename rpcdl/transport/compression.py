"""Optional lz4 compression of the large out-of-band buffers of answers, negotiated per connection.

Modes: ``"off"``, ``"on"`` and ``"auto"``. Workers and clients read theirs from
``RPCDL_COMPRESSION`` (default ``"auto"``); a worker also takes ``--compression``
(``Worker(compression=...)``). Compression needs the ``lz4`` package
(``pip install 'rpcdl[compression]'``): without it ``"auto"`` is off and ``"on"``
is refused with that hint.

Negotiation (in the handshake, :mod:`rpcdl.transport.handshake`): the client's hello says
what it wants and whether it can decode lz4; the worker's welcome says the
outcome, which both sides then use: off when either side cannot (lz4 missing,
or a peer that predates compression and so sets neither flag) or either asks for
``"off"``; else on when either asks for ``"on"``; else ``"auto"``.

What is compressed: only answers (worker -> client), and of them only
out-of-band buffers (tensors, arrays) of at least 64 KiB (``MIN_BYTES``), each on its
own with ``lz4.block``; a buffer that does not shrink by a tenth goes raw. A
frame flag and a per-buffer decoded size tell the receiver which (see
:mod:`rpcdl.transport.wire`), whose limits apply to the compressed and to the decoded
sizes before it allocates. The receiver decodes each buffer with lz4's public
API and copies it into the memory its tensor will live in.

``"auto"`` compresses where it pays, judged from two measurements, re-evaluated
every half second (``EVALUATE_EVERY``):

* the link's rate: bytes sent / seconds spent in sends, counted only over
  periods when sending was the bottleneck (sends blocked most of the time),
  so a fast link whose sends return at once never gets an estimate;
* lz4's ratio and speed on this data: the compressed buffers themselves when
  on, else a slice of one buffer every 0.1 s (``SAMPLE_EVERY``). The speed is
  measured in the sending thread's CPU time: a thread preempted while it
  compresses (a busy machine, more threads than cores) does not make lz4 look
  slow, and one such sample cannot turn compression off.

Sending ``n`` bytes costs ``n / rate`` raw and ``n / speed + n * ratio / rate``
compressed; it compresses when the latter is below 0.8 (``WORTH``) times the
former. On a loopback connection ``"auto"`` stays off: there is no link to save.

Threading: one :class:`Compressor` per worker connection; any thread sending an
answer calls :meth:`Compressor.prepare` and :meth:`Compressor.sent`, and the
worker's stats read :meth:`Compressor.state`. The compressor's lock guards every
access to what changes (whether it compresses, why, the measurements and the
totals); lz4 runs outside it. Its mode and negotiated mode do not change.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .gathered import Gathered, as_view

try:
    import lz4.block as _lz4
except ImportError:  # optional dependency
    _lz4 = None

COMPRESSION_ENV = "RPCDL_COMPRESSION"
NO_LZ4_ENV = "RPCDL_NO_LZ4"  #: set to 1: behave as though lz4 were not installed (tests, comparisons)
MODES = ("off", "on", "auto")
DEFAULT_MODE = "auto"
MIN_BYTES = 64 * 1024  #: smaller buffers are never compressed
MAX_BYTES = 0x7E000000  #: lz4.block's largest input; larger buffers go raw
EVALUATE_EVERY = 0.5  #: seconds between two decisions of "auto"
SAMPLE_EVERY = 0.1  #: seconds between two samples while "auto" is off
ACCELERATION = 4  #: lz4's speed/ratio trade-off: faster than lz4's default of 1, for slightly more bytes
WORTH = 0.8  #: "auto" compresses when that costs less than this share of sending raw
_SAMPLE_BYTES = 256 * 1024
_SHRINK = 0.9  # a compressed buffer must be smaller than this share of the original
_BLOCKED = 0.5  # share of a period spent in sends from which the link counts as the bottleneck
INSTALL_HINT = "pip install 'rpcdl[compression]' (or pip install lz4)"


def lz4_available() -> bool:
    """Whether lz4 can be used here (installed, and not disabled by ``RPCDL_NO_LZ4=1``)."""
    return _lz4 is not None and os.environ.get(NO_LZ4_ENV, "") in ("", "0")


def resolve_mode(mode: str | None = None) -> str:
    """The compression mode to use: ``mode``, else ``RPCDL_COMPRESSION``, else ``"auto"``.

    Args:
        mode: ``"off"``, ``"on"``, ``"auto"`` or ``None``.

    Returns:
        the mode; ``"off"`` for ``"auto"`` where lz4 is not installed.

    Raises:
        ValueError: not one of the modes.
        ImportError: ``"on"`` without lz4 installed (the message says how to install it).

    Example::

        >>> resolve_mode("off")
        'off'
    """
    where = "compression"
    if mode is None:
        mode, where = os.environ.get(COMPRESSION_ENV, "").strip().lower() or DEFAULT_MODE, COMPRESSION_ENV
    if mode not in MODES:
        raise ValueError(f"{where} must be one of {', '.join(MODES)}, got {mode!r}")
    if not lz4_available():
        if mode == "on":
            raise ImportError(f"{where}='on' needs the lz4 package, which is not installed: {INSTALL_HINT}")
        return "off"
    return mode


def negotiate(client_mode: str, client_decodes: bool, worker_mode: str) -> str:
    """The mode a connection uses, from what the client wants and can do and the worker's resolved mode
    (``"off"`` where the worker has no lz4)."""
    if not client_decodes or "off" in (client_mode, worker_mode):
        return "off"
    return "on" if "on" in (client_mode, worker_mode) else "auto"


def decompress_into(data: bytearray | memoryview, target: Any) -> None:
    """Decode one buffer compressed by :class:`Compressor` into ``target``, which it must fill exactly.

    lz4's public API decodes into memory of its own, which is then copied into
    ``target`` (the memory the tensor will live in, pinned where asked).

    Args:
        data: the compressed bytes (as received).
        target: writable memory of the decoded size (where the tensor will live).

    Raises:
        ValueError: the data is corrupt or does not decode to exactly ``target``'s size.

    Example::

        >>> (packed,), (size,) = Compressor("on").prepare([bytes(1 << 20)])
        >>> target = bytearray(size)
        >>> decompress_into(bytearray(packed), target)
        >>> target == bytes(1 << 20)
        True
    """
    if _lz4 is None:
        raise ValueError(f"received an lz4-compressed buffer but lz4 is not installed: {INSTALL_HINT}")
    view = memoryview(target).cast("B")
    size = view.nbytes
    try:
        unpacked = _lz4.decompress(data, uncompressed_size=size)  # at most size bytes: a longer output is an error
    except _lz4.LZ4BlockError as exc:
        raise ValueError(f"a compressed buffer is corrupt: {exc}") from None
    if len(unpacked) != size:
        raise ValueError(f"a compressed buffer decodes to {len(unpacked)} bytes, not the {size} announced")
    view[:] = unpacked


class Compressor:
    """The sending side's compression of one connection (see the module docstring).

    Args:
        mode: the negotiated mode, ``"off"``, ``"on"`` or ``"auto"``.
        loopback: whether the peer is on this machine (``"auto"`` then stays off).
        clock: seconds, monotonic (the periods of ``"auto"``).

    Example::

        >>> compressor = Compressor("on")
        >>> buffers, decoded_sizes = compressor.prepare([bytes(1 << 20)])
        >>> decoded_sizes, len(buffers[0]) < 1 << 20
        ([1048576], True)
    """

    def __init__(self, mode: str, loopback: bool = False, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.negotiated = mode
        self.mode = mode
        reason = {"on": "asked for", "off": "off"}.get(mode, "measuring")
        if mode == "auto" and loopback:
            self.mode, reason = "off", "auto: loopback connection"
        self._lock = threading.Lock()
        self._active = mode == "on"
        self._reason = reason
        self._bytes_before = 0  # buffers compressed: their size, and the size sent
        self._bytes_after = 0
        self._buffers_compressed = 0
        self._link_rate: float | None = None  # bytes/s, when sending was the bottleneck
        self._period_start = clock()
        self._sent_bytes = 0
        self._send_seconds = 0.0
        self._sample_in = self._sample_out = 0
        self._sample_seconds = 0.0
        self._sampled_at = 0.0

    @property
    def active(self) -> bool:
        """Whether answers are compressed now."""
        with self._lock:
            return self._active

    def prepare(self, buffers: list[Any]) -> tuple[list[Any], list[int] | None]:
        """Compress what pays among ``buffers``.

        Returns:
            the buffers to send, and for each its decoded size (``0``: sent raw),
            or ``None`` when none is compressed.
        """
        if self.mode == "off" or not buffers:
            return buffers, None
        sizes = [b.nbytes if type(b) is Gathered else memoryview(b).nbytes for b in buffers]
        large = [i for i, size in enumerate(sizes) if MIN_BYTES <= size <= MAX_BYTES]
        if not large:
            return buffers, None
        with self._lock:
            active = self._active
        if not active:
            first = buffers[large[0]]
            self._sample(first.pieces[0] if type(first) is Gathered else memoryview(first).cast("B"))
            return buffers, None
        views = [as_view(b) for b in buffers]
        out, sizes = list(views), [0] * len(views)
        total_in = total_out = 0
        started = time.thread_time()
        for i in large:
            size = views[i].nbytes
            packed = _lz4.compress(views[i], mode="fast", acceleration=ACCELERATION, store_size=False)
            total_in += size
            total_out += min(len(packed), size)
            if len(packed) < size * _SHRINK:
                out[i], sizes[i] = packed, size
        elapsed = time.thread_time() - started
        with self._lock:
            self._sample_in += total_in
            self._sample_out += total_out
            self._sample_seconds += elapsed
            self._bytes_before += total_in
            self._bytes_after += total_out
            self._buffers_compressed += sum(1 for s in sizes if s)
        return (out, sizes) if any(sizes) else (buffers, None)

    def sent(self, wire_bytes: int, seconds: float) -> None:
        """Note a send of ``wire_bytes`` that took ``seconds``; ``"auto"`` may decide anew."""
        if self.mode != "auto":
            return
        with self._lock:
            self._sent_bytes += wire_bytes
            self._send_seconds += seconds
            now = self._clock()
            period = now - self._period_start
            if period >= EVALUATE_EVERY:
                self._evaluate(period)
                self._period_start = now
                self._sent_bytes = 0
                self._send_seconds = 0.0

    def _sample(self, view: Any) -> None:
        if self.mode != "auto":
            return
        now = self._clock()
        with self._lock:
            if now - self._sampled_at < SAMPLE_EVERY:
                return
            self._sampled_at = now
        piece = view[:_SAMPLE_BYTES]
        started = time.thread_time()
        packed = _lz4.compress(piece, mode="fast", acceleration=ACCELERATION, store_size=False)
        elapsed = time.thread_time() - started
        with self._lock:
            self._sample_in += piece.nbytes
            self._sample_out += min(len(packed), piece.nbytes)
            self._sample_seconds += elapsed

    def _evaluate(self, period: float) -> None:
        """Decide (under the lock) from the measurements of the period just ended."""
        if self._send_seconds >= _BLOCKED * period and self._send_seconds > 0:
            self._link_rate = self._sent_bytes / self._send_seconds
        if self._link_rate is None or not self._sample_in or self._sample_seconds <= 0:
            self._reason = "auto: off, the link is not the bottleneck" if self._sample_in else self._reason
            return
        ratio = self._sample_out / self._sample_in
        speed = self._sample_in / self._sample_seconds
        raw_cost = 1.0 / self._link_rate
        compressed_cost = 1.0 / speed + ratio / self._link_rate
        self._active = compressed_cost < WORTH * raw_cost
        self._reason = (
            f"auto: {'on' if self._active else 'off'}, link {self._link_rate * 8 / 1e6:.0f} Mbit/s, "
            f"lz4 ratio {ratio:.2f} at {speed / 1e6:.0f} MB/s"
        )
        self._sample_in = self._sample_out = 0
        self._sample_seconds = 0.0

    def state(self) -> dict[str, Any]:
        """What this connection chose and how it went, for :func:`rpcdl.stats`."""
        with self._lock:
            return {
                "negotiated": self.negotiated,
                "mode": self.mode,
                "active": self._active,
                "reason": self._reason,
                "buffers_compressed": self._buffers_compressed,
                "bytes_before": self._bytes_before,
                "bytes_after": self._bytes_after,
                "ratio": round(self._bytes_after / self._bytes_before, 4) if self._bytes_before else None,
                "link_mbit_s": round(self._link_rate * 8 / 1e6, 1) if self._link_rate else None,
            }
