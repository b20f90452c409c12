"""Objects to ``(payload, buffers)`` and back.

Pickle protocol 5 through cloudpickle, so lambdas, closures and functions of
``__main__`` travel by value, and the code of the user's own modules travels
with them (:mod:`rpcdl.serialization.user_code`): a worker needs only the installed packages.
Code that goes by value is pickled once per object while what it captured is
unchanged (:mod:`rpcdl.serialization.code_cache`), and rebuilt once on the worker.
Tensors and numpy arrays leave their bytes out of the payload as out-of-band
buffers: the wire layer sends them from their own memory and receives them
into preallocated memory, which becomes the tensor.
Exceptions travel as reports that rebuild them on the other side with their
type, their traceback and the worker they came from.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import sys
import threading
import traceback
import types
from collections.abc import Iterable, Iterator
from typing import Any

import cloudpickle
import numpy as np
import tblib
import torch

from ..errors import RemoteError
from ..transport.context import SEGMENT, thread_context
from .code_cache import cached_frozen_code, code_of, found_by_name, frozen_function_code
from .plain_pickle import NUMPY_DTYPES, PlainPickles
from .stacked import StackedSamples
from .user_code import define, import_or_define, is_users_module, lookup

PROTOCOL = 5


_UINT8 = np.dtype(np.uint8)
# A received buffer of these dtypes is viewed and shaped in numpy before torch takes it: fewer calls than
# torch's own view and reshape, for every tensor of every answer.
_NUMPY_OF = {dtype: torch.empty(0, dtype=dtype).numpy().dtype for dtype in NUMPY_DTYPES}


def _rebuild_tensor(buffer: Any, dtype: torch.dtype, shape: tuple[int, ...], requires_grad: bool) -> torch.Tensor:
    as_numpy = _NUMPY_OF.get(dtype)
    if as_numpy is not None and type(buffer) is np.ndarray and buffer.dtype is _UINT8 and buffer.size:
        tensor = torch.from_numpy(buffer.view(as_numpy).reshape(shape))  # a received buffer (flat, contiguous)
    elif not memoryview(buffer).nbytes:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        flat = (
            torch.from_numpy(buffer) if isinstance(buffer, np.ndarray) else torch.frombuffer(buffer, dtype=torch.uint8)
        )
        tensor = flat.view(dtype).view(shape)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def _reduce_tensor(tensor: torch.Tensor):
    if tensor.layout != torch.strided or tensor.device.type != "cpu" or tensor.is_quantized:
        return None
    data = tensor.detach().contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy()
    return _rebuild_tensor, (pickle.PickleBuffer(raw), data.dtype, tuple(data.shape), tensor.requires_grad)


_DYNAMIC_CODE = "<dynamic-code>"  # the file name cloudpickle >= 3.1.3 gives the code objects it pickles


class _Pickler(cloudpickle.Pickler):
    _outermost = True  # False in the pickler of a user's object's code, which pickles all of it by value
    _by_value: Any = None  # the function this pickler pickles by value for the cache

    def reducer_override(self, obj):
        kind = type(obj)
        if kind is torch.Tensor or kind is StackedSamples:
            reduced = _reduce_tensor(obj if kind is torch.Tensor else obj.stack())
            return NotImplemented if reduced is None else reduced
        if kind is types.CodeType:
            return self._reduce_code(obj)
        if kind is types.FunctionType or kind is types.ModuleType or isinstance(obj, type):
            if self._outermost:
                known = _found_by_name.get(id(obj))
                if known is not None and known[1].get(known[2]) is obj:
                    return known[3]
                if kind is types.FunctionType and obj is not self._by_value:
                    code = cached_frozen_code(obj)  # a function of __main__, a lambda: as frozen as when cached
                    if code is not None:
                        return define, (code,)
            return self._reduce_named(obj, kind)
        return NotImplemented  # as cloudpickle's for anything but classes and functions

    def _reduce_code(self, code: types.CodeType) -> Any:
        """cloudpickle's reduction of ``code``, its file name kept: cloudpickle 3.1.3 writes ``<dynamic-code>``
        instead, and a remote traceback would name no file and show no line of a function sent by value."""
        rebuild, args = self.dispatch_table[types.CodeType](code)
        if code.co_filename != _DYNAMIC_CODE and _DYNAMIC_CODE in args:
            args = tuple(code.co_filename if arg == _DYNAMIC_CODE else arg for arg in args)
        return rebuild, args

    def _reduce_named(self, obj: Any, kind: type) -> Any:
        """The reduction of a class, function or module; remembered when it is found by name."""
        if kind is types.ModuleType:
            module_name, qualname = obj.__name__, ""
        else:
            module_name, qualname = obj.__module__, obj.__qualname__
        if is_users_module(module_name) and self._outermost and lookup(module_name, qualname) is obj:
            reduced = import_or_define, (module_name, qualname, code_of(obj, _pickle_code))
        else:
            if kind is types.FunctionType and self._outermost and obj is not self._by_value:
                code = None if found_by_name(obj) else frozen_function_code(obj, _pickle_function)
                if code is not None:
                    return define, (code,)
            reduced = super().reducer_override(obj)
            if reduced is not NotImplemented:  # pickled by value (or as a builtin type): decided anew each time
                return reduced
        if self._outermost:
            _remember_found_by_name(obj, module_name, qualname, reduced)
        return reduced


# id(obj) -> (obj, where its name is found, the name, its reduction), for functions, classes and modules pickled by
# reference (or as a user's module's code) and found by their name at the top of their module (or in sys.modules):
# their reduction never changes while the name is theirs
_found_by_name: dict[int, tuple[Any, dict, str, Any]] = {}
_MAX_FOUND_BY_NAME = 4096
_by_value_modules_seen: set[str] = cloudpickle.list_registry_pickle_by_value()  # modules registered by value


def _remember_found_by_name(obj: Any, module_name: Any, qualname: Any, reduced: Any) -> None:
    if not isinstance(module_name, str) or not isinstance(qualname, str) or "." in qualname:
        return
    if qualname:
        module = sys.modules.get(module_name)
        holder, name = getattr(module, "__dict__", None), qualname
    else:
        holder, name = sys.modules, module_name
    if isinstance(holder, dict) and holder.get(name) is obj and len(_found_by_name) < _MAX_FOUND_BY_NAME:
        _found_by_name[id(obj)] = (obj, holder, name, reduced)


def _forget_if_registrations_changed() -> None:
    """Forget the remembered reductions once a module is (un)registered with cloudpickle to go by value."""
    global _by_value_modules_seen
    registered = cloudpickle.list_registry_pickle_by_value()
    if registered != _by_value_modules_seen:
        _by_value_modules_seen = registered
        _found_by_name.clear()


class _CodePickler(_Pickler):
    _outermost = False


def _pickle_code(obj: Any) -> bytes:
    """``obj`` of a user's module pickled by value with what it refers to (see :mod:`.code_cache`)."""
    stream = io.BytesIO()
    _CodePickler(stream, protocol=PROTOCOL).dump(obj)
    return stream.getvalue()


def _pickle_function(function: types.FunctionType) -> bytes:
    """A function that cloudpickle pickles by value, pickled alone (see :mod:`rpcdl.serialization.code_cache`).

    What it refers to is pickled as in a message: the user's modules as
    their code, other frozen functions as their own cached pickles.
    """
    stream = io.BytesIO()
    pickler = _Pickler(stream, protocol=PROTOCOL)
    pickler._by_value = function
    pickler.dump(function)
    return stream.getvalue()


_PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes})  # pickled alike by pickle itself


class _ReusedPickler:
    """A thread's pickler for :func:`dumps`, kept between messages: making one costs as much as a small message."""

    def __init__(self) -> None:
        self.stream = io.BytesIO()
        self.buffers: list[memoryview] = []
        self.pickler = _Pickler(self.stream, protocol=PROTOCOL, buffer_callback=lambda b: self.buffers.append(b.raw()))
        self.busy = False


_picklers = threading.local()


def dumps(obj: Any) -> tuple[bytes, list[memoryview]]:
    """Serialize ``obj`` into a pickle payload and its out-of-band buffers.

    Returns:
        ``(payload, buffers)``: the buffers are views of the original memory,
        so the objects must not change until they have been sent.
    """
    if type(obj) in _PLAIN:
        return pickle.dumps(obj, protocol=PROTOCOL), []
    reused = getattr(_picklers, "pickler", None)
    if reused is None:
        reused = _picklers.pickler = _ReusedPickler()
    elif reused.busy:  # called while pickling (a reducer pickles something apart): a pickler of its own
        reused = _ReusedPickler()
    reused.busy = True
    _forget_if_registrations_changed()
    try:
        reused.pickler.dump(obj)
        return reused.stream.getvalue(), reused.buffers
    finally:  # nothing of this message stays referenced
        reused.pickler.clear_memo()
        reused.pickler.globals_ref = {}
        reused.stream.seek(0)
        reused.stream.truncate()
        reused.buffers = []
        reused.busy = False


_plain_pickles = PlainPickles(_rebuild_tensor)
_MAYBE_PLAIN = frozenset({torch.Tensor, StackedSamples, tuple, list, dict})
_NONE_PAYLOAD = pickle.dumps(None, protocol=PROTOCOL)


_ATOMS = frozenset({type(None), bool, int, float, str, bytes})  # the pickler writes them without a reducer
_CONTAINERS = frozenset({tuple, list, dict})
_ATOMS_OR_CONTAINERS = _ATOMS | _CONTAINERS
_CONTAINERS_DEEP = 3  # how deep :func:`_atoms_only` looks


def _atoms_only(obj: tuple | list | dict, depth: int = _CONTAINERS_DEEP) -> bool:
    """Whether the container ``obj`` holds numbers, strings, bytes and ``None``, in containers ``depth`` deep.

    The pickler writes such an object in C without calling back into Python
    (its reducer is asked only for other types), so :func:`pickle.dumps`
    writes the bytes :func:`dumps` would, faster than the plain writer.
    """
    items = [*obj, *obj.values()] if type(obj) is dict else obj
    kinds = set(map(type, items))  # one pass in C
    if kinds <= _ATOMS:
        return True
    if depth == 0 or not kinds <= _ATOMS_OR_CONTAINERS:
        return False
    containers = _CONTAINERS
    return all(_atoms_only(item, depth - 1) for item in items if type(item) in containers)


def dumps_answer(obj: Any) -> tuple[bytes, list[memoryview]]:
    """:func:`dumps` for a call's answer: the same bytes, written directly when the answer is plain
    (tensors, and tuples, lists and dicts of them and of numbers: see :mod:`rpcdl.serialization.plain_pickle`),
    or by :func:`pickle.dumps` when it holds no tensor (numbers and strings in containers: a chunk's values).

    Example::

        >>> dumps_answer(([1, 2], 0.5, 16)) == dumps(([1, 2], 0.5, 16))
        True
    """
    if obj is None:  # a call run for its effect, or whose result stays on the worker under an RRef
        return _NONE_PAYLOAD, []
    kind = type(obj)
    if kind in _MAYBE_PLAIN:
        if kind in _CONTAINERS and _atoms_only(obj):
            return pickle.dumps(obj, protocol=PROTOCOL), []
        written = _plain_pickles.dumps(obj)
        if written is not None:
            return written
    return dumps(obj)


def loads(payload: bytes | bytearray | memoryview, buffers: Iterable[Any] = ()) -> Any:
    """Rebuild an object from :func:`dumps`'s payload and (received) buffers."""
    return pickle.loads(payload, buffers=buffers)


def dumps_inline(obj: Any) -> bytes:
    """Serialize ``obj`` into one bytes object, buffers included (for storage)."""
    stream = io.BytesIO()
    _Pickler(stream, protocol=PROTOCOL).dump(obj)
    return stream.getvalue()


# ---------------------------------------------------------------------------- peer context

_context = thread_context  # (peer, local_store, connection, segment): see rpcdl.transport.context


@contextlib.contextmanager
def peer_context(peer: str, local_store: Any = None, connection: Any = None) -> Iterator[None]:
    """Tell objects being (un)pickled in this thread whom the message is for or from.

    Args:
        peer: the address of the other side, as this process names it.
        local_store: the RRef store of this process when it is a worker.
        connection: the client connection carrying the message, if any.

    Example::

        >>> with peer_context("127.0.0.1:6543"):
        ...     current_peer()
        ('127.0.0.1:6543', None)
    """
    previous = _context.value
    _context.value = (peer, local_store, connection, previous[SEGMENT])
    try:
        yield
    finally:
        _context.value = previous


def dumps_for(peer: str, obj: Any) -> tuple[bytes, list[memoryview]]:
    """:func:`dumps` under ``peer_context(peer)``, without making a context manager per message."""
    context = _context
    previous = context.value
    context.value = (peer, None, None, previous[SEGMENT])
    try:
        return dumps(obj)
    finally:
        context.value = previous


def loads_from(peer: str, connection: Any, payload: Any, buffers: Iterable[Any]) -> Any:
    """:func:`loads` under ``peer_context(peer, None, connection)``, without making a context manager."""
    context = _context
    previous = context.value
    context.value = (peer, None, connection, previous[SEGMENT])
    try:
        return pickle.loads(payload, buffers=buffers)
    finally:
        context.value = previous


def current_peer() -> tuple[str | None, Any]:
    """Return ``(peer, local_store)`` of the message being (un)pickled, or ``(None, None)``."""
    return _context.value[:2]


def current_connection() -> Any:
    """Return the client connection carrying the message being unpickled, or ``None``."""
    return _context.value[2]


# ---------------------------------------------------------------------------- exceptions


def _user_traceback(exc: BaseException):
    """Drop the leading frames that belong to rpcdl's own call machinery."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("rpcdl.") and tb.tb_next:
        tb = tb.tb_next
    return tb


def _rebuilt_traceback(frames: dict[str, Any]) -> types.TracebackType | None:
    """A traceback of the remote frames ``frames`` describe (``tblib``'s dict), as ``tblib`` rebuilds
    them, but from a stub whose code has no column positions: the local source line of a remote
    frame would otherwise get carets (``^^^^``) under the columns of the stub's own instruction."""
    stub = _without_columns(compile("raise __rpcdl_remote_frame", "<string>", "exec"))
    current = tblib.Traceback.from_dict(frames)
    top = last = None
    while current:
        code = current.tb_frame.f_code
        stand_in = stub.replace(co_firstlineno=current.tb_lineno, co_filename=code.co_filename, co_name=code.co_name)
        try:
            exec(stand_in, dict(current.tb_frame.f_globals), {})  # raises NameError: a frame at that line
        except NameError:
            made = sys.exc_info()[2].tb_next
            if last is None:
                top = made
            else:
                last.tb_next = made
            last = made
            del made
        current = current.tb_next
    return top


def _without_columns(code: types.CodeType) -> types.CodeType:
    """``code`` with the same lines and no column positions (Python 3.11+ location table; before, none)."""
    if sys.version_info < (3, 11):
        return code
    table, out, at = code.co_linetable, bytearray(), 0
    while at < len(table):
        first = table[at]
        at += 1
        kind = (first >> 3) & 15
        if kind == 15:  # no location at all
            out.append(first)
            continue
        if kind < 10:  # short form: same line, one byte of columns
            delta, at = 0, at + 1
        elif kind < 13:  # one-line form: line delta in the kind, two bytes of columns
            delta, at = kind - 10, at + 2
        else:  # 13: no columns, 14: long form; both start with the line delta
            delta, at = _read_signed(table, at)
            for _ in range(3 if kind == 14 else 0):  # end line, column, end column
                _, at = _read_unsigned(table, at)
        out.append(0x80 | 13 << 3 | (first & 7))
        out += _signed(delta)
    return code.replace(co_linetable=bytes(out))


def _read_unsigned(table: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = table[at]
        at += 1
        value |= (byte & 63) << shift
        shift += 6
        if not byte & 64:
            return value, at


def _read_signed(table: bytes, at: int) -> tuple[int, int]:
    value, at = _read_unsigned(table, at)
    return (-(value >> 1) if value & 1 else value >> 1), at


def _signed(value: int) -> bytes:
    unsigned = (-value << 1) | 1 if value < 0 else value << 1
    out = bytearray()
    while unsigned >= 64:
        out.append(64 | (unsigned & 63))
        unsigned >>= 6
    out.append(unsigned)
    return bytes(out)


def dump_exception(exc: BaseException) -> bytes:
    """Serialize ``exc`` as a report that :func:`load_exception` turns back into it."""
    tb = _user_traceback(exc)
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    report: dict[str, Any] = {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "traceback": text,
        "frames": None,
        "exception": None,
    }
    try:
        report["frames"] = tblib.Traceback(tb).as_dict() if tb is not None else None
    except Exception:
        pass
    try:
        report["exception"] = cloudpickle.dumps(exc.with_traceback(None), protocol=PROTOCOL)
    except Exception:
        pass
    finally:
        exc.with_traceback(tb)
    return pickle.dumps(report, protocol=PROTOCOL)


def load_exception(payload: bytes | bytearray, worker: str) -> BaseException:
    """Rebuild the exception of a report from :func:`dump_exception`.

    The exception keeps its own type when that type can be unpickled here,
    otherwise it becomes a :class:`~rpcdl.errors.RemoteError`. Either way it
    carries ``rpcdl_worker`` (the worker's address), ``remote_traceback`` (the
    traceback as formatted on the worker) and a note naming the worker.
    """
    report = pickle.loads(payload)
    exc: BaseException | None = None
    if report["exception"] is not None:
        try:
            exc = pickle.loads(report["exception"])
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RemoteError(report["type"], report["message"], report["traceback"])
    exc.rpcdl_worker = worker
    exc.remote_traceback = report["traceback"]
    note = f"raised on rpcdl worker {worker}"
    if report["frames"] is not None:
        try:
            exc = exc.with_traceback(_rebuilt_traceback(report["frames"]))
        except Exception:
            note += "; remote traceback:\n" + report["traceback"]
    exc.add_note(note)
    return exc
