"""Argument types and checks of the ``rpcdl`` commands: each says what is wrong with a value."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
from typing import Any

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


def is_source(entry: str) -> bool:
    """Whether ``entry`` of a worker list names a source (``dns://...``, ``redis://...``), not an address."""
    return "://" in entry


def worker_list(text: str) -> list[str]:
    """One value of ``--workers``: addresses and sources, comma-separated.

    Each part is ``HOST:PORT``; a file listing addresses (whitespace-separated, ``#``
    comments; what ``rpcdl worker --address-file`` writes), read now; or a source
    (``dns://...``, ``redis://...``), passed on unchanged for the data layer to resolve.

    Example::

        >>> worker_list("a:1,b:2")
        ['a:1', 'b:2']
    """
    entries: list[str] = []
    for part in (part.strip() for part in text.split(",")):
        if not part:
            continue
        if is_source(part):
            entries.append(part)
            continue
        try:
            parse_address(part)
        except ValueError as exc:
            if os.path.isfile(part):
                entries.extend(_addresses_in_file(part))
                continue
            if os.sep in part or ":" not in part:  # a path: every address has a colon
                raise argparse.ArgumentTypeError(f"no such file: {part!r} (nor is it an address: {exc})") from None
            raise argparse.ArgumentTypeError(f"{exc} (nor is {part!r} a file of addresses)") from None
        entries.append(part)
    return entries


def _addresses_in_file(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except (OSError, UnicodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read the worker list {path!r}: {exc}") from None
    words = [word for line in lines for word in line.split("#", 1)[0].split()]
    for word in words:
        try:
            parse_address(word)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{path}: {exc}") from None
    return words


def add_workers_argument(parser: Any, help: str) -> None:
    """Add ``--workers``, spelt the same in every command: ``--workers A B``, ``--workers A,B``, files, sources.

    Args:
        parser: a parser, or a group of one.
        help: what the workers are for, the first words of the help text.

    The parsed value is one flat list (see :func:`worker_list` for the forms of each entry).
    """
    parser.add_argument(
        "--workers",
        nargs="+",
        type=worker_list,
        action=_Extend,
        metavar="WORKERS",
        help=f"{help}: HOST:PORT entries, space- or comma-separated, files listing them, or sources (dns://, redis://)",
    )


class _Extend(argparse.Action):
    """Add each value's entries (each value is a list) to one flat list, across repeated options."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        entries = list(getattr(namespace, self.dest, None) or [])
        for value in values:
            entries.extend(value)
        setattr(namespace, self.dest, entries)


class Deprecated(argparse.Action):
    """An old spelling of an option: stores into the new one's destination and warns on standard error.

    Use with ``help=argparse.SUPPRESS`` and ``dest`` set to the new option's; pass ``new="--name"``.
    """

    def __init__(self, option_strings, dest, new: str, **kwargs) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def silent_worker(addresses: list[str], timeout: float) -> str | None:
    """Ping each worker; return a line naming the first that does not answer, or ``None``."""
    from ..rpc.client import ping  # here: the commands' parsers load without torch

    for address in addresses:
        if is_source(address):  # resolved by the data layer, later
            continue
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
