"""Seeding the random generators of a worker process.

A seeded loader seeds its worker before every batch, so seeding is on the
batch's path. ``torch.manual_seed`` seeds every device, and where CUDA is
built but not started in the process it records a lazy seed with its
caller's stack, some hundreds of microseconds per call. So torch is seeded
with ``torch.manual_seed`` where the process has started CUDA or the host
has an MPS or XPU device, and otherwise through its CPU generator alone
(about a microsecond): the same numbers on the CPU. A worker that starts
CUDA in the middle of a batch has CUDA's generators seeded from its next
batch on.

Threading: stateless but for :func:`_other_accelerator`'s cache, computed
once per process (what devices a host has does not change while it runs).
"""

from __future__ import annotations

import functools
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
    if torch.cuda.is_initialized() or _other_accelerator():
        torch.manual_seed(seed)  # every device's generator
    else:
        torch.default_generator.manual_seed(seed)  # the only one there is: what torch.manual_seed seeds here
    np.random.seed(seed % 2**32)


@functools.cache
def _other_accelerator() -> bool:
    """Whether this host has an MPS or XPU device (a generator of its own; asking starts no CUDA)."""
    xpu = getattr(torch, "xpu", None)
    return torch.backends.mps.is_available() or (xpu is not None and xpu.is_available())
