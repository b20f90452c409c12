"""Datasets and loaders on workers: RPCDataset, RPCDataloader, the scheduler, samplers, cache, distributed helpers."""
