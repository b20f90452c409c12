"""Prometheus metrics: the names (:mod:`rpcdl.metrics.names`) and an HTTP server for a collector.

This package is below the server and data layers: it knows no worker and no
loader. The collectors sit with what they read: :mod:`rpcdl.server.worker_metrics`
(a worker's counters) and :mod:`rpcdl.data.trainer_metrics` (a trainer's data flow,
and :func:`rpcdl.serve_metrics`). They read plain counters at scrape time,
so a process nobody scrapes pays nothing for them.
"""
