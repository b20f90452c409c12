"""The chunk sizer and the answer-size estimate: pure logic, no process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rpcdl.data import chunked_pass
from rpcdl.data.chunked_pass import ChunkReader, ChunkSizer, ReaderState
from rpcdl.data.chunks import answer_bytes, run_chunk
from rpcdl.errors import ChunkFailed
from rpcdl.serialization.stacked import StackedSamples

pytestmark = pytest.mark.timeout(30)


def test_a_chunk_grows_by_doubling_up_to_its_bound():
    sizer = ChunkSizer(16, timeout=120)
    sizes = []
    for _ in range(7):
        sizes.append(sizer.size)
        sizer.observe(sizer.size, seconds=sizer.size * 1e-5)
    assert sizes == [1, 2, 4, 8, 16, 16, 16]


def test_a_chunk_aims_at_its_seconds_and_shrinks_at_once_when_items_get_slower():
    sizer = ChunkSizer(256, timeout=120)
    for _ in range(10):
        sizer.observe(sizer.size, seconds=sizer.size * 1e-4)  # 100 us an item: 40 in 4 ms
    assert sizer.size == 40
    sizer.observe(40, seconds=40 * 1e-3)
    assert sizer.size == 4
    sizer.observe(4, seconds=4 * 0.1)
    assert sizer.size == 1


def test_a_short_timeout_makes_chunks_smaller():
    sizer = ChunkSizer(256, timeout=0.01)  # a chunk aims at a twentieth of it: 0.5 ms
    for _ in range(10):
        sizer.observe(sizer.size, seconds=sizer.size * 1e-4)
    assert sizer.size == 5


def test_a_byte_target_bounds_the_answer_of_a_chunk():
    sizer = ChunkSizer(64, timeout=120, target_bytes=256 * 1024)
    for _ in range(10):
        sizer.observe(sizer.size, seconds=1e-6, nbytes=sizer.size * 16 * 1024)
    assert sizer.size == 16
    sizer.observe(16, seconds=1e-6, nbytes=16 * 1024 * 1024)  # items of 1 MB: one a call
    assert sizer.size == 1
    unbounded = ChunkSizer(64, timeout=120)
    for _ in range(10):
        unbounded.observe(unbounded.size, seconds=1e-6, nbytes=unbounded.size * 1024 * 1024)
    assert unbounded.size == 64


def test_a_lower_bound_applies_to_the_next_chunk_and_a_higher_one_lets_it_grow():
    sizer = ChunkSizer(16, timeout=120)
    for _ in range(5):
        sizer.observe(sizer.size, seconds=sizer.size * 1e-5)
    assert sizer.size == 16
    sizer.max_chunk_size = 4
    assert (sizer.max_chunk_size, sizer.size) == (4, 4)
    sizer.max_chunk_size = 32
    assert sizer.size == 4  # grows again from there, by its answers
    sizer.observe(4, seconds=4e-5)
    assert sizer.size == 8


def _grown(sizer: ChunkSizer, size: int) -> ChunkSizer:
    """``sizer`` after cheap full chunks made it ``size`` items (doubling at each)."""
    while sizer.size < size:
        sizer.observe(sizer.size, seconds=1e-6)
    assert sizer.size == size
    return sizer


def test_a_short_chunk_does_not_make_the_next_one_larger_and_restart_goes_back_to_one():
    sizer = _grown(ChunkSizer(64, timeout=120), 8)
    sizer.observe(3, seconds=1e-6)  # the source ended or was slow: says nothing about 16
    assert sizer.size == 8
    sizer.restart()
    assert sizer.size == 1


def test_answer_bytes_counts_tensors_arrays_and_strings_inside_containers():
    batch = {"image": torch.zeros(2, 3, dtype=torch.uint8), "label": torch.zeros(2), "names": ["ab", "cde"]}
    assert answer_bytes(batch) == 6 + 8 + 5
    assert answer_bytes((np.zeros(4), b"xy", 7)) == 32 + 2
    assert answer_bytes(StackedSamples([torch.zeros(3), torch.zeros(3)])) == 24
    assert answer_bytes(torch.nn.Parameter(torch.zeros(2))) == 8  # a subclass of Tensor
    assert answer_bytes([[[[torch.zeros(100)]]]]) == 0  # deeper than it looks: an estimate, not a walk


def test_run_chunk_runs_every_item_and_reports_the_ones_that_raised():
    values, seconds, nbytes = run_chunk(torch.zeros, [1, 2])
    assert [v.tolist() for v in values] == [[0.0], [0.0, 0.0]] and seconds >= 0 and nbytes == 12
    with pytest.raises(ChunkFailed) as failed:
        run_chunk(lambda x: 1 / x, [1, 0, 2])
    assert failed.value.values == [1.0, None, 0.5] and list(failed.value.errors) == [1]


def test_the_reader_hands_out_what_it_pulled_before_the_source_raised():
    def source():
        yield from range(5)
        raise KeyError("sampler broke")

    reader = ChunkReader(source(), _grown(ChunkSizer(4, timeout=120), 4))
    assert list(reader) == [[0, 1, 2, 3], [4]]
    assert reader.state is ReaderState.FAILED
    assert isinstance(reader.take_error(), KeyError)
    assert reader.state is ReaderState.ENDED and reader.take_error() is None  # handed out once
    assert list(reader) == []


class _Clock:
    """A stand-in for the reader's clock: time moves only when the source says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_source_of_some_microseconds_an_item_fills_its_chunk_for_as_long_as_a_chunk_aims_to_take(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(chunked_pass, "perf_counter", clock)

    def source(step: float):
        for item in range(100):
            clock.now += step
            yield item

    # 150 us an item (a torchdata node asked for its state after each) is not slow: pulling goes on until an
    # item comes after 4 ms, the 27th.
    reader = ChunkReader(source(150e-6), _grown(ChunkSizer(64, timeout=120), 64))
    assert len(next(reader)) == 27
    # An item that takes longer than FILL_SECONDS to come ends its chunk: the next may be as slow.
    reader = ChunkReader(source(chunked_pass.FILL_SECONDS * 1.5), _grown(ChunkSizer(64, timeout=120), 64))
    assert len(next(reader)) == 1
