"""A definition: an object pickled so that every process with the same code pickles it to the same bytes.

A worker shares one dataset among the trainers that send it the same
definition (see ``RRefStore.share`` in ``rpcdl.rpc.rref``), so the bytes must
not depend on the process that pickled them. A message's pickle does:
cloudpickle gives each class it pickles by value (one of ``__main__``, or of
a user's own module, see :mod:`rpcdl.serialization.user_code`) an id drawn at
random in each process. Here such a class, and such a function found by its
name, is pickled as its module, its name and a digest of its module's
source file instead: the same file gives the same bytes, an edited one other
bytes. Everything else is pickled as in a message (lambdas by value,
installed code by name, values as they are).

A definition is a key, never unpickled: it names code without carrying it.
Values that pickle differently from process to process (a set of strings,
whose order follows the hash seed) make different definitions: then nothing
is shared, which is safe.

Threading: any thread may pickle; the digests of source files are cached in
a dict that any thread may fill (two threads reading one file reach the same
digest).
"""

from __future__ import annotations

import hashlib
import io
import sys
import types
from typing import Any

import cloudpickle

from .user_code import is_users_module, lookup

_digests: dict[str, bytes | None] = {}  # module name -> digest of its source file as first read here


def pickle_definition(obj: Any) -> bytes:
    """Pickle ``obj`` to the same bytes in every process that has the same code (see the module).

    Args:
        obj: the definition, e.g. ``(dataset_class, args, kwargs)``.

    Returns:
        the bytes; equal for two processes whose user code has the same source files.

    Raises:
        TypeError, pickle.PicklingError: a part of ``obj`` does not pickle.

    Example::

        >>> pickle_definition((len, (1,), {})) == pickle_definition((len, (1,), {}))
        True
    """
    stream = io.BytesIO()
    _DefinitionPickler(stream, protocol=5).dump(obj)
    return stream.getvalue()


def _named_in_source(module_name: str, qualname: str, digest: bytes) -> Any:
    """Stands for a class or function in a definition, which is never unpickled."""
    raise TypeError(f"a definition naming {module_name}.{qualname} is a key, and is not unpickled")


class _DefinitionPickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type) or type(obj) is types.FunctionType:
            named = _by_source(obj)
            if named is not None:
                return named
        return super().reducer_override(obj)


def _by_source(obj: Any) -> tuple | None:
    """``obj`` as its module, name and source digest, if it is the user's code found by its name."""
    module_name, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    if module_name != "__main__" and not is_users_module(module_name):
        return None
    if lookup(module_name, qualname) is not obj:
        return None
    digest = _source_digest(module_name)
    return None if digest is None else (_named_in_source, (module_name, qualname, digest))


def _source_digest(module_name: str) -> bytes | None:
    """A digest of the source file of the module ``module_name`` as first read, or ``None`` without one."""
    if module_name in _digests:
        return _digests[module_name]
    path = getattr(sys.modules.get(module_name), "__file__", None)
    digest = None
    if isinstance(path, str):
        try:
            with open(path, "rb") as source:
                digest = hashlib.sha256(source.read()).digest()
        except OSError:
            digest = None
    _digests[module_name] = digest
    return digest
