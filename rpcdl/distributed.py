"""Distributed training helpers (the public path; they live in ``rpcdl.data.ranks``)."""

from .data.elastic import ElasticDistributedSampler
from .data.ranks import distributed_loader, merge_states, shard_workers

__all__ = ["ElasticDistributedSampler", "distributed_loader", "merge_states", "shard_workers"]
