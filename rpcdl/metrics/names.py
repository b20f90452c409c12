"""The names of rpcdl's Prometheus metrics, their kinds and what they measure: the one table of them.

The collectors (:mod:`rpcdl.server.worker_metrics` for workers, :mod:`rpcdl.data.trainer_metrics`
for trainers) take their help texts from here, and the documentation's table
is checked against it.
"""

from __future__ import annotations

import dataclasses

__all__ = ["TRAINER_METRICS", "WORKER_METRICS", "MetricName"]


@dataclasses.dataclass(frozen=True)
class MetricName:
    """One metric: its ``name`` (as exposed, ``_total`` included for counters), ``kind`` and ``help``."""

    name: str
    kind: str  #: "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, ...] = ()

    @property
    def family(self) -> str:
        """The name prometheus-client gives the metric's family (a counter's lacks ``_total``)."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name


WORKER_METRICS = {
    metric.name: metric
    for metric in (
        MetricName("rpcdl_worker_calls_total", "counter", "Calls this worker ran, served or failed."),
        MetricName("rpcdl_worker_failures_total", "counter", "Calls that raised an exception in user code."),
        MetricName("rpcdl_worker_rejected_total", "counter", "Calls rejected (the worker was draining)."),
        MetricName("rpcdl_worker_busy_seconds_total", "counter", "Seconds spent running calls, all slots together."),
        MetricName("rpcdl_worker_bytes_received_total", "counter", "Bytes received from clients."),
        MetricName("rpcdl_worker_bytes_sent_total", "counter", "Bytes sent to clients."),
        MetricName("rpcdl_worker_calls_in_flight", "gauge", "Calls received and not answered yet."),
        MetricName("rpcdl_worker_clients", "gauge", "Clients connected now."),
        MetricName("rpcdl_worker_parallel", "gauge", "Calls this worker runs at once (--parallel)."),
        MetricName("rpcdl_worker_draining", "gauge", "1 while the worker drains before it stops, else 0."),
    )
}
"""What ``rpcdl worker --metrics-port`` exposes."""

TRAINER_METRICS = {
    metric.name: metric
    for metric in (
        MetricName("rpcdl_batches_total", "counter", "Batches the loaders of this process yielded."),
        MetricName(
            "rpcdl_data_wait_seconds_total", "counter", "Seconds the training loop spent blocked in next() on a loader."
        ),
        MetricName(
            "rpcdl_data_work_seconds_total",
            "counter",
            "Seconds the training loop spent between two next() calls of an epoch (its own work).",
        ),
        MetricName(
            "rpcdl_worker_batch_seconds_total", "counter", "Seconds the workers spent making the batches delivered."
        ),
        MetricName("rpcdl_bytes_received_total", "counter", "Bytes of the answers that carried the batches."),
        MetricName("rpcdl_call_seconds", "histogram", "Duration of a loader's calls, from sent to answered."),
        MetricName("rpcdl_calls_in_flight", "gauge", "Calls sent by the loaders and not answered yet."),
        MetricName("rpcdl_workers", "gauge", "The loaders' workers, by state.", ("state",)),
        MetricName(
            "rpcdl_workers_needed",
            "gauge",
            "Workers of the measured speed that keep this trainer fed, over the interval since the last scrape.",
        ),
        MetricName(
            "rpcdl_data_wait_fraction", "gauge", "Fraction of the time spent waiting for data since the last scrape."
        ),
    )
}
"""What a trainer exposes (:func:`rpcdl.serve_metrics`, ``RPCDL_METRICS_PORT``)."""
