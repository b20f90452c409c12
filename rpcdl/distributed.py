"""Distributed training helpers (the public path; they live in ``rpcdl.data.distributed``)."""

from .data.distributed import distributed_loader, merge_states, shard_workers
from .data.elastic import ElasticDistributedSampler

__all__ = ["ElasticDistributedSampler", "distributed_loader", "merge_states", "shard_workers"]
