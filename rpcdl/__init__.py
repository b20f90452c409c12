"""rpcdl: run PyTorch datasets on remote CPU workers, stream ready batches to training.

The names here are the public API; see the documentation for guides. They are
imported on first use, so the command line starts without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .logs import install_fallback

__version__ = "0.1.0"

install_fallback()  # warnings reach stderr with time, level and logger name until the program configures logging

_EXPORTS = {
    "AuthenticationError": "errors",
    "CacheUnavailable": "errors",
    "DatasetMismatch": "errors",
    "RRefNotFound": "errors",
    "ConnectionLost": "errors",
    "LimitExceeded": "errors",
    "ProtocolError": "errors",
    "RPCDLError": "errors",
    "RemoteError": "errors",
    "WorkerTimeout": "errors",
    "WorkerLeaving": "errors",
    "WorkerUnavailable": "errors",
    "ping": "rpc.client",
    "remote": "rpc.client",
    "rpc_async": "rpc.client",
    "rpc_sync": "rpc.client",
    "shutdown": "rpc.client",
    "stats": "rpc.client",
    "RRef": "rpc.rref",
    "Worker": "server.worker",
    "run_worker": "server.worker",
    "RPCDataset": "data.dataset",
    "RPCDataloader": "data.dataloader",
    "NoWorkersLeft": "data.scheduler",
    "WorkerSource": "data.sources",
    "local_workers": "local",
    "set_random_seeds": "seeding",
    "serve_metrics": "data.trainer_metrics",
    "CacheLoader": "data.cache.cached",
    "CachedDataset": "data.cache.cached",
}

# Public submodules, reached by attribute after a plain ``import rpcdl`` (``rpcdl.samplers.X``) and
# imported on that first use, as the names above: ``import rpcdl`` stays free of torch. The
# integrations are imported only when the user reaches for them; the core never does.
_SUBMODULES = ("distributed", "integrations", "launch", "samplers")

__all__ = [
    "AuthenticationError",
    "CacheLoader",
    "CacheUnavailable",
    "CachedDataset",
    "ConnectionLost",
    "DatasetMismatch",
    "LimitExceeded",
    "NoWorkersLeft",
    "ProtocolError",
    "RPCDLError",
    "RPCDataloader",
    "RPCDataset",
    "RRef",
    "RRefNotFound",
    "RemoteError",
    "Worker",
    "WorkerLeaving",
    "WorkerSource",
    "WorkerTimeout",
    "WorkerUnavailable",
    "local_workers",
    "ping",
    "remote",
    "rpc_async",
    "rpc_sync",
    "run_worker",
    "serve_metrics",
    "set_random_seeds",
    "shutdown",
    "stats",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"rpcdl.{name}")  # the import sets it as an attribute of the package
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rpcdl' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rpcdl.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBMODULES})


if TYPE_CHECKING:
    from .data.cache.cached import CachedDataset, CacheLoader
    from .data.dataloader import RPCDataloader
    from .data.dataset import RPCDataset
    from .data.scheduler import NoWorkersLeft
    from .data.sources import WorkerSource
    from .data.trainer_metrics import serve_metrics
    from .errors import (
        AuthenticationError,
        CacheUnavailable,
        ConnectionLost,
        DatasetMismatch,
        LimitExceeded,
        ProtocolError,
        RemoteError,
        RPCDLError,
        RRefNotFound,
        WorkerLeaving,
        WorkerTimeout,
        WorkerUnavailable,
    )
    from .local import local_workers
    from .rpc.client import ping, remote, rpc_async, rpc_sync, shutdown, stats
    from .rpc.rref import RRef
    from .seeding import set_random_seeds
    from .server.worker import Worker, run_worker
