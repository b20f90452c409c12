"""Integrations of rpcdl with other libraries, installed as ``rpcdl.integrations``.

- :mod:`rpcdl.integrations.lightning`: ``RPCDataModule`` for Lightning.
- :mod:`rpcdl.integrations.torchdata`: ``RPCMapper``, ``rpc_map`` and ``RPCIterableDataset``.

The core package never imports these modules.
"""

from __future__ import annotations

import importlib
from typing import Any

# Reached by attribute too (``rpcdl.integrations.lightning.RPCDataModule`` after ``import rpcdl``),
# imported on that first use: each needs its library, which the others do not.
_SUBMODULES = ("lightning", "torchdata")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES})
