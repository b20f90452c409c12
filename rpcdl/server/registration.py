"""A worker's entry in a Redis registry (``rpcdl worker --register``): a heartbeat, and leaving it.

The layout, and how a beat and a leave change it, is :mod:`rpcdl.registry`'s. Threading: the heartbeat thread
(``rpcdl-registry-ADDRESS``) owns the redis-py client and does every write:
it beats every ``ttl / 3`` seconds until told to stop, then removes the entry
and ends. Other threads reach it only through :meth:`Registration.leave`,
which sets an :class:`threading.Event` and joins the thread.
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Any

from ..registry import RegistryURL, beat, leave

log = logging.getLogger("rpcdl.worker")


class _Beat(enum.Enum):
    """Where the heartbeat stands (the heartbeat thread's own)."""

    NOT_YET = "not yet"  #: no beat written yet
    JOINED = "joined"  #: the last beat was written
    FAILING = "failing"  #: the last beat failed (said once)


class Registration:
    """Keeps ``address`` alive in the registry at ``url`` until :meth:`leave`.

    Args:
        url: the registry.
        address: the worker's advertised ``"host:port"``.
        client: a redis-py client (default: one made from ``url``).

    Example::

        >>> registration = Registration(RegistryURL.parse("redis://127.0.0.1:6379"), "10.0.0.7:6543")  # doctest: +SKIP
        >>> registration.start()  # doctest: +SKIP
        >>> registration.leave()  # doctest: +SKIP
    """

    def __init__(self, url: RegistryURL, address: str, client: Any = None) -> None:
        self.url = url
        self.address = address
        self._client = client if client is not None else url.client()
        self._leaving = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rpcdl-registry-{address}", daemon=True)

    def start(self) -> None:
        """Start beating (the first beat is written from the thread at once)."""
        self._thread.start()

    def leave(self, timeout: float = 5.0) -> None:
        """Stop beating and remove the entry; wait up to ``timeout`` seconds for it to be done."""
        self._leaving.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        state = _Beat.NOT_YET
        while True:
            try:
                joined = beat(self.url, self._client, self.address)
                if state is _Beat.NOT_YET:
                    log.info("rpcdl worker %s: joined registry %s", self.address, self._where())
                elif state is _Beat.FAILING or joined:  # back after a failure, or after its entry expired
                    log.info("rpcdl worker %s: registered in %s now", self.address, self._where())
                state = _Beat.JOINED
            except Exception as exc:  # redis-py's errors, and OSError: the worker serves on regardless
                if state is not _Beat.FAILING:
                    log.warning(
                        "rpcdl worker %s: could not register in %s (%s); trying again every %.1fs",
                        self.address,
                        self._where(),
                        exc,
                        self.url.heartbeat,
                    )
                state = _Beat.FAILING
            if self._leaving.wait(self.url.heartbeat):
                break
        try:
            leave(self.url, self._client, self.address)
            log.info("rpcdl worker %s: left registry %s", self.address, self._where())
        except Exception as exc:
            log.warning(
                "rpcdl worker %s: could not leave registry %s (%s): it expires", self.address, self._where(), exc
            )
        finally:
            self._client.close()

    def _where(self) -> str:
        return f"redis://{self.url.host}:{self.url.port}/{self.url.db} key {self.url.key!r}"
