"""The public names of DESIGN.md import, and the command line starts without torch."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import rpcdl

PUBLIC = {
    "rpcdl": "RPCDataset RPCDataloader rpc_async rpc_sync remote RRef run_worker Worker shutdown ping stats "
    "set_random_seeds local_workers CachedDataset CacheLoader",
    "rpcdl.samplers": "LoadBalancingDistributedSampler LoadBalancingDistributedBatchSampler",
    "rpcdl.distributed": "shard_workers distributed_loader",
    "rpcdl.integrations.lightning": "RPCDataModule",
    "rpcdl.integrations.torchdata": "RPCMapper RPCIterableDataset rpc_map",
    "rpcdl.launch": "main",
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_design_names_import(module):
    imported = importlib.import_module(module)
    for name in PUBLIC[module].split():
        if name == "rpc_map":  # a DataPipe functional form, registered on import
            from torch.utils.data import IterDataPipe

            assert "rpc_map" in IterDataPipe.functions
            continue
        assert hasattr(imported, name), f"{module}.{name}"


def test_lazy_exports_are_complete():
    assert sorted(rpcdl.__all__) == sorted(rpcdl._EXPORTS)
    for name in rpcdl.__all__:
        assert getattr(rpcdl, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        rpcdl.nope  # noqa: B018


def test_command_line_starts_without_torch():
    code = "import sys, rpcdl.cli; rpcdl.cli.build_parser(); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr
