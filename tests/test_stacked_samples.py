"""A batch answered over a socket is sent as the stack of its samples without being stacked on the worker: the same
pickle as the stacked tensor's, one buffer made of the samples' own memory, one tensor on arrival."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
from blocking_wire import FrameReader, send_frame
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

import rpcdl
from rpcdl.data.fetch import fetch_batch
from rpcdl.serialization.pickling import dumps, dumps_answer, loads
from rpcdl.serialization.stacked import StackedSamples
from rpcdl.transport.compression import Compressor
from rpcdl.transport.context import thread_context
from rpcdl.transport.gathered import Gathered
from rpcdl.transport.wire import Frame, Kind, Limits

pytestmark = pytest.mark.timeout(60)

SAMPLES = {
    "images": [torch.full((3, 16, 16), i, dtype=torch.uint8) for i in range(8)],
    "rows": [torch.arange(300, dtype=torch.float32) + i for i in range(4)],
    "scalars": [torch.tensor(float(i)) for i in range(5)],
    "one sample": [torch.ones(2, 2, dtype=torch.int64)],
}


@pytest.mark.parametrize("name", list(SAMPLES))
def test_stacked_samples_pickle_byte_for_byte_as_their_stack(name):
    samples = SAMPLES[name]
    for answer, stacked in [
        (StackedSamples(samples), torch.stack(samples)),
        ({"x": StackedSamples(samples), "n": 3}, {"x": torch.stack(samples), "n": 3}),
    ]:
        payload, buffers = dumps_answer(answer)
        expected_payload, expected_buffers = dumps(stacked)
        assert payload == expected_payload
        [gathered] = buffers
        assert type(gathered) is Gathered and len(gathered.pieces) == len(samples)  # not stacked here
        assert bytes(gathered.joined()) == bytes(expected_buffers[0])
        arrived = loads(payload, [gathered.joined()])
        assert torch.equal(arrived if isinstance(arrived, torch.Tensor) else arrived["x"], torch.stack(samples))


def test_samples_that_cannot_be_sent_from_their_memory_are_stacked_first():
    transposed = [torch.arange(6.0).reshape(2, 3).t(), torch.zeros(3, 2)]  # not contiguous
    needs_grad = [torch.ones(2, requires_grad=True), torch.ones(2)]
    for samples in (transposed, needs_grad):
        payload, buffers = dumps_answer(StackedSamples(samples))
        assert all(type(buffer) is not Gathered for buffer in buffers)
        assert torch.equal(loads(payload, buffers), torch.stack(samples).detach())


def test_a_gathered_buffer_is_read_as_one_buffer_and_compressed_whole():
    pieces = [memoryview(bytes([i]) * (100_000 + i)) for i in range(3)]
    frame = Frame(Kind.RESULT, 7, 0, b"payload", [b"small", Gathered(pieces)])
    ours, theirs = socket.socketpair()
    try:
        sender = threading.Thread(target=send_frame, args=(theirs, frame), name="test-sender")
        sender.start()
        received = FrameReader(ours, Limits(), stall_timeout=10).read_frame()
        sender.join()
    finally:
        ours.close()
        theirs.close()
    assert [bytes(b) for b in received.buffers] == [b"small", b"".join(bytes(p) for p in pieces)]
    assert frame.buffer_bytes == 5 + sum(p.nbytes for p in pieces)
    sent, sizes = Compressor("on").prepare(frame.buffers)
    assert sizes[1] == frame.buffers[1].nbytes and len(sent[1]) < sizes[1]  # one block, the whole buffer


class Images(Dataset):
    def __len__(self) -> int:
        return 96

    def __getitem__(self, index: int) -> dict:
        image = torch.full((3, 64, 64), index % 251, dtype=torch.uint8)
        return {"image": image, "label": index, "features": torch.full((40,), float(index))}


def test_a_worker_call_answered_over_the_socket_does_not_stack_large_samples():
    indices = list(range(16))
    assert isinstance(fetch_batch(Images(), indices, default_collate, None)["image"], torch.Tensor)  # no call here
    previous, thread_context.value = thread_context.value, ("client:1", None, None, None)  # a call, no segment
    try:
        batch = fetch_batch(Images(), indices, default_collate, None)
    finally:
        thread_context.value = previous
    assert isinstance(batch["image"], StackedSamples)
    assert isinstance(batch["features"], torch.Tensor)  # small: stacked, one buffer either way


class Tagged(torch.Tensor):
    """A tensor subclass: its batches keep the type, as with torch's default collate."""


class TaggedImages(Images):
    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((3, 64, 64), index % 251, dtype=torch.uint8).as_subclass(Tagged)


def test_batches_over_the_socket_equal_torch_dataloaders(embedded_worker):
    worker = embedded_worker(shared_memory=0)
    loader = rpcdl.RPCDataloader(rpcdl.RPCDataset([worker.address], Images), batch_size=32)
    ours = list(loader)
    assert rpcdl.stats(worker.address)["transport"] == "socket"
    theirs = list(DataLoader(Images(), batch_size=32))
    assert len(ours) == len(theirs) == 3
    for mine, torchs in zip(ours, theirs, strict=True):
        assert mine.keys() == torchs.keys()
        for key in mine:
            assert mine[key].shape == torchs[key].shape and torch.equal(mine[key], torchs[key])


def test_a_tensor_subclass_batch_keeps_its_type_over_the_socket(embedded_worker):
    worker = embedded_worker(shared_memory=0)
    [ours] = list(rpcdl.RPCDataloader(rpcdl.RPCDataset([worker.address], TaggedImages), batch_size=96))
    [theirs] = list(DataLoader(TaggedImages(), batch_size=96))
    assert type(ours) is type(theirs) is Tagged and torch.equal(ours, theirs)
