"""Distributed training helpers (the public path; they live in ``rpcdl.data.distributed``)."""

from .data.distributed import distributed_loader, shard_workers

__all__ = ["distributed_loader", "shard_workers"]
