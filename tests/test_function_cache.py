"""A function pickled by value (a lambda, a closure, a function of ``__main__``) is pickled once, not once per call,
while what it captured stays the same (the rule of :mod:`rpcdl.serialization.code_cache`)."""

from __future__ import annotations

import textwrap

import cloudpickle
import pytest

import rpcdl
from rpcdl.serialization.code_cache import found_by_name, frozen_function_code
from rpcdl.serialization.pickling import dumps, loads


@pytest.fixture
def by_value_pickles(monkeypatch):
    """Count the functions cloudpickle pickles by value in this process."""
    pickled: list[str] = []
    original = cloudpickle.Pickler._dynamic_function_reduce

    def counting(self, func):
        pickled.append(func.__qualname__)
        return original(self, func)

    monkeypatch.setattr(cloudpickle.Pickler, "_dynamic_function_reduce", counting)
    return pickled


def main_module_functions(source: str) -> dict:
    """Define ``source`` as a script's ``__main__`` would: its functions travel by value."""
    scope = {"__name__": "__main__"}
    exec(textwrap.dedent(source), scope)
    return scope


@pytest.mark.timeout(30)
def test_a_lambda_is_pickled_once_across_100_calls(embedded_worker, by_value_pickles):
    worker = embedded_worker().address
    triple = lambda x: x * 3  # noqa: E731
    results = [rpcdl.rpc_sync(worker, triple, (i,)) for i in range(100)]
    assert results == [i * 3 for i in range(100)]
    assert by_value_pickles == [triple.__qualname__]


@pytest.mark.timeout(30)
def test_a_main_function_with_a_closure_is_pickled_once_and_follows_its_rebound_globals(
    embedded_worker, by_value_pickles
):
    worker = embedded_worker().address
    scope = main_module_functions(
        """
        import math
        OFFSET = 1

        def shift(x):
            return x + OFFSET

        def make_scaler(factor):
            def scale(x):
                return math.floor(shift(x) * factor)
            return scale
        """
    )
    scale = scope["make_scaler"](2)
    assert [rpcdl.rpc_sync(worker, scale, (i,)) for i in range(100)] == [(i + 1) * 2 for i in range(100)]
    assert sorted(by_value_pickles) == ["make_scaler.<locals>.scale", "shift"]

    scope["OFFSET"] = 10  # a global of a function it calls, rebound: both are pickled again
    assert [rpcdl.rpc_sync(worker, scale, (i,)) for i in range(3)] == [(i + 10) * 2 for i in range(3)]
    assert len(by_value_pickles) == 4


@pytest.mark.timeout(30)
def test_a_closure_whose_captured_value_is_rebound_between_calls_gives_the_current_results(
    embedded_worker, by_value_pickles
):
    worker = embedded_worker().address

    def make():
        factor = 2

        def scale(x):
            return x * factor

        def set_factor(value):
            nonlocal factor
            factor = value

        return scale, set_factor

    scale, set_factor = make()
    answers = []
    for factor in (2, 5, 5, 7, 2):
        set_factor(factor)
        answers.append([rpcdl.rpc_sync(worker, scale, (i,)) for i in range(3)])
    assert answers == [[i * factor for i in range(3)] for factor in (2, 5, 5, 7, 2)]
    assert len(by_value_pickles) == 4  # once per value it captured in turn, not once per call


@pytest.mark.timeout(30)
def test_a_closure_over_a_mutable_value_travels_with_its_contents_at_every_call(embedded_worker, by_value_pickles):
    worker = embedded_worker().address
    weights = [1, 2]
    total = lambda: sum(weights)  # noqa: E731
    answers = []
    for extra in (3, 4, 5):
        weights.append(extra)
        answers.append(rpcdl.rpc_sync(worker, total))
    assert answers == [6, 10, 15]
    assert len(by_value_pickles) == 3


@pytest.mark.timeout(30)
def test_a_function_that_rebinds_what_it_captured_starts_afresh_at_every_call(embedded_worker, by_value_pickles):
    worker = embedded_worker().address

    def make_counter():
        count = 0

        def counter():
            nonlocal count
            count += 1
            return count

        return counter

    counter = make_counter()
    assert [rpcdl.rpc_sync(worker, counter) for _ in range(3)] == [1, 1, 1]
    scope = main_module_functions(
        """
        calls = 0

        def count_calls():
            global calls
            calls += 1
            return calls
        """
    )
    assert [rpcdl.rpc_sync(worker, scope["count_calls"]) for _ in range(3)] == [1, 1, 1]
    assert len(by_value_pickles) == 6


def test_which_functions_are_frozen():
    pickle_count = []

    def pickle_by_value(function):
        pickle_count.append(function)
        return cloudpickle.dumps(function)

    def uses_a_list(x, acc=[]):  # noqa: B006
        return acc

    class Local:
        pass

    def uses_a_class():
        return Local

    import math

    def uses_a_module_and_a_builtin(x):
        return math.floor(len(x))

    assert frozen_function_code(uses_a_list, pickle_by_value) is None
    assert frozen_function_code(uses_a_class, pickle_by_value) is None
    first = frozen_function_code(uses_a_module_and_a_builtin, pickle_by_value)
    assert first is not None and frozen_function_code(uses_a_module_and_a_builtin, pickle_by_value) is first
    assert len(pickle_count) == 1
    assert found_by_name(math.floor) and not found_by_name(uses_a_list)


def test_a_recursive_and_mutually_recursive_functions_round_trip():
    scope = main_module_functions(
        """
        def even(n):
            return True if n == 0 else odd(n - 1)

        def odd(n):
            return False if n == 0 else even(n - 1)

        def factorial(n):
            return 1 if n <= 1 else n * factorial(n - 1)
        """
    )
    for _ in range(2):
        even, factorial = loads(*dumps((scope["even"], scope["factorial"])))
        assert even(10) and not even(7) and factorial(5) == 120


@pytest.mark.timeout(30)
def test_the_worker_rebuilds_a_frozen_function_once_and_keeps_it(embedded_worker):
    worker = embedded_worker().address

    def make():
        def remembers_its_calls():
            remembers_its_calls.calls_here = getattr(remembers_its_calls, "calls_here", 0) + 1
            return remembers_its_calls.calls_here

        return remembers_its_calls

    function = make()
    assert [rpcdl.rpc_sync(worker, function) for _ in range(3)] == [1, 2, 3]  # the same object on the worker
    assert not hasattr(function, "calls_here")  # which is not the caller's
