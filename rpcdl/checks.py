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
