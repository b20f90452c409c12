"""Argument types and checks of the ``rpcdl`` commands: each says what is wrong with a value."""

from __future__ import annotations

import argparse

from .address import parse_address


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value}")
    return value


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535 (0 picks a free port), got {value}")
    return value


def worker_address(text: str) -> str:
    try:
        parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def silent_worker(addresses: list[str], timeout: float) -> str | None:
    """Ping each worker; return a line naming the first that does not answer, or ``None``."""
    from .client import ping  # here: the commands' parsers load without torch

    for address in addresses:
        try:
            ping(address, timeout=timeout)
        except Exception as exc:
            return f"worker {address} does not answer: {exc}"
    return None
