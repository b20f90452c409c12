"""How a worker's time went to its clients: the seconds each one's calls ran, and those run while another waited.

The fair queue (:mod:`rpcdl.server.fair_queue`) promises equal shares of the
worker's time to the clients that keep calls waiting there. Whether a client
keeps a call waiting depends on how soon it sends the next one, which a busy
machine delays; so the worker's total time per client shows the promise only
on a machine that keeps up. The time a client's calls ran *when they were
taken from the queue while another client had a call waiting* shows it
whatever the machine does: a client is only ever taken ahead of a waiting one
that used at least as much, so, over any run, the client of long calls gets
no more of that time than the client of short calls it passed over, give or
take one call. A queue that takes turns per call would give it eight times as
much when its calls are eight times as long.

Records are kept per client address, the most recently served
``MAX_CLIENTS`` of them: a small record each, bounded however many clients
come and go.

Threading: a :class:`TimeShares` has no lock of its own: it is a field of
``rpcdl.server.slots.Slots``, whose lock guards every access to it.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

MAX_CLIENTS = 1024  #: client records kept, the most recently served


class TimeShare(NamedTuple):
    """The worker time one client got.

    Attributes:
        calls: calls of the client that ran.
        busy: seconds they ran.
        contended: seconds run by those of its calls that were taken from the
            queue while another client had a call waiting there.
    """

    calls: int
    busy: float
    contended: float


class TimeShares:
    """The worker time each client got, kept for the ``capacity`` clients served most recently.

    Args:
        capacity: how many clients' records are kept; the one served longest ago goes first.

    Example::

        >>> shares = TimeShares()
        >>> shares.add("127.0.0.1:50001", 0.032, contended=False)
        >>> shares.add("127.0.0.1:50002", 0.004, contended=True)
        >>> shares.snapshot()["127.0.0.1:50002"]
        TimeShare(calls=1, busy=0.004, contended=0.004)
    """

    def __init__(self, capacity: int = MAX_CLIENTS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 (client records kept), got {capacity}")
        self._capacity = capacity
        # per client: [calls, busy seconds, contended seconds]; a list, changed in place (no record made per call)
        self._records: collections.OrderedDict[str, list] = collections.OrderedDict()

    def add(self, client: str, seconds: float, *, contended: bool) -> None:
        """Count a call of ``client`` that ran ``seconds``.

        Args:
            client: the client's address.
            seconds: how long the call ran.
            contended: whether it was taken from the queue while another client had a call waiting.
        """
        records = self._records
        record = records.get(client)
        if record is None:
            records[client] = record = [0, 0.0, 0.0]
            if len(records) > self._capacity:
                records.popitem(last=False)
        else:
            records.move_to_end(client)
        record[0] += 1
        record[1] += seconds
        if contended:
            record[2] += seconds

    def snapshot(self) -> dict[str, TimeShare]:
        """The records kept, by client address, the one served longest ago first."""
        return {client: TimeShare(*record) for client, record in self._records.items()}
