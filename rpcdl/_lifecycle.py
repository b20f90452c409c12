"""What this process must do when it forks and when it exits, registered in one place.

In a forked child, every component drops what belongs to its parent (open
connections, pooled buffers): the hooks registered with
:func:`in_forked_child` run, in registration order, before the child runs any
other code.

At exit, components shut down in a fixed order of phases (:class:`ExitPhase`),
before the interpreter finalizes: a thread of ours still inside torch's C++
code at finalization would abort the process, so every thread that may be
there is stopped and joined by then.

Threading model: hooks are registered at import time, which may be on any
thread (a name of ``rpcdl`` imports its module on first use); ``_lock`` guards
both lists of hooks for every access. A fork takes that lock first and lets it
go after, in the parent and in the child, so the child never inherits it held
by a thread it does not have. Fork hooks run in the child on the thread that
forked, exit hooks on the thread that runs ``atexit`` (the main thread).
"""

from __future__ import annotations

import atexit
import enum
import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger("rpcdl")


class ExitPhase(enum.IntEnum):
    """When, at exit, a component shuts down; lower phases first."""

    FLUSH = 1  # caches write what they buffered, while their stores are still up
    WORKERS = 2  # embedded workers stop
    CONNECTIONS = 3  # client connections close; their threads are joined
    LOOP = 4  # the event loop that owned their sockets stops
    SERVERS = 5  # servers this process started (a local redis-server) stop


_lock = threading.Lock()
_exit_hooks: list[tuple[ExitPhase, int, Callable[[], None]]] = []
_fork_hooks: list[Callable[[], None]] = []


def at_exit(phase: ExitPhase, hook: Callable[[], None]) -> None:
    """Run ``hook`` at exit in ``phase`` (hooks of one phase in registration order)."""
    with _lock:
        _exit_hooks.append((phase, len(_exit_hooks), hook))


def in_forked_child(hook: Callable[[], None]) -> None:
    """Run ``hook`` in every child this process forks, before anything else there."""
    with _lock:
        _fork_hooks.append(hook)


def _run_exit_hooks() -> None:
    with _lock:
        hooks = [hook for _, _, hook in sorted(_exit_hooks, key=lambda entry: entry[:2])]
    for hook in hooks:
        try:
            hook()
        except Exception:
            log.exception("rpcdl: an exit hook failed: %s", getattr(hook, "__qualname__", hook))


def _run_fork_hooks() -> None:
    """In the child: the lock, taken before the fork, is let go; then the hooks run."""
    hooks = list(_fork_hooks)
    _lock.release()
    for hook in hooks:
        hook()


atexit.register(_run_exit_hooks)
os.register_at_fork(before=_lock.acquire, after_in_parent=_lock.release, after_in_child=_run_fork_hooks)
