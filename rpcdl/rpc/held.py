"""What a thread holds back: calls sent together, and answers its caller reads itself.

Threading model: all state here is per thread (a ``threading.local``, each
field owned by its thread); no thread ever sees, sends or reads what another
thread holds. A forked child starts with nothing deferred (its parent's
connections are not its own).

Stages compose (a remote map over a remote map, in any depth, or over a data
loader) because of two rules:

1. **A block holds only the calls of the code that opened it.** Code a block
   calls out to, such as a stage's source (which may be another stage) or user
   code, runs under :func:`outside_held_blocks`: its calls are sent or read as
   if no block were open (or as its own blocks say), never held for the outer
   block.
2. **Nothing waits for answers while holding calls.** A thread about to wait
   (:meth:`torch.futures.Future.wait` on an rpcdl future, :func:`rpcdl.rpc.client.read_answers`,
   a synchronous call) first sends every call it holds, those of the enclosing
   blocks suspended by rule 1 included.

So a call held by a thread always leaves before that thread waits for
anything rpcdl can see, whatever the depth of the stages; and a plain source
(a list, a sampler) that never waits costs no extra system call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

from .._lifecycle import in_forked_child


class Sender(Protocol):
    """Where a held call goes (a :class:`~rpcdl.rpc.connection.Connection`)."""

    def send(self, frames: list) -> None: ...  # the frames of calls held back, now

    def flush(self) -> None: ...  # what the connection deferred, now


class _ThreadState(threading.local):
    """What one thread holds; the class attributes are each thread's start."""

    frames: dict[Sender, list] | None = None  #: the calls held by the innermost open block, by connection
    suspended: list[dict[Sender, list]] | None = None  #: those of enclosing blocks, suspended by outside_held_blocks
    read_here = False  #: whether answers of calls made now are left to this thread
    deferred: set[Sender] | None = None  #: connections where this thread deferred calls since it last waited


_state = _ThreadState()


def _after_fork_in_child() -> None:
    _state.deferred = None  # the parent's connections: the child never sends on them


in_forked_child(_after_fork_in_child)


def reads_here() -> bool:
    """Whether the answers of calls this thread makes now are left to it (see :func:`answers_read_here`)."""
    return _state.read_here


def holds_nothing() -> bool:
    """Whether this thread holds no call back (held in a block, or deferred): a call it sends now leaves first."""
    state = _state
    return not state.frames and not state.suspended and not state.deferred


def hold(connection: Sender, frame: Any) -> bool:
    """Hold ``frame`` for ``connection`` if this thread is in a :func:`sent_together` block.

    Returns:
        ``True`` if held (sent when the block ends or the thread waits), ``False`` if the caller sends it.
    """
    frames = _state.frames
    if frames is None:
        return False
    frames.setdefault(connection, []).append(frame)
    return True


def deferred_on(connection: Sender) -> None:
    """Note that this thread deferred a call on ``connection``: it leaves before this thread waits.

    (A connection defers a call made while the worker is busy with others, so
    that it leaves with the next ones, see :meth:`rpcdl.rpc.outbox.Outbox.defer`.)
    """
    deferred = _state.deferred
    if deferred is None:
        deferred = _state.deferred = set()
    deferred.add(connection)


def send_held() -> None:
    """Send every call this thread holds, those of suspended enclosing blocks first (they were made first), and
    those it deferred."""
    state = _state
    if state.deferred:
        deferred = list(state.deferred)
        state.deferred.clear()
        for connection in deferred:
            connection.flush()
    if not state.suspended and not state.frames:
        return  # nothing held: the usual case
    for frames in [*(state.suspended or ()), state.frames]:
        if frames:
            held = list(frames.items())
            frames.clear()
            for connection, pending in held:
                connection.send(pending)


@contextlib.contextmanager
def sent_together() -> Iterator[None]:
    """Hold back the calls this thread makes in the block and send them together as it ends.

    The calls to one worker then leave in one system call, which costs about
    what sending a single one does, and the worker reads them in one go: worth
    it when a thread sends several calls at once (the data loader does, as it
    fills its prefetch window). Order is kept: waiting for a future in the
    block, or making a synchronous call (:func:`rpcdl.rpc_sync`, :func:`rpcdl.ping`,
    :func:`rpcdl.stats`), first sends what the thread holds. Other threads' calls are
    not held, nor are those made under :func:`outside_held_blocks` (those may still
    be deferred briefly, as any call made while others are in flight, see
    :func:`rpcdl.rpc_async`). When the block ends, the calls it held are sent at
    once, along with any deferred before them. Blocks nest: the outermost sends.

    Example::

        >>> with rpcdl.rpc.client.sent_together():  # doctest: +SKIP
        ...     futures = [rpcdl.rpc_async(address, pow, (2, n)) for n in range(8)]
        >>> [future.wait() for future in futures]  # doctest: +SKIP
        [1, 2, 4, 8, 16, 32, 64, 128]
    """
    if _state.frames is not None:  # nested: the outermost block sends
        yield
        return
    _state.frames = {}
    try:
        yield
    finally:
        try:
            send_held()
        finally:
            _state.frames = None


@contextlib.contextmanager
def answers_read_here() -> Iterator[None]:
    """Leave the answers to the calls this thread makes in the block to this thread.

    Their connections' own threads do not read them: the thread reads them when
    it waits for their futures or calls :func:`rpcdl.rpc.client.read_answers`, which saves two
    thread switches per answer. Meant for one thread driving many calls, as the
    data loader does. Answers it leaves unread for 0.1 s are read by their
    connections' threads after all, so a worker never blocks sending them; so
    are the answers of a connection whose last answer was large (1 MiB or
    more), which arrive faster read in parallel, one thread per connection.

    Example::

        >>> with rpcdl.rpc.client.answers_read_here():  # doctest: +SKIP
        ...     futures = [rpcdl.rpc_async(address, pow, (2, n)) for n in range(8)]
        >>> while not all(future.done() for future in futures):  # doctest: +SKIP
        ...     rpcdl.rpc.client.read_answers(futures, timeout=1.0)
    """
    previous = _state.read_here
    _state.read_here = True
    try:
        yield
    finally:
        _state.read_here = previous


@contextlib.contextmanager
def outside_held_blocks() -> Iterator[None]:
    """Run the block as if this thread were in no :func:`sent_together` or :func:`answers_read_here` block.

    For code a block calls out to and does not control: a stage's source
    (which may be another stage that waits for its own answers) or user code.
    The calls held so far stay held, unless the block waits for answers, which
    sends them first; calls made in the block are not held for the enclosing
    block, and their answers are read as outside any block.

    Example::

        >>> with rpcdl.rpc.client.sent_together(), rpcdl.rpc.client.answers_read_here():  # doctest: +SKIP
        ...     for item in items:
        ...         with rpcdl.rpc.client.outside_held_blocks():
        ...             item = preprocess(item)  # may call workers and wait for them
        ...         futures.append(rpcdl.rpc_async(address, fn, (item,)))
    """
    state = _state
    frames, read_here = state.frames, state.read_here
    if frames is not None:
        if state.suspended is None:
            state.suspended = []
        state.suspended.append(frames)
    state.frames, state.read_here = None, False
    try:
        yield
    finally:
        if frames is not None:
            state.suspended.pop()
        state.frames, state.read_here = frames, read_here
