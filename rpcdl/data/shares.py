"""Each rank's share of a changing fleet: balanced, the same on every rank, and little moved by a join or a leave.

:func:`assignment` maps ``W`` worker addresses to ``R`` ranks as a pure
function of (the set of addresses, ``R``): every rank computes the same
assignment without talking to the others, and the order in which a source
lists the addresses does not matter.

Invariants:

* **Balance.** With ``W >= R``, every worker serves exactly one rank and every
  rank gets ``floor(W/R)`` or ``ceil(W/R)`` workers. With ``W < R``, every rank
  gets exactly one worker and every worker serves ``floor(R/W)`` or
  ``ceil(R/W)`` ranks.
* **Few moves.** A worker that joins or leaves moves some other workers
  between ranks, each one (rank, worker) pair of the assignment changed: a
  few chains of crossings, each at most as long as the tree is deep, where
  splitting the sorted order into runs moves about ``R / 2``. The count of
  moved workers depends on ``R``, not on ``W``, so the changed part of the
  pairs falls as the fleet grows. ``benchmarks/shares.py``
  measures the mean, the 99th percentile and the worst over many changes;
  tests bound the worst and the mean of a fixed set of changes at 1,024
  ranks for 1,024, 4,000, 4,096, 4,097, 4,150, 4,200 and 8,192 workers.

How (``W >= R``). Each address has two hashes: a position ``p`` in ``[0, 1)``
and a priority ``g``. The ranks are split in halves recursively (a binary tree
over ``0..R-1``); a node holds the ranks ``[a, b)`` and the workers handed to
it, and gives each half its workers:

1. *Counts.* With ``Q = W // R``, a node of ``R'`` ranks holds ``Q*R' + e``
   workers, ``0 <= e <= R'``: ``e`` extra workers, at most one per rank. Its
   left half of ``R1`` ranks gets ``e1`` of the extras, its right half of
   ``R2`` ranks the other ``e - e1``, with ``max(0, e - R2) <= e1 <= min(R1,
   e)`` so that both halves can hold theirs. That keeps the invariant down to
   the leaves, where a rank holds ``Q`` or ``Q + 1``: the balance.
2. *Who.* The workers whose position lies in the left half's arc of
   ``[0, 1)`` (``p < mid / R``) would go left: that is consistent hashing, which
   moves nobody when a worker joins. ``e1`` is that natural count less
   ``Q*R1`` where that lies within its bounds: nobody crosses. Past a bound
   it is clipped, so that the half that gives crossers takes all the extras
   it can and the holes (ranks without one) sit in the half that receives;
   but with ``2e <= R'`` that half takes one extra fewer than it can, one
   step down as its surplus passes the bound by one (so that one worker more
   or less moves ``e1`` by one at most): a lone extra sits in the half that
   receives crossers, as a lone hole does. When the natural left side holds
   more than its count, some of its workers go right; when fewer, some of the
   right side's come left. Those that cross are the ones that crossed most
   often already, then those of highest priority ``g``.
3. *Where a crosser lands.* A worker that crosses takes a new position,
   hashed from its priority and its number of crossings, uniform in the arc of
   the half it enters, and counts as that half's own below.

Why a join moves few. Down the tree, the newcomer lands in one half. Either
that half's count grows by one (the extra goes where it landed: nothing else
moves at this node), or the count stays and one worker crosses to the other
half. Three things keep that crossing from spreading. The crosser enters the
other half at a random place, as one join would, rather than piled at the
edge next to the boundary, where a crowd of crossers would overflow the edge
rank and push more across at every level below. A worker that has crossed
crosses again first: when a half must give one back, it gives the one that
just came in. And a lone extra sits in the half that receives crossers. So
when the worker passed on lands in the half without the extra, that half
must give one worker more, and gives that one: a change travels as one
worker passed on, from the node where it is forced down to the rank that
takes the extra, one moved worker in all. Were the extra in the half that
gives, the same landing would make that half give one worker fewer: it would
keep back a worker of its own, which then stays with the extra while the
one passed on stays where it landed, each crossing handing both halves a
different change (a worker in and one out at independent places) that then
spread in both, at about every other node. A hole (a rank short of the
extra) sits in the receiving half for the same reason, read in reverse.
Only one extra goes across: with more, every change of the surplus of a
node past its bound would move its split, and between multiples of ``R``
many nodes lie there.

Where the moves come from. Where ``W`` is an exact multiple of ``R`` every
count is forced, and the rank that takes the extra lies at the end of a path
of ``log2 R`` nodes. At each of them the newcomer lands on the extra's side
or not: one chance in two, whatever rule picks that side from the counts,
since no rule can tell from the set which of its workers is the new one.
When not, its side gives one worker more, which carries the change on as
above, and is left with a swap: the newcomer in, the worker it gave out.
Below, where those two part, the newcomer's half must give one worker more
or take one fewer. Taking one fewer mostly costs nothing more: the worker
that went out was first in line on its side, so it was among the crossers
the other half sent, and the swap goes on as one. Giving one more sends a
worker other than the newcomer (which has not crossed: one of many in
line), and the swap becomes two. So a change moves a few times half the
depth's worth of workers: about 10 on average at 1,024 ranks within a
couple of workers of a multiple of ``R``, twice as many in one change in a
hundred, and at most about three times as many. Between multiples the
counts have slack and fewer cross where the extras are many (4,000 or
4,200 workers over 1,024 ranks: 5 to 9 on average); a few workers past a
multiple, with several extras in a node but few, a change moves about as
many as where a lone extra went to the half that gives (4,100: about 17).
A leave is the same in reverse. Rendezvous hashing moves nobody but is
uneven (some ranks get none); this gives up those moves for the balance.

With ``W < R`` the same tree gives ``W`` ranks one worker each (``Q = 0``, so
that one worker more or less near ``W = R`` moves as few as elsewhere); the
ranks left without one are then handed out to the workers, taken in the order
of their positions, by the same tree with the roles swapped: each worker
serves its one rank plus ``floor((R-W)/W)`` or ``ceil((R-W)/W)`` of those,
``floor(R/W)`` or ``ceil(R/W)`` in all. A join or a leave moves most of those
handed-out ranks, since each worker's arc shifts; with ``W`` close to ``R``
they are few.

Cost: two hashes per address, a mix per crossing and ``O(W log W)`` work
for the whole assignment (a sort of each node's crossing side, ``log R``
levels deep), shared by every rank of a process (cached per list and per set
of addresses and ``R``).

Threading: pure functions; the cache is ``functools.lru_cache``'s, safe to
call from any thread.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence

__all__ = ["assignment", "rank_share"]

#: (position in [0, 1), crossings * 2**64 + priority, the item)
_Keyed = tuple[float, int, object]


def _keys(item: object, salt: str) -> tuple[float, int]:
    digest = hashlib.blake2b(f"{salt}|{item}".encode(), digest_size=16).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64, int.from_bytes(digest[8:], "big")


def _split(items: list[_Keyed], bins: int) -> list[list[object]]:
    """Hand ``items`` to ``bins`` bins, ``len(items) // bins`` or one more each (the tree of the module's
    docstring)."""
    quota = len(items) // bins
    out: list[list[object]] = [[] for _ in range(bins)]
    # An explicit stack of nodes: (items, first bin, end bin, extras).
    stack: list[tuple[list[_Keyed], int, int, int]] = [(items, 0, bins, len(items) - quota * bins)]
    while stack:
        held, first, end, extras = stack.pop()
        if end - first == 1:
            out[first] = [item for _, _, item in held]
            continue
        middle = (first + end) // 2
        left_bins, right_bins = middle - first, end - middle
        boundary = middle / bins
        left = [keyed for keyed in held if keyed[0] < boundary]
        right = [keyed for keyed in held if keyed[0] >= boundary]
        left_extras = _left_extras(len(left) - quota * left_bins, extras, left_bins, right_bins)
        wanted = quota * left_bins + left_extras
        if len(left) > wanted:
            left.sort(key=_order)
            right.extend(_crossed(keyed, middle, right_bins, bins) for keyed in left[wanted:])
            del left[wanted:]
        elif len(left) < wanted:
            right.sort(key=_order)
            keep = len(right) - (wanted - len(left))
            left.extend(_crossed(keyed, first, left_bins, bins) for keyed in right[keep:])
            del right[keep:]
        stack.append((left, first, middle, left_extras))
        stack.append((right, middle, end, extras - left_extras))
    return out


def _left_extras(surplus: int, extras: int, left_bins: int, right_bins: int) -> int:
    """How many of a node's ``extras`` its left half takes, given the left half's natural ``surplus`` over ``quota``
    per bin (step 2 of the module's docstring): the surplus itself where both halves can hold theirs; past a
    bound, clipped, except that with at most half the bins holding an extra the half that gives crossers takes
    one fewer than it can."""
    low, high = max(0, extras - right_bins), min(left_bins, extras)
    if 2 * extras <= left_bins + right_bins:
        # Extras are the scarce ones: past a bound, the half that gives crossers keeps one extra fewer than it
        # could, stepping down as its surplus grows, so that one worker more or less moves the split by one.
        # One and no more: a deeper step would answer every change of the surplus in a wide band of nodes.
        if surplus > high:
            surplus = max(2 * high - surplus, high - 1)
        elif surplus < low:
            surplus = min(2 * low - surplus, low + 1)
    return min(max(surplus, low), high)


def _order(keyed: _Keyed) -> int:
    """The order in which a side's workers cross, the last first: those that crossed most, then by priority."""
    return keyed[1]


def _crossed(keyed: _Keyed, first: int, count: int, bins: int) -> _Keyed:
    """``keyed`` crossed into the half of ``count`` bins from ``first``: a new position, hashed, inside that half's
    arc, and one crossing more in its order."""
    order = keyed[1] + _CROSSING
    return (first + (_mix(order + (order >> 64) * _GOLDEN) >> 11) / 2.0**53 * count) / bins, order, keyed[2]


_CROSSING = 1 << 64
_MASK = _CROSSING - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(value: int) -> int:
    """A 64-bit mix of ``value``'s bits (splitmix64's finalizer)."""
    value &= _MASK
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK
    return value ^ (value >> 31)


@functools.lru_cache(maxsize=8)
def _assignment(addresses: frozenset[str], world_size: int) -> tuple[tuple[str, ...], ...]:
    keyed: list[_Keyed] = [(*_keys(address, "worker"), address) for address in addresses]
    shares = [sorted(share) for share in _split(keyed, world_size)]
    if len(addresses) < world_size:  # each worker has one rank or none; the others are handed out among them
        workers = [address for _, _, address in sorted(keyed)]
        empty = [rank for rank, share in enumerate(shares) if not share]
        ranks: list[_Keyed] = [((rank + 0.5) / world_size, _keys(rank, "rank")[1], rank) for rank in empty]
        for worker, served in zip(workers, _split(ranks, len(workers)), strict=True):
            for rank in served:
                shares[rank] = [worker]  # type: ignore[index]
    return tuple(tuple(share) for share in shares)  # type: ignore[misc]


def assignment(addresses: Iterable[str], world_size: int) -> tuple[tuple[str, ...], ...]:
    """Every rank's share of a changing fleet: ``assignment(addresses, R)[r]`` is rank ``r``'s workers, sorted.

    A pure function of the set of ``addresses`` and ``world_size`` (see the
    module's docstring for the invariants and why a join or a leave moves
    few workers), cached per set so that every rank of a process shares one
    computation.

    Args:
        addresses: the workers' ``HOST:PORT`` addresses (their order does not matter; repeats count once).
        world_size: the number of ranks, at least 1.

    Returns:
        one tuple of addresses per rank: ``floor(W/R)`` or ``ceil(W/R)`` of them each; with fewer workers than
        ranks, one each, every worker serving ``floor(R/W)`` or ``ceil(R/W)`` ranks; no worker: all empty.

    Raises:
        ValueError: ``world_size`` is not a positive integer.

    Example::

        >>> shares = assignment([f"10.0.0.{i}:6543" for i in range(10)], 4)
        >>> sorted(len(share) for share in shares)
        [2, 2, 3, 3]
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer of at least 1 (the number of ranks), got {world_size!r}")
    listed = addresses if isinstance(addresses, tuple) else tuple(addresses)
    if not listed:
        return ((),) * world_size
    return _listed(listed, world_size)


@functools.lru_cache(maxsize=8)
def _listed(addresses: tuple[str, ...], world_size: int) -> tuple[tuple[str, ...], ...]:
    """:func:`_assignment` of one list as given: a rank that asks again with the same tuple (a fleet's
    membership) finds it without building the set again."""
    return _assignment(frozenset(addresses), world_size)


def rank_share(addresses: Sequence[str], rank: int, world_size: int) -> tuple[str, ...]:
    """Rank ``rank``'s share of :func:`assignment`, in the order of ``addresses``.

    Example::

        >>> rank_share(["a:1", "b:1", "c:1", "d:1"], 0, 2) in (("a:1", "b:1"), ("a:1", "c:1"), ("a:1", "d:1"),
        ...                                                     ("b:1", "c:1"), ("b:1", "d:1"), ("c:1", "d:1"))
        True
    """
    own = set(assignment(addresses, world_size)[rank])
    seen: set[str] = set()
    share = []
    for address in addresses:
        if address in own and address not in seen:
            seen.add(address)
            share.append(address)
    return tuple(share)
