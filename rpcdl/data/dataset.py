"""RPCDataset: a dataset built on every worker, addressed through remote references.

A worker keeps one copy per recipe, shared by the trainers that send it
(the worker keys it on a digest of the recipe pickled alike in every trainer,
:mod:`rpcdl.serialization.definition`, see :func:`rpcdl.rpc.rref.shared_rref`),
unless a trainer asks for its own (``rpcdl_per_trainer=True``).

The dataset keeps where it is built (one reference per worker) and its recipe;
whether a worker is usable is its loader's pool's record alone
(:mod:`rpcdl.data.worker_pool`). A call that finds the dataset gone from a worker (it
restarted) fails with :class:`~rpcdl.errors.RRefNotFound`, which takes the
worker out of the pool; the pool then revives it through the loader's
:class:`DatasetSetup`, which builds the dataset there again.

The workers come from a :class:`~rpcdl.data.sources.Fleet` (a list, a file,
a DNS name, a registry, any ``addresses()``): as it is made, the dataset is
built on this client's own share of the fleet, and it is ready as soon as one
worker has built it (:mod:`rpcdl.data.first_copy`: the wait for the fleet to
come up, up to :func:`~rpcdl.data.sources.start_timeout`, saying every 10 s
what it waits for). The other workers' builds go on in the background; one
that could not build it (refused, a host name that does not resolve yet) is
given the dataset by its loader's pool, as is a worker that joins later, or
another rank's worker called on when this rank's own are gone (a revival
through :class:`DatasetSetup`), before it serves. One build at a time runs per
worker: a revival while a build is in flight waits for that build.

Threading: the references and the builds in flight change on the thread that
builds the dataset, on the threads of a loader's passes (a revival drops a
reference) and on the threads completing builds; the dataset's lock guards
every access to them, and to the length, which the first copy installed fixes.
The recipe is fixed.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import torch
from torch.utils.data import Dataset, IterableDataset

from ..checks import check_loader_timeout
from ..errors import DatasetMismatch, UnknownHost, WorkerTimeout, WorkerUnavailable
from ..rpc.client import rpc_async
from ..rpc.invoke import named_arguments, unpicklable_part
from ..rpc.rref import RRef, RRefNotFound, shared_rref
from ..serialization.definition import pickle_definition
from .first_copy import wait_for_first_copy
from .probes import Revival, back_when, probe_async
from .sources import Fleet, start_timeout

log = logging.getLogger("rpcdl.dataset")
_SHARED_KIND = "rpcdl.RPCDataset"  # what a worker's shared datasets are keyed under


def _iterable_dataset_error(name: str) -> TypeError:
    return TypeError(
        f"RPCDataset needs a map-style dataset (__getitem__ and __len__), but {name} is an IterableDataset. "
        "To process the items of an iterable on the workers, use rpcdl.integrations.torchdata.RPCMapper "
        "(torchdata.nodes) or the DataPipe form .rpc_map(workers, fn); rpcdl.integrations.torchdata."
        "RPCIterableDataset streams remote batches into a plain torch DataLoader"
    )


def _make(factory: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Runs on a worker: build the dataset and check that it is map-style."""
    dataset = factory(*args, **kwargs)
    if isinstance(dataset, IterableDataset):
        raise _iterable_dataset_error(f"{getattr(factory, '__qualname__', factory)!s}(...)")
    items = "no length" if _length_or_none(dataset) is None else f"{len(dataset)} items"
    log.info("dataset %s built (%s)", getattr(factory, "__qualname__", type(dataset).__qualname__), items)
    return dataset


def _length_or_none(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def _build(factory: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[RRef, int | None]:
    """Runs on a worker: build a dataset of this client's own, keep it there, return a reference and its length."""
    dataset = _make(factory, args, kwargs)
    return RRef(dataset), _length_or_none(dataset)


def _build_shared(definition: bytes, factory: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[RRef, int | None]:
    """Runs on a worker: the dataset every client sending this definition shares, built by the first.

    ``definition`` is the recipe pickled alike in every trainer with the same
    code (:func:`rpcdl.serialization.definition.pickle_definition`); the worker
    keys the dataset on a digest of those bytes under its token (see
    :func:`rpcdl.rpc.rref.shared_rref`). This client holds its own reference,
    and the dataset is freed when no client holds one.
    """
    rref = shared_rref(_SHARED_KIND, definition, lambda: _make(factory, args, kwargs))
    return rref, _length_or_none(rref.local_value())


def _length(dataset: Any) -> int:
    return len(dataset)


class _Length(enum.Enum):
    UNKNOWN = "unknown"  #: no copy installed yet: the first one fixes the length


def _get_item(dataset: Any, index: Any) -> Any:
    return dataset[index]


class RPCDataset(Dataset):
    """A dataset built on remote workers: each worker holds one copy, shared by the trainers that send it.

    ``dataset(*args, **kwargs)`` runs on every worker; only a reference comes
    back. The recipe is kept, so a worker that restarts is given the dataset
    again, and its length is checked against the others'.

    Trainers that send a worker the same recipe (the same pickled ``dataset``
    and arguments, under the same token) share one instance there: the first
    builds it, the others arriving meanwhile wait for that build (a build that
    raises raises for each of them, and is not kept), and it is freed when the
    last of them releases it. So 64 ranks borrowing one worker cost it one
    copy, not 64. A method called through the dataset's RRef that changes the
    dataset changes it for every trainer sharing it; a dataset that keeps
    per-trainer state (a cursor, a cache filled per epoch) should be built
    with ``rpcdl_per_trainer=True``.

    Args:
        workers: worker addresses, ``"host:port"``; or a worker source: a file
            listing them (watched), ``"dns://NAME:PORT"``, ``"redis://HOST:PORT[/DB]?key=KEY"``,
            any object with ``addresses()`` (:class:`rpcdl.WorkerSource`), or a
            :class:`~rpcdl.data.sources.Fleet` (a source with this rank's share).
        dataset: a dataset class, or any callable returning a map-style
            dataset (lambdas included).
        args: positional arguments for ``dataset``.
        kwargs: keyword arguments for ``dataset``.
        rpcdl_timeout: seconds each worker has to build the dataset (default
            120; ``0``: no limit). Keyword-only, and named so that it cannot
            clash with the dataset's own arguments. It is also the timeout of
            rebuilds on a restarted worker and of ``dataset[i]`` here. A build
            that times out goes on running on the worker: with ``--parallel 1``
            its next calls wait behind it.
        rpcdl_start_timeout: seconds to wait for the first worker to build it
            (default: ``RPCDL_START_TIMEOUT``, else 600). The dataset is ready
            as soon as any worker of this client's share has built it; a
            worker that refuses connections or whose host name does not
            resolve yet is asked again meanwhile, and in the background once
            it is ready (see :doc:`/guides/fleets`). Keyword-only.
        rpcdl_per_trainer: build a copy for this trainer alone on each worker
            (``True``), instead of sharing the copy of every trainer that sends
            the same recipe (``False``, the default). Keyword-only, named so
            that it cannot clash with the dataset's own arguments.

    Raises:
        DatasetMismatch: workers built datasets of different lengths.
        WorkerUnavailable: no worker could build it within ``rpcdl_start_timeout``
            (the message names each worker and why).
        WorkerTimeout: no worker finished building it within ``rpcdl_timeout``
            (the message names the workers and how to allow more).
        TypeError: ``dataset`` is (or built) an ``IterableDataset``.
        Exception: whatever ``dataset(...)`` raised on a worker, with its traceback.

    .. note::
        In a distributed job, give each rank a
        ``Fleet(workers, rank, world_size)``: it builds the dataset on its own
        share (``workers[rank::world_size]``) and calls on the others' when its
        own are gone (``RPCDataModule`` does this).

    Example::

        >>> dataset = rpcdl.RPCDataset(["node01:6543", "node02:6543"], torchvision.datasets.MNIST,
        ...                            root="/data", transform=ToTensor())  # doctest: +SKIP
        >>> len(dataset)  # doctest: +SKIP
        60000
    """

    timeout: float = 120.0

    def __init__(
        self,
        workers: Sequence[str],
        dataset: Callable[..., Dataset],
        *args: Any,
        rpcdl_timeout: float = 120.0,
        rpcdl_start_timeout: float | None = None,
        rpcdl_per_trainer: bool = False,
        **kwargs: Any,
    ):
        self.fleet = workers if isinstance(workers, Fleet) else Fleet(workers)
        if not callable(dataset):
            raise TypeError(f"dataset must be a dataset class or a callable returning one, got {dataset!r}")
        if isinstance(dataset, type) and issubclass(dataset, IterableDataset):
            raise _iterable_dataset_error(dataset.__qualname__)
        self.timeout = check_loader_timeout(rpcdl_timeout, "rpcdl_timeout")
        if not isinstance(rpcdl_per_trainer, bool):
            raise TypeError(
                f"rpcdl_per_trainer must be True (a copy per trainer on each worker) or False (one copy per worker, "
                f"shared by the trainers sending the same dataset), got {rpcdl_per_trainer!r}"
            )
        self.per_trainer = rpcdl_per_trainer
        self._timeout_given = float(rpcdl_timeout)
        self.factory = dataset
        self.args = args
        self.kwargs = kwargs
        # what a worker shares its copy by (None: this trainer's own); the recipe is fixed, so pickled once here
        self._definition: bytes | None = None if rpcdl_per_trainer else self._pickle_definition()
        self._lock = threading.Lock()
        self._rrefs: dict[str, RRef | None] = {}
        self._building: dict[str, torch.futures.Future] = {}  # the builds in flight, each until it is installed
        self._length: int | _Length | None = _Length.UNKNOWN  # the first copy's, fixed from then on
        self._build_first(start_timeout(rpcdl_start_timeout))

    def _build_first(self, timeout: float) -> None:
        """Build the dataset on this client's share of the fleet; return once one worker has built it."""
        with self._lock:
            for address in self.fleet.membership().addresses:
                self._rrefs.setdefault(address, None)
        name = getattr(self.factory, "__qualname__", "the dataset")
        wait_for_first_copy(self.fleet, self.rebuild_async, name, timeout)
        with self._lock:  # the workers the fleet listed meanwhile
            for address in self.fleet.membership().addresses:
                self._rrefs.setdefault(address, None)

    @property
    def workers(self) -> list[str]:
        """The workers this dataset knows of: where it is built, or may be built (its fleet's, so far)."""
        with self._lock:
            return list(self._rrefs)

    def _build_timed_out(self, address: str, exc: WorkerTimeout) -> WorkerTimeout:
        name = getattr(self.factory, "__qualname__", "dataset")
        return WorkerTimeout(
            f"worker {address} did not build {name} within rpcdl_timeout={self._timeout_given:g}s. It is still "
            "building it (a call is not cancelled when the client stops waiting), and with --parallel 1 its "
            "next calls wait until the build ends. Allow more time with "
            f"rpcdl.RPCDataset(workers, {name}, ..., rpcdl_timeout=SECONDS) (0: no limit)"
        )

    @property
    def rrefs(self) -> list[RRef | None]:
        """The remote references, one per worker (``None`` where not built)."""
        with self._lock:
            return list(self._rrefs.values())

    def rref(self, address: str) -> RRef | None:
        """The reference to the dataset on ``address``, or ``None`` if it is not built there."""
        with self._lock:
            return self._rrefs.get(address)

    def build_async(self, address: str) -> torch.futures.Future:
        """Build the dataset on ``address`` (or share the copy built there); the future gives ``(rref, length)``."""
        recipe = (self.factory, self.args, self.kwargs)
        definition = self._definition
        try:
            if definition is None:
                return rpc_async(address, _build, recipe, timeout=self.timeout)
            return rpc_async(address, _build_shared, (definition, *recipe), timeout=self.timeout)
        except TypeError:  # a dataset argument that does not pickle: named as the user wrote it
            parts = {"the dataset class or factory": self.factory, **named_arguments(self.args, self.kwargs)}
            culprit = unpicklable_part(address, parts)
            if culprit is None:
                raise
            name = getattr(self.factory, "__qualname__", "the dataset")
            raise TypeError(f"RPCDataset cannot send {name} and its arguments to worker {address}: {culprit}") from None

    def _pickle_definition(self) -> bytes | None:
        """The recipe pickled alike in every trainer with the same code, what a worker shares a copy by; ``None``
        when it does not pickle so (then this trainer's copy is its own, and sending the recipe says what fails)."""
        try:
            return pickle_definition((self.factory, self.args, self.kwargs))
        except Exception as exc:  # pickle's own errors, and what a __reduce__ raised
            log.debug("the dataset is built for this trainer alone: its definition does not pickle (%s)", exc)
            return None

    def rebuild_async(self, address: str) -> torch.futures.Future:
        """Build the dataset on ``address`` again (it lost it, or never had it) and install it (:meth:`accept`).

        The reference to the lost copy is dropped at once. While a build is in
        flight there, its future is returned rather than a second build. The
        future completes once the new copy is installed, or fails with the
        build's error (a host name that does not resolve fails with
        :class:`~rpcdl.errors.WorkerUnavailable`: a worker not made yet is
        asked again later).
        """
        with self._lock:
            building = self._building.get(address)
            if building is not None:
                return building
            self._rrefs[address] = None
            installed: torch.futures.Future = torch.futures.Future()
            self._building[address] = installed
        try:
            built = self.build_async(address)
        except BaseException:
            with self._lock:
                del self._building[address]
            raise
        built.add_done_callback(functools.partial(self._install, address, installed))
        return installed

    def _install(self, address: str, installed: torch.futures.Future, built: torch.futures.Future) -> None:
        # On the thread that read the build's answer: errors keep their type (a transient one is retried).
        try:
            try:
                self.accept(address, *built.wait())
            finally:
                with self._lock:
                    self._building.pop(address, None)
        except UnknownHost as exc:
            installed.set_exception(WorkerUnavailable(str(exc)))
        except WorkerTimeout as exc:
            installed.set_exception(self._build_timed_out(address, exc))
        except Exception as exc:
            installed.set_exception(exc)
        else:
            installed.set_result(None)

    def accept(self, address: str, rref: RRef, length: int | None) -> None:
        """Install a copy built on ``address`` (by :meth:`build_async`), checking its length.

        Raises:
            DatasetMismatch: its length differs from the others'.
        """
        with self._lock:
            if self._length is _Length.UNKNOWN:  # the first copy: the others must have its length
                self._length = length
            elif length != self._length:
                self._rrefs[address] = None
                raise DatasetMismatch(
                    f"worker {address} built a dataset of length {length}, the others have {self._length}: "
                    "it is kept out; check that every worker sees the same data"
                )
            self._rrefs[address] = rref

    def release(self) -> None:
        """Free the copies on every worker now rather than when this object is collected."""
        with self._lock:
            self._rrefs = dict.fromkeys(self._rrefs)

    def __getstate__(self) -> dict[str, Any]:
        with self._lock:
            state = self.__dict__.copy()
            state["_rrefs"] = dict(self._rrefs)
        del state["_lock"]
        state["_building"] = {}  # a copy builds nothing: its own rebuilds start afresh
        state["factory"], state["args"], state["kwargs"] = None, None, None
        state["_recipe"] = cloudpickle.dumps((self.factory, self.args, self.kwargs))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.factory, self.args, self.kwargs = cloudpickle.loads(state.pop("_recipe"))
        state = {k: v for k, v in state.items() if k not in ("factory", "args", "kwargs")}
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        if self._length is None or self._length is _Length.UNKNOWN:
            raise TypeError("this RPCDataset has no length (its dataset defines no __len__)")
        return self._length

    def __getitem__(self, index: Any) -> Any:
        """Fetch one sample from the first worker holding the dataset (for inspection)."""
        with self._lock:
            built = list(self._rrefs.items())
        for address, rref in built:
            if rref is not None:
                return rpc_async(address, _get_item, (rref, index), timeout=self.timeout).wait()
        raise RuntimeError("no worker holds this dataset")

    def __repr__(self) -> str:
        name = getattr(self.factory, "__qualname__", repr(self.factory))
        return f"RPCDataset({name}, workers={self.workers}, length={self._length})"


class DatasetSetup:
    """What a loader's worker needs before it serves: the dataset (a :class:`~rpcdl.data.probes.WorkerSetup`).

    A worker taken out because it lost the dataset (:class:`~rpcdl.errors.RRefNotFound`:
    it restarted), or that never built it, builds it again; any other is probed
    (:func:`~rpcdl.data.probes.probe_async`), and a batch tells whether it still
    holds the dataset.

    Args:
        dataset: the remote dataset.
        probe_timeout: seconds a probe may take.
    """

    def __init__(self, dataset: RPCDataset, probe_timeout: float):
        self.dataset = dataset
        self.probe_timeout = probe_timeout

    def revive_async(self, address: str, failure: BaseException | None) -> torch.futures.Future[Revival]:
        """Rebuild the dataset on ``address`` where it is lost, else probe it."""
        if isinstance(failure, RRefNotFound) or self.dataset.rref(address) is None:
            return back_when(self.dataset.rebuild_async(address))
        return probe_async(address, failure, self.probe_timeout)
