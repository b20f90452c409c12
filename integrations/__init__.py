"""Integrations of rpcdl with other libraries, installed as ``rpcdl.integrations``.

- :mod:`rpcdl.integrations.lightning`: ``RPCDataModule`` for Lightning.
- :mod:`rpcdl.integrations.torchdata`: ``RPCMapper``, ``rpc_map`` and ``RPCIterableDataset``.

The core package never imports these modules.
"""
