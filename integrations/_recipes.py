"""Objects described as ``{"class_path": ..., "init_args": {...}}``, the form LightningCLI YAML uses.

Kept apart from :mod:`rpcdl.integrations.lightning` and free of Lightning imports:
workers unpickle :class:`WithNestedObjects` and must not pay for importing Lightning.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset


def import_object(path: str) -> Any:
    """The object a dotted path names: ``"package.module.Name"``."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"class_path must be a dotted path such as 'package.module.Class', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"cannot import {module_name!r} for class_path {path!r}: {exc}") from exc
    try:
        return getattr(module, name)
    except AttributeError:
        raise ImportError(f"module {module_name!r} has no {name!r} (class_path {path!r})") from None


def is_object_spec(value: Any) -> bool:
    """Whether ``value`` is a ``{class_path, init_args}`` mapping."""
    return isinstance(value, dict) and "class_path" in value and set(value) <= {"class_path", "init_args"}


def check_nested(value: Any) -> None:
    """Import the class paths of nested ``{class_path, init_args}`` values now, for early errors."""
    if is_object_spec(value):
        import_object(value["class_path"])
        check_nested(value.get("init_args") or {})
    elif isinstance(value, dict):
        for item in value.values():
            check_nested(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            check_nested(item)


def instantiate(value: Any) -> Any:
    """Build nested ``{class_path, init_args}`` values (transforms, say) into objects."""
    if is_object_spec(value):
        return import_object(value["class_path"])(**instantiate(dict(value.get("init_args") or {})))
    if isinstance(value, dict):
        return {key: instantiate(item) for key, item in value.items()}
    if isinstance(value, list):
        return [instantiate(item) for item in value]
    return value


class WithNestedObjects:
    """A dataset factory whose keyword arguments hold ``{class_path, init_args}`` values built on the worker."""

    def __init__(self, factory: Callable[..., Dataset]):
        self.factory = factory
        self.__qualname__ = getattr(factory, "__qualname__", type(factory).__qualname__)

    def __call__(self, **kwargs: Any) -> Dataset:
        return self.factory(**instantiate(kwargs))


def dataset_recipe(spec: Any, name: str) -> tuple[Callable[..., Dataset], dict[str, Any]] | None:
    """``(factory, kwargs)`` built on the workers for a dataset argument, checked here."""
    if spec is None:
        return None
    if isinstance(spec, str):
        factory, kwargs = import_object(spec), {}
    elif isinstance(spec, dict):
        if not is_object_spec(spec):
            raise ValueError(
                f"{name} must look like {{'class_path': 'package.module.Dataset', 'init_args': {{...}}}}, "
                f"got keys {sorted(spec)}"
            )
        factory = import_object(spec["class_path"])
        kwargs = dict(spec.get("init_args") or {})
    elif callable(spec):
        factory, kwargs = spec, {}
    else:
        raise TypeError(f"{name} must be a class path, a {{class_path, init_args}} mapping or a callable, got {spec!r}")
    if not callable(factory):
        raise TypeError(f"{name}: {factory!r} is not a class or a callable returning a dataset")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        try:
            signature.bind(**kwargs)
        except TypeError as exc:
            label = getattr(factory, "__qualname__", repr(factory))
            raise TypeError(f"{name}: init_args {kwargs} do not fit {label}{signature}: {exc}") from None
    if any(is_object_spec(v) or isinstance(v, (dict, list)) for v in kwargs.values()):
        check_nested(kwargs)
        factory = WithNestedObjects(factory)
    return factory, kwargs
