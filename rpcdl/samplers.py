"""Samplers that balance work across ranks (the public path; they live in ``rpcdl.data.samplers``)."""

from .data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

__all__ = ["LoadBalancingDistributedBatchSampler", "LoadBalancingDistributedSampler"]
