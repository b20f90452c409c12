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


def _rpcdl_modules() -> list[str]:
    import pkgutil

    names = ["rpcdl"]
    for info in pkgutil.walk_packages(rpcdl.__path__, "rpcdl."):
        if not info.name.startswith(("rpcdl.cli.bench", "rpcdl.examples", "rpcdl.configs", "rpcdl.__main__")):
            names.append(info.name)
    return names


def test_every_exception_rpcdl_defines_derives_from_rpcdl_error_and_is_documented():
    from pathlib import Path

    documented = (Path(__file__).resolve().parent.parent / "docs" / "api" / "errors.rst").read_text()
    found = {}
    for module_name in _rpcdl_modules():
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            defined_here = isinstance(value, type) and value.__module__ == module_name
            if defined_here and issubclass(value, BaseException) and not name.startswith("_"):
                found[f"{module_name}.{name}"] = value
    assert "rpcdl.errors.LimitExceeded" in found  # the walk sees the package
    outside = [name for name, value in found.items() if not issubclass(value, rpcdl.RPCDLError)]
    assert not outside, f"not under RPCDLError: {outside}"
    exported = {name for name in rpcdl.__all__ if isinstance(getattr(rpcdl, name), type)}
    user_facing = [value for name, value in found.items() if not name.startswith("rpcdl.data.cache.backends.")]
    undocumented = [v.__name__ for v in user_facing if v.__name__ not in documented]
    assert not undocumented, f"exceptions missing from docs/api/errors.rst: {undocumented}"
    unexported = [v.__name__ for v in user_facing if v.__name__ not in exported and v.__module__ != "rpcdl.errors"]
    assert not unexported, f"exceptions defined outside rpcdl.errors and not exported from rpcdl: {unexported}"
