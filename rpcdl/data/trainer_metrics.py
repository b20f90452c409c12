"""A trainer's Prometheus metrics: the data flow of its loaders, read when scraped; :func:`rpcdl.serve_metrics`.

What is counted, and by whom, is :mod:`rpcdl.data.flow`'s business: plain
counters under a lock, changed by the threads advancing the loaders' epochs.
A scrape copies them (:data:`~rpcdl.data.flow.PROCESS_FLOW`,
:data:`~rpcdl.data.flow.CALL_SECONDS`, the pools of
:data:`~rpcdl.data.flow.LIVE_POOLS`) and turns them into metric families.

Threading: each scrape runs on a thread of its metrics server.
:class:`TrainerCollector`'s lock guards the snapshot of its last scrape and
the figures from it (what ``rpcdl_workers_needed`` shows). The servers
started in this process are guarded by a lock of their own.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ..address import parse_address
from ..checks import check_int
from ..metrics.exposition import MetricsServer, serve_collector
from ..metrics.names import TRAINER_METRICS
from .flow import CALL_SECONDS, LIVE_POOLS, PROCESS_FLOW, FlowSnapshot
from .records import WorkerState

__all__ = ["METRICS_PORT_ENV", "TrainerCollector", "serve_metrics", "serve_metrics_from_environment"]

METRICS_PORT_ENV = "RPCDL_METRICS_PORT"
"""``PORT`` or ``HOST:PORT``: where a trainer serves its metrics (loopback when no host is given)."""

_WORKER_STATES = tuple(state.value for state in WorkerState)


class TrainerCollector:
    """The metrics of :data:`~rpcdl.metrics.names.TRAINER_METRICS` for this process's loaders.

    ``rpcdl_workers_needed`` and ``rpcdl_data_wait_fraction`` cover the
    interval since the previous scrape that saw batches (see
    :class:`~rpcdl.data.flow.FlowFigures`); they are absent until a batch was
    measured.

    Example::

        >>> names = [metric.name for metric in TrainerCollector().collect()]
        >>> "rpcdl_batches" in names, "rpcdl_workers_needed" in names
        (True, False)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._previous = PROCESS_FLOW.snapshot()
        self._needed = float("nan")
        self._fraction = float("nan")

    def _advise(self, now: FlowSnapshot) -> tuple[float, float]:
        """The figures since the last scrape that saw batches (that scrape's, when none came since)."""
        with self._lock:
            figures = now.since(self._previous)
            if figures.batches > 0 and figures.worker_batches > 0:
                self._needed, self._fraction = figures.workers_needed, figures.data_wait_fraction
                self._previous = now
            return self._needed, self._fraction

    def collect(self) -> Iterator[Metric]:
        flow = PROCESS_FLOW.snapshot()
        needed, fraction = self._advise(flow)
        windows = LIVE_POOLS.windows()
        values = {
            "rpcdl_batches_total": flow.batches,
            "rpcdl_data_wait_seconds_total": flow.wait_seconds,
            "rpcdl_data_work_seconds_total": flow.work_seconds,
            "rpcdl_worker_batch_seconds_total": flow.worker_seconds,
            "rpcdl_bytes_received_total": flow.bytes_received,
            "rpcdl_calls_in_flight": sum(worker["in_flight"] for pool in windows for worker in pool.values()),
            "rpcdl_workers_needed": needed,
            "rpcdl_data_wait_fraction": fraction,
        }
        for name, metric in TRAINER_METRICS.items():
            if name == "rpcdl_call_seconds":
                buckets, total = CALL_SECONDS.snapshot()
                labelled = [(_bucket_label(bound), count) for bound, count in buckets]
                yield HistogramMetricFamily(metric.family, metric.help, buckets=labelled, sum_value=total)
            elif name == "rpcdl_workers":
                family = GaugeMetricFamily(metric.family, metric.help, labels=list(metric.labels))
                states = [worker["state"] for pool in windows for worker in pool.values()]
                for state in _WORKER_STATES:
                    family.add_metric([state], float(states.count(state)))
                yield family
            elif metric.kind == "counter":
                yield CounterMetricFamily(metric.family, metric.help, value=float(values[name]))
            elif not math.isnan(values[name]):
                yield GaugeMetricFamily(metric.family, metric.help, value=float(values[name]))


def _bucket_label(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)


class _Servers:
    """The metrics servers of this process by the address asked for, so that asking twice serves once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_address: dict[tuple[str, int], MetricsServer] = {}
        self._by_request: dict[str, MetricsServer] = {}

    def serve(self, port: int, host: str) -> int:
        """Serve on ``host:port``, unless served already; ``port`` 0 always starts a server. Returns its port."""
        with self._lock:  # held while binding: two threads asking for one port start one server
            return self._serve(port, host).port

    def serve_once(self, requested: str, port: int, host: str) -> int:
        """Serve as :meth:`serve`, once per ``requested`` (a request that may say port 0): later ones get
        the same port."""
        with self._lock:
            server = self._by_request.get(requested)
            if server is None:
                server = self._by_request[requested] = self._serve(port, host)
            return server.port

    def _serve(self, port: int, host: str) -> MetricsServer:
        """Called with the lock held."""
        server = self._by_address.get((host, port)) if port else None
        if server is None:
            server = serve_collector(TrainerCollector(), port, host)
            self._by_address[(host, server.port)] = server
        return server


_servers = _Servers()


def serve_metrics(port: int = 0, host: str = "127.0.0.1") -> int:
    """Serve this trainer's metrics at ``http://HOST:PORT/metrics`` for Prometheus, from a background thread.

    The metrics (see the documentation's table) cover every
    :class:`~rpcdl.RPCDataloader` of the process: batches, seconds the
    training loop waited for data, the workers' time on the batches, calls
    and their durations, workers by state, and ``rpcdl_workers_needed``: how
    many workers of the measured speed keep this trainer fed. They are read
    from plain counters when scraped. Asking again for a port already served
    returns it, serving once.

    Args:
        port: the port; ``0`` lets the system pick a free one.
        host: the interface to listen on (``"0.0.0.0"`` for all).

    Returns:
        the port it listens on.

    Raises:
        OSError: the port cannot be bound (the message names it and why).

    Example::

        >>> port = rpcdl.serve_metrics(9400)  # doctest: +SKIP
        >>> # curl http://127.0.0.1:9400/metrics
    """
    check_int(port, "port", minimum=0, maximum=65535, meaning="0 picks a free port")
    if not isinstance(host, str):
        raise TypeError(f"host must be a string such as '127.0.0.1' or '0.0.0.0', got {host!r}")
    return _servers.serve(port, host)


def serve_metrics_from_environment(local_rank: int | None = None) -> int | None:
    """Serve the metrics where ``RPCDL_METRICS_PORT`` says, if set; return the port, else ``None``.

    ``RPCDL_METRICS_PORT`` is ``PORT`` (on loopback) or ``HOST:PORT``; the
    process of local rank ``r`` serves on ``PORT + r``, so that the ranks of a
    node do not collide (``0``: each picks a free port). Every
    :class:`~rpcdl.RPCDataloader` calls it as it is made, and
    :class:`~rpcdl.integrations.lightning.RPCDataModule` with the trainer's
    local rank as it sets up; the first call serves, the others return its port.

    Args:
        local_rank: this process's rank on its node (default: ``$LOCAL_RANK``, as
            torchrun and Lightning set it, else 0).

    Raises:
        ValueError: the variable is not a port or ``HOST:PORT``.
        OSError: the port cannot be bound.
    """
    text = os.environ.get(METRICS_PORT_ENV, "").strip()
    if not text:
        return None
    try:
        host, port = parse_address(text) if ":" in text else ("127.0.0.1", int(text))
        check_int(port, METRICS_PORT_ENV, minimum=0, maximum=65535)
    except ValueError as exc:
        raise ValueError(
            f"${METRICS_PORT_ENV}={text!r} is not PORT or HOST:PORT (0 picks a free port): {exc}"
        ) from None
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    return _servers.serve_once(text, port + local_rank if port else 0, host)
