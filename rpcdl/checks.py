"""Argument checks shared by the public entry points: each error says what is wrong."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

_N = TypeVar("_N", int, float)


def check_timeout(value: Any, name: str = "timeout") -> float:
    """Return ``value`` as seconds; raise ``ValueError`` unless it is a positive number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def check_positive_int(value: Any, name: str, meaning: str = "") -> int:
    """Return ``value``; raise ``ValueError`` unless it is an integer of at least 1 (``meaning`` explains it)."""
    return check_int(value, name, minimum=1, meaning=meaning)


def check_int(
    value: Any,
    name: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    meaning: str = "",
    optional: bool = False,
    wrong_type: type[Exception] = ValueError,
) -> Any:
    """Return ``value`` if it is an integer (not a bool) in ``minimum..maximum``, else raise saying what it must be.

    Args:
        value: what the caller gave.
        name: the argument's name, for the message.
        minimum, maximum: the bounds, both included; ``None``: unbounded.
        meaning: what the value means, added in parentheses (``"0 picks a free port"``).
        optional: ``None`` is accepted (and returned) too.
        wrong_type: the exception for a value that is no integer at all (torch raises
            ``TypeError`` there in places); one out of range raises ``ValueError``.

    Returns:
        ``value``, unchanged.

    Example::

        >>> check_int(8080, "port", minimum=0, maximum=65535)
        8080
        >>> check_int(-1, "epoch", minimum=0)
        Traceback (most recent call last):
        ...
        ValueError: epoch must be a non-negative integer, got -1
    """
    if value is None and optional:
        return value
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if is_int and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return value
    if minimum is not None and maximum is not None:
        kind = f"an integer in {minimum}..{maximum}"
    elif minimum == 0 or minimum == 1:
        kind = "a non-negative integer" if minimum == 0 else "a positive integer"
    elif minimum is not None:
        kind = f"an integer of at least {minimum}"
    elif maximum is not None:
        kind = f"an integer of at most {maximum}"
    else:
        kind = "an integer"
    detail = (" or None" if optional else "") + (f" ({meaning})" if meaning else "")
    raise (ValueError if is_int else wrong_type)(f"{name} must be {kind}{detail}, got {value!r:.100}")


def check_number(
    value: Any, name: str, *, minimum: float | None = None, maximum: float | None = None, unit: str = ""
) -> float:
    """Return ``value`` as a float if it is a number (not a bool, not NaN) in ``minimum..maximum``; else ``ValueError``.

    Args:
        value: what the caller gave.
        name: the argument's name, for the message.
        minimum, maximum: the bounds, both included; ``None``: unbounded.
        unit: what it counts (``"seconds"``), for the message.

    Returns:
        ``value`` as a float.

    Example::

        >>> check_number(0.5, "random_level", minimum=0, maximum=1)
        0.5
        >>> check_number(-2, "retry_interval", minimum=0, unit="seconds")
        Traceback (most recent call last):
        ...
        ValueError: retry_interval must be a non-negative number of seconds, got -2
    """
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if is_number and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return float(value)
    of = f" of {unit}" if unit else ""
    if minimum is not None and maximum is not None:
        kind = f"a number{of} in [{minimum:g}, {maximum:g}]"
    elif minimum == 0:
        kind = f"a non-negative number{of}"
    elif minimum is not None:
        kind = f"a number{of} of at least {minimum:g}"
    elif maximum is not None:
        kind = f"a number{of} of at most {maximum:g}"
    else:
        kind = f"a number{of}"
    raise ValueError(f"{name} must be {kind}, got {value!r:.100}")


#: What ``timeout=0`` ("no timeout", torch's DataLoader default) becomes for the calls of a loader or
#: dataset build: a year. A worker that dies is still noticed at once, by its connection breaking;
#: one that hangs while connected is waited for, as torch waits for a hung DataLoader worker.
NO_TIMEOUT = 365 * 24 * 3600.0


def check_loader_timeout(value: Any, name: str = "timeout") -> float:
    """Return the seconds a call may take under torch's DataLoader rules: ``0`` means no timeout.

    Returns:
        ``value`` as seconds, or :data:`NO_TIMEOUT` for ``0``.

    Raises:
        TypeError: ``value`` is not a number.
        ValueError: ``value`` is negative (torch's message).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise TypeError(f"{name} must be a number of seconds (0: no timeout), got {value!r}")
    if value < 0:
        raise ValueError(f"{name} option should be non-negative")
    return NO_TIMEOUT if value == 0 else min(float(value), NO_TIMEOUT)


def environment_number(
    name: str, default: _N, parse: Callable[[str], _N], expected: str, valid: Callable[[_N], bool] | None = None
) -> _N:
    """Read the environment variable ``name`` as a number: ``default`` when it is unset or blank.

    Args:
        name: the variable.
        default: the value when it is unset or blank.
        parse: ``int`` or ``float``.
        expected: what the value must be, for the message (``"a whole number"``).
        valid: whether a parsed value may be used; ``None``: any finite one.

    Returns:
        The parsed value.

    Raises:
        ValueError: ``"{name} must be {expected}, got {text!r}"`` when the text does not parse or the value
            is not ``valid`` (NaN and infinities never are).

    Example::

        >>> os.environ["RPCDL_EXAMPLE_SECONDS"] = "2.5"
        >>> environment_number("RPCDL_EXAMPLE_SECONDS", 1.0, float, "seconds >= 0", lambda seconds: seconds >= 0)
        2.5
        >>> del os.environ["RPCDL_EXAMPLE_SECONDS"]
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = parse(text)
    except ValueError:
        value = None
    if value is None or (type(value) is float and not math.isfinite(value)) or (valid and not valid(value)):
        raise ValueError(f"{name} must be {expected}, got {text!r}")
    return value
