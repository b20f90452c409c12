"""The process's open-file limit, raised once to the hard limit: every connection is a file descriptor.

A worker holds one socket per client and a trainer one per worker it calls;
the usual soft limit of 1,024 descriptors would cap a fleet well below its
size, and the hard limit (often a million) is there to be taken by a process
that needs it. The worker raises it when it starts serving, the client when
it first connects; both through :func:`raise_open_file_limit`, which acts
once per process and says what it did in one line at debug level
(``rpcdl.limits``). A process forked afterwards inherits the raised limit.

Threading: any thread may call :func:`raise_open_file_limit`; a lock makes
the first call the only one that acts, and guards the record of its outcome.
"""

from __future__ import annotations

import logging
import threading

try:
    import resource
except ImportError:  # not on this platform (Windows): nothing to raise
    resource = None  # type: ignore[assignment]

log = logging.getLogger("rpcdl.limits")

_lock = threading.Lock()
_outcome: tuple[int, int] | None = None  # (soft limit before, soft limit after), once raised; under _lock


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files (``RLIMIT_NOFILE``) to its hard limit, once.

    Later calls change nothing and return the first call's outcome. A limit
    that cannot be raised (a platform without it, a refusal by the system) is
    left as it is, and said at debug level.

    Returns:
        ``(before, after)``: the soft limit before the first call and after it
        (``-1`` for unlimited, ``(0, 0)`` where the platform has no such limit).

    Example::

        >>> before, after = raise_open_file_limit()
        >>> after >= before or after == -1
        True
    """
    global _outcome
    with _lock:
        if _outcome is not None:
            return _outcome
        _outcome = _raise()
        return _outcome


def _raise() -> tuple[int, int]:
    if resource is None:
        log.debug("this platform has no open-file limit to raise")
        return 0, 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        log.debug("open-file limit: %s, already the hard limit", _name(soft))
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.debug("open-file limit: %s; could not raise it to the hard limit %s: %s", _name(soft), _name(hard), exc)
        return soft, soft
    log.debug("open-file limit raised from %s to the hard limit, %s", _name(soft), _name(hard))
    return soft, hard


def _name(limit: int) -> str:
    return "unlimited" if resource is not None and limit == resource.RLIM_INFINITY else str(limit)
