"""Worker addresses: ``HOST:PORT`` strings, IPv6 hosts in brackets."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from typing import Any


def parse_address(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6]:port"``) into ``(host, port)``.

    Raises:
        ValueError: ``address`` is not of that form; the message shows the form.

    Example::

        >>> parse_address("127.0.0.1:6543")
        ('127.0.0.1', 6543)
        >>> parse_address("[::1]:6543")
        ('::1', 6543)
    """
    if not isinstance(address, str):
        raise TypeError(f"a worker address must be a 'HOST:PORT' string, got {type(address).__name__}: {address!r}")
    host, sep, port_text = address.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        sep = ""
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(
            f"malformed worker address {address!r}: expected HOST:PORT with a port in 1..65535, "
            "e.g. '127.0.0.1:6543', 'node07:6543' or '[::1]:6543'"
        )
    return host, int(port_text)


def format_address(host: str, port: int) -> str:
    """Join ``host`` and ``port``, bracketing IPv6 literals."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_workers(workers: Any) -> list[str]:
    """Validate a list of worker addresses; return it as a plain list.

    Raises:
        TypeError: ``workers`` is not a non-empty list of strings.
        ValueError: an address is malformed, or listed twice.
    """
    if isinstance(workers, str) or not isinstance(workers, Sequence) or not workers:
        raise TypeError(
            f"workers must be a non-empty list of 'host:port' strings, got {workers!r}; "
            "start workers with `rpcdl worker` or use rpcdl.local_workers(n)"
        )
    for address in workers:
        parse_address(address)
    if len(set(workers)) != len(workers):
        raise ValueError(f"workers lists the same worker twice: {list(workers)}")
    return list(workers)
