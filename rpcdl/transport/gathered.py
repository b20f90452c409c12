"""An out-of-band buffer made of pieces: sent back to back, received as one.

A worker's batch of same-shape samples travels as one tensor. Stacking the
samples first costs a copy of the whole batch on the worker; sending each
sample's own memory in turn, as the pieces of one buffer, costs none, and the
receiver reads the buffer into one allocation as it reads any other (the
lengths on the wire are the same). See :class:`rpcdl.serialization.stacked.StackedSamples`.

Threading: a :class:`Gathered` is built by one thread and not changed after.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Gathered", "as_view"]


class Gathered:
    """The pieces of one buffer, in order (byte ``memoryview`` objects).

    Args:
        pieces: the buffer's parts; their memory must not change until the frame is sent.

    Example::

        >>> whole = Gathered([memoryview(b"ab"), memoryview(b"cd")])
        >>> whole.nbytes, bytes(whole.joined())
        (4, b'abcd')
    """

    __slots__ = ("nbytes", "pieces")

    def __init__(self, pieces: Sequence[memoryview]):
        self.pieces = list(pieces)
        self.nbytes = sum(piece.nbytes for piece in self.pieces)

    def joined(self) -> bytearray:
        """The pieces copied into one buffer (for what needs contiguous memory: compression, say)."""
        whole = bytearray(self.nbytes)
        view, at = memoryview(whole), 0
        for piece in self.pieces:
            view[at : at + piece.nbytes] = piece
            at += piece.nbytes
        return whole


def as_view(buffer: Any) -> memoryview:
    """A byte view of an out-of-band buffer; a :class:`Gathered` one joined first."""
    return memoryview(buffer.joined() if type(buffer) is Gathered else buffer).cast("B")
