"""Argument checks shared by the public entry points: each error says what is wrong."""

from __future__ import annotations

from typing import Any


def check_timeout(value: Any, name: str = "timeout") -> float:
    """Return ``value`` as seconds; raise ``ValueError`` unless it is a positive number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def check_positive_int(value: Any, name: str, meaning: str = "") -> int:
    """Return ``value``; raise ``ValueError`` unless it is an integer of at least 1 (``meaning`` explains it)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        detail = f" ({meaning})" if meaning else ""
        raise ValueError(f"{name} must be a positive integer{detail}, got {value!r}")
    return value


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
