"""What this process must do when it forks and when it exits, registered in one place.

In a forked child, every component drops what belongs to its parent (open
connections, pooled buffers): the hooks registered with
:func:`in_forked_child` run, in registration order, before the child runs any
other code.

At exit, components shut down in a fixed order of phases (:class:`ExitPhase`),
before the interpreter finalizes: a thread of ours still inside torch's C++
code at finalization would abort the process, so every thread that may be
there is stopped and joined by then.

Threading model: hooks are registered at import time; fork hooks run on the
thread that forked, exit hooks on the thread that runs ``atexit`` (the main
thread).
"""

from __future__ import annotations

import atexit
import enum
import logging
import os
from collections.abc import Callable

log = logging.getLogger("rpcdl")


class ExitPhase(enum.IntEnum):
    """When, at exit, a component shuts down; lower phases first."""

    FLUSH = 1  # caches write what they buffered, while their stores are still up
    WORKERS = 2  # embedded workers stop
    CONNECTIONS = 3  # client connections close; their threads are joined
    SERVERS = 4  # servers this process started (a local redis-server) stop


_exit_hooks: list[tuple[ExitPhase, int, Callable[[], None]]] = []
_fork_hooks: list[Callable[[], None]] = []


def at_exit(phase: ExitPhase, hook: Callable[[], None]) -> None:
    """Run ``hook`` at exit in ``phase`` (hooks of one phase in registration order)."""
    _exit_hooks.append((phase, len(_exit_hooks), hook))


def in_forked_child(hook: Callable[[], None]) -> None:
    """Run ``hook`` in every child this process forks, before anything else there."""
    _fork_hooks.append(hook)


def _run_exit_hooks() -> None:
    for _, _, hook in sorted(_exit_hooks, key=lambda entry: entry[:2]):
        try:
            hook()
        except Exception:
            log.exception("rpcdl: an exit hook failed: %s", getattr(hook, "__qualname__", hook))


def _run_fork_hooks() -> None:
    for hook in _fork_hooks:
        hook()


atexit.register(_run_exit_hooks)
os.register_at_fork(after_in_child=_run_fork_hooks)
