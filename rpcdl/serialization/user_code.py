"""Which code travels with a call: the user's own modules go by value, installed packages by name.

A class or function of a module that is the user's own (``mydata.py`` beside
the training script, a package of theirs that is not installed; see
:func:`travels_by_value`) is pickled as a reference *and* its code:
:func:`import_or_define` rebuilds it on the worker from the module when the
worker can import it (a shared filesystem, :func:`rpcdl.local_workers`), so
module state and class identity behave as they always did, and from the code
sent along when it cannot. Everything else is imported by name on the worker.

The sender pickles each object's code once (:mod:`rpcdl.serialization.code_cache`), so
the same code arrives again for it; a worker rebuilds it once and keeps it
(the most recent 256), so a rebuilt function keeps its globals between calls
the way an imported module would.

Threading: the decisions are cached in dicts that any thread may fill; two
threads deciding the same module at once reach the same answer. The rebuilt
objects are kept under a lock.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import pickle
import site
import sys
import sysconfig
import threading
import types
from typing import Any

import cloudpickle

_BY_REFERENCE_PACKAGES = frozenset(("rpcdl", "torch", "numpy", "cloudpickle", "tblib"))
_decided: dict[str, bool] = {}  # module name -> whether it is the user's own
_not_importable: set[str] = set()  # module names this process failed to import
_MAX_REBUILT = 256
_rebuilt: dict[bytes, Any] = {}  # code received -> the object rebuilt from it, oldest first
_rebuilt_lock = threading.Lock()


@functools.cache
def _installed_roots() -> tuple[str, ...]:
    """Folders whose modules are installed: the standard library and site-packages."""
    roots = {sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update([*site.getsitepackages(), site.getusersitepackages()])
    return tuple(sorted({os.path.join(os.path.realpath(root), "") for root in roots if root}))


@functools.cache
def _installed_top_level_names() -> frozenset[str]:
    """Top-level import names of the installed distributions, editable installs included."""
    names = set()
    for distribution in importlib.metadata.distributions():
        declared = distribution.read_text("top_level.txt") or ""
        names.update(line.strip() for line in declared.splitlines() if line.strip())
        name = distribution.metadata["Name"] or ""
        names.add(name.lower().replace("-", "_").replace(".", "_"))
    return frozenset(names)


def travels_by_value(module: types.ModuleType) -> bool:
    """Whether ``module`` is the user's own, so that its code travels with the calls that use it.

    A module is the user's own when its file lies outside the standard library
    and every site-packages folder, and its top-level name is no installed
    distribution's. Built-in modules, the standard library, installed packages
    (editable installs included) and rpcdl itself are imported by name on the
    worker, so they must be installed there. ``__main__`` is left to
    cloudpickle, which pickles it by value already.

    Args:
        module: an imported module.

    Returns:
        whether its functions and classes carry their code.

    Example::

        >>> import json
        >>> travels_by_value(json)
        False
    """
    name = module.__name__
    path = getattr(module, "__file__", None)
    if name == "__main__" or name.partition(".")[0] in _BY_REFERENCE_PACKAGES or not isinstance(path, str):
        return False
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts or path.startswith(_installed_roots()):
        return False
    return name.partition(".")[0] not in _installed_top_level_names()


def is_users_module(module_name: Any) -> bool:
    """Whether the module named ``module_name`` is imported here and the user's own (cached).

    The first time it is, cloudpickle is told to pickle it by value.

    Args:
        module_name: a module's ``__name__`` (anything else is not a user's module).

    Returns:
        whether the module's code travels with the calls that use it.

    Example::

        >>> is_users_module("torch.utils.data")
        False
    """
    decided = _decided.get(module_name) if isinstance(module_name, str) else False
    if decided is not None:
        return decided
    module = sys.modules.get(module_name)
    if module is None:  # rebuilt here from code that came by value: cloudpickle sends it by value again
        return False
    decided = travels_by_value(module)
    if decided:
        cloudpickle.register_pickle_by_value(module)
    _decided[module_name] = decided
    return decided


def lookup(module_name: str, qualname: str) -> Any:
    """Return the object named ``qualname`` in the imported module ``module_name``, or ``None``.

    Args:
        module_name: the module, which is not imported by this.
        qualname: a dotted qualified name in it (``""`` for the module itself).

    Returns:
        the object, or ``None`` if the module is not imported or has no such name.

    Example::

        >>> import os.path
        >>> lookup("os.path", "join") is os.path.join
        True
    """
    found: Any = sys.modules.get(module_name)
    for part in qualname.split(".") if qualname else ():
        found = getattr(found, part, None)
    return found


def _import_here(module_name: str) -> types.ModuleType | None:
    module = sys.modules.get(module_name)
    if module is not None or module_name in _not_importable:
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing != module_name and not module_name.startswith(missing + "."):
            raise  # the module is here but needs a package that is not installed: say so
        _not_importable.add(module_name)
        return None


def import_or_define(module_name: str, qualname: str, code: bytes | str) -> Any:
    """Rebuild a class, function or module of the user's: by name if its module imports here, else from ``code``.

    Args:
        module_name: the module the object comes from.
        qualname: its qualified name in that module (``""`` for the module itself).
        code: the object pickled by value, or why it could not be.

    Returns:
        the object.

    Raises:
        ModuleNotFoundError: the module does not import here and its code could not be sent.

    Example::

        >>> import json
        >>> import_or_define("json", "dumps", b"") is json.dumps  # imports here: taken by name
        True
    """
    if _import_here(module_name) is not None:
        found = lookup(module_name, qualname)
        if found is not None:
            return found
    if isinstance(code, str):
        raise ModuleNotFoundError(
            f"No module named {module_name!r} here, and the code of {qualname or module_name} could not travel "
            f"with the call ({code}): install {module_name} where the workers can import it, or keep what cannot be "
            "pickled out of that module's globals",
            name=module_name,
        )
    return define(code)


def define(code: bytes) -> Any:
    """Rebuild an object from its code pickled by value, once: the same code gives the same object again.

    The code of the user's modules and of frozen functions
    (:mod:`rpcdl.serialization.code_cache`) arrives the same for every call that uses it;
    the most recent 256 objects rebuilt are kept.

    Args:
        code: the object pickled by value.

    Returns:
        the object.

    Example::

        >>> define(pickle.dumps(len)) is len
        True
    """
    with _rebuilt_lock:
        found = _rebuilt.get(code)
    if found is None:
        found = pickle.loads(code)
        with _rebuilt_lock:
            _rebuilt[code] = found
            while len(_rebuilt) > _MAX_REBUILT:
                del _rebuilt[next(iter(_rebuilt))]
    return found
