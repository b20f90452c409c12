"""Remote preprocessing inside torchdata and torch.utils.data pipelines.

Three ways to put rpcdl workers into a pipeline you already build:

- :class:`RPCMapper`: a ``torchdata.nodes`` node mapping each item through a
  function on the workers, in order, with checkpoints that resume exactly.
- ``rpc_map``: the same as a DataPipe functional form (:class:`RPCMapperIterDataPipe`),
  registered when this module is imported.
- :class:`RPCIterableDataset`: an IterableDataset over batches collated on the
  workers, for a plain :class:`torch.utils.data.DataLoader`, sharded across the
  DataLoader's worker processes and across ranks.

Every process (a forked DataLoader worker included) opens its own connections.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import cloudpickle
import torch
from torch.utils.data import IterableDataset, IterDataPipe, functional_datapipe, get_worker_info

try:
    from torchdata.nodes import BaseNode
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("rpcdl.integrations.torchdata needs torchdata>=0.9: pip install 'rpcdl[torchdata]'") from exc

from rpcdl.checks import check_int, check_positive_int
from rpcdl.data.chunked_pass import ChunkedItem, ChunkedPass, ChunkedPassState
from rpcdl.data.dataloader import RPCDataloader
from rpcdl.data.dataset import RPCDataset
from rpcdl.data.guard import EntryGuard
from rpcdl.data.ranks import rank_and_world_size
from rpcdl.data.sources import WorkerSource

from ._remote_map import DEFAULT_MAX_CHUNK_SIZE, RemoteMap, check_fn, check_options, listed, workers_or_source

__all__ = ["RPCIterableDataset", "RPCMapper", "RPCMapperIterDataPipe"]

X = TypeVar("X")
T = TypeVar("T")


class _RemoteMapOwner:
    """Gives each process its own :class:`RemoteMap` (a forked child never shares its parent's)."""

    workers: list[str] | WorkerSource
    fn: Callable
    prefetch_factor: int
    timeout: float
    pin_memory: bool
    max_chunk_size: int
    _remote_map: RemoteMap | None

    def _get_remote_map(self) -> RemoteMap:
        remote_map = self._remote_map
        if remote_map is None or remote_map.pid != os.getpid():
            remote_map = self._remote_map = RemoteMap(
                self.workers, self.fn, prefetch_factor=self.prefetch_factor, timeout=self.timeout,
                pin_memory=self.pin_memory, max_chunk_size=self.max_chunk_size,
            )  # fmt: skip
        return remote_map

    @property
    def items_served(self) -> dict[str, int]:
        """How many items each worker mapped (and this process accepted) so far."""
        if self._remote_map is None or self._remote_map.pid != os.getpid():
            return dict.fromkeys(listed(self.workers), 0)
        return self._remote_map.items_served.snapshot()

    def worker_states(self) -> dict[str, str]:
        """Each worker's state in this process: ``active``, ``down`` or ``probing``."""
        if self._remote_map is None or self._remote_map.pid != os.getpid():
            return dict.fromkeys(listed(self.workers), "active")
        return self._remote_map.pool.states()


# ---------------------------------------------------------------------------- torchdata.nodes


class RPCMapper(_RemoteMapOwner, BaseNode[T]):
    """A ``torchdata.nodes`` node that maps each item of ``source`` through ``fn`` on remote workers.

    Items come out in the order of ``source``. They travel in chunks: one call
    maps a list of items on a worker. A chunk starts at one item and grows
    while ``fn`` is cheap (aiming at about 4 ms of work per call, at most
    ``max_chunk_size`` items); filling one never waits for a slow source, it
    goes with the items there. Each chunk goes to the worker expected to finish
    it first, at most ``prefetch_factor`` chunks (2 at least) in flight per worker, and at
    most that many chunks per worker are pulled from ``source`` ahead of the
    item handed out: up to ``prefetch_factor * max_chunk_size`` items per
    worker are held in memory (a worker on a link with a long round trip may
    get up to four times as many calls). A worker that dies, disconnects or
    does not answer a chunk within ``timeout``: the chunk goes whole to the
    other workers, the worker is probed in the background and used again when
    it answers. An exception raised by ``fn`` is not retried: it is raised in
    the item's place (the remote traceback attached), after the items of its
    chunk before it, and the next call goes on with the following item. A
    chunk that fails as a whole otherwise (its answer breaks a message limit
    or cannot be pickled, or it timed out on every worker) is mapped again one
    item per call, so its error comes at the item that causes it. An
    exception raised by ``source`` comes out in its place too, after every
    item pulled before it, as with ``Mapper`` and ``ParallelMapper``; the next
    call goes on with what ``source`` gives next (as ``Mapper`` does;
    ``ParallelMapper`` blocks there).

    The state (``state_dict()`` of a :class:`torchdata.nodes.Loader`) holds the
    state of ``source`` after the last item handed out, so items pulled ahead
    are pulled again on resume: a pipeline loaded with it yields exactly the
    items not yielded yet. As with ``ParallelMapper``, an error handed out
    does not move the state: a state taken right after it resumes with the
    failed item, which is mapped (or pulled from ``source``) again.

    Across ranks: the state is ``source``'s, so it resumes on another world
    size where the source's state does. Shard with
    ``SamplerWrapper(rpcdl.distributed.ElasticDistributedSampler(...))``: its
    state holds the global position (the samples consumed in the epoch's
    global order, every rank counted as having taken as many as this one), and
    any rank of any world size resumes it, each sample not consumed once. A
    source sharded otherwise (torch's ``DistributedSampler``, a list sliced by
    rank) counts the items of its own shard only: its state resumes on the
    same rank and world size, not on another.

    Args:
        source: the node whose items are mapped.
        workers: worker addresses, ``"host:port"``; or a worker source (a file, ``"dns://NAME:PORT"``,
            ``"redis://..."``, an :class:`rpcdl.WorkerSource`): workers that join take items mid-pass.
        fn: applied to each item on a worker; anything cloudpickle can send
            (lambdas and closures too). It is sent with every call (chunk):
            keep what it captures small and build heavy objects on the workers.
        prefetch_factor: calls (chunks) in flight per worker.
        timeout: seconds a worker has to map a chunk before the chunk goes to
            another worker (chunks aim at a twentieth of it at most); also how
            long to wait for a worker to come back when none is left (then
            :class:`rpcdl.NoWorkersLeft` is raised).
        pin_memory: receive tensors into pinned memory when CUDA is available.
        snapshot_frequency: record the state of ``source`` every this many
            items (1: every item; 0: only at the start of the epoch, as
            ``ParallelMapper``). Larger values make ``state_dict`` cheaper
            for sources with large states; resuming then skips up to that many
            items of ``source`` again (with 0, every item handed out so far).
        max_chunk_size: the most items one call maps (1: one call per item,
            for items so large that a chunk of them would hold too much memory).

    Example::

        >>> from torchdata.nodes import Batcher, Loader, SamplerWrapper
        >>> node = SamplerWrapper(range(1000))  # doctest: +SKIP
        >>> node = RPCMapper(node, workers, lambda i: decode(paths[i]))  # doctest: +SKIP
        >>> loader = Loader(Batcher(node, batch_size=32))  # doctest: +SKIP
        >>> for batch in loader:  # doctest: +SKIP
        ...     ...
        >>> checkpoint = loader.state_dict()  # doctest: +SKIP
    """

    SOURCE_KEY = "source"
    STEPS_KEY = "steps_since_snapshot"

    def __init__(
        self,
        source: BaseNode[X],
        workers: Sequence[str],
        fn: Callable[[X], T],
        *,
        prefetch_factor: int = 2,
        timeout: float = 120.0,
        pin_memory: bool = False,
        snapshot_frequency: int = 1,
        max_chunk_size: int = DEFAULT_MAX_CHUNK_SIZE,
    ):
        super().__init__()
        if not isinstance(source, BaseNode):
            raise TypeError(
                f"source must be a torchdata.nodes.BaseNode, got {type(source).__name__}; wrap an iterable in "
                "torchdata.nodes.IterableWrapper or a sampler in torchdata.nodes.SamplerWrapper"
            )
        self.workers = workers_or_source(workers)
        check_fn(fn)
        check_options(prefetch_factor, timeout, max_chunk_size)
        check_int(
            snapshot_frequency, "snapshot_frequency", minimum=0,
            meaning="0: record the source's state only at the start of an epoch",
        )  # fmt: skip
        self.source = source
        self.fn = fn
        self.prefetch_factor = prefetch_factor
        self.timeout = float(timeout)
        self.pin_memory = pin_memory
        self.max_chunk_size = max_chunk_size
        self.snapshot_frequency = snapshot_frequency
        self._remote_map = None
        self._pass: ChunkedPass | None = None
        self._snapshot: dict[str, Any] | None = None
        self._steps = 0
        self._pulled = 0
        self._behind: Any = _UP_TO_DATE  # what the error handed out last did not apply to the state yet
        self._entry = EntryGuard("this RPCMapper")  # one thread at a time in next()

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if self._pass is not None:
            self._pass.close()
            self._pass = None
        if initial_state is not None:
            if not isinstance(initial_state, dict) or not {self.SOURCE_KEY, self.STEPS_KEY} <= initial_state.keys():
                raise ValueError(
                    f"not an RPCMapper state: expected a dict with keys {self.SOURCE_KEY!r} and {self.STEPS_KEY!r}, "
                    f"got {initial_state!r:.200}"
                )
            snapshot, steps = initial_state[self.SOURCE_KEY], initial_state[self.STEPS_KEY]
            self.source.reset(snapshot)
            for skipped in range(steps):
                try:
                    next(self.source)
                except StopIteration:
                    raise ValueError(
                        f"cannot resume RPCMapper: its source ended after {skipped} of the {steps} items to skip; "
                        "the state does not belong to this pipeline"
                    ) from None
            self._snapshot, self._steps = snapshot, steps
        else:
            self.source.reset(None)
            self._snapshot, self._steps = self.source.state_dict(), 0
        self._pulled = 0
        self._behind = _UP_TO_DATE

    def _pull(self) -> Iterator[tuple[Any, Any]]:
        """The items of ``source``, each with the source's state after it (every ``snapshot_frequency``)."""
        source, frequency = self.source, self.snapshot_frequency
        if frequency == 1:  # the default: every item's state, with no count to keep
            state_dict = source.state_dict
            for item in source:
                yield item, state_dict()
            return
        for item in source:
            self._pulled += 1
            yield item, (source.state_dict() if frequency and self._pulled % frequency == 0 else None)

    def _advance(self, snapshot: Any) -> None:
        """Move the state past one thing handed out, which came with ``snapshot`` (or ``None``)."""
        if snapshot is _SOURCE_NOW:
            self._snapshot, self._steps = self.source.state_dict(), 0
        elif snapshot is not None:
            self._snapshot, self._steps = snapshot, 0
        else:
            self._steps += 1

    def next(self) -> T:
        if not self._entry.try_enter():
            raise self._entry.busy()
        try:
            return self._next()
        finally:
            self._entry.leave()

    def _next(self) -> T:
        if self._behind is not _UP_TO_DATE:  # the caller went on after an error: the state moves past it
            self._advance(self._behind)
            self._behind = _UP_TO_DATE
        mapping = self._pass
        if mapping is None:
            mapping = self._pass = self._get_remote_map().start(self._pull())
        try:
            task: ChunkedItem = next(mapping)
        except StopIteration:
            raise
        except Exception:
            if mapping.state is ChunkedPassState.SOURCE_FAILED:  # a new pass goes on with what the source gives next
                self._pass, self._behind = None, _SOURCE_NOW
            raise
        snapshot = task.payload[1]
        if task.error is not None:
            self._behind = snapshot
            return self._remote_map.result(task)  # raises the item's error
        if snapshot is not None:  # _advance, inline: this is every item's path
            self._snapshot, self._steps = snapshot, 0
        else:
            self._steps += 1
        return task.value

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self._snapshot, self.STEPS_KEY: self._steps}


_UP_TO_DATE = object()  # RPCMapper._behind: nothing to apply
_SOURCE_NOW = object()  # RPCMapper._behind: the source raised; its state now is the one after the failure


# ---------------------------------------------------------------------------- DataPipe


@functional_datapipe("rpc_map")
class RPCMapperIterDataPipe(_RemoteMapOwner, IterDataPipe):
    """Map each item of a DataPipe through ``fn`` on remote workers (functional name: ``rpc_map``).

    The DataPipe form of :class:`RPCMapper`, with the same scheduling, order
    and failure handling. Under a :class:`torch.utils.data.DataLoader` with
    worker processes, put ``sharding_filter()`` before ``rpc_map`` so that
    each DataLoader worker maps its own share; each opens its own connections.

    Args:
        source_datapipe: the DataPipe whose items are mapped.
        workers: worker addresses, ``"host:port"``; or a worker source (a file, ``"dns://NAME:PORT"``,
            ``"redis://..."``, an :class:`rpcdl.WorkerSource`): workers that join take items mid-pass.
        fn: applied to each item on a worker (lambdas and closures too).
        prefetch_factor: calls (chunks of items, as :class:`RPCMapper`) in flight per worker.
        timeout: seconds a worker has to map a chunk before it goes to another.
        pin_memory: receive tensors into pinned memory when CUDA is available.
        max_chunk_size: the most items one call maps.

    Example::

        >>> import rpcdl.integrations.torchdata  # registers rpc_map
        >>> from torch.utils.data.datapipes.iter import IterableWrapper
        >>> pipe = IterableWrapper(range(1000)).shuffle().sharding_filter()
        >>> pipe = pipe.rpc_map(workers, lambda i: augment(i)).batch(32)  # doctest: +SKIP
        >>> loader = torch.utils.data.DataLoader(pipe, batch_size=None, num_workers=2)  # doctest: +SKIP
    """

    def __init__(
        self,
        source_datapipe: IterDataPipe,
        workers: Sequence[str],
        fn: Callable,
        *,
        prefetch_factor: int = 2,
        timeout: float = 120.0,
        pin_memory: bool = False,
        max_chunk_size: int = DEFAULT_MAX_CHUNK_SIZE,
    ):
        super().__init__()
        if not isinstance(source_datapipe, IterDataPipe):
            raise TypeError(f"source_datapipe must be an IterDataPipe, got {type(source_datapipe).__name__}")
        self.workers = workers_or_source(workers)
        check_fn(fn)
        check_options(prefetch_factor, timeout, max_chunk_size)
        self.source_datapipe = source_datapipe
        self.fn = fn
        self.prefetch_factor = prefetch_factor
        self.timeout = float(timeout)
        self.pin_memory = pin_memory
        self.max_chunk_size = max_chunk_size
        self._remote_map = None

    def __iter__(self) -> Iterator[Any]:
        remote_map = self._get_remote_map()
        remote_pass = remote_map.start((item, None) for item in self.source_datapipe)
        try:
            for task in remote_pass:
                yield remote_map.result(task)
        finally:
            remote_pass.close()

    def __len__(self) -> int:
        return len(self.source_datapipe)

    def __getstate__(self) -> dict[str, Any]:
        state = {key: value for key, value in self.__dict__.items() if key != "_remote_map"}
        if IterDataPipe.getstate_hook is not None:
            return IterDataPipe.getstate_hook(state)
        state["fn"] = _PickledFunction(cloudpickle.dumps(self.fn))  # lambdas cross to spawned processes
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state.get("fn"), _PickledFunction):
            state["fn"] = cloudpickle.loads(state["fn"].payload)
        state["_remote_map"] = None
        self.__dict__.update(state)


class _PickledFunction:
    __slots__ = ("payload",)

    def __init__(self, payload: bytes):
        self.payload = payload

    def __reduce__(self):
        return _PickledFunction, (self.payload,)


# ---------------------------------------------------------------------------- IterableDataset


class _ShardBatches:
    """Batches ``shard, shard + num_shards, ...`` of ``indices`` cut into ``batch_size`` pieces."""

    def __init__(self, indices: list[int], batch_size: int, drop_last: bool, shard: int, num_shards: int):
        self.indices, self.batch_size = indices, batch_size
        self.shard, self.num_shards = shard, num_shards
        count = len(indices)
        self.total = count // batch_size if drop_last else -(-count // batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        size = self.batch_size
        for b in range(self.shard, self.total, self.num_shards):
            yield self.indices[b * size : (b + 1) * size]

    def __len__(self) -> int:
        return len(range(self.shard, self.total, self.num_shards))


class RPCIterableDataset(IterableDataset):
    """Batches collated on remote workers, as an IterableDataset for a plain DataLoader.

    Use it with ``torch.utils.data.DataLoader(ds, batch_size=None, num_workers=N)``:
    batching happens on the rpcdl workers, the DataLoader only moves the
    batches (and pins them with ``pin_memory=True``).

    Each epoch the sample indices ``0..len(dataset)-1`` (shuffled with
    ``seed + epoch`` when ``shuffle``, the same order on every process) are
    split across ranks like :class:`~torch.utils.data.DistributedSampler`
    (rank ``r`` takes every ``world_size``-th index from ``r``) but never
    padded: no sample is yielded twice. Each rank cuts its share into batches
    of ``batch_size``; the DataLoader's worker ``w`` of ``W`` loads batches
    ``w, w + W, ...`` with an :class:`~rpcdl.RPCDataloader` over all the rpcdl
    workers. A DataLoader takes from its workers in turn, so it yields the
    rank's batches in order, whatever ``num_workers``.

    Without ``drop_last`` ranks may get one sample (so one batch) more than
    others; with it every rank gets ``len(dataset) // world_size`` samples,
    cut into full batches only. Call :meth:`set_epoch` before each epoch to
    reshuffle (with ``persistent_workers=True`` the DataLoader's workers keep
    the epoch they started with: leave it off when shuffling).

    Args:
        dataset: the remote dataset; it must have a length.
        batch_size: samples per batch.
        shuffle: shuffle the samples every epoch.
        drop_last: drop the samples that would make ranks uneven and the last
            incomplete batch of each rank.
        collate_fn: merges samples into a batch, on the rpcdl worker (default:
            ``default_collate``).
        seed: seed of the shuffling, the same on every rank.
        rank, world_size: this process's rank and the number of ranks; default
            to those of the initialized ``torch.distributed`` group, else 0 and 1.
        prefetch_factor: calls in flight per rpcdl worker, per DataLoader worker (a call
            carries one batch, or a chunk of small ones: see :class:`~rpcdl.RPCDataloader`).
        timeout: seconds an rpcdl worker has to deliver a batch before it goes
            to another.

    Example::

        >>> dataset = rpcdl.RPCDataset(workers, MyDataset, root="/data")  # doctest: +SKIP
        >>> iterable = RPCIterableDataset(dataset, batch_size=32, shuffle=True)  # doctest: +SKIP
        >>> loader = DataLoader(iterable, batch_size=None, num_workers=2, pin_memory=True)  # doctest: +SKIP
        >>> for epoch in range(3):  # doctest: +SKIP
        ...     iterable.set_epoch(epoch)
        ...     for images, labels in loader:
        ...         ...
    """

    def __init__(
        self,
        dataset: RPCDataset,
        batch_size: int = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        collate_fn: Callable | None = None,
        *,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        prefetch_factor: int = 2,
        timeout: float = 120.0,
    ):
        if not isinstance(dataset, RPCDataset):
            raise TypeError(
                f"dataset must be an RPCDataset, got {type(dataset).__name__}; build it on the workers with "
                "rpcdl.RPCDataset(workers, MyDataset, *args, **kwargs)"
            )
        len(dataset)  # a dataset without a length cannot be split: raise its TypeError now
        check_positive_int(batch_size, "batch_size")
        check_int(seed, "seed", wrong_type=TypeError)
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable or None, got {collate_fn!r}")
        if rank is not None and world_size is not None:
            rank_and_world_size(rank, world_size)
        check_options(prefetch_factor, timeout)
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.collate_fn = collate_fn
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.prefetch_factor = prefetch_factor
        self.timeout = float(timeout)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffled order of epoch ``epoch`` in the next iterations."""
        self.epoch = check_int(epoch, "epoch", minimum=0)

    def _rank_indices(self) -> list[int]:
        rank, world_size = rank_and_world_size(self.rank, self.world_size)
        count = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(count, generator=generator).tolist()
        else:
            order = list(range(count))
        if self.drop_last:
            order = order[: count - count % world_size]
        return order[rank::world_size]

    def __len__(self) -> int:
        """The number of batches this rank yields in an epoch (over all DataLoader workers)."""
        return len(_ShardBatches(self._rank_indices(), self.batch_size, self.drop_last, 0, 1))

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        shard, num_shards = (info.id, info.num_workers) if info is not None else (0, 1)
        batches = _ShardBatches(self._rank_indices(), self.batch_size, self.drop_last, shard, num_shards)
        if len(batches) == 0:
            return iter(())
        loader = RPCDataloader(
            self.dataset, batch_sampler=batches, collate_fn=self.collate_fn, timeout=self.timeout,
            prefetch_factor=self.prefetch_factor,
        )  # fmt: skip
        return iter(loader)

    def __repr__(self) -> str:
        return f"RPCIterableDataset({self.dataset!r}, batch_size={self.batch_size}, shuffle={self.shuffle})"
