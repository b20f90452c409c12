"""Seeding a worker's generators: the same streams, and no lazy CUDA seed per batch where CUDA is not started."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import rpcdl
from rpcdl.seeding import derive_seed

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _random_states_restored():
    """These tests seed the process's generators: the tests after them find the states they had."""
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    yield
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


def test_seeding_draws_the_streams_torch_manual_seed_draws():
    rpcdl.set_random_seeds(11, 3)
    drawn = (torch.rand(5), random.random(), np.random.rand())
    seed = derive_seed(11, 3)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    assert torch.equal(drawn[0], torch.rand(5))
    assert drawn[1:] == (random.random(), np.random.rand())


@pytest.mark.skipif(torch.cuda.is_initialized(), reason="this process has started CUDA")
def test_a_process_without_an_accelerator_seeds_torch_without_manual_seed(monkeypatch):
    if torch.backends.mps.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()):
        pytest.skip("this host has an MPS or XPU device: torch.manual_seed seeds it")
    calls = []
    monkeypatch.setattr(torch, "manual_seed", lambda seed: calls.append(seed))  # counts; seeds nothing
    rpcdl.set_random_seeds(11, 3)
    assert calls == [], "torch.manual_seed records a lazy CUDA seed with a formatted stack on every batch"
    first = torch.rand(3)
    rpcdl.set_random_seeds(11, 3)
    assert torch.equal(first, torch.rand(3))  # seeded all the same
