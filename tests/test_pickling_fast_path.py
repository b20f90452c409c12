"""The pickler remembers how a function, class or module found by name is reduced, and forgets it when that no
longer holds: the name is rebound, or its module is registered with cloudpickle to travel by value."""

from __future__ import annotations

import sys
import types

import cloudpickle
import pytest

from rpcdl.serialization import pickling
from rpcdl.serialization.pickling import dumps, loads


@pytest.fixture
def module():
    """A module imported by name (no file: not the user's own), with a function and a class."""
    made = types.ModuleType("rpcdl_fast_path_module")
    exec("def double(x):\n    return 2 * x\n\nclass Box:\n    pass\n", made.__dict__)
    sys.modules[made.__name__] = made
    try:
        yield made
    finally:
        del sys.modules[made.__name__]
        pickling._found_by_name.pop(id(made.double), None)
        pickling._found_by_name.pop(id(made.Box), None)


def test_a_function_and_a_class_found_by_name_are_remembered_and_travel_by_reference(module):
    payload, _ = dumps((module.double, module.Box, (3,), {}))
    assert id(module.double) in pickling._found_by_name and id(module.Box) in pickling._found_by_name
    again, _ = dumps((module.double, module.Box, (3,), {}))
    assert again == payload
    function, cls, args, _ = loads(again)
    assert function is module.double and cls is module.Box and function(*args) == 6


def test_a_function_whose_name_was_rebound_travels_by_value_again(module):
    original = module.double
    dumps((original,))
    module.double = lambda x: -x  # the name is no longer the original's
    rebuilt = loads(dumps((original,))[0])[0]
    assert rebuilt is not module.double and rebuilt is not original
    assert rebuilt(4) == 8


def test_registering_a_module_to_travel_by_value_is_seen_by_the_next_message(module):
    dumps((module.double,))
    assert loads(dumps((module.double,))[0])[0] is module.double
    cloudpickle.register_pickle_by_value(module)
    try:
        rebuilt = loads(dumps((module.double,))[0])[0]
        assert rebuilt is not module.double and rebuilt(5) == 10
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    assert loads(dumps((module.double,))[0])[0] is module.double


def test_functions_pickled_by_value_are_not_remembered_by_name():
    scope = {"__name__": "__main__"}
    exec("def triple(x):\n    return 3 * x\n", scope)
    triple = scope["triple"]
    square = lambda x: x * x  # noqa: E731
    for _ in range(2):
        rebuilt_triple, rebuilt_square = loads(dumps((triple, square))[0])
    assert id(triple) not in pickling._found_by_name and id(square) not in pickling._found_by_name
    assert rebuilt_triple(2) == 6 and rebuilt_square(3) == 9
