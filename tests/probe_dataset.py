"""ProbeDataset: samples that say which worker loaded them (no Lightning import, so workers load it fast)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import Dataset


class Shift:
    """A "transform" for the nested class_path test: adds ``offset``."""

    def __init__(self, offset: float):
        self.offset = offset

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        return value + self.offset


class ProbeDataset(Dataset):
    """Sample ``i`` says who loaded it: its index, the worker's pid and a random draw made there."""

    def __init__(self, n: int, transform: Shift | None = None):
        self.n = n
        self.transform = transform

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        noise = torch.rand(())  # the "augmentation", drawn from the worker's seeded generator
        if self.transform is not None:
            noise = self.transform(noise)
        return {"index": torch.tensor(index), "pid": torch.tensor(os.getpid()), "noise": noise}


def probe_spec(n: int) -> dict[str, Any]:
    """The ``train_dataset`` argument of RPCDataModule for a ProbeDataset of ``n`` samples."""
    return {"class_path": "probe_dataset.ProbeDataset", "init_args": {"n": n}}
