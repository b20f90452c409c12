"""Serve a Prometheus collector over HTTP at ``/metrics``, on a thread of its own (``rpcdl-metrics-HOST:PORT``).

Nothing is computed until a scrape comes: the collector reads the counters
then, on the thread serving that request (one per request).
"""

from __future__ import annotations

import socket
import threading
from http.server import ThreadingHTTPServer

from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector, CollectorRegistry

from ..address import format_address
from ..checks import check_int

__all__ = ["MetricsServer", "serve_collector"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a scrape in progress does not hold the process up at exit


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """An HTTP server answering ``GET /metrics`` from one registry, started by :func:`serve_collector`.

    Attributes:
        port: the port it listens on (the one the system chose for port 0).
        url: where to scrape it.
    """

    def __init__(self, server: ThreadingHTTPServer, host: str):
        self._server = server
        self.port: int = server.server_address[1]
        self.url = f"http://{format_address(host, self.port)}/metrics"
        self._thread = threading.Thread(
            target=server.serve_forever, name=f"rpcdl-metrics-{format_address(host, self.port)}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop answering and close the port (waits for the serving thread)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def serve_collector(collector: Collector, port: int, host: str) -> MetricsServer:
    """Serve ``collector`` (and nothing else) at ``http://HOST:PORT/metrics``.

    Args:
        collector: what a scrape reads (``collect()`` yields metric families).
        port: the port; ``0`` lets the system pick one.
        host: the interface to listen on.

    Returns:
        the server, started.

    Raises:
        OSError: the port cannot be bound (the message names the address and the reason).

    Example::

        >>> server = serve_collector(MyCollector(), 0, "127.0.0.1")  # doctest: +SKIP
        >>> server.url  # doctest: +SKIP
        'http://127.0.0.1:40123/metrics'
    """
    check_int(port, "metrics port", minimum=0, maximum=65535, meaning="0 picks a free port")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server_class = _Server6 if ":" in host else _Server
    try:
        server = server_class((host, port), MetricsHandler.factory(registry))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        # No errno: the message names the metrics port, so that a command line reporting a failed bind of
        # the worker's own port (an OSError with an errno) does not take it for that one.
        raise OSError(f"cannot serve metrics on {format_address(host, port)}: {reason}") from None
    return MetricsServer(server, host)
