"""Seeding the random generators of a worker process."""

from __future__ import annotations

import random

import numpy as np
import torch


def derive_seed(base_seed: int, *keys: int) -> int:
    """Mix ``base_seed`` with ``keys`` (epoch, worker index...) into a 63-bit seed.

    Different keys give unrelated seeds, the same keys the same seed.

    Example::

        >>> derive_seed(0, 1, 2) == derive_seed(0, 1, 2) != derive_seed(0, 2, 1)
        True
    """
    sequence = np.random.SeedSequence([base_seed % 2**64, *(k % 2**64 for k in keys)])
    return int(sequence.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def set_random_seeds(base_seed: int, worker_id: int) -> None:
    """Seed Python's, torch's and numpy's default generators in this process.

    Call it on each worker (through :func:`rpcdl.rpc_async`) with the same
    ``base_seed`` and a distinct ``worker_id``: workers draw different streams,
    and the same arguments draw the same stream again. Workers may run tasks out
    of order, so this gives non-redundancy between workers, not bitwise
    reproducibility of a whole run.

    Args:
        base_seed: the seed shared by all workers (an epoch's seed, say).
        worker_id: the worker's index.

    Example::

        >>> base_seed = torch.randint(0, 2**32 - 1, [1]).item()
        >>> for i, worker in enumerate(workers):  # doctest: +SKIP
        ...     rpcdl.rpc_async(worker, rpcdl.set_random_seeds, args=[base_seed, i])
    """
    if not isinstance(base_seed, int) or not isinstance(worker_id, int):
        raise TypeError(f"base_seed and worker_id must be integers, got {base_seed!r} and {worker_id!r}")
    seed = derive_seed(base_seed, worker_id)
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
