"""Datasets and functions the tests send to workers (importable on both sides)."""

from __future__ import annotations

import os
import time

import torch
from torch.utils.data import Dataset


class RangeDataset(Dataset):
    """Sample ``i`` is ``torch.tensor(i)``; optionally slow."""

    def __init__(self, n: int, delay: float = 0.0):
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return torch.tensor(index)


class SlowOnPidDataset(RangeDataset):
    """Slow only in the worker process whose address is in ``slow_addresses`` (by env)."""

    def __init__(self, n: int, delay: float, slow_port: int, fast_delay: float = 0.0):
        super().__init__(n, fast_delay)
        self.slow = os.environ.get("RPCDL_TEST_PORT") == str(slow_port)
        self.slow_delay = delay

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.slow:
            time.sleep(self.slow_delay)
        return super().__getitem__(index)


class FailingDataset(RangeDataset):
    """Raises ``ValueError`` for one index."""

    def __init__(self, n: int, bad_index: int):
        super().__init__(n)
        self.bad_index = bad_index

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.bad_index:
            raise ValueError(f"index {index} is broken")
        return super().__getitem__(index)


def worker_pid() -> int:
    return os.getpid()


def sleep_and_return(seconds: float, value):
    time.sleep(seconds)
    return value
