"""An :class:`~rpcdl.RPCDataloader`'s epochs: which one comes next, and where each is.

An :class:`EpochBook` keeps a loader's epochs: what the next one is
(:class:`Counted`, :class:`Chosen` by ``set_epoch`` or :class:`Resumed` from a
state), the :class:`Position` of the epoch that yielded last, and the open
iterators, to close them. As an epoch begins, the book tells the samplers its
number, and an :class:`~rpcdl.data.elastic.ElasticDistributedSampler` its
number and its origin in one call. A state is written and read by
:mod:`rpcdl.data.resume` alone: the book takes a
:class:`~rpcdl.data.resume.LoaderPosition` to resume and gives one back.

Threading: a loader's iterators may start and advance epochs on several
threads while another asks for the state. The book's lock guards every access
to its fields and to its positions, and is held through the start of an epoch
(the samplers are told the epoch and the random generators drawn, as one step).
Each :class:`Position` is changed by the thread advancing its epoch, through
the book.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch.utils.data import RandomSampler

from .elastic import ElasticDistributedSampler
from .resume import WHOLE_EPOCH, LoaderPosition, Origin

__all__ = ["Chosen", "Closeable", "Counted", "EpochBook", "EpochStart", "Position", "PositionState", "Resumed"]


# ---------------------------------------------------------------------------- the epochs of a loader


class PositionState(enum.Enum):
    """Where the epoch of a :class:`Position` is."""

    RUNNING = "running"  #: batches may still come
    FINISHED = "finished"  #: it ended (every batch, an error that ends it, or closed)


class Position:
    """Where an epoch is: its number, the batches yielded, the sampler's generator at its start.

    ``yielded_prefix``, ``yielded_extra`` and ``state`` change, through its
    :class:`EpochBook` (whose lock guards them), as the thread advancing its
    epoch yields; ``epoch``, ``generator_state``, ``origin`` (where an
    :class:`~rpcdl.data.elastic.ElasticDistributedSampler`'s layout starts: its
    first batch is numbered ``origin.first_batch``) and where it started
    (``start_prefix``, ``start_extra``: the batches a resumed epoch skips) never do.
    """

    __slots__ = (
        "epoch",
        "generator_state",
        "origin",
        "start_extra",
        "start_prefix",
        "state",
        "yielded_extra",
        "yielded_prefix",
    )

    def __init__(self, start: LoaderPosition):
        self.epoch = start.epoch
        self.generator_state = start.generator_state
        self.origin = start.origin
        self.start_prefix = start.yielded_prefix
        self.start_extra = frozenset(start.yielded_extra)
        self.yielded_prefix = start.yielded_prefix
        self.yielded_extra = set(start.yielded_extra)
        self.state = PositionState.RUNNING

    def snapshot(self) -> LoaderPosition:
        """The position now, as :mod:`rpcdl.data.resume` writes it (the caller holds the book's lock)."""
        return LoaderPosition(
            self.epoch, self.yielded_prefix, tuple(sorted(self.yielded_extra)), self.generator_state, self.origin
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Counted:
    """The next epoch is the one after the last (or the one a sampler was told, see :meth:`EpochBook.begin`)."""

    epoch: int


@dataclasses.dataclass(frozen=True, slots=True)
class Chosen:
    """The next epoch was chosen with ``set_epoch``."""

    epoch: int


@dataclasses.dataclass(frozen=True, slots=True)
class Resumed:
    """The next epoch continues a loaded state, at ``position``."""

    position: LoaderPosition


@dataclasses.dataclass(frozen=True, slots=True)
class NoEpoch:
    """No epoch has begun yet."""


#: The one :class:`NoEpoch`.
NO_EPOCH = NoEpoch()


@dataclasses.dataclass(frozen=True)
class EpochStart:
    """An epoch begun: its position, and its batches (their order fixed)."""

    position: Position
    batches: Iterator[Any]


def _started(batches: Iterable[Any]) -> Iterator[Any]:
    """``batches`` as an iterator that already drew its first item (a generator's body runs up to it)."""
    iterator = iter(batches)
    try:
        first = next(iterator)
    except StopIteration:
        return iter(())
    return itertools.chain((first,), iterator)


class Closeable(Protocol):
    """An open iterator of a loader, as its book sees it."""

    def close(self) -> None: ...


class EpochBook:
    """A loader's epochs (see the module): the next one, the position of the one that yielded last.

    Args:
        samplers: the loader's samplers (sampler, batch sampler, the batch
            sampler's sampler): those with ``set_epoch`` are told each epoch,
            an ``ElasticDistributedSampler`` its epoch and origin at once
            (``begin_epoch``).
        random_sampler: the sampler whose random order a state restores.
        generator: the loader's ``generator`` (torch's DataLoader draws its
            workers' base seed from it at each epoch: the same draw keeps the
            random streams where torch leaves them).
    """

    def __init__(self, samplers: Sequence[Any], random_sampler: Any, generator: torch.Generator | None):
        self._lock = threading.Lock()
        told = {id(sampler): sampler for sampler in samplers if hasattr(sampler, "set_epoch")}  # each once
        self._samplers = list(told.values())
        self._random_sampler = random_sampler
        self._generator = generator
        self._next: Counted | Chosen | Resumed = Counted(0)
        self._begun: Position | NoEpoch = NO_EPOCH  # the epoch that began last (its number was told the samplers)
        self._last: Position | NoEpoch = NO_EPOCH  # the epoch that began or yielded last: the one a state tells
        self._drawn: torch.Generator | None = None  # the generator drawn for the sampler at the last epoch
        self._open: list[weakref.ref[Closeable]] = []  # no callbacks: pruned here, when an iterator opens

    @property
    def generator(self) -> torch.Generator | None:
        """The loader's generator."""
        with self._lock:
            return self._generator

    @generator.setter
    def generator(self, generator: torch.Generator | None) -> None:
        with self._lock:
            self._generator = generator

    @property
    def epoch(self) -> int | None:
        """The epoch that began last; ``None`` before the first."""
        with self._lock:
            return None if isinstance(self._begun, NoEpoch) else self._begun.epoch

    def choose(self, epoch: int) -> None:
        """Make the next epoch ``epoch`` (a loaded state still wins: it names its own epoch)."""
        with self._lock:
            if not isinstance(self._next, Resumed):
                self._next = Chosen(epoch)

    def resume(self, position: LoaderPosition) -> None:
        """Make the next epoch continue at ``position`` (read by :func:`~rpcdl.data.resume.read_loader_state`)."""
        with self._lock:
            self._next = Resumed(position)

    def origin(self) -> Origin:
        """Where the epoch a loader's length tells starts: the loaded state's, not begun yet; else the running
        epoch's that began last; else the beginning of an epoch."""
        with self._lock:
            if isinstance(self._next, Resumed):
                return self._next.position.origin
            begun = self._begun
            if isinstance(begun, Position) and begun.state is PositionState.RUNNING:
                return begun.origin
            return WHOLE_EPOCH

    def opened(self, iterator: Closeable) -> None:
        """Keep ``iterator`` (weakly) to close it with :meth:`open_iterators`."""
        with self._lock:
            self._open = [reference for reference in self._open if reference() is not None]
            self._open.append(weakref.ref(iterator))

    def open_iterators(self) -> list[Closeable]:
        """The iterators opened and not freed yet."""
        with self._lock:
            alive = [reference() for reference in self._open]
            iterators = [iterator for iterator in alive if iterator is not None]
            self._open = [weakref.ref(iterator) for iterator in iterators]
            return iterators

    def begin(self, requested: int | None, batches: Iterable[Any]) -> EpochStart:
        """Begin an epoch: choose it, tell the samplers, set the random generators, start ``batches``.

        The epoch is, first to last: the loaded state's, ``requested`` (a
        trainer's epoch), the one chosen with ``set_epoch``, the one the user
        last told a sampler (its ``set_epoch``), the one after the last.

        ``batches`` (the sampler, or the batch sampler) is started here, its
        first batch drawn: its order is fixed now, from the epoch and the
        generators just set, even if another epoch begins on another thread
        before this one pulls its next batch.

        Raises:
            Exception: what the sampler raised for its first batch (the epoch
                begun is over then).
        """
        with self._lock:
            plan = self._next
            last = None if isinstance(self._begun, NoEpoch) else self._begun.epoch
            told = {getattr(sampler, "epoch", last) for sampler in self._samplers} - {last}
            if isinstance(plan, Resumed):
                epoch = plan.position.epoch
            elif requested is not None:
                epoch = requested
            elif isinstance(plan, Chosen):
                epoch = plan.epoch
            elif told:
                epoch = max(told)  # the user called sampler.set_epoch(): follow it
            else:
                epoch = plan.epoch
            self._next = Counted(epoch + 1)
            resumed = plan.position if isinstance(plan, Resumed) else LoaderPosition(epoch)
            for sampler in self._samplers:
                if isinstance(sampler, ElasticDistributedSampler):
                    sampler.begin_epoch(epoch, resumed.origin)  # the epoch and its origin, in one call
                else:
                    sampler.set_epoch(epoch)
            start = self._set_generators(resumed.generator_state)
            position = Position(dataclasses.replace(resumed, generator_state=start))
            self._begun = self._last = position
            try:
                started = _started(batches)
            except BaseException:
                position.state = PositionState.FINISHED
                raise
            return EpochStart(position, started)

    def yielded(self, position: Position, seq: int) -> None:
        """Batch ``seq`` of ``position``'s epoch was handed out: it is the epoch a state tells now."""
        with self._lock:
            if seq != position.yielded_prefix:
                position.yielded_extra.add(seq)
            elif position.yielded_extra:
                extra = position.yielded_extra
                seq += 1
                while seq in extra:
                    extra.discard(seq)
                    seq += 1
                position.yielded_prefix = seq
            else:
                position.yielded_prefix = seq + 1
            self._last = position

    def finished(self, position: Position) -> None:
        """``position``'s epoch ended."""
        with self._lock:
            position.state = PositionState.FINISHED

    def position(self, end: float | None) -> LoaderPosition:
        """The position a state tells: the loaded state not used yet; the epoch that yielded last while it
        runs and its consumer has batches left (``end``: the batch number its epoch ends at, for the
        consumer; ``None``: unknown); else the start of the next."""
        with self._lock:
            if isinstance(self._next, Resumed):
                return self._next.position
            last = self._last
            if isinstance(last, Position) and last.state is PositionState.RUNNING:
                complete = end is not None and not last.yielded_extra and last.yielded_prefix >= end
                if not complete:
                    return last.snapshot()
            generator = self._own_generator()
            return LoaderPosition(
                self._next.epoch, generator_state=generator.get_state() if generator is not None else None
            )

    def seed_source(self) -> str:
        """Where the random order of the loader's sampler comes from (one of
        :data:`~rpcdl.data.resume.SEED_SOURCES`)."""
        with self._lock:
            if self._own_generator() is not None:
                return "generator"
            return "global" if isinstance(self._random_sampler, RandomSampler) else "sampler"

    def _set_generators(self, saved: torch.Tensor | None) -> torch.Tensor | None:
        """Restore or draw the sampler's random generator for the epoch starting; its state at the start."""
        generator = self._own_generator()
        if generator is not None and saved is not None:
            generator.set_state(saved)
        start = generator.get_state() if generator is not None else None
        # torch's DataLoader draws its workers' base seed here: the same draw keeps the random
        # streams (the global one, or the loader's generator) where torch would leave them.
        torch.empty((), dtype=torch.int64).random_(generator=self._generator)
        if generator is None:
            generator = self._epoch_generator()
            if generator is not None:
                if saved is not None:
                    generator.set_state(saved)
                start = generator.get_state()
        return start

    def _epoch_generator(self) -> torch.Generator | None:
        """A ``RandomSampler`` without a generator of its own: a new one for the epoch starting now.

        Seeded from torch's global generator, as the sampler's ``__iter__`` would
        seed it: the same order as torch's for the same seed, and a generator the
        loader can keep in its state to resume the epoch. ``None`` for other samplers.
        """
        sampler = self._random_sampler
        if not isinstance(sampler, RandomSampler):
            return None
        if sampler.generator is not None and sampler.generator is not self._drawn:
            return None
        generator = torch.Generator()
        generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        sampler.generator = self._drawn = generator
        return generator

    def _own_generator(self) -> torch.Generator | None:
        """The sampler's generator when it is the user's (a generator drawn per epoch is not, between epochs)."""
        generator = getattr(self._random_sampler, "generator", None)
        if not isinstance(generator, torch.Generator) or generator is self._drawn:
            return None
        return generator
