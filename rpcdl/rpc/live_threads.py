"""The threads of this process's connections, until they end: at exit they are joined.

Threading model: the set is shared by all threads under ``_live_lock``, which
guards every access. A thread enters it as :func:`start_live_thread` starts it,
under the lock (so the set never holds a thread not started yet, which
nobody could join), and leaves it as it ends; a forked child starts with an
empty set (its parent's threads do not exist there).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .._lifecycle import in_forked_child

_live_threads: set[threading.Thread] = set()
_live_lock = threading.Lock()


def start_live_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """Start a daemon thread running ``target``, registered until ``target`` returns; return it.

    Closed connections' threads are joined at exit too: one may still be completing a call.

    Example::

        >>> start_live_thread(lambda: None, name="rpcdl-example").join()
    """

    def run_then_leave() -> None:
        try:
            target()
        finally:
            with _live_lock:
                _live_threads.discard(thread)

    thread = threading.Thread(target=run_then_leave, name=name, daemon=True)
    with _live_lock:  # started before anyone can see it, to join it
        _live_threads.add(thread)
        thread.start()
    return thread


def join_connection_threads(timeout: float) -> list[str]:
    """Wait up to ``timeout`` seconds in all for the threads of this process's connections to end.

    Returns:
        the names of those still running then.
    """
    deadline = time.monotonic() + timeout
    with _live_lock:
        threads = [thread for thread in _live_threads if thread is not threading.current_thread()]
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    return [thread.name for thread in threads if thread.is_alive()]


def _forget_parents_threads() -> None:
    global _live_threads, _live_lock
    _live_threads, _live_lock = set(), threading.Lock()


in_forked_child(_forget_parents_threads)
