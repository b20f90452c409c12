"""This process's one event loop: it owns every socket rpcdl opens, on both sides.

The loop runs in one daemon thread, ``rpcdl-loop``, started by the first use
(:func:`process_loop`); a trainer's connections and an embedded worker's
sessions share it. uvloop is used when it is installed (never required).
User code never runs on the loop: a worker runs calls on its executor, a
trainer unpickles in the thread that waits for an answer.

Threads and what each owns: the loop thread owns the loop and everything its
callbacks touch (sockets, transports, protocols). Any other thread reaches
them only by posting a callback (:func:`call_soon`) or running a coroutine
there (:func:`run_coroutine`). ``_lock`` guards the one :class:`_Running`
record of this process (the loop and its thread) for every read and write;
a forked child starts with none (its parent's thread does not exist there),
and at exit the loop is stopped and its thread joined, after the workers and
connections that use it have closed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .._lifecycle import ExitPhase, at_exit, in_forked_child

THREAD_NAME = "rpcdl-loop"  #: the name of the loop's thread

T = TypeVar("T")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class _Running:
    """A loop and the thread running it."""

    def __init__(self) -> None:
        self.loop = _new_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), name=THREAD_NAME, daemon=True)
        self.thread.start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(started.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def stop(self, timeout: float) -> None:
        if self.thread is threading.current_thread():
            raise RuntimeError("the rpcdl loop cannot be stopped from its own thread")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)


_lock = threading.Lock()
_running: _Running | None = None


def process_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop, started in the thread ``rpcdl-loop`` on first use.

    Returns:
        the loop; it runs until the process exits.

    Example::

        >>> loop = process_loop()
        >>> loop.is_running()
        True
    """
    global _running
    with _lock:
        if _running is None:
            _running = _Running()
        return _running.loop


def in_loop_thread() -> bool:
    """Whether the calling thread is the loop's own thread.

    Example::

        >>> in_loop_thread()
        False
    """
    running = _running
    return running is not None and running.thread is threading.current_thread()


def call_soon(callback: Callable[..., object], *args: Any) -> None:
    """Run ``callback(*args)`` on the loop, soon; callable from any thread.

    Args:
        callback: a function that must not block (it runs on the loop).
        args: its arguments.

    Example::

        >>> done = threading.Event()
        >>> call_soon(done.set)
        >>> done.wait(5)
        True
    """
    process_loop().call_soon_threadsafe(callback, *args)


def run_coroutine(coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coroutine`` on the loop and wait for its result, from another thread.

    Args:
        coroutine: what to run.
        timeout: seconds to wait; ``None`` waits as long as it takes.

    Returns:
        the coroutine's result (its exception is raised).

    Raises:
        TimeoutError: it did not finish within ``timeout`` (it is cancelled).
        RuntimeError: called from the loop's own thread, where waiting would
            block the loop for ever.

    Example::

        >>> async def answer():
        ...     return 42
        >>> run_coroutine(answer(), timeout=5)
        42
    """
    if in_loop_thread():
        coroutine.close()
        raise RuntimeError("run_coroutine() waits for the loop, so it cannot run on the loop's own thread")
    future = asyncio.run_coroutine_threadsafe(coroutine, process_loop())
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"the rpcdl loop did not finish {coroutine!r} within {timeout}s") from None


def _stop_at_exit() -> None:
    global _running
    with _lock:
        running, _running = _running, None
    if running is not None:
        running.stop(timeout=5.0)


def _forget_parents_loop() -> None:
    global _running, _lock
    _running = None
    _lock = threading.Lock()


at_exit(ExitPhase.LOOP, _stop_at_exit)
in_forked_child(_forget_parents_loop)
