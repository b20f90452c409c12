"""RPCDataloader: batches collated on remote workers, delivered in order, exactly once.

Scheduling and failure handling live in :mod:`rpcdl.data.scheduler`: each call
(a batch, or a chunk of small batches: see :mod:`rpcdl.data.epoch`) goes to the
worker expected to deliver it first, a late call gets a copy on another
worker, a worker that fails is taken out, revived (its dataset rebuilt when it
lost it) and rejoins. An exception raised by user code is not retried: it is
raised in place of its batch, with the remote traceback and the batch's
indices.

Threading: a loader runs no thread of its own; each ``next()`` of one of its
iterators does the work, on the thread that calls it. Several iterators of one
loader may be advanced by several threads at once, each iterator by one thread
at a time (see :mod:`rpcdl.data.epoch`). What they share has one owner each:
the workers' records are the pool's, under its lock
(:mod:`rpcdl.data.worker_pool`); the epochs' bookkeeping is the
:class:`~rpcdl.data.epoch_book.EpochBook`'s, under its lock; the chunk sizer
and the served counts have their own locks, and so has an
:class:`~rpcdl.data.elastic.ElasticDistributedSampler` for the origin of its
epoch (set by the book as an epoch begins). The loader's other fields are its
settings, changed by the user's thread between epochs.

A state is written and read by :mod:`rpcdl.data.resume` alone
(:meth:`RPCDataloader.state_dict`, :meth:`RPCDataloader.load_state_dict`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler
from torch.utils.data._utils.collate import default_collate, default_convert

from ..checks import check_int, check_loader_timeout, check_number, check_positive_int
from .chunked_pass import ChunkSizer, ServedCounts
from .dataset import DatasetSetup, RPCDataset
from .elastic import ElasticDistributedSampler
from .epoch import TARGET_CHUNK_BYTES, EpochCall, EpochIterator, EpochPlan
from .epoch_book import EpochBook
from .fetch import fetch_batches_at, fetch_samples_at
from .flow import LIVE_POOLS, PROCESS_FLOW, DataFlow, FlowSnapshot
from .probes import PROBE_TIMEOUT
from .resume import epoch_batches, loader_shape, read_loader_state, write_loader_state
from .torch_rules import FIXED_ATTRIBUTES, refuse_torch_only
from .trainer_metrics import serve_metrics_from_environment
from .worker_pool import WorkerPool

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
        prefetch_factor: calls in flight or ready per worker, at least (and
            3 at least: one runs at the worker, one waits there, and one
            covers the way back of its answer and of the next call); a
            worker whose link has a long round trip gets more, up to
            4 times as many (see :meth:`worker_windows`). A call fetches one batch, or
            a chunk of consecutive small batches (see ``max_batches_per_call``).
        max_batches_per_call: the most batches (samples, with
            ``batch_size=None``) one call may fetch. Cheap, small batches go
            in chunks of up to that many, about 4 ms of work and 512 KB per
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
    here, except ``num_workers=0`` and ``persistent_workers=False``, which
    describe what rpcdl does (no loading processes in the trainer). Several
    iterators of one loader run independently, each its own epoch, as
    torch's do, on one thread or several (each iterator advanced by one
    thread at a time: another thread entering the same iterator's
    ``next()`` meanwhile gets a ``RuntimeError``). The loader runs no thread of
    its own: each ``next()`` does the work. As in
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
        max_batches_per_call: int = 32,
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
        self.seed = seed
        setup = DatasetSetup(dataset, min(call_timeout, PROBE_TIMEOUT))
        self._pool = WorkerPool(
            dataset.fleet, prefetch_factor=prefetch_factor, timeout=self._revival_wait(), setup=setup
        )
        LIVE_POOLS.add(self._pool)
        serve_metrics_from_environment()  # when RPCDL_METRICS_PORT asks for it, once per process
        self._flow = DataFlow(parent=PROCESS_FLOW)
        self._batches_served = ServedCounts(dataset.workers, self._flow)
        random_sampler = sampler if batch_sampler is None else getattr(batch_sampler, "sampler", sampler)
        samplers = [s for s in (sampler, batch_sampler, getattr(batch_sampler, "sampler", None)) if s]
        self._epochs = EpochBook(samplers, random_sampler, generator)
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
        return self._batches_served.snapshot()

    @property
    def generator(self) -> torch.Generator | None:
        """The random generator of the default ``RandomSampler`` (torch draws its workers' base seed from it
        at each epoch; so does this loader, to leave the random streams where torch would)."""
        return self._epochs.generator

    @generator.setter
    def generator(self, generator: torch.Generator | None) -> None:
        self._epochs.generator = generator

    @property
    def max_batches_per_call(self) -> int:
        """The most batches one call may fetch (see the class); setting it applies to the next call."""
        return self._chunk_sizer.max_chunk_size

    @max_batches_per_call.setter
    def max_batches_per_call(self, value: int) -> None:
        self._chunk_sizer.max_chunk_size = check_max_batches_per_call(value)

    def data_flow(self) -> FlowSnapshot:
        """This loader's data flow so far: batches, seconds its consumer waited in ``next()`` and worked between
        them, seconds its workers spent on the batches. Two snapshots give the figures between them.

        Example::

            >>> start = loader.data_flow()  # doctest: +SKIP
            >>> for batch in loader: ...  # doctest: +SKIP
            >>> figures = loader.data_flow().since(start)  # doctest: +SKIP
            >>> figures.data_wait_fraction, figures.workers_needed  # doctest: +SKIP
            (0.42, 3.4)
        """
        return self._flow.snapshot()

    def worker_states(self) -> dict[str, str]:
        """Each worker's state: ``active``, ``down``, ``probing``, ``excluded``, ``draining`` (it said it is
        leaving: its calls in flight finish), ``standby`` (another rank's, used once this rank's own are gone)
        or ``left`` (its source no longer lists it)."""
        return self._pool.states()

    def worker_windows(self) -> dict[str, dict[str, Any]]:
        """Per worker: ``state``, calls ``in_flight``, its ``window`` (calls it may have in flight: from
        ``prefetch_factor``, 3 at least, to 4 times it, to cover its link's round trip) and, in seconds (``None`` until
        measured), its ``service_time``, shortest round trip ``rtt`` and recent average ``round_trip``.

        Example: ``loader.worker_windows()["127.0.0.1:6543"]["window"]`` gives ``3`` on loopback.
        """
        return self._pool.windows()

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch``.

        Otherwise epochs count iterations from 0, or follow the epoch last given
        to the sampler's own ``set_epoch`` when the training loop calls it. A
        subclass's :meth:`requested_epoch`, when it names one, comes first.
        """
        self._epochs.choose(check_int(epoch, "epoch", minimum=0))

    def __len__(self) -> int:
        return self._batches_numbered()

    def _batches_numbered(self) -> int:
        """The batches of an epoch; in one resumed on another cluster shape, the batches counted before it too."""
        elastic = self._elastic_sampler()
        if elastic is not None:
            return epoch_batches(elastic.layout(), self._epochs.origin(), self.batch_size, self.drop_last)
        return len(self.batch_sampler) if self.batch_sampler is not None else len(self.sampler)

    def _elastic_sampler(self) -> ElasticDistributedSampler | None:
        """The sampler when its epochs resume from a global position (it is this loader's, batched by
        torch's ``BatchSampler``), else ``None``."""
        sampler = self.sampler
        if isinstance(sampler, ElasticDistributedSampler) and (
            self.batch_sampler is None or type(self.batch_sampler) is BatchSampler
        ):
            return sampler
        return None

    @property
    def epoch(self) -> int | None:
        """The epoch of the iteration in progress (or last run); ``None`` before the first."""
        return self._epochs.epoch

    def __iter__(self) -> Iterator[Any]:
        """Start an epoch. It begins with the first ``next()``: an iterator made and dropped costs nothing.

        Iterators already open go on: each yields its whole epoch, as torch's do
        (``zip(loader, loader)``, or ``next(iter(loader))`` inside the training loop).
        """
        iterator = EpochIterator(_Opener(self))
        self._epochs.opened(iterator)
        return iterator

    def close(self) -> None:
        """End every epoch in progress; batches still in flight are dropped when they arrive.

        Any thread may close the loader: an iterator advanced meanwhile by another thread ends at its next step.
        """
        for iterator in self._epochs.open_iterators():
            iterator.close()

    def requested_epoch(self) -> int | None:
        """The epoch the next iteration must be, when something outside the loader decides it.

        An extension point for subclasses, as Lightning's ``LightningDataModule``
        hooks are: a trainer's loader returns the trainer's current epoch, so
        that the loader's epochs (the sampler's ``set_epoch``, the workers'
        reseeding) follow the trainer whatever iterators it made and dropped
        meanwhile. The loader calls it once as each epoch begins (the first
        ``next()`` of an iterator), on the thread that advances that iterator.
        A state loaded with :meth:`load_state_dict` still wins: it names its
        own epoch.

        Returns:
            a non-negative epoch number, or ``None`` (the default) for the
            loader's own rules: the epoch chosen with :meth:`set_epoch`, else the
            one the user last told the sampler (its ``set_epoch``), else the one
            after the last.

        Example::

            >>> class TrainerLoader(rpcdl.RPCDataloader):  # doctest: +SKIP
            ...     def requested_epoch(self):
            ...         return trainer.current_epoch
        """
        return None

    def epoch_batch_limit(self) -> float:
        """The batches of an epoch its consumer takes at most, when something outside the loader ends epochs early.

        An extension point for subclasses: a trainer that stops each epoch
        after a number of batches without asking for more (Lightning's
        ``limit_train_batches``) returns that number, so that a loader whose
        epoch yielded that many batches tells, in :meth:`state_dict`, the start
        of the next epoch rather than a position in this one. The loader calls
        it in each :meth:`state_dict`, on the thread that calls that; it
        matters only for a sampler with a length.

        Returns:
            a non-negative number of batches, or ``float("inf")`` (the
            default): the consumer takes every batch.

        Example::

            >>> class TrainerLoader(rpcdl.RPCDataloader):  # doctest: +SKIP
            ...     def epoch_batch_limit(self):
            ...         return trainer.num_training_batches
        """
        return float("inf")

    def _open_epoch(self) -> EpochPlan:
        """Begin an epoch (on its iterator's first ``next()``): what it needs."""
        batched = self.batch_sampler is not None
        requested = check_int(
            self.requested_epoch(),
            f"{type(self).__name__}.requested_epoch()",
            minimum=0,
            optional=True,
            wrong_type=TypeError,
        )
        start = self._epochs.begin(requested, self.batch_sampler if batched else self.sampler)
        position = start.position
        # torch's default collate (convert) function is named by None: nothing to pickle per call.
        default = default_collate if batched else default_convert
        call = EpochCall(
            self.dataset,
            self.seed,
            position.epoch,
            fetch_batches_at if batched else fetch_samples_at,
            None if self.collate_fn is default else self.collate_fn,
            self.pin_memory,
            self._call_timeout,
        )
        return EpochPlan(
            position=position,
            batches=start.batches,
            call=call,
            pool=self._pool,
            sizer=self._chunk_sizer,
            served=self._batches_served,
            in_order=self.in_order,
            book=self._epochs,
            reseed_timeout=self._revival_wait(),
            flow=self._flow,
        )

    def state_dict(self) -> dict[str, Any]:
        """The position in the current epoch: load it into a new loader to resume.

        The position is that of the iterator that yielded a batch last (when
        several are open at once). It records what determines the batches
        (their number per epoch, ``batch_size``, ``drop_last``, the sampler's
        kind, ``in_order``, and ``seed_source``: whether a random order comes
        from the loader's ``generator``, from torch's global generator, or from
        the sampler itself): a loader whose batches differ refuses it.

        A loader over an :class:`~rpcdl.distributed.ElasticDistributedSampler`
        (made by :func:`rpcdl.distributed.distributed_loader`) adds the global
        position: the sampler's ``layout`` (the order's ``length``, ``shuffle``
        and ``seed``, the ``world_size`` and ``rank``), ``consumed`` and
        ``consumed_extra`` (the positions of the epoch's global order consumed,
        counting every rank as having yielded the batches this one did) and the
        ``origin`` of an epoch resumed on another shape. Such a state loads on
        any rank of any world size and batch size (see :meth:`load_state_dict`).

        With the semantics of torchdata's ``StatefulDataLoader``: a loader that
        loads this state yields, on its next iteration, the batches of the same
        epoch not yielded yet, in the same order (the sampler's random order is
        restored through its generator). Once every batch of an epoch has been
        yielded, the state is the start of the next epoch.

        The state is a dict of plain data (but ``generator_state``, a tensor)
        with a format ``version``; :mod:`rpcdl.data.resume` writes and reads it.

        Returns:
            the state.

        Example::

            >>> iterator = iter(loader)  # doctest: +SKIP
            >>> first = next(iterator)  # doctest: +SKIP
            >>> resumed = rpcdl.RPCDataloader(dataset, batch_size=4)  # doctest: +SKIP
            >>> resumed.load_state_dict(loader.state_dict())  # doctest: +SKIP
        """
        try:
            batches: int | None = self._batches_numbered()
        except TypeError:
            batches = None
        limit = check_number(
            self.epoch_batch_limit(), f"{type(self).__name__}.epoch_batch_limit()", minimum=0, unit="batches"
        )
        position = self._epochs.position(min(batches, limit) if batches is not None else None)
        elastic = self._elastic_sampler()
        layout = elastic.layout() if elastic is not None else None
        shape = loader_shape(self, batches, self._epochs.seed_source())
        return write_loader_state(shape, position, layout, self.batch_size, self.drop_last)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration continues that epoch.

        A loader over an :class:`~rpcdl.distributed.ElasticDistributedSampler`
        also resumes the state of another rank, world size or batch size over
        the same order (dataset length, ``shuffle``, ``seed``): the samples of
        the epoch not consumed are split among this loader's ranks, each once;
        batches are numbered after those counted before, so ``len()`` is those
        plus this rank's share of the rest until the epoch ends.

        Raises:
            TypeError: ``state`` is not a dict, or one of its fields has the wrong type.
            ValueError: a field is missing or out of range, or the state comes from
                a loader whose batches differ, or from another order (the
                message names each differing field with both values), or holds
                one rank's batches yielded out of order and is loaded on
                another rank or world size (join the ranks' states with
                :func:`rpcdl.distributed.merge_states`).
        """
        elastic = self._elastic_sampler()
        layout = elastic.layout() if elastic is not None else None
        position = read_loader_state(state, self, self._epochs.seed_source(), layout)
        self.close()
        self._epochs.resume(position)  # the sampler is given the origin as the epoch begins

    def __repr__(self) -> str:
        return f"RPCDataloader({self.dataset!r}, batch_size={self.batch_size}, workers={len(self.dataset.workers)})"


def check_max_batches_per_call(value: Any) -> int:
    """Return ``value``; raise ``ValueError`` unless it is a positive integer (a loader's ``max_batches_per_call``).

    Example::

        >>> check_max_batches_per_call(16)
        16
    """
    return check_positive_int(value, "max_batches_per_call", "batches one call may fetch (1: one each)")


class _Opener:
    """Begins an epoch of ``loader`` for its iterator (an :class:`~rpcdl.data.epoch.EpochOpener`).

    The iterator holds it; the loader does not hold the iterator (only a weak
    reference to close it), so no cycle forms.
    """

    __slots__ = ("loader",)

    def __init__(self, loader: RPCDataloader):
        self.loader = loader

    def open(self) -> EpochPlan:
        return self.loader._open_epoch()


_DEFAULT_REVIVAL_WAIT = 120.0
