"""Datasets for the side-by-side suites: each is built the same way by torch's DataLoader and on rpcdl's workers."""

from __future__ import annotations

import collections
import time

import numpy as np
import torch
from torch.utils.data import Dataset

Pair = collections.namedtuple("Pair", ["index", "square"])


class StructuredDataset(Dataset):
    """Samples of every shape ``default_collate`` knows: tensors, numbers, numpy, strings, dicts, named tuples."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        return {
            "tensor": torch.full((2, 3), float(index)),
            "int": index,
            "float": index / 2,
            "array": np.arange(3, dtype=np.int32) + index,
            "name": f"sample-{index}",
            "pair": Pair(index, torch.tensor(index * index)),
            "list": [index, torch.tensor([index])],
        }


class BatchedReadDataset(Dataset):
    """Defines ``__getitems__``: a sample read through it is marked, so its use shows in the batch."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, bool]:
        return index, False

    def __getitems__(self, indices: list[int]) -> list[tuple[int, bool]]:
        return [(index, True) for index in indices]


class FailingAt(Dataset):
    """Raises ``KeyError`` (a type with its own ``str``) for one index."""

    def __init__(self, n: int, bad: int):
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.bad:
            raise KeyError(f"sample {index} is missing")
        return torch.tensor(index)


class SlowDataset(Dataset):
    """Every sample takes ``delay`` seconds."""

    def __init__(self, n: int, delay: float):
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.tensor(index)


def subset_of_range(n: int, indices: list[int]) -> torch.utils.data.Subset:
    from helpers import RangeDataset

    return torch.utils.data.Subset(RangeDataset(n), indices)


def stack_of_ranges(n: int) -> torch.utils.data.StackDataset:
    from helpers import RangeDataset

    return torch.utils.data.StackDataset(RangeDataset(n), BatchedReadDataset(n))


def failing_collate(samples):
    raise ZeroDivisionError(f"cannot collate {len(samples)} samples")


def identity_collate(samples):
    return samples
