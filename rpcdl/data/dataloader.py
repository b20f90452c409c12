"""RPCDataloader: batches collated on remote workers, delivered in order, exactly once.

Scheduling and failure handling live in :mod:`rpcdl.data.scheduler`: each call
(a batch, or a chunk of small batches: see :mod:`rpcdl.data.epoch`) goes to the
worker expected to deliver it first, a late call gets a copy on another
worker, a worker that fails is taken out, revived (its dataset rebuilt when it
lost it) and rejoins. An exception raised by user code is not retried: it is
raised in place of its batch, with the remote traceback and the batch's
indices.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler
from torch.utils.data._utils.collate import default_collate, default_convert

from ..checks import check_int, check_loader_timeout, check_positive_int
from .chunks import ChunkSizer
from .dataset import RPCDataset
from .epoch import TARGET_CHUNK_BYTES, EpochIterator
from .loader_state import check_state, loader_shape
from .scheduler import WorkerPool, WorkerSlot, probe_async
from .torch_rules import FIXED_ATTRIBUTES, refuse_torch_only

log = logging.getLogger("rpcdl.dataloader")

# ---------------------------------------------------------------------------- the loader


class RPCDataloader:
    """A data loader whose workers are remote processes.

    A drop-in for :class:`torch.utils.data.DataLoader` over an
    :class:`~rpcdl.RPCDataset`: the same sampling arguments and rules, batches
    collated on the workers. Iterating it twice runs two epochs; samplers with
    ``set_epoch`` are told the epoch.

    Args:
        dataset: the remote dataset.
        batch_size: samples per batch; ``None`` yields single samples.
        shuffle: reshuffle the samples every epoch.
        sampler: strategy to draw samples (mutually exclusive with ``shuffle``).
        batch_sampler: yields lists of indices (mutually exclusive with
            ``batch_size``, ``shuffle``, ``sampler`` and ``drop_last``).
        collate_fn: merges samples into a batch, on the worker.
        pin_memory: receive batches into pinned memory when CUDA is available.
        drop_last: drop the last incomplete batch.
        timeout: seconds a worker has to deliver a batch before its batches go
            to the others (a batch that times out on every worker raises
            :class:`~rpcdl.errors.WorkerTimeout`, a ``RuntimeError``); also how
            long the loader waits for a worker to come back when none is left.
            ``0``, as in torch, means no timeout: a worker that dies is still
            noticed at once (its connection breaks), one that hangs is waited
            for, and the loader waits 120 s for a worker to come back. The
            dataset's build on the workers has its own timeout
            (``RPCDataset(..., rpcdl_timeout=)``).
        prefetch_factor: calls in flight or ready per worker, at least; a
            worker whose link has a long round trip gets more, up to 4 times
            as many (see :meth:`worker_windows`). A call fetches one batch, or
            a chunk of consecutive small batches (see ``max_batches_per_call``).
        max_batches_per_call: the most batches (samples, with
            ``batch_size=None``) one call may fetch. Cheap, small batches go
            in chunks of up to that many, about 2 ms of work and 256 KB per
            call, which divides the cost of a call between them; batches of
            a few hundred KB or more, or slow ones, go one per call, as they
            do with ``1``.
        in_order: yield batches in sampler order (``True``) or as they come.
        generator: random generator of the default ``RandomSampler``.
        seed: when set, the random generators of the workers are seeded from
            ``(seed, epoch, batch index)`` before each batch (and each worker
            from ``(seed, epoch)`` and its index at each epoch), so random
            augmentations differ between epochs and repeat across runs,
            whichever worker loads a batch.
        workers, args, kwargs: rpcdataloader's older form: build the
            :class:`~rpcdl.RPCDataset` from ``dataset(*args, **kwargs)`` on ``workers``.

    torch's ``num_workers``, ``persistent_workers``, ``worker_init_fn`` and
    ``multiprocessing_context`` raise a ``TypeError`` saying what replaces them
    here. Several iterators of one loader run independently, each its own
    epoch, as torch's do; they are advanced by one thread at a time (the
    loader runs no thread of its own: each ``next()`` does the work). As in
    torch, ``batch_size``, ``batch_sampler``, ``sampler``, ``drop_last`` and
    ``dataset`` cannot be set after construction.

    Example::

        >>> dataset = rpcdl.RPCDataset(workers, torchvision.datasets.FakeData,
        ...                            transform=torchvision.transforms.ToTensor())  # doctest: +SKIP
        >>> loader = rpcdl.RPCDataloader(dataset, batch_size=32, shuffle=True, pin_memory=True)  # doctest: +SKIP
        >>> for images, labels in loader:  # doctest: +SKIP
        ...     ...
    """

    def __init__(
        self,
        dataset: RPCDataset | Callable,
        batch_size: int | None = 1,
        shuffle: bool | None = False,
        sampler: Sampler | Iterable | None = None,
        batch_sampler: Sampler | Iterable | None = None,
        collate_fn: Callable | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 120,
        *,
        prefetch_factor: int = 2,
        max_batches_per_call: int = 16,
        in_order: bool = True,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        workers: Sequence[str] | None = None,
        args: Sequence = (),
        kwargs: dict[str, Any] | None = None,
        **torch_only: Any,
    ):
        refuse_torch_only(torch_only)
        if workers is not None:
            dataset = RPCDataset(workers, dataset, *args, **(kwargs or {}))
        if not isinstance(dataset, RPCDataset):
            raise TypeError(
                f"dataset must be an RPCDataset, got {type(dataset).__name__}; build it on the workers with "
                "rpcdl.RPCDataset(workers, MyDataset, *args, **kwargs)"
            )
        call_timeout = check_loader_timeout(timeout)
        check_positive_int(prefetch_factor, "prefetch_factor", "calls in flight or ready per worker")
        chunk_sizer = ChunkSizer(check_max_batches_per_call(max_batches_per_call), call_timeout, TARGET_CHUNK_BYTES)
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ValueError(f"batch_size should be a positive integer value, but got batch_size={batch_size}")
        check_int(seed, "seed", optional=True, wrong_type=TypeError)
        # torch.utils.data.DataLoader's rules, with its messages.
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError(
                    "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last"
                )
            batch_size = None
            drop_last = False
        elif batch_size is None and drop_last:
            raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive with drop_last")
        if sampler is None:
            sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
        if batch_size is not None and batch_sampler is None:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        if collate_fn is None:
            collate_fn = default_collate if batch_sampler is not None else default_convert
        if pin_memory and not torch.cuda.is_available():
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=2,
            )

        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        self.timeout = float(timeout)
        self._call_timeout = call_timeout
        self.prefetch_factor = prefetch_factor
        self._chunk_sizer = chunk_sizer
        self.in_order = in_order
        self.generator = generator
        self.seed = seed
        self._pool = WorkerPool(
            dataset.workers, prefetch_factor=prefetch_factor, timeout=self._revival_wait(),
            revive=self._revive, forget=dataset.forget,
        )  # fmt: skip
        self._batches_served = dict.fromkeys(dataset.workers, 0)
        self._next_epoch = 0
        self._explicit_epoch: int | None = None
        self._told_epoch: int | None = None
        self._started_epoch: int | None = None
        self._iterator: EpochIterator | None = None  # the one that yielded last: state_dict() tells its position
        self._open_iterators: weakref.WeakSet[EpochIterator] = weakref.WeakSet()
        self._resume: dict[str, Any] | None = None
        self._drawn_generator: torch.Generator | None = None  # the sampler's, when drawn each epoch as torch does
        self._initialized = True

    def __setattr__(self, name: str, value: Any) -> None:
        if name in FIXED_ATTRIBUTES and getattr(self, "_initialized", False):
            # torch.utils.data.DataLoader's rule and message.
            raise ValueError(f"{name} attribute should not be set after {self.__class__.__name__} is initialized")
        super().__setattr__(name, value)

    def _revival_wait(self) -> float:
        """How long to wait for a worker to come back when none is left (not for ever without a timeout)."""
        return min(self._call_timeout, _DEFAULT_REVIVAL_WAIT)

    # ------------------------------------------------------------------ public

    @property
    def workers(self) -> list[str]:
        """The addresses of the workers this loader uses."""
        return list(self.dataset.workers)

    @property
    def batches_served(self) -> dict[str, int]:
        """How many batches each worker delivered (and the loader accepted) so far."""
        return dict(self._batches_served)

    @property
    def max_batches_per_call(self) -> int:
        """The most batches one call may fetch (see the class); setting it applies to the next call."""
        return self._chunk_sizer.max_chunk_size

    @max_batches_per_call.setter
    def max_batches_per_call(self, value: int) -> None:
        self._chunk_sizer.max_chunk_size = check_max_batches_per_call(value)

    def worker_states(self) -> dict[str, str]:
        """Each worker's state: ``active``, ``down``, ``probing`` or ``excluded``."""
        return self._pool.states()

    def worker_windows(self) -> dict[str, dict[str, Any]]:
        """Per worker: ``state``, calls ``in_flight``, its ``window`` (calls it may have in flight: from
        ``prefetch_factor`` to 4 times it, to cover its link's round trip) and, in seconds (``None`` until
        measured), its ``service_time``, shortest round trip ``rtt`` and recent average ``round_trip``.

        Example: ``loader.worker_windows()["127.0.0.1:6543"]["window"]`` gives ``2`` on loopback.
        """
        return self._pool.windows()

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch``.

        Otherwise epochs count iterations from 0, or follow the epoch last given
        to the sampler's own ``set_epoch`` when the training loop calls it.
        """
        self._explicit_epoch = check_int(epoch, "epoch", minimum=0)

    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        return len(self.sampler)

    @property
    def epoch(self) -> int | None:
        """The epoch of the iteration in progress (or last run); ``None`` before the first."""
        return self._started_epoch

    def __iter__(self) -> Iterator[Any]:
        """Start an epoch. It begins with the first ``next()``: an iterator made and dropped costs nothing.

        Iterators already open go on: each yields its whole epoch, as torch's do
        (``zip(loader, loader)``, or ``next(iter(loader))`` inside the training loop).
        """
        iterator = EpochIterator(self)
        self._open_iterators.add(iterator)
        return iterator

    def close(self) -> None:
        """End every epoch in progress; batches still in flight are dropped when they arrive."""
        for iterator in list(self._open_iterators):
            iterator.close()

    def _begin_epoch(self) -> tuple[int, Any, dict[str, Any] | None]:
        """Choose the epoch, tell the samplers; return ``(epoch, generator state, resumed state)``."""
        resume, self._resume = self._resume, None
        samplers = [s for s in (self.sampler, self.batch_sampler, getattr(self.batch_sampler, "sampler", None)) if s]
        told = {getattr(s, "epoch", self._told_epoch) for s in samplers if hasattr(s, "set_epoch")}
        if resume is not None:
            epoch = resume["epoch"]
        elif self._explicit_epoch is not None:
            epoch = self._explicit_epoch
        elif told - {self._told_epoch}:
            epoch = max(told - {self._told_epoch})  # the user called sampler.set_epoch(): follow it
        else:
            epoch = self._next_epoch
        self._explicit_epoch = None
        self._next_epoch = epoch + 1
        self._started_epoch = epoch
        for sampler in samplers:
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
        self._told_epoch = epoch
        saved = resume.get("generator_state") if resume is not None else None
        generator = self._own_generator()
        if generator is not None and saved is not None:
            generator.set_state(saved)
        start = generator.get_state() if generator is not None else None
        # torch's DataLoader draws its workers' base seed here: the same draw keeps the random
        # streams (the global one, or the loader's generator) where torch would leave them.
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        if generator is None:
            generator = self._epoch_generator()
            if generator is not None:
                if saved is not None:
                    generator.set_state(saved)
                start = generator.get_state()
        return epoch, start, resume

    def state_dict(self) -> dict[str, Any]:
        """The position in the current epoch: load it into a new loader to resume.

        The position is that of the iterator that yielded a batch last (when
        several are open at once). It records what determines the batches
        (their number per epoch, ``batch_size``, ``drop_last``, the sampler's
        kind, ``in_order``): a loader whose batches differ refuses it.

        With the semantics of torchdata's ``StatefulDataLoader``: a loader that
        loads this state yields, on its next iteration, the batches of the same
        epoch not yielded yet, in the same order (the sampler's random order is
        restored through its generator). Once every batch of an epoch has been
        yielded, the state is the start of the next epoch.
        """
        shape = loader_shape(self)
        if self._resume is not None:
            return {**shape, **self._resume}
        iterator = self._iterator
        if iterator is not None and iterator.started and not iterator.finished:
            state = iterator.state_dict()
            if not self._epoch_complete(state):
                return {**shape, **state}
        generator = self._own_generator()
        return {
            **shape,
            "epoch": self._explicit_epoch if self._explicit_epoch is not None else self._next_epoch,
            "yielded_prefix": 0,
            "yielded_extra": [],
            "generator_state": generator.get_state() if generator is not None else None,
        }

    def _epoch_complete(self, state: dict[str, Any]) -> bool:
        try:
            return not state["yielded_extra"] and state["yielded_prefix"] >= len(self)
        except TypeError:  # a sampler without a length
            return False

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration continues that epoch.

        Raises:
            TypeError: ``state`` is not a dict, or one of its fields has the wrong type.
            ValueError: a field is missing or out of range, or the state comes from
                a loader whose batches differ (the message names each differing
                field with both values).
        """
        state = check_state(state, loader_shape(self))
        self.close()
        self._resume = state

    def _revive(self, slot: WorkerSlot) -> torch.futures.Future:
        """Make a failed worker usable: rebuild the dataset where it was lost, else probe it."""
        if self.dataset.rref(slot.address):  # a batch will tell whether it still holds the dataset
            return probe_async(slot, min(self._call_timeout, 10.0))
        built = self.dataset.build_async(slot.address)
        return built.then(lambda done: self.dataset.accept(slot.address, *done.wait()))

    def _random_sampler(self) -> Sampler | Iterable:
        return self.sampler if self.batch_sampler is None else getattr(self.batch_sampler, "sampler", self.sampler)

    def _epoch_generator(self) -> torch.Generator | None:
        """A ``RandomSampler`` without a generator of its own: a new one for the epoch starting now.

        Seeded from torch's global generator, as the sampler's ``__iter__`` would
        seed it: the same order as torch's for the same seed, and a generator the
        loader can keep in its state to resume the epoch. ``None`` for other samplers.
        """
        sampler = self._random_sampler()
        if not isinstance(sampler, RandomSampler):
            return None
        if sampler.generator is not None and sampler.generator is not self._drawn_generator:
            return None
        generator = torch.Generator()
        generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        sampler.generator = self._drawn_generator = generator
        return generator

    def _own_generator(self) -> torch.Generator | None:
        """The sampler's generator when it is the user's (a generator drawn per epoch is not, between epochs)."""
        generator = getattr(self._random_sampler(), "generator", None)
        if not isinstance(generator, torch.Generator) or generator is self._drawn_generator:
            return None
        return generator

    def __repr__(self) -> str:
        return f"RPCDataloader({self.dataset!r}, batch_size={self.batch_size}, workers={len(self.dataset.workers)})"


def check_max_batches_per_call(value: Any) -> int:
    """Return ``value``; raise ``ValueError`` unless it is a positive integer (a loader's ``max_batches_per_call``).

    Example::

        >>> check_max_batches_per_call(16)
        16
    """
    return check_positive_int(value, "max_batches_per_call", "batches one call may fetch (1: one each)")


_DEFAULT_REVIVAL_WAIT = 120.0
