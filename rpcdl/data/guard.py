"""One thread at a time in an iterator: a second one entering gets an error instead of corrupting it.

Threading: an :class:`EntryGuard` is a lock taken without waiting by the thread
entering what it guards; whoever cannot take it is told at once.
"""

from __future__ import annotations

import functools
import threading

__all__ = ["EntryGuard"]


class EntryGuard:
    """Refuses a second thread inside ``what`` while one is there, as a generator refuses to run twice at once.

    Use it as a context manager, or, on a path taken for every item, as
    ``if not guard.try_enter(): raise guard.busy()`` then ``try: ... finally:
    guard.leave()`` (the lock's own methods: a with-block costs two Python calls
    more, a measurable part of a small batch's cost).

    Args:
        what: what it guards, for the message ("this epoch").

    Attributes:
        try_enter: enters if no thread is inside; returns whether it did (then :attr:`leave` after).
        leave: leaves what :attr:`try_enter` entered.

    Example::

        >>> guard = EntryGuard("this pass")
        >>> with guard:
        ...     guard.try_enter()
        False
    """

    __slots__ = ("_what", "leave", "try_enter")

    def __init__(self, what: str):
        lock = threading.Lock()
        self.try_enter = functools.partial(lock.acquire, False)
        self.leave = lock.release
        self._what = what

    def busy(self) -> RuntimeError:
        """The error for a thread that could not enter."""
        return RuntimeError(
            f"{self._what} is already being advanced by another thread (or by its own source): advance an "
            "iterator from one thread at a time; each thread may iterate its own iterator of the same loader"
        )

    def __enter__(self) -> None:
        if not self.try_enter():
            raise self.busy()

    def __exit__(self, *exc_info: object) -> None:
        self.leave()

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return EntryGuard, (self._what,)  # a copy (a pickled iterator's) is entered by no thread
