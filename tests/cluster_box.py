"""The cluster in a box for the tests: worker hosts in network namespaces, one worker on each (see test_cluster.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import pytest
from netns_cluster import Cluster, unavailable

import rpcdl


def skip_without_namespaces() -> None:
    """Skip the test, with the reason, where network namespaces cannot be made here."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no cluster in a box here: {reason}")


@contextlib.contextmanager
def cluster_of_workers(directory, token: str, worker_options: Sequence[Sequence[str]]) -> Iterator[Cluster]:
    """One host per entry of ``worker_options`` on 1 Gbit/s links, each running ``rpcdl worker`` with those
    options and ``token``; its addresses in ``.workers``. Skips the test, with the reason, where namespaces
    cannot be made."""
    skip_without_namespaces()
    token_file = directory / "token"
    token_file.write_text(token)
    with Cluster(len(worker_options), rate="1gbit") as box:
        box.workers = [
            box.start_worker(index, "--token-file", str(token_file), "--log-level", "WARNING", *options)
            for index, options in enumerate(worker_options)
        ]
        yield box
    rpcdl.shutdown()
