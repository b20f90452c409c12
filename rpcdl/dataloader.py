"""RPCDataloader: batches collated on remote workers, delivered in order, exactly once.

Scheduling: each batch goes to the worker expected to finish it first (its
calls in flight times its measured service time), at most ``prefetch_factor``
calls per worker, and never to a worker much slower than the best one could
be. At most ``prefetch_factor`` batches per worker are in flight or waiting to
be yielded. When the batch the training loop waits for is late on its worker,
a copy goes to another worker and the first answer wins.

Failures: a worker that disconnects, times out or restarts is taken out; its
batches go to the others; it is probed in the background and rejoins (its
dataset rebuilt when it lost it). An exception raised by user code is not
retried: it is raised in place of its batch, with the remote traceback and the
batch's indices.
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import queue
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler
from torch.utils.data._utils.collate import default_collate, default_convert

from .client import ping_async, rpc_async
from .dataset import DatasetMismatch, RPCDataset
from .errors import RPCDLError, is_transient, remote_origin
from .rref import RRefNotFound
from .seeding import derive_seed, set_random_seeds

log = logging.getLogger("rpcdl.dataloader")

_HEDGE_FACTOR = 3.0  # a head batch older than this many service times gets a copy elsewhere
_SLOW_FACTOR = 2.0  # a worker expected to finish later than this times the best is skipped
_MIN_HEDGE_AGE = 0.05
_PROBE_TIMEOUT = 10.0
_FIRST_PROBE_DELAY = 0.2
_MAX_PROBE_DELAY = 5.0


class NoWorkersLeft(RPCDLError, RuntimeError):
    """Every worker of a loader failed and none came back within its timeout."""


# ---------------------------------------------------------------------------- on the workers


def _fetch_batch(dataset: Any, indices: Sequence[Any], collate_fn: Callable, seed: int | None) -> Any:
    if seed is not None:
        set_random_seeds(seed, 0)
    return collate_fn([dataset[i] for i in indices])


def _fetch_sample(dataset: Any, index: Any, convert_fn: Callable, seed: int | None) -> Any:
    if seed is not None:
        set_random_seeds(seed, 0)
    return convert_fn(dataset[index])


# ---------------------------------------------------------------------------- bookkeeping


class _State(enum.Enum):
    ACTIVE = "active"
    DOWN = "down"  # failed; probed until it answers
    PROBING = "probing"  # a probe or a rebuild is in flight
    EXCLUDED = "excluded"  # its dataset does not match: never used again


class _WorkerSlot:
    """What the loader knows of one worker."""

    __slots__ = (
        "address",
        "failure",
        "global_index",
        "in_flight",
        "last_done",
        "probe_at",
        "probe_delay",
        "served",
        "service_time",
        "state",
    )  # fmt: skip

    def __init__(self, address: str, global_index: int):
        self.address = address
        self.global_index = global_index
        self.state = _State.ACTIVE
        self.in_flight: set[_Attempt] = set()
        self.service_time: float | None = None
        self.last_done = 0.0
        self.probe_at = 0.0
        self.probe_delay = _FIRST_PROBE_DELAY
        self.failure: BaseException | None = None
        self.served = 0

    def expected_done(self, now: float, default: float) -> float:
        return (len(self.in_flight) + 1) * (self.service_time or default)

    def observe(self, attempt: _Attempt, now: float) -> None:
        service = now - max(attempt.sent_at, self.last_done)
        self.last_done = now
        self.service_time = service if self.service_time is None else 0.8 * self.service_time + 0.2 * service


class _Task:
    __slots__ = ("attempts", "done", "indices", "seq")

    def __init__(self, seq: int, indices: Any):
        self.seq = seq
        self.indices = indices
        self.attempts: list[_Attempt] = []
        self.done = False


class _Attempt:
    __slots__ = ("live", "sent_at", "task", "worker")

    def __init__(self, task: _Task, worker: _WorkerSlot, sent_at: float):
        self.task, self.worker, self.sent_at, self.live = task, worker, sent_at, True


class _Failed:
    """A batch whose user code raised: re-raised in its place."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


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
            to the others; also how long the loader waits for a worker to come
            back when none is left.
        prefetch_factor: batches in flight or ready per worker.
        in_order: yield batches in sampler order (``True``) or as they come.
        generator: random generator of the default ``RandomSampler``.
        seed: when set, the random generators of the workers are seeded from
            ``(seed, epoch, batch index)`` before each batch (and each worker
            from ``(seed, epoch)`` and its index at each epoch), so random
            augmentations differ between epochs and repeat across runs,
            whichever worker loads a batch.
        workers, args, kwargs: rpcdataloader's older form: build the
            :class:`~rpcdl.RPCDataset` from ``dataset(*args, **kwargs)`` on ``workers``.

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
        in_order: bool = True,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        workers: Sequence[str] | None = None,
        args: Sequence = (),
        kwargs: dict[str, Any] | None = None,
    ):
        if workers is not None:
            dataset = RPCDataset(workers, dataset, *args, **(kwargs or {}))
        if not isinstance(dataset, RPCDataset):
            raise TypeError(
                f"dataset must be an RPCDataset, got {type(dataset).__name__}; build it on the workers with "
                "rpcdl.RPCDataset(workers, MyDataset, *args, **kwargs)"
            )
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if isinstance(prefetch_factor, bool) or not isinstance(prefetch_factor, int) or prefetch_factor < 1:
            raise ValueError(f"prefetch_factor must be a positive integer, got {prefetch_factor!r}")
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ValueError(
                f"batch_size should be a positive integer value or None, but got batch_size={batch_size!r}"
            )
        if seed is not None and not isinstance(seed, int):
            raise TypeError(f"seed must be an integer or None, got {seed!r}")
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
        self.prefetch_factor = prefetch_factor
        self.in_order = in_order
        self.generator = generator
        self.seed = seed
        self._slots = [_WorkerSlot(address, i) for i, address in enumerate(dataset.workers)]
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._next_epoch = 0
        self._explicit_epoch: int | None = None
        self._told_epoch: int | None = None
        self._iterator: _EpochIterator | None = None
        self._resume: dict[str, Any] | None = None

    # ------------------------------------------------------------------ public

    @property
    def workers(self) -> list[str]:
        """The addresses of the workers this loader uses."""
        return list(self.dataset.workers)

    @property
    def batches_served(self) -> dict[str, int]:
        """How many batches each worker delivered (and the loader accepted) so far."""
        return {slot.address: slot.served for slot in self._slots}

    def worker_states(self) -> dict[str, str]:
        """Each worker's state: ``active``, ``down``, ``probing`` or ``excluded``."""
        return {slot.address: slot.state.value for slot in self._slots}

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch``.

        Otherwise epochs count iterations from 0, or follow the epoch last given
        to the sampler's own ``set_epoch`` when the training loop calls it.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        self._explicit_epoch = epoch

    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        if self._iterator is not None:
            self._iterator.close()
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
        for sampler in samplers:
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
        self._told_epoch = epoch
        generator = self._sampler_generator()
        if resume is not None and resume.get("generator_state") is not None and generator is not None:
            generator.set_state(resume["generator_state"])
        generator_state = generator.get_state() if generator is not None else None
        self._iterator = _EpochIterator(self, epoch, generator_state, resume)
        return self._iterator

    def state_dict(self) -> dict[str, Any]:
        """The position in the current epoch: load it into a new loader to resume.

        With the semantics of torchdata's ``StatefulDataLoader``: a loader that
        loads this state yields, on its next iteration, the batches of the same
        epoch not yielded yet, in the same order (the sampler's random order is
        restored through its generator).
        """
        if self._iterator is not None and not self._iterator.finished:
            return self._iterator.state_dict()
        generator = self._sampler_generator()
        return {
            "epoch": self._explicit_epoch if self._explicit_epoch is not None else self._next_epoch,
            "yielded_prefix": 0,
            "yielded_extra": [],
            "generator_state": generator.get_state() if generator is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration continues that epoch."""
        missing = {"epoch", "yielded_prefix", "yielded_extra"} - set(state)
        if missing:
            raise ValueError(f"not an RPCDataloader state: missing {sorted(missing)}")
        self._resume = dict(state)

    def _sampler_generator(self) -> torch.Generator | None:
        sampler = self.sampler if self.batch_sampler is None else getattr(self.batch_sampler, "sampler", self.sampler)
        generator = getattr(sampler, "generator", None)
        if isinstance(sampler, RandomSampler) and generator is None:
            # torch draws a fresh seed each epoch; owning the generator makes the order resumable.
            sampler.generator = generator = torch.Generator()
            generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        return generator if isinstance(generator, torch.Generator) else None

    def __repr__(self) -> str:
        return f"RPCDataloader({self.dataset!r}, batch_size={self.batch_size}, workers={len(self._slots)})"


class _EpochIterator(Iterator[Any]):
    """One epoch: dispatches batches, reorders answers, handles failures."""

    def __init__(self, loader: RPCDataloader, epoch: int, generator_state: Any, resume: dict[str, Any] | None):
        self.loader = loader
        self.epoch = epoch
        self.generator_state = generator_state
        self.finished = False
        self._slots = loader._slots
        self._events = loader._events  # shared by epochs: a probe may finish in a later one
        source = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
        skip_prefix = resume["yielded_prefix"] if resume else 0
        skip = set(resume["yielded_extra"]) if resume else set()
        self._yielded_prefix = skip_prefix
        self._yielded_extra: set[int] = set(skip)
        self._tasks = (
            _Task(seq, indices)
            for seq, indices in itertools.islice(enumerate(source), skip_prefix, None)
            if seq not in skip
        )
        self._source_done = False
        self._waiting: collections.deque[_Task] = collections.deque()  # to (re)send, oldest first
        self._outstanding: dict[int, _Task] = {}  # sent or ready, not yielded
        self._ready: dict[int, Any] = {}
        self._ready_order: collections.deque[int] = collections.deque()
        self._all_down_since: float | None = None
        self._fetch = _fetch_batch if loader.batch_sampler is not None else _fetch_sample
        if loader.seed is not None:
            self._reseed_workers()
        now = time.monotonic()
        for slot in self._slots:
            # A probe still in flight reports to the epoch that sent it, which is over: probe again.
            if slot.state in (_State.DOWN, _State.PROBING):
                slot.state = _State.DOWN
                slot.probe_at = now

    # ------------------------------------------------------------------ iteration

    def __next__(self) -> Any:
        if self.finished:
            raise StopIteration
        while True:
            item = self._pop_ready()
            if item is not _NOTHING:
                if isinstance(item, _Failed):
                    raise item.error
                return item
            if self._source_done and not self._outstanding and not self._waiting:
                self.close()
                raise StopIteration
            self._dispatch()
            self._probe_due()
            self._handle_events(self._wait_time())

    def close(self) -> None:
        """Stop the epoch; answers still in flight are dropped when they arrive."""
        self.finished = True
        for task in self._outstanding.values():
            for attempt in task.attempts:
                attempt.live = False
                attempt.worker.in_flight.discard(attempt)
        self._outstanding.clear()
        self._ready.clear()
        self._waiting.clear()

    def __del__(self):
        if not self.finished:
            self.close()

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "yielded_prefix": self._yielded_prefix,
            "yielded_extra": sorted(self._yielded_extra),
            "generator_state": self.generator_state,
        }

    def _pop_ready(self) -> Any:
        if self.loader.in_order:
            if not self._outstanding:
                return _NOTHING
            seq = self._head()
            if seq not in self._ready:
                return _NOTHING
        elif self._ready_order:
            seq = self._ready_order.popleft()
        else:
            return _NOTHING
        item = self._ready.pop(seq)
        del self._outstanding[seq]
        self._mark_yielded(seq)
        return item

    def _head(self) -> int:
        """The sequence number of the next batch to yield in order."""
        return min(self._outstanding)

    def _mark_yielded(self, seq: int) -> None:
        if seq == self._yielded_prefix:
            self._yielded_prefix += 1
            while self._yielded_prefix in self._yielded_extra:
                self._yielded_extra.discard(self._yielded_prefix)
                self._yielded_prefix += 1
        else:
            self._yielded_extra.add(seq)

    # ------------------------------------------------------------------ dispatch

    def _window(self) -> int:
        active = sum(slot.state == _State.ACTIVE for slot in self._slots)
        return self.loader.prefetch_factor * max(active, 1)

    def _default_service_time(self) -> float:
        times = [slot.service_time for slot in self._slots if slot.service_time is not None]
        return min(times) if times else 1.0

    def _pick_worker(self, now: float, exclude: _WorkerSlot | None = None) -> _WorkerSlot | None:
        """The active worker expected to finish a new batch first, if it is not much slower than the best."""
        default = self._default_service_time()
        candidates = [slot for slot in self._slots if slot.state == _State.ACTIVE and slot is not exclude]
        if not candidates:
            return None
        best_possible = min(slot.expected_done(now, default) for slot in candidates)
        free = [slot for slot in candidates if len(slot.in_flight) < self.loader.prefetch_factor]
        if not free:
            return None
        chosen = min(free, key=lambda slot: (slot.expected_done(now, default), len(slot.in_flight)))
        if chosen.expected_done(now, default) > _SLOW_FACTOR * best_possible:
            return None  # better to wait for a faster worker
        return chosen

    def _dispatch(self) -> None:
        now = time.monotonic()
        while True:
            if not self._waiting:
                if self._source_done or len(self._outstanding) >= self._window():
                    break
                try:
                    task = next(self._tasks)
                except StopIteration:
                    self._source_done = True
                    break
                self._outstanding[task.seq] = task
                self._waiting.append(task)
            slot = self._pick_worker(now)
            if slot is None:
                break
            self._send(self._waiting.popleft(), slot, now)
        self._hedge(now)

    def _send(self, task: _Task, slot: _WorkerSlot, now: float) -> None:
        loader = self.loader
        attempt = _Attempt(task, slot, now)
        rref = loader.dataset.rref(slot.address)
        if rref is None:
            self._waiting.appendleft(task)
            self._mark_down(slot, RRefNotFound(f"no dataset on worker {slot.address}"))
            return
        seed = derive_seed(loader.seed, self.epoch, task.seq) if loader.seed is not None else None
        task.attempts.append(attempt)
        slot.in_flight.add(attempt)
        future = rpc_async(
            slot.address, self._fetch, (rref, task.indices, loader.collate_fn, seed),
            pin_memory=loader.pin_memory, timeout=loader.timeout,
        )  # fmt: skip
        future.add_done_callback(lambda done: self._events.put(("batch", attempt, done)))

    def _hedge(self, now: float) -> None:
        """Send a copy of the batch the loop waits for when it is late on its worker."""
        if not self.loader.in_order or not self._outstanding:
            return
        head = self._outstanding[self._head()]
        live = [a for a in head.attempts if a.live]
        if head.seq in self._ready or len(live) != 1 or len(head.attempts) > 2:
            return
        attempt = live[0]
        typical = self._default_service_time()
        if now - attempt.sent_at < max(_HEDGE_FACTOR * typical, _MIN_HEDGE_AGE):
            return
        slot = self._pick_worker(now, exclude=attempt.worker)
        if slot is not None:
            self._send(head, slot, now)

    def _reseed_workers(self) -> None:
        base = derive_seed(self.loader.seed, self.epoch)
        futures = [
            rpc_async(slot.address, set_random_seeds, (base, slot.global_index), timeout=self.loader.timeout)
            for slot in self._slots
            if slot.state == _State.ACTIVE
        ]
        for future in futures:
            try:
                future.wait()
            except Exception as exc:
                if not is_transient(exc):
                    raise

    # ------------------------------------------------------------------ events

    def _wait_time(self) -> float:
        now = time.monotonic()
        deadline = now + 0.5
        probes = [slot.probe_at for slot in self._slots if slot.state == _State.DOWN]
        if probes:
            deadline = min(deadline, min(probes))
        if self.loader.in_order and self._outstanding:
            deadline = min(deadline, now + max(_MIN_HEDGE_AGE, self._default_service_time()))
        return max(0.0, deadline - now)

    def _handle_events(self, wait: float) -> None:
        try:
            event = self._events.get(timeout=wait)
        except queue.Empty:
            self._check_no_workers()
            return
        while True:
            kind, attempt_or_slot, future = event
            if kind == "batch":
                self._on_batch(attempt_or_slot, future)
            else:
                self._on_probe(kind, attempt_or_slot, future)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
        self._check_no_workers()

    def _on_batch(self, attempt: _Attempt, future: torch.futures.Future) -> None:
        slot, task = attempt.worker, attempt.task
        slot.in_flight.discard(attempt)
        try:
            value = future.wait()
        except Exception as exc:
            worker_failed = is_transient(exc) or (remote_origin(exc) and isinstance(exc, RRefNotFound))
            if not attempt.live or task.done:
                if worker_failed and slot.state == _State.ACTIVE:
                    self._mark_down(slot, exc)  # its batch was saved by a copy, yet the worker failed
                return
            if worker_failed:
                attempt.live = False
                self._retry(task)
                self._mark_down(slot, exc)
                return
            value = _Failed(self._annotate(exc, task, slot))
        else:
            slot.observe(attempt, time.monotonic())
        if not attempt.live or task.done or self.finished:
            return
        task.done = True
        for other in task.attempts:
            if other.live:
                other.live = False
                other.worker.in_flight.discard(other)
        if not isinstance(value, _Failed):
            slot.served += 1
        self._ready[task.seq] = value
        self._ready_order.append(task.seq)

    def _annotate(self, exc: BaseException, task: _Task, slot: _WorkerSlot) -> BaseException:
        indices = task.indices
        if isinstance(indices, (list, tuple)) and len(indices) > 16:
            shown = f"{list(indices[:16])} ... ({len(indices)} in all)"
        else:
            shown = repr(indices)
        exc.add_note(f"while loading batch {task.seq} of epoch {self.epoch} (indices {shown}) on worker {slot.address}")
        return exc

    def _retry(self, task: _Task) -> None:
        if not task.done and not any(a.live for a in task.attempts) and task not in self._waiting:
            self._waiting.appendleft(task)

    def _mark_down(self, slot: _WorkerSlot, exc: BaseException) -> None:
        if slot.state == _State.EXCLUDED:
            return
        if slot.state == _State.ACTIVE:
            log.warning("worker %s left the loader: %s", slot.address, exc)
        if isinstance(exc, RRefNotFound):
            self.loader.dataset.forget(slot.address)
        slot.state = _State.DOWN
        slot.failure = exc
        slot.probe_at = time.monotonic() + slot.probe_delay
        slot.probe_delay = min(slot.probe_delay * 2, _MAX_PROBE_DELAY)
        for attempt in list(slot.in_flight):
            attempt.live = False
            self._retry(attempt.task)
        slot.in_flight.clear()
        self._waiting = collections.deque(sorted(self._waiting, key=lambda t: t.seq))

    # ------------------------------------------------------------------ probes

    def _probe_due(self) -> None:
        now = time.monotonic()
        for slot in self._slots:
            if slot.state != _State.DOWN or slot.probe_at > now:
                continue
            slot.state = _State.PROBING
            if self.loader.dataset.rref(slot.address) is None:
                future = self.loader.dataset.build_async(slot.address)
                kind = "built"
            else:  # a batch will tell whether it still holds the dataset
                future = ping_async(slot.address, timeout=min(self.loader.timeout, _PROBE_TIMEOUT))
                kind = "pinged"
            future.add_done_callback(lambda done, slot=slot, kind=kind: self._events.put((kind, slot, done)))

    def _on_probe(self, kind: str, slot: _WorkerSlot, future: torch.futures.Future) -> None:
        if slot.state != _State.PROBING:
            return
        try:
            result = future.wait()
            if kind == "built":
                self.loader.dataset.accept(slot.address, *result)
        except DatasetMismatch as exc:
            slot.state = _State.EXCLUDED
            slot.failure = exc
            log.error("%s", exc)
            return
        except Exception as exc:
            if not is_transient(exc):
                log.error("worker %s cannot rebuild the dataset, it is kept out: %s", slot.address, exc)
                slot.state = _State.EXCLUDED
                slot.failure = exc
                return
            slot.state = _State.DOWN
            slot.probe_at = time.monotonic() + slot.probe_delay
            slot.probe_delay = min(slot.probe_delay * 2, _MAX_PROBE_DELAY)
            return
        log.warning("worker %s is back", slot.address)
        slot.state = _State.ACTIVE
        slot.probe_delay = _FIRST_PROBE_DELAY
        slot.service_time = None
        slot.last_done = 0.0

    def _check_no_workers(self) -> None:
        if any(slot.state == _State.ACTIVE for slot in self._slots):
            self._all_down_since = None
            return
        now = time.monotonic()
        if self._all_down_since is None:
            self._all_down_since = now
        recoverable = any(slot.state != _State.EXCLUDED for slot in self._slots)
        if recoverable and now - self._all_down_since < self.loader.timeout:
            return
        self.close()
        details = "; ".join(f"{slot.address} ({slot.state.value}: {slot.failure})" for slot in self._slots)
        raise NoWorkersLeft(
            f"no worker of this loader is left (waited {self.loader.timeout:g}s for one to come back): {details}"
        )


_NOTHING = object()
