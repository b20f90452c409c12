"""rpcdl: run PyTorch datasets on remote CPU workers, stream ready batches to training.

The names here are the public API; see the documentation for guides.
"""

from .cache import CachedDataset, CacheLoader
from .client import ping, remote, rpc_async, rpc_sync, shutdown, stats
from .dataloader import RPCDataloader
from .dataset import DatasetMismatch, RPCDataset
from .errors import (
    AuthenticationError,
    ConnectionLost,
    ProtocolError,
    RemoteError,
    RPCDLError,
    WorkerTimeout,
    WorkerUnavailable,
)
from .local import local_workers
from .rref import RRef
from .scheduler import NoWorkersLeft
from .seeding import set_random_seeds
from .worker import Worker, run_worker

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "CacheLoader",
    "CachedDataset",
    "ConnectionLost",
    "DatasetMismatch",
    "NoWorkersLeft",
    "ProtocolError",
    "RPCDLError",
    "RPCDataloader",
    "RPCDataset",
    "RRef",
    "RemoteError",
    "Worker",
    "WorkerTimeout",
    "WorkerUnavailable",
    "local_workers",
    "ping",
    "remote",
    "rpc_async",
    "rpc_sync",
    "run_worker",
    "set_random_seeds",
    "shutdown",
    "stats",
]
