"""Samples that travel as their stack without being stacked where they are.

A worker's batch call answers with the stack of its samples (torch's
``default_collate``). Over a socket, the stacked tensor exists only to be
sent, so the copy that builds it is waste: a :class:`StackedSamples` is
pickled as the stacked tensor would be, byte for byte, with one out-of-band
buffer made of the samples' own memory
(:class:`~rpcdl.transport.gathered.Gathered`), and the receiver rebuilds one
tensor from it. Anything that pickles it another way stacks it first.

The samples are read when the answer is sent, after the call returned: this
assumes a dataset does not change a sample once it returned it (torch's
DataLoader assumes as much within a batch, which it collates last).

Threading: built by the thread running a call, read by the one sending its answer; not changed after.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["StackedSamples"]


class StackedSamples:
    """Tensors of one shape and dtype, contiguous, on the CPU, to be sent as ``torch.stack(samples)``.

    Args:
        samples: the tensors, in order.

    Example::

        >>> stacked = StackedSamples([torch.zeros(2), torch.ones(2)])
        >>> stacked.stack()
        tensor([[0., 0.],
                [1., 1.]])
    """

    __slots__ = ("samples",)

    def __init__(self, samples: Sequence[torch.Tensor]):
        self.samples = list(samples)

    def stack(self) -> torch.Tensor:
        """The tensor these samples stand for."""
        return torch.stack(self.samples)

    def __reduce__(self):
        return torch.stack, (self.samples,)
