"""Argument types and checks of the ``rpcdl`` commands: each says what is wrong with a value."""

from __future__ import annotations

import argparse
import os
import socket
import threading

from ..address import parse_address
from ..local import LOG_LEVELS
from ..registry import RegistryURL

_RESOLVE_TIMEOUT = 10.0


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


def non_negative_float(text: str) -> float:
    """A finite number of seconds, ``0`` or more (``0``: no wait)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds (0 or more), got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds, 0 or more, got {value}")
    return value


def registry_url(text: str) -> str:
    """A Redis registry URL (see :mod:`rpcdl.registry`), checked; kept as text."""
    try:
        RegistryURL.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


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


def worker_addresses(text: str) -> list[str]:
    """One or more worker addresses, ``HOST:PORT[,HOST:PORT...]``."""
    return [worker_address(part.strip()) for part in text.split(",") if part.strip()]


def silent_worker(addresses: list[str], timeout: float) -> str | None:
    """Ping each worker; return a line naming the first that does not answer, or ``None``."""
    from ..rpc.client import ping  # here: the commands' parsers load without torch

    for address in addresses:
        try:
            ping(address, timeout=timeout)
        except Exception as exc:
            return f"worker {address} does not answer: {exc}"
    return None


def log_level(text: str) -> str:
    """A logging level name, any case; returned upper-case."""
    name = text.strip().upper()
    if name not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected a logging level ({', '.join(LOG_LEVELS)}), got {text!r}")
    return name


def new_file(text: str) -> str:
    """A file to write: its folder must exist."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the folder {folder} does not exist")
    return text


def existing_file(text: str) -> str:
    """A file to read: it must exist."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def host_problem(host: str, timeout: float = _RESOLVE_TIMEOUT) -> str | None:
    """Look ``host`` up; return a sentence saying why it does not resolve, or ``None`` when it does.

    The look-up runs in a daemon thread (``rpcdl-resolve``) so that a name server that does not
    answer costs ``timeout`` seconds, not the resolver's own retries.
    """
    outcome: list[BaseException | None] = []

    def look_up() -> None:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            outcome.append(None)
        except (OSError, UnicodeError) as exc:
            outcome.append(exc)

    thread = threading.Thread(target=look_up, name="rpcdl-resolve", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        return f"{host!r} does not resolve: no answer from the name service within {timeout:g}s"
    error = outcome[0]
    if error is None:
        return None
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return f"{host!r} does not resolve: {reason}"
