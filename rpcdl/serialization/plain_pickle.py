"""The pickles of plain answers, written directly: the bytes :func:`rpcdl.serialization.pickling.dumps` would write.

A plain answer is a CPU tensor (strided, contiguous, of a dtype numpy has, not
requiring grad), ``None``, a bool, an int, a float, a str, or a tuple, list or
dict (str keys) of plain answers: what a ``__getitem__`` or a collate function
returns most often. Pickling one through the pickler calls its Python-level
``reducer_override`` for every object and builds each tensor's reduction with
several torch operations; writing its opcodes here costs a few Python
operations. The bytes are those the pickler writes (protocol 5, one frame, the
same memo), so nothing on the wire changes; anything else is left to the pickler.

Threading: :meth:`PlainPickles.dumps` keeps a message's state in locals; the cache of
dtypes' names is filled once per dtype (two threads filling it write equal entries).
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..transport.gathered import Gathered
from .stacked import StackedSamples

_FRAME_TARGET = 64 * 1024  # the pickler starts a new frame past this: such pickles are left to it
_BATCH = 1000  # the pickler's APPENDS / SETITEMS batch size
_STRIDED = torch.strided
NUMPY_DTYPES = frozenset(  # the dtypes numpy has too
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    }
)
_BININT1 = pickle.BININT1[0]
_HEAD = pickle.PROTO + bytes((5,))
_ARGUMENTS_START = pickle.MARK + pickle.NEXT_BUFFER
_ARGUMENTS_END = pickle.NEWFALSE + pickle.TUPLE + pickle.MEMOIZE + pickle.REDUCE + pickle.MEMOIZE
_TUPLE1_MEMOIZE = pickle.TUPLE1 + pickle.MEMOIZE
_TUPLE2_MEMOIZE = pickle.TUPLE2 + pickle.MEMOIZE
_TUPLE_OF = (b"", pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)
_pack_q = struct.Struct("<Q").pack
_pack_i = struct.Struct("<i").pack
_pack_h = struct.Struct("<H").pack
_pack_d = struct.Struct(">d").pack


class _NotPlain(Exception):
    pass


class PlainPickles:
    """Writes the pickles of plain answers (see the module).

    Args:
        rebuild: the function a tensor's reduction calls, ``(buffer, dtype, shape, requires_grad) -> tensor``,
            pickled by reference.
    """

    def __init__(self, rebuild: Callable[..., torch.Tensor]):
        self._rebuild = rebuild
        self._rebuild_names = _Global(rebuild.__module__, rebuild.__qualname__)
        self._dtypes: dict[torch.dtype, _Global] = {}

    def dumps(self, obj: Any) -> tuple[bytes, list[memoryview]] | None:
        """The payload and out-of-band buffers of ``obj``, or ``None`` if it is not plain."""
        out = bytearray()
        buffers: list[memoryview] = []
        memo: dict[Any, int] = {}  # id(object) -> its index; (None, index) for objects never looked up
        try:
            self._save(obj, out, buffers, memo)
        except (_NotPlain, RuntimeError, BufferError, UnicodeEncodeError):
            return None
        out += pickle.STOP
        if len(out) >= _FRAME_TARGET:
            return None
        if len(out) < 4:
            return _HEAD + bytes(out), buffers
        return _HEAD + pickle.FRAME + _pack_q(len(out)) + out, buffers

    def _save(self, obj: Any, out: bytearray, buffers: list, memo: dict) -> None:
        kind = type(obj)
        if obj is None:
            out += pickle.NONE
        elif kind is int:
            _save_int(obj, out)
        elif kind is bool:
            out += pickle.NEWTRUE if obj else pickle.NEWFALSE
        elif kind is float:
            out += pickle.BINFLOAT + _pack_d(obj)
        elif id(obj) in memo:
            _get(memo[id(obj)], out)
        elif kind is torch.Tensor:
            self._save_tensor(obj, out, buffers, memo)
        elif kind is StackedSamples:
            self._save_stacked(obj, out, buffers, memo)
        elif kind is str:
            _save_str(obj, out, memo)
        elif kind is tuple:
            if not obj:
                out += pickle.EMPTY_TUPLE
                return
            size = len(obj)
            if size > 3:
                out += pickle.MARK
            for item in obj:
                self._save(item, out, buffers, memo)
            if id(obj) in memo:  # the tuple is inside itself (through a list): the pickler's own dance, left to it
                raise _NotPlain
            out += _TUPLE_OF[size] if size <= 3 else pickle.TUPLE
            _memoize(obj, out, memo)
        elif kind is list:
            out += pickle.EMPTY_LIST
            _memoize(obj, out, memo)
            if len(obj) == 1:
                self._save(obj[0], out, buffers, memo)
                out += pickle.APPEND
                return
            for first in range(0, len(obj), _BATCH):
                out += pickle.MARK
                for item in obj[first : first + _BATCH]:
                    self._save(item, out, buffers, memo)
                out += pickle.APPENDS
        elif kind is dict:
            out += pickle.EMPTY_DICT
            _memoize(obj, out, memo)
            if any(type(key) is not str for key in obj):
                raise _NotPlain
            items = list(obj.items())
            if len(items) == 1:
                self._save(items[0][0], out, buffers, memo)
                self._save(items[0][1], out, buffers, memo)
                out += pickle.SETITEM
                return
            for first in range(0, len(items), _BATCH):
                out += pickle.MARK
                for key, value in items[first : first + _BATCH]:
                    self._save(key, out, buffers, memo)
                    self._save(value, out, buffers, memo)
                out += pickle.SETITEMS
        else:
            raise _NotPlain

    def _save_tensor(self, tensor: torch.Tensor, out: bytearray, buffers: list, memo: dict) -> None:
        if not _is_plain(tensor):
            raise _NotPlain
        buffers.append(pickle.PickleBuffer(tensor.numpy()).raw())  # numpy() refuses conjugate and negative views
        self._save_reduction(tensor, tensor.dtype, tensor.shape, out, buffers, memo)

    def _save_stacked(self, stacked: StackedSamples, out: bytearray, buffers: list, memo: dict) -> None:
        samples = stacked.samples
        first = samples[0]
        if not all(type(sample) is torch.Tensor and _is_plain(sample) for sample in samples):
            raise _NotPlain
        buffers.append(Gathered([pickle.PickleBuffer(sample.numpy()).raw() for sample in samples]))
        self._save_reduction(stacked, first.dtype, (len(samples), *first.shape), out, buffers, memo)

    def _save_reduction(
        self, tensor: Any, dtype: torch.dtype, shape: Sequence[int], out: bytearray, buffers: list, memo: dict
    ) -> None:
        """The opcodes of ``_rebuild(the next buffer, dtype, shape, False)``, memoized as ``tensor``."""
        self._rebuild_names.save(self._rebuild, out, memo)
        out += _ARGUMENTS_START
        names = self._dtypes.get(dtype)
        if names is None:
            names = self._dtypes[dtype] = _Global(dtype.__module__, dtype.__reduce_ex__(pickle.HIGHEST_PROTOCOL))
        names.save(dtype, out, memo)
        rank = len(shape)
        if rank == 2 and shape[0] <= 0xFF and shape[1] <= 0xFF:  # the usual shapes of a batch and of a row
            out += bytes((_BININT1, shape[0], _BININT1, shape[1])) + _TUPLE2_MEMOIZE
            index = len(memo)
            memo[(None, index)] = index
        elif rank == 1 and shape[0] <= 0xFF:
            out += bytes((_BININT1, shape[0])) + _TUPLE1_MEMOIZE
            index = len(memo)
            memo[(None, index)] = index
        else:
            self._save(tuple(shape), out, buffers, {})
            if shape:  # the tuple was memoized (its index is the next one: the memo just used was empty)
                index = len(memo)
                memo[(None, index)] = index
        out += _ARGUMENTS_END
        index = len(memo)
        memo[(None, index)] = index  # the arguments
        memo[id(tensor)] = index + 1


def _is_plain(tensor: torch.Tensor) -> bool:
    return (
        tensor.dtype in NUMPY_DTYPES
        and not tensor.requires_grad
        and tensor.is_cpu
        and tensor.layout is _STRIDED
        and tensor.is_contiguous()
    )


class _Global:
    """A global pickled by reference (its module and name, and the opcodes that name it the first time)."""

    __slots__ = ("module", "name", "opcodes")

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name
        self.opcodes = _str_opcodes(module) + _str_opcodes(name) + pickle.STACK_GLOBAL + pickle.MEMOIZE

    def save(self, obj: Any, out: bytearray, memo: dict) -> None:
        found = memo.get(id(obj))
        if found is not None:
            _get(found, out)
            return
        module, name = id(self.module), id(self.name)
        if module in memo or name in memo:  # a string memoized already: named by its index
            for text in (self.module, self.name):
                if id(text) in memo:
                    _get(memo[id(text)], out)
                else:
                    _save_str(text, out, memo)
            out += pickle.STACK_GLOBAL
            _memoize(obj, out, memo)
            return
        index = len(memo)
        memo[module], memo[name], memo[id(obj)] = index, index + 1, index + 2
        out += self.opcodes


def _memoize(obj: Any, out: bytearray, memo: dict) -> None:
    memo[id(obj)] = len(memo)
    out += pickle.MEMOIZE


def _get(index: int, out: bytearray) -> None:
    out += pickle.BINGET + bytes((index,)) if index < 256 else pickle.LONG_BINGET + struct.pack("<I", index)


def _save_int(value: int, out: bytearray) -> None:
    if 0 <= value <= 0xFF:
        out += pickle.BININT1 + bytes((value,))
    elif 0 <= value <= 0xFFFF:
        out += pickle.BININT2 + _pack_h(value)
    elif -0x80000000 <= value <= 0x7FFFFFFF:
        out += pickle.BININT + _pack_i(value)
    else:
        encoded = pickle.encode_long(value)
        if len(encoded) >= 256:
            raise _NotPlain
        out += pickle.LONG1 + bytes((len(encoded),)) + encoded


def _str_opcodes(text: str) -> bytes:
    """The opcodes of ``text`` and its MEMOIZE."""
    encoded = text.encode("utf-8")  # the pickler's "surrogatepass": a lone surrogate raises here, left to it
    if len(encoded) < 256:
        return pickle.SHORT_BINUNICODE + bytes((len(encoded),)) + encoded + pickle.MEMOIZE
    return pickle.BINUNICODE + struct.pack("<I", len(encoded)) + encoded + pickle.MEMOIZE


def _save_str(text: str, out: bytearray, memo: dict) -> None:
    out += _str_opcodes(text)
    memo[id(text)] = len(memo)
