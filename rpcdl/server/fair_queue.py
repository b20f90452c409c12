"""The calls waiting for a worker's slots, queued per client: fair shares of the worker's time.

Clients that keep a worker busy get equal shares of its *time*, not of its
calls: a client whose calls take 30 ms does not get eight times the worker of
one whose calls take 4 ms. Each client has a usage, the busy seconds its
calls took where they ran (the slots measure each call and
:meth:`FairQueue.charge` it); whenever a slot frees, the next call comes from
the waiting client that has used the least. Clients of equal usage (calls
never charged, or of equal durations) take turns in the order they joined,
round robin.

A client that starts waiting does not bank the time it was idle: it starts at
the queue's floor, the usage of the client chosen last (the least any waiting
client had then), or at its own usage if that is higher. So a trainer back
after a pause shares the worker from then on, and does not take it whole to
catch up. Each client's own calls keep their order (a call that uses an RRef
runs after the call that makes it, from the same connection).

A call charged before its client's next one is chosen weighs at once; a call
still running when another slot frees is not counted yet (its duration is not
known), so with ``parallel`` slots a client may run up to ``parallel`` calls
before its usage catches up.

Threading: a ``FairQueue`` has no lock of its own: it is a field of
``rpcdl.server.slots.Slots``, whose lock guards every access to it.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

_Client = TypeVar("_Client", bound=Hashable)
_Item = TypeVar("_Item")
_PRUNE_EVERY = 256  # charges between two passes that forget the idle clients at the floor


class FairQueue(Generic[_Client, _Item]):
    """Items queued per client; the next comes from the waiting client that has used the least time.

    Without charges every client weighs the same: clients take turns.

    Example::

        >>> queue = FairQueue()
        >>> for client, call in [("a", 1), ("a", 2), ("a", 3), ("b", 4)]:
        ...     queue.push(client, call)
        >>> [queue.pop() for _ in range(len(queue))]
        [('a', 1), ('b', 4), ('a', 2), ('a', 3)]
        >>> for client, call in [("a", 5), ("a", 6), ("b", 7), ("b", 8)]:
        ...     queue.push(client, call)
        >>> queue.charge("a", 0.030)  # a's calls took 30 ms where b's took nothing
        >>> [queue.pop() for _ in range(len(queue))]
        [('b', 7), ('b', 8), ('a', 5), ('a', 6)]
    """

    def __init__(self) -> None:
        self._waiting: dict[_Client, collections.deque[_Item]] = {}  # never an empty deque
        self._used: dict[_Client, float] = {}  # busy seconds charged, from the floor of when it joined
        self._version: dict[_Client, int] = {}  # a waiting client's current entry in the heap
        # (usage, order, client, version): the entries of waiting clients, stale ones skipped as they surface
        self._heap: list[tuple[float, int, _Client, int]] = []
        self._order = itertools.count()
        self._floor = 0.0  # the usage of the client chosen last: where a client that starts waiting starts
        self._count = 0
        self._charges = 0  # since the last pass that forgot idle clients

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def push(self, client: _Client, item: _Item) -> None:
        """Queue ``item`` after ``client``'s other items; a client not waiting yet starts at the floor.

        Args:
            client: who sent the item.
            item: what to queue.
        """
        queued = self._waiting.get(client)
        if queued is None:
            self._waiting[client] = queued = collections.deque()
            self._used[client] = max(self._used.get(client, 0.0), self._floor)
            self._enter(client)
        queued.append(item)
        self._count += 1

    def pop(self) -> tuple[_Client, _Item]:
        """Take the oldest item of the waiting client that has used the least (the first to wait, on a tie).

        Returns:
            ``(client, item)``.

        Raises:
            IndexError: nothing is queued.
        """
        if not self._count:
            raise IndexError("pop from an empty FairQueue")
        heap = self._heap
        while True:
            used, _, client, version = heapq.heappop(heap)
            if self._version.get(client) == version:
                break
        queued = self._waiting[client]
        item = queued.popleft()
        self._count -= 1
        self._floor = max(self._floor, used)
        if queued:
            self._enter(client)  # behind the clients of equal usage: turns
        else:
            del self._waiting[client], self._version[client]
            if not self._waiting:
                heap.clear()  # only stale entries are left
        return client, item

    def pass_through(self, client: _Client) -> None:
        """Note that an item of ``client`` runs at once, nothing being queued: what :meth:`push` then
        :meth:`pop` would do to the usages and the floor, without queueing it.

        Args:
            client: who sent the item.

        Raises:
            ValueError: items are queued (they go first: :meth:`push` the item).
        """
        if self._count:
            raise ValueError("an item passes through only an empty FairQueue: push it behind the queued ones")
        used = self._used.get(client, 0.0)
        if used < self._floor:
            used = self._used[client] = self._floor  # starts at the floor, as a client that starts waiting does
        self._floor = used

    def charge(self, client: _Client, seconds: float) -> None:
        """Count ``seconds`` of the worker's time against ``client`` (a call of its, run just now).

        Args:
            client: whose call ran (queued here or not: a call run at once counts too).
            seconds: how long it ran.
        """
        self._used[client] = max(self._used.get(client, 0.0), self._floor) + seconds
        if client in self._waiting:
            self._enter(client)
        self._charges += 1
        if self._charges >= _PRUNE_EVERY:
            self._charges = 0
            self._prune()

    def usage(self, client: _Client) -> float:
        """The busy seconds counted against ``client``, or the floor when it has used no more than that."""
        return max(self._used.get(client, 0.0), self._floor)

    def clients(self) -> int:
        """How many clients have items waiting."""
        return len(self._waiting)

    def _enter(self, client: _Client) -> None:
        """(Re)place ``client``'s entry in the heap at its usage, after the entries already there."""
        version = self._version.get(client, 0) + 1
        self._version[client] = version
        heapq.heappush(self._heap, (self._used[client], next(self._order), client, version))

    def _prune(self) -> None:
        """Forget the usage of idle clients at or below the floor: joining again, they start there anyway."""
        floor = self._floor
        self._used = {client: used for client, used in self._used.items() if used > floor or client in self._waiting}
