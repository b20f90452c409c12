"""An :class:`~rpcdl.RPCDataloader`'s epochs: which one comes next, where each is, and the state that says so.

A state is the position in an epoch (``epoch``, ``yielded_prefix``: batches
``0 .. yielded_prefix - 1`` were yielded, ``yielded_extra``: batches yielded
beyond them, ``generator_state``: the sampler's random generator at the start of
the epoch) and what determines the epoch's batches (:data:`SHAPE_FIELDS`, with
``seed_source``: where a random order comes from). A position only means
something in a loader that makes the same batches: a state is refused by a
loader whose shape differs (:func:`check_state`). States written before the
shape was recorded still load (their missing fields are not checked). A loader
over an :class:`~rpcdl.data.elastic.ElasticDistributedSampler` adds the global
position (:mod:`rpcdl.data.global_state`), which loads on another shape.

An :class:`EpochBook` keeps a loader's epochs: what the next one is
(:class:`Counted`, :class:`Chosen` by ``set_epoch`` or :class:`Resumed` from a
state), the :class:`Position` of the epoch that yielded last, and the open
iterators, to close them.

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

from ..checks import check_int
from .elastic import WHOLE_EPOCH, ElasticDistributedSampler, Origin

#: The fields of a state that determine the batch sequence of an epoch.
SHAPE_FIELDS = ("batches", "batch_size", "drop_last", "sampler", "batch_sampler", "in_order", "seed_source")
POSITION_FIELDS = ("epoch", "yielded_prefix", "yielded_extra")

#: The samplers whose split among ranks is by complexity (their names, as a shape holds them).
_LOAD_BALANCING = ("LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler")

#: Where a loader's random order comes from (a state's ``seed_source``): the sampler's own generator
#: (the loader's ``generator=``, or a ``RandomSampler(generator=...)``); a generator drawn from torch's
#: global one at each epoch (a ``RandomSampler`` without one); or the sampler alone (no random order
#: drawn by the loader: a sequential sampler, or one seeded by its own ``seed``, as ``DistributedSampler``).
SEED_SOURCES = ("generator", "global", "sampler")


class Shaped(Protocol):
    """What a loader's shape is read from (an :class:`~rpcdl.RPCDataloader`)."""

    batch_size: int | None
    drop_last: bool
    sampler: Any
    batch_sampler: Any
    in_order: bool

    def __len__(self) -> int: ...


def loader_shape(loader: Shaped, batches: int | None, seed_source: str) -> dict[str, Any]:
    """The fields of :data:`SHAPE_FIELDS` for ``loader``, with its ``batches`` in an epoch (``None`` for a
    sampler without length) and its ``seed_source`` (one of :data:`~rpcdl.data.loader_state.SEED_SOURCES`)."""
    batch_sampler = loader.batch_sampler
    return {
        "batches": batches,
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "sampler": _sampler_name(loader.sampler),
        "batch_sampler": _sampler_name(batch_sampler) if batch_sampler is not None else None,
        "in_order": loader.in_order,
        "seed_source": seed_source,
    }


def _sampler_name(sampler: Any) -> str:
    """How a shape names ``sampler``: its class, and for a load-balancing one the world size it splits for
    (its split is by complexity, so a state resumes only on that world size, even where the number of
    batches per rank happens to be the same on another)."""
    name = type(sampler).__qualname__
    if name in _LOAD_BALANCING:
        return f"{name}(num_replicas={sampler.num_replicas})"
    return name


def check_state(state: Any, shape: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of ``state`` after checking that it is a valid position for a loader of ``shape``.

    Raises:
        TypeError: ``state`` is not a dict, or a field has the wrong type.
        ValueError: a field is missing or out of range, or the state was saved
            by a loader that makes different batches (each differing field named
            with both values).
    """
    if not isinstance(state, dict):
        raise TypeError(
            f"an RPCDataloader state must be the dict returned by RPCDataloader.state_dict(), "
            f"got {type(state).__name__}: {state!r:.100}"
        )
    missing = [name for name in POSITION_FIELDS if name not in state]
    if missing:
        raise ValueError(
            f"not an RPCDataloader state: missing {missing}; load what RPCDataloader.state_dict() returned"
        )
    differences = [
        f"{name}: the state has {state[name]!r}, this loader has {shape[name]!r}"
        for name in SHAPE_FIELDS
        if name in state and state[name] != shape[name]
    ]
    if differences:
        hint = ""
        balancing = [name for name in (shape["sampler"], shape["batch_sampler"]) if name]
        if any(name.startswith(_LOAD_BALANCING) for name in balancing) and any(
            name.startswith(("batches", "sampler", "batch_sampler")) for name in differences
        ):
            hint = (
                " (a load-balancing sampler's state resumes only on the world size it was taken on: the "
                "sampler splits an epoch among ranks by complexity, groups of num_replicas samples sorted by "
                "cost, not by DistributedSampler's layout, which is the one a state taken on W ranks is split "
                "again from; a different number of batches per rank means another world size, or another "
                "dataset, batch_fn or drop_last. Resume on the same world size, or start the epoch again)"
            )
        elif any(name.startswith("seed_source") for name in differences):
            hint = (
                " (seed_source: the random order came from the loader's generator= in one loader and from "
                "torch's global generator in the other; build both the same way)"
            )
        raise ValueError(
            "this state was saved by a loader that makes different batches; resuming would skip or repeat "
            f"samples. Differences: {'; '.join(differences)}{hint}. Load it into a loader built with the same "
            "batch_size, drop_last, sampler, generator and in_order over a dataset of the same length, or "
            "start the epoch again (load no state: the next iteration is a whole epoch). Loaders made by "
            "rpcdl.distributed.distributed_loader (and RPCDataModule) resume on another world size or batch size"
        )
    _check_counter(state, "epoch")
    prefix = _check_counter(state, "yielded_prefix")
    batches = shape["batches"]
    if batches is not None and prefix > batches:
        raise ValueError(f"yielded_prefix={prefix} is out of range: an epoch of this loader has {batches} batches")
    extra = state["yielded_extra"]
    if not isinstance(extra, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in extra):
        raise TypeError(f"yielded_extra must be a list of batch numbers (integers), got {extra!r:.100}")
    if len(set(extra)) != len(extra):
        raise ValueError(f"yielded_extra lists a batch more than once: {sorted(extra)!r:.100}")
    upper = batches if batches is not None else float("inf")
    outside = [i for i in extra if not prefix < i < upper]
    if outside:
        limit = f" and below {batches}" if batches is not None else ""
        raise ValueError(
            f"yielded_extra holds batch numbers out of range {outside!r:.100}: each must be above "
            f"yielded_prefix={prefix}{limit}"
        )
    generator_state = state.get("generator_state")
    if generator_state is not None and not (
        isinstance(generator_state, torch.Tensor) and generator_state.dtype == torch.uint8
    ):
        raise TypeError(
            "generator_state must be None or the uint8 tensor of torch.Generator.get_state(), "
            f"got {type(generator_state).__name__}"
        )
    return dict(state)


def _check_counter(state: dict[str, Any], name: str) -> int:
    return check_int(state[name], name, minimum=0, wrong_type=TypeError)


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

    def __init__(
        self,
        epoch: int,
        generator_state: torch.Tensor | None,
        prefix: int,
        extra: Iterable[int],
        origin: Origin = WHOLE_EPOCH,
    ):
        self.epoch = epoch
        self.generator_state = generator_state
        self.origin = origin
        self.start_prefix = prefix
        self.start_extra = frozenset(extra)
        self.yielded_prefix = prefix
        self.yielded_extra = set(extra)
        self.state = PositionState.RUNNING

    def as_state(self) -> dict[str, Any]:
        """The position as the fields of a state."""
        return {
            "epoch": self.epoch,
            "yielded_prefix": self.yielded_prefix,
            "yielded_extra": sorted(self.yielded_extra),
            "generator_state": self.generator_state,
            "origin": self.origin,
        }


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
    """The next epoch continues a loaded state."""

    state: dict[str, Any]


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
            sampler's sampler): those with ``set_epoch`` are told each epoch.
        random_sampler: the sampler whose random order a state restores.
        generator: the loader's ``generator`` (torch's DataLoader draws its
            workers' base seed from it at each epoch: the same draw keeps the
            random streams where torch leaves them).
    """

    def __init__(self, samplers: Sequence[Any], random_sampler: Any, generator: torch.Generator | None):
        self._lock = threading.Lock()
        self._samplers = [sampler for sampler in samplers if hasattr(sampler, "set_epoch")]
        self._elastic = [sampler for sampler in samplers if isinstance(sampler, ElasticDistributedSampler)]
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

    def resume(self, state: dict[str, Any]) -> None:
        """Make the next epoch continue ``state`` (checked already): its position fields, its
        ``generator_state`` and its ``origin`` (an :class:`~rpcdl.data.elastic.Origin`)."""
        with self._lock:
            self._next = Resumed(
                {
                    **{name: state[name] for name in POSITION_FIELDS},
                    "generator_state": state.get("generator_state"),
                    "origin": state.get("origin", WHOLE_EPOCH),
                }
            )

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
                epoch = plan.state["epoch"]
            elif requested is not None:
                epoch = requested
            elif isinstance(plan, Chosen):
                epoch = plan.epoch
            elif told:
                epoch = max(told)  # the user called sampler.set_epoch(): follow it
            else:
                epoch = plan.epoch
            self._next = Counted(epoch + 1)
            for sampler in self._samplers:
                sampler.set_epoch(epoch)
            saved = plan.state.get("generator_state") if isinstance(plan, Resumed) else None
            start = self._set_generators(saved)
            prefix, extra = (
                (plan.state["yielded_prefix"], plan.state["yielded_extra"]) if isinstance(plan, Resumed) else (0, ())
            )
            origin = plan.state.get("origin", WHOLE_EPOCH) if isinstance(plan, Resumed) else WHOLE_EPOCH
            for sampler in self._elastic:
                sampler.set_origin(origin)
            position = Position(epoch, start, prefix, extra, origin)
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
            if seq == position.yielded_prefix:
                position.yielded_prefix += 1
                while position.yielded_prefix in position.yielded_extra:
                    position.yielded_extra.discard(position.yielded_prefix)
                    position.yielded_prefix += 1
            else:
                position.yielded_extra.add(seq)
            self._last = position

    def finished(self, position: Position) -> None:
        """``position``'s epoch ended."""
        with self._lock:
            position.state = PositionState.FINISHED

    def state(self, batches: int | None) -> dict[str, Any]:
        """The position fields of the state (``origin`` an :class:`~rpcdl.data.elastic.Origin`): the loaded
        state not used yet, the epoch that yielded last while it runs and has batches left (``batches`` in an
        epoch; ``None``: unknown), else the start of the next."""
        with self._lock:
            if isinstance(self._next, Resumed):
                return dict(self._next.state)
            last = self._last
            if isinstance(last, Position) and last.state is PositionState.RUNNING:
                complete = batches is not None and not last.yielded_extra and last.yielded_prefix >= batches
                if not complete:
                    return last.as_state()
            generator = self._own_generator()
            return {
                "epoch": self._next.epoch,
                "yielded_prefix": 0,
                "yielded_extra": [],
                "generator_state": generator.get_state() if generator is not None else None,
                "origin": WHOLE_EPOCH,
            }

    def seed_source(self) -> str:
        """Where the random order of the loader's sampler comes from (one of
        :data:`~rpcdl.data.loader_state.SEED_SOURCES`)."""
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
