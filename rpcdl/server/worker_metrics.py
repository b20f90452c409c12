"""A worker's Prometheus metrics (``rpcdl worker --metrics-port``), read from its counters when scraped.

Threading: :class:`WorkerCollector` has no state of its own beyond the worker
it reads; each scrape runs on a thread of the metrics server and reads the
worker through its ``stats()`` (:meth:`rpcdl.Worker.stats`), which takes the
worker's and its counters' locks for a copy. Nothing on the worker's own
threads changes for metrics: they count as they always do.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..metrics.exposition import MetricsServer, serve_collector
from ..metrics.names import WORKER_METRICS

__all__ = ["StatsSource", "WorkerCollector", "serve_worker_metrics"]

# Each metric and the stats() field it shows.
_FIELDS = {
    "rpcdl_worker_failures_total": "calls_failed",
    "rpcdl_worker_rejected_total": "calls_rejected",
    "rpcdl_worker_busy_seconds_total": "busy_s",
    "rpcdl_worker_bytes_received_total": "bytes_in",
    "rpcdl_worker_bytes_sent_total": "bytes_out",
    "rpcdl_worker_calls_in_flight": "calls_in_flight",
    "rpcdl_worker_clients": "clients",
    "rpcdl_worker_parallel": "parallel",
    "rpcdl_worker_draining": "draining",
}


class StatsSource(Protocol):
    """What a collector reads: a :class:`rpcdl.Worker` (not imported here: it imports this module)."""

    def stats(self) -> dict[str, Any]: ...


class WorkerCollector:
    """The metrics of :data:`~rpcdl.metrics.names.WORKER_METRICS` for ``worker``, read at each scrape.

    Args:
        worker: the worker to read.

    Example::

        >>> with rpcdl.Worker() as worker:  # doctest: +SKIP
        ...     [metric.name for metric in WorkerCollector(worker).collect()][0]
        'rpcdl_worker_calls'
    """

    def __init__(self, worker: StatsSource):
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        stats = self.worker.stats()
        values = {name: float(stats[field]) for name, field in _FIELDS.items()}
        values["rpcdl_worker_calls_total"] = float(stats["calls_served"] + stats["calls_failed"])
        for name, metric in WORKER_METRICS.items():
            family = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
            yield family(metric.family, metric.help, value=values[name])


def serve_worker_metrics(worker: StatsSource, port: int, host: str) -> MetricsServer:
    """Serve ``worker``'s metrics at ``http://HOST:PORT/metrics`` until the returned server is stopped.

    Args:
        worker: the worker.
        port: the port; ``0`` picks a free one.
        host: the interface to listen on.

    Raises:
        OSError: the port cannot be bound.

    Example::

        >>> server = serve_worker_metrics(worker, 9100, "0.0.0.0")  # doctest: +SKIP
        >>> server.stop()  # doctest: +SKIP
    """
    return serve_collector(WorkerCollector(worker), port, host)
