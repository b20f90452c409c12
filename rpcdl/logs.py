"""rpcdl's logging: only the ``rpcdl`` logger is ever configured, never the root logger.

Two situations:

* A program using rpcdl as a library (a trainer): rpcdl adds one
  :class:`FallbackHandler` to the ``rpcdl`` logger at import. It writes
  warnings to standard error with the time, level and logger name, and only
  while the program has configured no handler of its own on the root logger;
  once it has, records pass on to the program's handlers untouched (as
  Lightning does for its own logger, without keeping them from the root).
* The ``rpcdl`` command (a worker): :func:`configure` gives the ``rpcdl``
  logger a handler and a level of its own (``--log-level``, ``--log-format``),
  so a third-party library's debug messages (PIL's PNG chunks, say) stay off.

Threading: :func:`configure` runs once, in the main thread, before any other
thread logs; the handlers themselves are thread-safe (``logging`` locks each).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

LOGGER = "rpcdl"  #: the one logger rpcdl configures
FORMATS = ("text", "json")  #: the values of ``--log-format``
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``time`` (UTC, ISO 8601), ``level``, ``logger``,
    ``message``, and ``exception`` when there is one; what log collectors parse.

    Example::

        >>> record = logging.LogRecord("rpcdl.worker", logging.INFO, "", 0, "client %s left", ("a:1",), None)
        >>> json.loads(JsonFormatter().format(record))["message"]
        'client a:1 left'
    """

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class FallbackHandler(logging.StreamHandler):
    """Writes rpcdl's records to standard error only while the root logger has no handler.

    It stands in for Python's last-resort handler (which prints a bare
    message) until the program configures logging, then steps aside.
    """

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(TEXT_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the program configured logging: its handlers get the record (it propagates)
        self.stream = sys.stderr  # the current one: a test or a program may have replaced it
        super().emit(record)


def install_fallback() -> None:
    """Add a :class:`FallbackHandler` to the ``rpcdl`` logger, once (``import rpcdl`` does)."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(handler, FallbackHandler) for handler in logger.handlers):
        logger.addHandler(FallbackHandler())


def configure(level: str = "INFO", log_format: str = "text") -> None:
    """Configure the ``rpcdl`` logger alone for a command: a handler on standard error and a level.

    The root logger is left as it is, so other libraries' records follow
    Python's defaults (warnings only). Calling it again replaces the handler.

    Args:
        level: a level name: ``"DEBUG"``, ``"INFO"``, ``"WARNING"``, ``"ERROR"`` or ``"CRITICAL"``.
        log_format: ``"text"`` (time, level, logger, message) or ``"json"`` (one object per line).

    Raises:
        ValueError: an unknown level or format.

    Example::

        >>> configure("DEBUG", "json")  # doctest: +SKIP
        >>> logging.getLogger("rpcdl.worker").info("client %s left", "10.0.0.7:51234")  # doctest: +SKIP
        {"time": "2026-11-27T09:14:03.949Z", "level": "INFO", "logger": "rpcdl.worker", "message": "client ...", ...}
    """
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {log_format!r}")
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"unknown logging level {level!r}")
    logger = logging.getLogger(LOGGER)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # the command owns standard error; the root logger is not configured
