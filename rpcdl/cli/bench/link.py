"""``rpcdl bench --workers HOST:PORT ... --link``: what the link to a user's own workers delivers.

Figures, each with a one-line verdict:

- ``latency``: round trips of pings to each worker, p50 and p99;
- ``raw``: the link's raw rate, measured with the workers themselves: each
  streams incompressible bytes in large frames with no pickle (a ``STREAM``
  request, see :mod:`rpcdl.transport.control`), all at once, one connection each;
- ``images``: rpcdl image batches of random bytes (incompressible), as a ratio of ``raw``;
- ``compression``: compressible batches with the client asking for
  compression ``off``, ``on`` and ``auto``, each as a ratio of ``raw``;
- ``chosen``: what each connection chose: compression, the adaptive window,
  TLS (version and cipher), shared memory where the worker reports it.

Raw streams and loaders take turns, round after round, and the figures are
medians. The trainer's CPU seconds per GB are given beside each rate: on a
small trainer the CPU, not the link, is often the limit.

Threading: run from one thread; the raw streams are connections on this
process's event loop (``rpcdl-loop``), which reads them all at once: the
thread that runs :func:`raw_rate` waits for them and never reads a socket.
"""

from __future__ import annotations

import asyncio
import math
import os
import ssl
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...address import parse_address
from ...rpc.dial import dial_on_loop
from ...transport.compression import COMPRESSION_ENV
from ...transport.control import decode_rejected, encode_stream
from ...transport.event_loop import call_soon, run_coroutine
from ...transport.frame_protocol import FrameProtocol
from ...transport.security import default_client_tls, resolve_token
from ...transport.wire import Frame, Kind, Limits, encode_frame
from .report import percentile
from .workloads import IMAGE_SHAPE, ImageDataset, SmoothImageDataset

PINGS = 50
STREAM_FRAME_BYTES = 8 << 20  #: size of the frames a worker streams for the raw rate
_TIMEOUT = 60.0
_IMAGE_BYTES = math.prod(IMAGE_SHAPE)


@dataclass
class LinkSizes:
    """How much each measurement moves.

    Args:
        rounds: interleaved rounds; figures are medians.
        seconds: about how long each measurement of a rate lasts.
        batch: images per batch.
        pings: pings per worker.
    """

    rounds: int = 3
    seconds: float = 2.0
    batch: int = 64
    pings: int = PINGS

    @classmethod
    def quick(cls) -> LinkSizes:
        return cls(rounds=1, seconds=0.3, batch=8, pings=10)


@dataclass
class Rate:
    """One measured rate: MB/s of payload and the trainer's CPU seconds per GB."""

    mb_s: float
    cpu_s_per_gb: float


@dataclass
class LinkReport:
    """The figures of ``rpcdl bench --link``; :meth:`as_dict` for JSON."""

    workers: list[str]
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    rates: dict[str, list[Rate]] = field(default_factory=dict)
    chosen: dict[str, dict[str, Any]] = field(default_factory=dict)
    verdicts: dict[str, str] = field(default_factory=dict)

    def median(self, name: str) -> Rate:
        samples = self.rates[name]
        return Rate(statistics.median(r.mb_s for r in samples), statistics.median(r.cpu_s_per_gb for r in samples))

    def ratio(self, name: str) -> float:
        """``name``'s median rate over the raw rate's."""
        return self.median(name).mb_s / self.median("raw").mb_s

    def as_dict(self) -> dict[str, Any]:
        medians = {name: vars(self.median(name)) for name in self.rates}
        ratios = {name: round(self.ratio(name), 3) for name in self.rates if name != "raw"}
        return {
            "workers": self.workers,
            "latency_ms": self.latency_ms,
            "median": medians,
            "ratio_to_raw": ratios,
            "samples": {n: [vars(r) for r in s] for n, s in self.rates.items()},
            "chosen": self.chosen,
            "verdicts": self.verdicts,
        }


def _timed(run: Callable[[], int]) -> Rate:
    """Run ``run`` (which returns the bytes it moved); its rate and this process's CPU per GB."""
    cpu, started = time.process_time(), time.perf_counter()
    moved = run()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    return Rate(moved / elapsed / 1e6, cpu / (moved / 1e9))


# ---------------------------------------------------------------------------- figures


def latency(address: str, pings: int) -> dict[str, float]:
    """Ping ``address`` ``pings`` times (after one to connect); p50 and p99 in milliseconds."""
    import rpcdl

    rpcdl.ping(address, timeout=_TIMEOUT)
    times = [rpcdl.ping(address, timeout=_TIMEOUT) * 1e3 for _ in range(pings)]
    return {"p50": round(percentile(times, 0.5), 3), "p99": round(percentile(times, 0.99), 3)}


class RawStream:
    """One connection to a worker that asks it for ``STREAM`` frames and receives them into one buffer.

    The connection is a trainer's: dialled and received on the event loop
    (:func:`rpcdl.rpc.dial.dial_on_loop`, then a
    :class:`~rpcdl.transport.frame_protocol.FrameProtocol` with this stream as
    its sink); its fields are the loop's once it is open.

    Args:
        address: the worker, ``"host:port"``; credentials come from the environment.

    Example::

        >>> stream = RawStream("127.0.0.1:6543")  # doctest: +SKIP
        >>> stream.receive(4) == 4 * STREAM_FRAME_BYTES  # doctest: +SKIP
        True
    """

    def __init__(self, address: str):
        host, port = parse_address(address)
        self.address = address
        self._target = memoryview(bytearray(STREAM_FRAME_BYTES))
        self._call_id = 0
        self._request: _Request  # the latest request, set on the loop as the connection opens
        self.tls: dict[str, Any] | None = None
        ssl_context = default_client_tls()
        self._transport = run_coroutine(self._open(host, port, ssl_context), timeout=_TIMEOUT)

    async def _open(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> Any:
        deadline = time.monotonic() + 10.0
        transport, reader, _ = await dial_on_loop(
            self.address,
            host,
            port,
            resolve_token(),
            ssl_context,
            handshake_timeout=10.0,
            grace=5.0,
            failed=lambda error: deadline,
            compression="off",
        )
        tls = transport.get_extra_info("ssl_object") if ssl_context is not None else None
        if tls is not None:
            self.tls = {"version": tls.version(), "cipher": tls.cipher()[0]}
        none_yet = asyncio.get_running_loop().create_future()
        none_yet.set_result(0)
        self._request = _Request(0, none_yet)  # settled: frames that arrive now answer nothing
        protocol = FrameProtocol(self, Limits(), allocate=self._allocate, leftover=reader.leftover())
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        return transport

    def receive(self, count: int) -> int:
        """Ask for ``count`` frames and wait until the loop received them; return the bytes received.

        Args:
            count: frames of :data:`STREAM_FRAME_BYTES` to ask for.

        Returns:
            the bytes of the frames' buffers.

        Raises:
            RuntimeError: the worker refused the request, answered something else, or closed the connection.
            TimeoutError: the worker sent nothing for a minute.
        """
        return run_coroutine(self.receiving(count))

    async def receiving(self, count: int) -> int:
        """:meth:`receive` as a coroutine on the loop (many streams at once: :func:`raw_rate`)."""
        self._call_id += 1
        self._request = request = _Request(count, asyncio.get_running_loop().create_future())
        request_frame = Frame(Kind.STREAM, self._call_id, payload=encode_stream(STREAM_FRAME_BYTES, count))
        self._transport.write(b"".join(encode_frame(request_frame)))
        while True:
            frames = request.frames
            await asyncio.wait([request.done], timeout=_TIMEOUT)
            if request.done.done():
                return request.done.result()
            if request.frames == frames:
                request.done.cancel()
                raise TimeoutError(f"worker {self.address} sent nothing for {_TIMEOUT:g}s of a raw stream")

    def close(self) -> None:
        """Close the connection (from any thread but the loop's)."""
        call_soon(self._transport.abort)

    # ------------------------------------------------------------------ the protocol's sink, on the loop

    def _allocate(self, call_id: int, size: int) -> memoryview:
        return self._target[:size]

    def frame_received(self, frame: Frame) -> None:
        request = self._request
        if request.done.done():
            return
        if frame.kind == Kind.REJECTED:
            error = RuntimeError(f"worker {self.address} refused a raw stream: {decode_rejected(frame.payload)}")
            request.done.set_exception(error)
        elif frame.kind != Kind.STREAM_DATA or frame.call_id != self._call_id:
            error = RuntimeError(f"worker {self.address} answered a raw stream with a {frame.kind.name} frame")
            request.done.set_exception(error)
        else:
            request.frames += 1
            request.moved += frame.buffer_bytes
            if request.frames == request.count:
                request.done.set_result(request.moved)

    def receiving_failed(self, error: Exception) -> None:
        if not self._request.done.done():
            self._request.done.set_exception(error)

    def stream_ended(self, error: Exception | None) -> None:
        if not self._request.done.done():
            self._request.done.set_exception(
                RuntimeError(
                    f"worker {self.address} closed the connection during a raw stream request (an rpcdl worker "
                    "older than this client does that: it lacks STREAM; install the same rpcdl version on both sides)"
                )
            )


@dataclass
class _Request:
    """One raw stream request of a :class:`RawStream`: the frames asked for, those received, their bytes."""

    count: int
    done: asyncio.Future[int]
    frames: int = 0
    moved: int = 0


def raw_rate(streams: Sequence[RawStream], frames: int) -> Rate:
    """All ``streams`` at once, ``frames`` frames each, received on the event loop."""

    async def receive_all() -> int:
        return sum(await asyncio.gather(*(stream.receiving(frames) for stream in streams)))

    return _timed(lambda: run_coroutine(receive_all()))


class Loaders:
    """An rpcdl loader over the workers per case: images, and compressible images per compression mode."""

    MODES = ("off", "on", "auto")

    def __init__(self, workers: list[str], batch: int, batches_per_worker: int):
        self.workers = workers
        self.batch = batch
        self.batches = batches_per_worker * len(workers)

    def measure(self, case: str) -> tuple[Rate, dict[str, Any]]:
        """Run one epoch of ``case`` (``images`` or ``compression <mode>``) on new connections.

        Returns its rate and what each worker's connection chose.
        """
        import rpcdl

        dataset_class, mode = (ImageDataset, "off") if case == "images" else (SmoothImageDataset, case.split()[1])
        rpcdl.shutdown()  # new connections: each asks for its case's compression in the handshake
        previous = os.environ.get(COMPRESSION_ENV)
        os.environ[COMPRESSION_ENV] = mode
        try:
            dataset = rpcdl.RPCDataset(self.workers, dataset_class, self.batches * self.batch)
            loader = rpcdl.RPCDataloader(dataset, batch_size=self.batch)
            try:
                sum(1 for _ in loader)  # warm-up: connections, the datasets, the adaptive window
                rate = _timed(lambda: sum(b.numel() for b in loader))
                windows = loader.worker_windows()
                chosen = {w: _connection_choices(w, windows.get(w, {})) for w in self.workers}
            finally:
                dataset.release()
        finally:
            if previous is None:
                del os.environ[COMPRESSION_ENV]
            else:
                os.environ[COMPRESSION_ENV] = previous
        return rate, chosen


def _connection_choices(worker: str, window: dict[str, Any]) -> dict[str, Any]:
    """What the connection to ``worker`` chose, as the worker and the loader report it."""
    import rpcdl

    counters = rpcdl.stats(worker, timeout=_TIMEOUT)
    shared = {k: v for k, v in counters.items() if "shm" in k or "shared_memory" in k}
    return {
        "compression": counters.get("compression"),
        "window": {k: window.get(k) for k in ("window", "rtt", "round_trip", "service_time")},
        "shared_memory": shared or "not reported by this worker",
    }


# ---------------------------------------------------------------------------- the whole run


def measure_link(workers: list[str], sizes: LinkSizes, progress: Callable[[str], None] = print) -> LinkReport:
    """Measure every figure of the link to ``workers`` (credentials from the environment)."""
    report = LinkReport(list(workers))
    for worker in workers:
        report.latency_ms[worker] = latency(worker, sizes.pings)
    progress(f"latency: {report.latency_ms}")
    streams = [RawStream(worker) for worker in workers]
    try:
        probe = raw_rate(streams, 2)
        frames = max(2, math.ceil(probe.mb_s * 1e6 * sizes.seconds / STREAM_FRAME_BYTES / len(workers)))
        batch_bytes = sizes.batch * _IMAGE_BYTES
        per_worker = max(2, math.ceil(probe.mb_s * 1e6 * sizes.seconds / batch_bytes / len(workers)))
        loaders = Loaders(list(workers), sizes.batch, per_worker)
        cases = ["images", *(f"compression {mode}" for mode in Loaders.MODES)]
        report.rates = {name: [] for name in ["raw", *cases]}
        for round_ in range(sizes.rounds):
            report.rates["raw"].append(raw_rate(streams, frames))
            for case in cases:
                rate, chosen = loaders.measure(case)
                report.rates[case].append(rate)
                report.chosen[case] = chosen
            latest = ", ".join(f"{n} {r[-1].mb_s:,.0f} MB/s" for n, r in report.rates.items())
            progress(f"round {round_ + 1}: {latest}")
        tls = {s.address: s.tls for s in streams}
    finally:
        for stream in streams:
            stream.close()
    report.chosen["tls"] = tls
    report.verdicts = verdicts(report)
    return report


def verdicts(report: LinkReport) -> dict[str, str]:
    """One line per figure: what it means for this link."""
    result = {}
    worst = max(v["p99"] for v in report.latency_ms.values())
    typical = statistics.median(v["p50"] for v in report.latency_ms.values())
    kind = "a local network" if typical < 1.0 else "a long link: the adaptive window covers its round trip"
    result["latency"] = f"p50 {typical:.2f} ms, worst p99 {worst:.2f} ms: {kind}"
    raw = report.median("raw")
    result["raw"] = (
        f"the link moves {raw.mb_s * 8 / 1e3:.2f} Gbit/s from {len(report.workers)} worker(s) at once "
        f"(the trainer spends {raw.cpu_s_per_gb:.2f} CPU s per GB receiving it)"
    )
    images = report.median("images")
    ratio = report.ratio("images")
    if ratio >= 0.95:
        judged = "rpcdl runs at the link's rate"
    elif ratio >= 0.8:
        judged = "rpcdl runs close to the link's rate"
    else:
        judged = (
            f"rpcdl falls short of the link's rate: the trainer spends {images.cpu_s_per_gb:.2f} CPU s per GB "
            f"(raw: {raw.cpu_s_per_gb:.2f}); more trainer cores, or fewer, larger tensors per batch, help"
        )
    result["images"] = f"{ratio:.2f}x raw: {judged}"
    off, on, auto = (report.ratio(f"compression {m}") for m in Loaders.MODES)
    if on >= 1.1 * off:
        pays = f"compression pays here ({on / off:.2f}x off with compressible batches)"
    else:
        pays = f"compression does not pay here ({on / off:.2f}x off): the link is faster than lz4 helps"
    chose = "auto chose well" if auto >= 0.9 * max(on, off) else "auto chose worse than the best fixed mode"
    result["compression"] = f"off {off:.2f}x, on {on:.2f}x, auto {auto:.2f}x raw: {pays}; {chose}"
    tls = [t for t in report.chosen.get("tls", {}).values() if t]
    result["tls"] = f"TLS on ({tls[0]['version']}, {tls[0]['cipher']})" if tls else "plain TCP (no RPCDL_TLS_CA)"
    return result


def format_link(report: LinkReport) -> str:
    """The report as text: a table of rates and ratios, what each connection chose, the verdicts."""
    lines = ["figure                 MB/s   x raw   trainer CPU s/GB"]
    for name in report.rates:
        rate = report.median(name)
        ratio = "" if name == "raw" else f"{report.ratio(name):.2f}"
        lines.append(f"{name:<20} {rate.mb_s:>7,.0f}  {ratio:>6}  {rate.cpu_s_per_gb:>10.2f}")
    lines.append("")
    pings = "; ".join(f"{w} p50 {v['p50']} p99 {v['p99']}" for w, v in report.latency_ms.items())
    lines.append(f"latency (ms): {pings}")
    lines.append("what each connection chose:")
    for case, chosen in report.chosen.items():
        if case == "tls":
            continue
        for worker, choice in chosen.items():
            compression = choice["compression"] or {}
            window = choice["window"]
            lines.append(
                f"  {case:<17} {worker}: compression {compression.get('mode')} active={compression.get('active')}"
                f" ({compression.get('reason')}); window {window.get('window')} (rtt {_ms(window.get('rtt'))});"
                f" shared memory: {choice['shared_memory']}"
            )
    lines.append("verdicts:")
    lines.extend(f"  {name}: {verdict}" for name, verdict in report.verdicts.items())
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"
