"""Memory measurements of ``rpcdl bench``: this process's resident memory, sampled from a thread."""

from __future__ import annotations

import os
import threading
from typing import Any


class RssSampler:
    """Samples this process's resident memory from a thread; keeps the peak since the last reset."""

    def __init__(self, period: float = 0.002):
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._run, name="rpcdl-bench-rss", daemon=True)

    def rss(self) -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, self.rss())

    def reset(self) -> int:
        self.peak = current = self.rss()
        return current

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def touch_pages(batch: Any) -> None:
    """Read one byte per page of a batch, as a training step would read it all (maps shared memory in)."""
    tensor = batch[0] if isinstance(batch, (list, tuple)) else batch
    flat = tensor.reshape(-1)
    flat[:: 4096 // flat.element_size()].sum()
