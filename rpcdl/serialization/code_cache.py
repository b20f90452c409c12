"""The sender's cache of code pickled by value: each object's code is pickled once, not once per call.

Two kinds of objects have their code pickled by value and kept here, weakly
keyed by the object:

* a class or function of the user's own module (:mod:`rpcdl.serialization.user_code`):
  its code is pickled at first send and kept for as long as the object lives;
* a function that cloudpickle pickles by value (a lambda, a nested function,
  a function of ``__main__``), when it is *frozen*, by this rule:

  - its code neither rebinds a global (``global x; x = ...``) nor a variable
    it captured (``nonlocal x; x = ...``): on the worker the rebuilt
    function is kept and reused (:func:`rpcdl.serialization.user_code.define`), so such
    writes would carry over from call to call;
  - every value it captures (closure cells) and every global it names, its
    defaults and its attributes are immutable: ``None``, ``bool``, ``int``,
    ``float``, ``complex``, ``str``, ``bytes``, ``range``, tuples and
    frozensets of those, modules, classes and functions imported by name
    (their code is the worker's own, or that of the user's module), or
    another frozen function.

  A frozen function's cached pickle is used again only while each of those
  values is still the very object it was at first send (a global or cell
  rebound since is pickled anew); any other function is pickled at every
  call, as before. So a captured list, dict or tensor, or a class defined in
  ``__main__``, always travels with its current contents.

  A worker keeps the function it rebuilt, as it keeps an imported module's:
  what the function stores on itself there (an attribute) stays on that
  worker from call to call, and never reaches the caller's copy.

Threading: any thread may pickle; the cache is written under a lock (read without), and an
object pickled by two threads at once is pickled twice, the same way.
"""

from __future__ import annotations

import dis
import functools
import itertools
import operator
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

from .user_code import lookup

_FROZEN_SCALARS = frozenset(
    (type(None), bool, int, float, complex, str, bytes, range, type(Ellipsis), type(NotImplemented))
)
_ABSENT = object()  # a global not (yet) defined, an empty cell
_ITSELF = object()  # the function refers to itself: not kept, so that the cache does not keep it alive
_REBINDING = frozenset(("STORE_GLOBAL", "DELETE_GLOBAL"))
_REBINDING_CAPTURED = frozenset(("STORE_DEREF", "DELETE_DEREF"))


class _Entry:
    __slots__ = ("code", "functions", "values")

    def __init__(self, code: bytes | str, values: tuple | None, functions: tuple) -> None:
        self.code = code  # the object pickled by value, or why it cannot be
        self.values = values  # what the code froze, compared by identity; None: nothing to compare
        self.functions = functions  # frozen functions among the values, themselves checked


_entries: weakref.WeakKeyDictionary[Any, _Entry] = weakref.WeakKeyDictionary()
_entries_lock = threading.Lock()
_pickling = threading.local()  # .functions: those this thread is pickling now (mutual recursion)


def code_of(obj: Any, pickle_by_value: Callable[[Any], bytes]) -> bytes | str:
    """Return ``obj`` pickled by value as first sent from this process, or why it cannot be.

    For a class or function of the user's own module, whose code is kept for
    as long as the object lives.

    Args:
        obj: the class, function or module.
        pickle_by_value: pickles ``obj`` with its code (about a millisecond).

    Returns:
        the pickle, or the text of the error that pickling it raised (a lock
        in the module's globals, say): then it travels by name only.

    Example::

        >>> import pickle
        >>> code_of(len, pickle.dumps) == pickle.dumps(len)
        True
    """
    with _entries_lock:
        entry = _entries.get(obj)
    if entry is None:
        try:
            code: bytes | str = pickle_by_value(obj)
        except Exception as exc:
            code = f"{type(exc).__name__}: {exc}"
        entry = _Entry(code, None, ())
        with _entries_lock:
            _entries[obj] = entry
    return entry.code


def frozen_function_code(function: types.FunctionType, pickle_by_value: Callable[[Any], bytes]) -> bytes | None:
    """Return the cached by-value pickle of ``function`` if it is frozen (see the module's rule), else ``None``.

    The first call pickles it; later ones return the same bytes for as long
    as what it captured and names is unchanged.

    Args:
        function: a function that cloudpickle pickles by value.
        pickle_by_value: pickles ``function`` with its code and what it refers to.

    Returns:
        the pickle, or ``None``: pickle ``function`` as part of the message, as usual.

    Example::

        >>> import cloudpickle
        >>> square = lambda x: x * x
        >>> first = frozen_function_code(square, cloudpickle.dumps)
        >>> frozen_function_code(square, cloudpickle.dumps) is first
        True
    """
    in_progress = getattr(_pickling, "functions", None)
    if in_progress is None:
        in_progress = _pickling.functions = set()
    if function in in_progress:
        return None
    entry = _still_frozen(function, None)
    if entry is not None:
        return entry.code
    values = _values(function)
    if values is None or not _all_frozen(values, {function}):
        return None
    in_progress.add(function)
    try:
        code = pickle_by_value(function)
    finally:
        in_progress.discard(function)
    functions = tuple(value for value in values if type(value) is types.FunctionType and not found_by_name(value))
    with _entries_lock:
        _entries[function] = _Entry(code, values, functions)
    return code


@functools.lru_cache(maxsize=4096)
def _code_facts(code: types.CodeType) -> tuple[tuple[str, ...], bool]:
    """The global names ``code`` (nested code included) may read; whether it rebinds a global or a captured one."""
    names: set[str] = set()
    rebinds = False
    captured = set(code.co_freevars)
    pending = [code]
    while pending:
        current = pending.pop()
        names.update(current.co_names)
        for instruction in dis.get_instructions(current):
            if instruction.opname in _REBINDING or (
                instruction.opname in _REBINDING_CAPTURED and instruction.argval in captured
            ):
                rebinds = True
        pending.extend(const for const in current.co_consts if isinstance(const, types.CodeType))
    return tuple(sorted(names)), rebinds


def _values(function: types.FunctionType) -> tuple | None:
    """What a by-value pickle of ``function`` freezes, in a fixed order; ``None`` if its code rebinds any."""
    names, rebinds = _code_facts(function.__code__)
    if rebinds:
        return None
    found: list[Any] = [function.__code__, function.__defaults__]
    if names:
        found.extend(map(function.__globals__.get, names, itertools.repeat(_ABSENT, len(names))))
    if function.__closure__:
        for cell in function.__closure__:
            try:
                found.append(cell.cell_contents)
            except ValueError:
                found.append(_ABSENT)
    for mapping in (function.__kwdefaults__, function.__dict__):
        if mapping:
            for key, value in mapping.items():
                found += (key, value)
    if len(found) > 2 and id(function) in map(id, found):  # beyond its code and defaults
        return tuple(_ITSELF if value is function else value for value in found)
    return tuple(found)


def cached_frozen_code(function: types.FunctionType) -> bytes | None:
    """The pickle :func:`frozen_function_code` made of ``function`` if it is still frozen, else ``None``.

    Pickles nothing: for a function not cached yet (or no longer frozen) it
    returns ``None`` and the caller goes the usual way. It lets a pickler reuse
    the bytes without first deciding again how ``function`` travels.

    Example::

        >>> import cloudpickle
        >>> cube = lambda x: x**3
        >>> cached_frozen_code(cube) is None  # not pickled yet
        True
        >>> code = frozen_function_code(cube, cloudpickle.dumps)
        >>> cached_frozen_code(cube) is code
        True
    """
    entry = _still_frozen(function, None)
    return None if entry is None else entry.code


def _still_frozen(function: types.FunctionType, checked: set | None) -> _Entry | None:
    """The cached entry of ``function`` if its frozen values are all the same objects still, else ``None``."""
    entry = _entries.get(function)  # a read: no lock needed
    if entry is None or entry.values is None:
        return None
    current = _values(function)
    if current is None or len(current) != len(entry.values) or not all(map(operator.is_, current, entry.values)):
        return None
    if entry.functions:
        checked = set() if checked is None else checked
        checked.add(function)
        if not all(other in checked or _still_frozen(other, checked) is not None for other in entry.functions):
            return None
    return entry


def _all_frozen(values: tuple, seen: set) -> bool:
    return all(_frozen(value, seen) for value in values[1:])  # values[0] is the code itself


def _frozen(value: Any, seen: set) -> bool:
    """Whether ``value`` cannot change without being rebound (see the module's rule)."""
    kind = type(value)
    if kind in _FROZEN_SCALARS or value is _ABSENT or value is _ITSELF:
        return True
    if kind is tuple or kind is frozenset:
        return all(_frozen(item, seen) for item in value)
    if kind is types.ModuleType:
        return value.__name__ != "__main__"
    if kind is types.FunctionType:
        if found_by_name(value) or value in seen:
            return True
        seen.add(value)
        values = _values(value)
        return values is not None and _all_frozen(values, seen)
    if kind is types.BuiltinFunctionType or isinstance(value, type):
        return found_by_name(value)
    return False


def found_by_name(obj: Any) -> bool:
    """Whether ``obj`` is found by its module and qualified name: it is pickled by reference (or as user code).

    Args:
        obj: a function, class or builtin.

    Returns:
        ``False`` for lambdas, nested functions and everything of ``__main__``.

    Example::

        >>> found_by_name(len), found_by_name(lambda: 0)
        (True, False)
    """
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str) or module_name == "__main__":
        return False
    try:
        return lookup(module_name, qualname) is obj
    except Exception:
        return False
