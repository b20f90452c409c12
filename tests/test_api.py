"""The public paths of DESIGN.md are reached after a plain ``import rpcdl``; it and the command line need no torch."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rpcdl

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT.parent / "shared" / "DESIGN.md"  # beside the checkout in the developers' tree, not in the repo

# Every public path DESIGN.md names (code outside this repository calls them). A name added to
# DESIGN.md fails test_design_md_names_no_path_missing_here until it is added here too.
PUBLIC_PATHS = [
    "rpcdl.RPCDataset",
    "rpcdl.RPCDataloader",
    "rpcdl.WorkerSource",
    "rpcdl.rpc_async",
    "rpcdl.rpc_sync",
    "rpcdl.remote",
    "rpcdl.RRef",
    "rpcdl.RRef.to_here",
    "rpcdl.RRef.owner",
    "rpcdl.RRef.is_owner",
    "rpcdl.RRef.local_value",
    "rpcdl.run_worker",
    "rpcdl.Worker",
    "rpcdl.shutdown",
    "rpcdl.ping",
    "rpcdl.stats",
    "rpcdl.set_random_seeds",
    "rpcdl.serve_metrics",
    "rpcdl.local_workers",
    "rpcdl.CachedDataset",
    "rpcdl.CacheLoader",
    "rpcdl.launch",
    "rpcdl.samplers.LoadBalancingDistributedSampler",
    "rpcdl.samplers.LoadBalancingDistributedBatchSampler",
    "rpcdl.distributed.shard_workers",
    "rpcdl.distributed.distributed_loader",
    "rpcdl.integrations",
    "rpcdl.integrations.lightning.RPCDataModule",
    "rpcdl.integrations.lightning.RPCDataModule.setup",
    "rpcdl.integrations.lightning.RPCDataModule.teardown",
    "rpcdl.integrations.lightning.RPCDataModule.state_dict",
    "rpcdl.integrations.torchdata",
    "rpcdl.integrations.torchdata.RPCMapper",
    "rpcdl.integrations.torchdata.RPCIterableDataset",
    "rpcdl.integrations.torchdata.rpc_map",  # a DataPipe functional form: registered, not an attribute
]
_DOTTED = re.compile(r"\brpcdl(?:\.[A-Za-z_]\w*)+")
_RREF_METHOD = re.compile(r"\bRRef\.([a-z_]\w*)")
_HEADING_PATH = re.compile(r"^## [^`]*`(rpcdl(?:\.\w+)+)`\s*$")
_BULLET_NAME = re.compile(r"^- `([A-Za-z_]\w*)")


def design_paths(text: str) -> set[str]:
    """The public paths a design document names.

    Dotted ``rpcdl.x.y`` paths anywhere, ``RRef.method`` forms, and under a heading
    that names a path (``## torchdata: `rpcdl.integrations.torchdata```) the names its
    bullets open with.
    """
    paths = {match.group(0) for match in _DOTTED.finditer(text)}
    paths |= {f"rpcdl.RRef.{name}" for name in _RREF_METHOD.findall(text)}
    section = None
    for line in text.splitlines():
        if line.startswith("#"):
            heading = _HEADING_PATH.match(line)
            section = heading.group(1) if heading else None
        elif section is not None and (bullet := _BULLET_NAME.match(line)):
            paths.add(f"{section}.{bullet.group(1)}")
    return paths


def test_design_paths_reads_each_form():
    text = (
        "Beyond both: `rpcdl.Worker` and `rpcdl.local_workers(n)`; see rpcdl/server/ and `RRef.to_here(timeout=...)`.\n"
        "## torchdata: `rpcdl.integrations.torchdata`\n"
        "- `RPCMapper(source, workers, fn)`: maps\n"
        "- `rpc_map`: the same\n"
        "- plain words, `not_a_name`\n"
        "## Another section\n"
        "- `outside`: not under a path\n"
    )
    assert design_paths(text) == {
        "rpcdl.Worker",
        "rpcdl.local_workers",
        "rpcdl.RRef.to_here",
        "rpcdl.integrations.torchdata",
        "rpcdl.integrations.torchdata.RPCMapper",
        "rpcdl.integrations.torchdata.rpc_map",
    }


def test_design_md_names_no_path_missing_here():
    if not DESIGN.exists():
        pytest.skip(f"{DESIGN} is not beside this checkout (PUBLIC_PATHS is still checked)")
    named = design_paths(DESIGN.read_text())
    assert "rpcdl.samplers.LoadBalancingDistributedSampler" in named  # the parser reads the document
    missing = sorted(named - set(PUBLIC_PATHS))
    assert not missing, f"DESIGN.md names public paths this test does not check: {missing}"


_REACH = """
import json, sys
import rpcdl
torch_at_import = "torch" in sys.modules
failures = {}
for path in json.loads(sys.argv[1]):
    parent, _, last = path.rpartition(".")
    try:
        value = rpcdl
        for name in parent.split(".")[1:]:
            value = getattr(value, name)
        if last == "rpc_map":  # a functional form, registered on IterDataPipe when its module loads
            from torch.utils.data import IterDataPipe

            assert "rpc_map" in IterDataPipe.functions, "not registered on IterDataPipe"
        else:
            getattr(value, last)
    except Exception as exc:
        failures[path] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"torch_at_import": torch_at_import, "failures": failures}))
"""


def test_every_public_path_is_reached_by_attribute_after_a_plain_import():
    result = subprocess.run(
        [sys.executable, "-c", _REACH, json.dumps(PUBLIC_PATHS)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["torch_at_import"] is False, "import rpcdl alone imported torch"
    assert report["failures"] == {}


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
