"""Credentials: the shared token and TLS contexts.

The token is read from ``RPCDL_TOKEN`` or the file named by ``RPCDL_TOKEN_FILE``
by worker and client alike; an explicit ``token=`` argument overrides both.
TLS is opt-in: a worker given a certificate and key serves TLS, a client given a
CA file (``RPCDL_TLS_CA``) or an :class:`ssl.SSLContext` verifies it.
"""

from __future__ import annotations

import functools
import os
import ssl
from pathlib import Path

TOKEN_ENV = "RPCDL_TOKEN"
TOKEN_FILE_ENV = "RPCDL_TOKEN_FILE"
TLS_CA_ENV = "RPCDL_TLS_CA"
TLS_CERT_ENV = "RPCDL_TLS_CERT"
TLS_KEY_ENV = "RPCDL_TLS_KEY"


class Token:
    """A shared secret whose value never appears in ``repr``, logs or errors."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes):
        if not secret:
            raise ValueError("an rpcdl token must not be empty")
        self._secret = secret

    @property
    def secret(self) -> bytes:
        return self._secret

    def __repr__(self) -> str:
        return "Token(<hidden>)"

    def __reduce__(self):
        raise TypeError("an rpcdl Token is never pickled")


def resolve_token(token: str | bytes | Token | None = None) -> Token | None:
    """Return the token to use: ``token`` if given, else the environment's, else ``None``.

    Args:
        token: an explicit token; ``""`` means "no token" even if one is set in the
            environment.

    Raises:
        ValueError: ``RPCDL_TOKEN_FILE`` names a file that cannot be read or is empty.
    """
    if isinstance(token, Token):
        return token
    if token is not None:
        if isinstance(token, str):
            token = token.encode()
        if not isinstance(token, bytes):
            raise TypeError(f"token must be str or bytes, got {type(token).__name__}")
        return Token(token) if token else None
    value = os.environ.get(TOKEN_ENV)
    if value:
        return Token(value.encode())
    path = os.environ.get(TOKEN_FILE_ENV)
    if path:
        return read_token_file(path)
    return None


@functools.lru_cache(maxsize=8)
def read_token_file(path: str) -> Token:
    """Read a token from a file (surrounding whitespace ignored), once per path.

    Raises:
        ValueError: the file cannot be read or is empty.
    """
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"token file {path!r} cannot be read: {exc.strerror}") from None
    if not secret:
        raise ValueError(f"token file {path!r} is empty; put the shared token in it")
    return Token(secret)


def server_tls_context(certfile: str | os.PathLike, keyfile: str | os.PathLike | None = None) -> ssl.SSLContext:
    """Build the TLS context a worker serves with.

    Args:
        certfile: PEM certificate chain of the worker.
        keyfile: PEM private key; ``None`` if it is inside ``certfile``.

    Example::

        >>> ctx = server_tls_context("worker.pem", "worker.key")  # doctest: +SKIP
        >>> Worker("0.0.0.0", 6543, ssl_context=ctx, token="...")  # doctest: +SKIP
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile, keyfile)
    return context


def client_tls_context(cafile: str | os.PathLike | None = None, *, check_hostname: bool = True) -> ssl.SSLContext:
    """Build the TLS context a client verifies workers with.

    Args:
        cafile: PEM file of the certificate authority that signed the workers'
            certificates; ``None`` uses the system's trust store.
        check_hostname: verify that the certificate names the host connected to.
    """
    context = ssl.create_default_context(cafile=os.fspath(cafile) if cafile is not None else None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = check_hostname
    return context


def default_client_tls() -> ssl.SSLContext | None:
    """The client TLS context from ``RPCDL_TLS_CA``, or ``None`` for plain TCP."""
    cafile = os.environ.get(TLS_CA_ENV)
    return _cached_client_tls(cafile) if cafile else None


@functools.lru_cache(maxsize=8)
def _cached_client_tls(cafile: str) -> ssl.SSLContext:
    return client_tls_context(cafile)


def default_server_tls() -> ssl.SSLContext | None:
    """The worker TLS context from ``RPCDL_TLS_CERT`` / ``RPCDL_TLS_KEY``, or ``None``."""
    certfile = os.environ.get(TLS_CERT_ENV)
    if not certfile:
        return None
    return server_tls_context(certfile, os.environ.get(TLS_KEY_ENV) or None)
