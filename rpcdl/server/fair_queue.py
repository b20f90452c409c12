"""The calls waiting for a worker's slots, queued per client and taken in turns: fair shares.

A client that keeps many calls queued (a greedy job, a large prefetch) gets
no more slots than one that keeps a few: whenever a slot frees, the next call
comes from the next client in the rotation that has calls waiting. Each
client's own calls keep their order (a call that uses an RRef runs after the
call that makes it, from the same connection). A client that starts waiting
joins the rotation at its end.

Threading: a ``FairQueue`` has no lock of its own: it is a field of
``rpcdl.server.slots.Slots``, whose lock guards every access to it.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Generic, TypeVar

_Client = TypeVar("_Client", bound=Hashable)
_Item = TypeVar("_Item")


class FairQueue(Generic[_Client, _Item]):
    """Items queued per client, taken one per client in turn (round robin over the clients waiting).

    Example::

        >>> queue = FairQueue()
        >>> for client, call in [("a", 1), ("a", 2), ("a", 3), ("b", 4)]:
        ...     queue.push(client, call)
        >>> [queue.pop() for _ in range(len(queue))]
        [('a', 1), ('b', 4), ('a', 2), ('a', 3)]
    """

    def __init__(self) -> None:
        # insertion order is the rotation: the first client takes the next turn; never an empty deque
        self._clients: collections.OrderedDict[_Client, collections.deque[_Item]] = collections.OrderedDict()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def push(self, client: _Client, item: _Item) -> None:
        """Queue ``item`` after ``client``'s other items; a client not waiting yet joins the rotation at its end."""
        queued = self._clients.get(client)
        if queued is None:
            self._clients[client] = queued = collections.deque()
        queued.append(item)
        self._count += 1

    def pop(self) -> tuple[_Client, _Item]:
        """Take the oldest item of the client whose turn it is; that client goes to the end of the rotation.

        Raises:
            IndexError: nothing is queued.
        """
        if not self._clients:
            raise IndexError("pop from an empty FairQueue")
        client, queued = next(iter(self._clients.items()))
        item = queued.popleft()
        self._count -= 1
        if queued:
            self._clients.move_to_end(client)
        else:
            del self._clients[client]
        return client, item

    def clients(self) -> int:
        """How many clients have items waiting."""
        return len(self._clients)
