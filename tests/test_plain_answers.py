"""Plain answers (tensors, and tuples, lists and dicts of them and of numbers) are pickled directly, byte for byte as
the pickler pickles them; anything else goes to the pickler. Received buffers become tensors through numpy views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rpcdl.serialization.pickling import _plain_pickles, _rebuild_tensor, dumps, dumps_answer, loads

_T = torch.arange(32 * 128, dtype=torch.float32).reshape(32, 128)
_I = torch.arange(32)
_SHARED = (1, 2)

PLAIN = {
    "tensor": _T,
    "tuple of tensors": (_T, _I),
    "the same tensor twice": (_T, _T, [_T]),
    "list of tensors, numbers and text": [_T, _I, 3, "a"],
    "dict": {"x": _T, "y": _I, "n": 3},
    "dtypes": [_T.to(dtype) for dtype in (torch.float64, torch.float16, torch.int8, torch.uint8, torch.int16)]
    + [_T.to(torch.int32), _T.to(torch.int64), _T.to(torch.complex64), _T.to(torch.complex128), _T > 3],
    "0-d and empty tensors": [torch.tensor(3.0), torch.empty(0, 5), torch.empty(0)],
    "shapes": [torch.zeros(300), torch.zeros(2, 300), torch.zeros(1, 2, 3, 4), torch.zeros(70000, 0)],
    "empty containers": ((), [], {}),
    "tuples of each size": [(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4, 5)],
    "atoms": [None, True, False, 1.5, -3, 255, 256, 65535, 65536, -(2**31), 2**31, 2**40, -(2**70)],
    "strings": ["x" * 300, "é", "", "key"],
    "nested": {"a": [_T, {"b": (_I, _I[:3])}], "key": {"key": 1}},
    "a tuple shared": [_SHARED, _SHARED, (_SHARED,)],
    "views": [_T[3:5], _T[:, :5].contiguous(), torch.zeros(3, 1)],
    "long list": [list(range(2500))],
    "long dict": {str(k): k for k in range(1500)},
}


@pytest.mark.parametrize("name", list(PLAIN))
def test_a_plain_answer_is_written_as_the_pickler_writes_it(name):
    answer = PLAIN[name]
    written = _plain_pickles.dumps(answer)
    assert written is not None, "written directly"
    payload, buffers = dumps(answer)
    assert written[0] == payload
    assert [bytes(b) for b in written[1]] == [bytes(b) for b in buffers]
    assert dumps_answer(answer)[0] == payload


NOT_PLAIN = {
    "requires grad": torch.ones(3, requires_grad=True),
    "not contiguous": _T[:, ::2],
    "bfloat16": _T.bfloat16(),
    "a parameter": torch.nn.Parameter(torch.ones(2)),
    "a function": (print,),
    "int keys": {1: 2},
    "torch.Size": torch.Size([3]),
    "sparse": torch.eye(3).to_sparse(),
    "conjugate view": torch.ones(2, dtype=torch.complex64).conj(),
    "a surrogate": "\ud800",
    "over a frame": [b"x" * 70000],
}


@pytest.mark.parametrize("name", list(NOT_PLAIN))
def test_anything_else_goes_to_the_pickler(name):
    answer = NOT_PLAIN[name]
    assert _plain_pickles.dumps(answer) is None
    assert _outcome(dumps_answer, answer) == _outcome(dumps, answer)


def _outcome(pickle, answer):
    try:
        return pickle(answer)[0]
    except Exception as exc:  # a conjugate view: the pickler's own error, either way
        return type(exc)


def test_a_tuple_inside_itself_goes_to_the_pickler():
    inner: list = []
    outer = (inner,)
    inner.append(outer)
    assert _plain_pickles.dumps(outer) is None
    rebuilt = loads(*dumps_answer(outer))
    assert rebuilt[0][0] is rebuilt


def _received(buffers):
    """The buffers as a worker or client receives them: new uint8 arrays."""
    received = []
    for buffer in buffers:
        array = torch.empty(memoryview(buffer).nbytes, dtype=torch.uint8).numpy()
        array[:] = np.frombuffer(buffer, np.uint8)
        received.append(array)
    return received


@pytest.mark.parametrize(
    "tensor",
    [_T, torch.tensor(2.5), _T > 3, _T.to(torch.complex64), torch.empty(0, 3), _T.bfloat16(), _T[:2].double()],
    ids=["f32", "0-d", "bool", "complex", "empty", "bf16", "f64"],
)
def test_a_received_tensor_is_rebuilt_with_its_dtype_shape_and_values(tensor):
    payload, buffers = dumps_answer(tensor)
    rebuilt = loads(payload, _received(buffers))
    assert rebuilt.dtype == tensor.dtype and rebuilt.shape == tensor.shape
    assert torch.equal(rebuilt, tensor)


def test_a_rebuilt_tensor_shares_the_received_memory():
    buffer = torch.zeros(16, dtype=torch.uint8).numpy()
    tensor = _rebuild_tensor(buffer, torch.float32, (2, 2), False)
    buffer[:4] = np.frombuffer(np.float32(1.5).tobytes(), np.uint8)
    assert tensor[0, 0].item() == 1.5
    assert _rebuild_tensor(buffer, torch.float32, (4,), True).requires_grad


def test_none_is_pickled_as_the_pickler_does():
    assert dumps_answer(None) == dumps(None) and loads(*dumps_answer(None)) is None


NO_TENSOR = {
    "a chunk's answer": (list(range(1000, 1045)), 0.0123, 45),
    "numbers and strings, nested": {"a": [1, "x", None, b"q"], "b": (2.5, [True, (-(2**70),)]), 3: {}},
    "deeper than the look": [[[[[1]]]]],
    "a list inside itself": (lambda inner: (inner.append(inner), inner)[1])([1]),
    "a tensor deep inside": [1, [2, (3, _I)]],
    "over a frame": (["x" * 70000], 1),
}


@pytest.mark.parametrize("name", list(NO_TENSOR))
def test_an_answer_without_tensors_is_pickled_as_the_pickler_does(name):
    answer = NO_TENSOR[name]
    payload, buffers = dumps(answer)
    written, written_buffers = dumps_answer(answer)
    assert written == payload
    assert [bytes(b) for b in written_buffers] == [bytes(b) for b in buffers]
    assert repr(loads(written, written_buffers)) == repr(answer)
