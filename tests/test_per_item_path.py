"""The consumer's path for a batch or item whose chunk is already here stays a handful of Python calls.

(And a seeded loader leaves each batch's seed to its worker.)

A loader's batch or a mapper's item that came in a chunk already received is
handed out without any call or wait: what remains is bookkeeping (the
position a state resumes from, the data-flow counters), which every batch
pays on the trainer's main thread. These tests count the Python calls into
rpcdl's own code that one ``next()`` makes on that path, with a profile hook
on the consuming thread: a count, not a time, so the machine's load does not
change it. The smallest count over an epoch is that path's (the other
``next()`` calls also receive a chunk or send one).
"""

from __future__ import annotations

import itertools
import os
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import helpers
import numpy as np
import torch
from torchdata.nodes import IterableWrapper

import rpcdl
import rpcdl.integrations
from rpcdl.integrations.torchdata import RPCMapper
from rpcdl.seeding import derive_seed, set_random_seeds

#: rpcdl's Python calls for a batch already here: the epoch's next(), its pass's next(), the flow's and the
#: position's bookkeeping (one call each, whatever the flows above the loader's).
LOADER_CALLS = 4
#: For an item already here: the node's next() and its body, and its pass's next().
MAPPER_CALLS = 3

_ROOTS = tuple(os.path.dirname(path) + os.sep for path in (rpcdl.__file__, rpcdl.integrations.__file__))


def fewest_calls(advance: Callable[[], Any], times: int) -> tuple[int, list[str]]:
    """The fewest Python calls into rpcdl's files that one of ``times`` calls of ``advance`` made, and their names."""
    fewest: tuple[int, list[str]] = (sys.maxsize, [])
    for _ in range(times):
        names: list[str] = []

        def count(frame: Any, event: str, arg: Any, names: list[str] = names) -> None:
            if event == "call" and frame.f_code.co_filename.startswith(_ROOTS):
                names.append(frame.f_code.co_qualname)

        sys.setprofile(count)
        try:
            advance()
        finally:
            sys.setprofile(None)
        if len(names) < fewest[0]:
            fewest = (len(names), names)
    return fewest


def increment(x: int) -> int:
    return x + 1


def test_a_batch_already_received_costs_a_few_calls(two_workers):
    dataset = rpcdl.RPCDataset(two_workers, helpers.RangeDataset, 400)
    loader = rpcdl.RPCDataloader(dataset, batch_size=2)
    batches: Iterator = iter(loader)
    calls, names = fewest_calls(lambda: next(batches), 150)
    assert calls <= LOADER_CALLS, f"a batch of a chunk already received made {calls} calls into rpcdl: {names}"
    assert len(list(batches)) == 50  # the rest of the epoch, each batch once


def test_an_item_already_received_costs_a_few_calls(two_workers):
    node = RPCMapper(IterableWrapper(itertools.count()), two_workers, increment)
    node.reset()
    values: list[int] = []
    calls, names = fewest_calls(lambda: values.append(next(node)), 300)
    assert calls <= MAPPER_CALLS, f"an item of a chunk already received made {calls} calls into rpcdl: {names}"
    assert values == list(range(1, 301))
    node.reset()


def test_a_position_counts_batches_yielded_in_any_order():
    # The position's bookkeeping for each batch, taken out of order as in_order=False yields: the prefix
    # grows through the batches yielded ahead of it, and only those beyond a gap stay listed.
    from rpcdl.data.epoch_book import EpochBook, Position
    from rpcdl.data.resume import LoaderPosition

    for order in itertools.permutations(range(5)):
        book = EpochBook([], None, None)
        position = Position(LoaderPosition(0, 0, (7,)))  # resumed with batch 7 yielded already
        for count, seq in enumerate(order, 1):
            book.yielded(position, seq)
            done = set(order[:count])
            prefix = next(n for n in itertools.count() if n not in done)
            assert (position.yielded_prefix, position.yielded_extra) == (prefix, done - set(range(prefix)) | {7})
        assert position.snapshot().yielded_extra == (7,)


class Noise(torch.utils.data.Dataset):
    """Sample ``i`` is a draw of the worker's torch generator, as seeded for its batch."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(())


def test_a_seeded_batch_is_seeded_on_the_worker_as_derive_seed_says(two_workers):
    # Each batch's seed, derive_seed(seed, epoch, batch number), costs some microseconds: the workers derive
    # it, and the thread iterating derives only the epoch's (to reseed the workers as it begins).
    loader = rpcdl.RPCDataloader(rpcdl.RPCDataset(two_workers, Noise), batch_size=4, seed=42)
    derived: list[int] = []

    def count(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is derive_seed.__code__:
            derived.append(1)

    for epoch in range(2):
        sys.setprofile(count)
        try:
            batches = list(loader)
        finally:
            sys.setprofile(None)
        expected = []
        saved = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
        try:  # the draws the workers make, made here
            for number in range(len(batches)):
                set_random_seeds(derive_seed(42, epoch, number), 0)
                expected.append(torch.stack([torch.rand(()) for _ in range(4)]))
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            torch.random.set_rng_state(saved[2])
        assert all(torch.equal(batch, want) for batch, want in zip(batches, expected, strict=True)), epoch
    assert len(derived) <= 2, f"the thread iterating derived {len(derived)} seeds in 2 epochs of 12 batches"
