"""Samplers that balance work across ranks (the public path; they live in ``rpcdl.data.load_balancing``)."""

from .data.load_balancing import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

__all__ = ["LoadBalancingDistributedBatchSampler", "LoadBalancingDistributedSampler"]
