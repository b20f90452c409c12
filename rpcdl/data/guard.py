"""One thread at a time in an iterator: a second one entering gets an error instead of corrupting it.

Threading: an :class:`EntryGuard` is a lock taken without waiting by the thread
entering what it guards; whoever cannot take it is told at once.
"""

from __future__ import annotations

import threading

__all__ = ["EntryGuard"]


class EntryGuard:
    """Refuses a second thread inside ``what`` while one is there, as a generator refuses to run twice at once.

    Args:
        what: what it guards, for the message ("this epoch").

    Example::

        >>> guard = EntryGuard("this pass")
        >>> with guard:
        ...     guard.try_enter()
        False
    """

    __slots__ = ("_lock", "_what")

    def __init__(self, what: str):
        self._lock = threading.Lock()
        self._what = what

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                f"{self._what} is already being advanced by another thread (or by its own source): advance an "
                "iterator from one thread at a time; each thread may iterate its own iterator of the same loader"
            )

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()

    def try_enter(self) -> bool:
        """Enter if no thread is inside; whether it did (then :meth:`leave` after)."""
        return self._lock.acquire(blocking=False)

    def leave(self) -> None:
        """Leave what :meth:`try_enter` entered."""
        self._lock.release()
