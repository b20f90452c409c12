"""Lightning integration: :class:`RPCDataModule` feeds a LightningModule from rpcdl workers.

Everything a LightningCLI YAML needs to configure is an argument of
:class:`RPCDataModule`: the workers, the datasets as class paths with init
arguments, and the loader settings. :func:`cli_main` is a ``LightningCLI`` that
takes the model and the data module as class paths, so the files in
``configs/`` run as::

    python -m rpcdl.integrations.lightning fit --config configs/digits.yaml
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePath
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import Dataset, Sampler

from rpcdl.address import check_workers, parse_address
from rpcdl.checks import check_int, check_loader_timeout, check_positive_int
from rpcdl.data.dataloader import RPCDataloader, check_max_batches_per_call
from rpcdl.data.dataset import RPCDataset
from rpcdl.data.elastic import ElasticDistributedSampler
from rpcdl.data.flow import FlowSnapshot
from rpcdl.data.resume import WHOLE_EPOCH, epoch_batches
from rpcdl.data.sources import (
    WORKERS_ENV,
    AddressList,
    FileSource,
    Fleet,
    WorkerSource,
    worker_source,
    workers_from_environment,
)
from rpcdl.data.trainer_metrics import serve_metrics_from_environment
from rpcdl.integrations._recipes import dataset_recipe, import_object
from rpcdl.local import LocalWorkers, local_workers
from rpcdl.seeding import derive_seed

__all__ = ["WORKERS_ENV", "DataFlowLogger", "RPCDataModule", "cli_main", "read_workers_file", "resolve_workers"]

log = logging.getLogger("rpcdl.lightning")

"""Environment variable listing worker addresses, separated by commas or whitespace."""

_SPLITS = ("train", "val", "test", "predict")
_STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}


# ---------------------------------------------------------------------------- workers


def _split_addresses(text: str, origin: str) -> list[str]:
    addresses = [item for item in re.split(r"[\s,]+", text) if item]
    for address in addresses:
        try:
            parse_address(address)
        except ValueError as exc:
            raise ValueError(f"{origin}: {exc}") from None
    return addresses


def read_workers_file(path: str | os.PathLike) -> list[str]:
    """Read worker addresses from a file: one ``HOST:PORT`` per line.

    Blank lines and ``#`` comments are ignored. This is the file
    ``rpcdl worker --address-file FILE`` appends to, so a Slurm job can start its
    workers, wait for them, and hand the file to the trainers.

    Args:
        path: the file.

    Returns:
        the addresses, in file order.

    Raises:
        ValueError: a line is not ``HOST:PORT`` (the message gives the line number),
            the file lists no worker, or lists one twice.

    Example::

        >>> read_workers_file("workers.txt")  # doctest: +SKIP
        ['cpu01:6543', 'cpu02:6543']
    """
    addresses = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            try:
                parse_address(entry)
            except ValueError as exc:
                raise ValueError(f"{path}, line {number}: {exc}") from None
            addresses.append(entry)
    if not addresses:
        raise ValueError(f"the workers file {path} lists no worker (one HOST:PORT per line is expected)")
    try:
        return check_workers(addresses)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _source(workers: Any) -> WorkerSource | None:
    """The worker source ``workers`` (RPCDataModule's argument) names; ``None``: start local workers.

    A file is watched (an empty one is waited for); ``dns://`` and ``redis://``
    URLs, here or in ``$RPCDL_WORKERS``, are sources; addresses are a fixed list.
    """
    if hasattr(workers, "addresses"):
        return workers
    if workers is None:
        return workers_from_environment()
    if isinstance(workers, str) and workers.strip().startswith(("dns://", "redis://", "rediss://")):
        return worker_source(workers.strip())
    if isinstance(workers, (str, os.PathLike)) and _names_a_file(workers):
        path = os.path.expandvars(os.path.expanduser(os.fspath(workers)))
        if Path(path).is_file():
            _check_lines(path)  # a malformed line is an error now, not a warning later
        return FileSource(path)  # a missing or empty file is waited for, and named
    addresses = resolve_workers(workers)
    return None if addresses is None else AddressList(addresses)


def _names_a_file(workers: str | os.PathLike) -> bool:
    """Whether ``workers`` is the path of a workers file (written yet or not) rather than addresses.

    A path object, an existing file, and a string with a ``/`` or without a
    ``:`` (``workers.txt``) are files; addresses are ``HOST:PORT``. A path
    naming an environment variable that is not set is not waited for: it is
    an error (:func:`resolve_workers` says which variable).
    """
    text = os.fspath(workers)
    path = os.path.expandvars(os.path.expanduser(text))
    if re.search(r"\$\{?\w+", path):
        return False
    if isinstance(workers, os.PathLike) or Path(path).is_file() or os.sep in path:
        return True
    with contextlib.suppress(ValueError):
        if _split_addresses(path, "workers"):
            return False
    return ":" not in path


def _check_lines(path: str) -> None:
    """Raise ``ValueError`` for a malformed line of the workers file ``path`` (an empty file is waited for)."""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            entry = line.split("#", 1)[0].strip()
            if entry:
                try:
                    parse_address(entry)
                except ValueError as exc:
                    raise ValueError(f"{path}, line {number}: {exc}") from None


def resolve_workers(workers: Sequence[str] | str | os.PathLike | None) -> list[str] | None:
    """Turn the ``workers`` argument of :class:`RPCDataModule` into a list of addresses.

    Args:
        workers: a list of ``HOST:PORT``; a path to a file listing them (``~`` and
            ``$VARIABLES`` expanded, see :func:`read_workers_file`); a string of
            addresses separated by commas or whitespace; or ``None``: then the
            addresses in ``$RPCDL_WORKERS`` when it is set.

    Returns:
        the addresses, or ``None`` when ``workers`` is ``None`` and
        ``$RPCDL_WORKERS`` is unset or empty (the caller starts local workers).

    Example::

        >>> resolve_workers(["127.0.0.1:6543", "127.0.0.1:6544"])
        ['127.0.0.1:6543', '127.0.0.1:6544']
        >>> resolve_workers("127.0.0.1:6543,127.0.0.1:6544")
        ['127.0.0.1:6543', '127.0.0.1:6544']
    """
    if workers is None:
        source = workers_from_environment()
        return None if source is None else source.addresses()
    if isinstance(workers, (str, os.PathLike)):
        path = os.path.expandvars(os.path.expanduser(os.fspath(workers)))
        if Path(path).is_file():
            return read_workers_file(path)
        with contextlib.suppress(ValueError):
            addresses = _split_addresses(path, "workers")
            if addresses:
                return addresses
        unset = re.findall(r"\$\{?(\w+)", path)
        hint = f" (environment variable {', '.join(unset)} not set)" if unset else ""
        raise FileNotFoundError(
            f"workers={os.fspath(workers)!r} is neither a file{hint} nor HOST:PORT addresses; give a list of "
            "HOST:PORT, a file listing them one per line, or None to use $RPCDL_WORKERS or local workers"
        )
    if not isinstance(workers, Sequence) or not workers:
        raise TypeError(f"workers must be a list of 'HOST:PORT' strings, a file path or None, got {workers!r}")
    return check_workers([address.strip() if isinstance(address, str) else address for address in workers])


# ---------------------------------------------------------------------------- loaders


class _UnpaddedShard(Sampler[int]):
    """Indices ``rank, rank + world_size, ...``: every sample once across ranks (for predict)."""

    def __init__(self, length: int, rank: int, world_size: int):
        self.length, self.rank, self.world_size = length, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.world_size))


class _TrainerLoader(RPCDataloader):
    """An RPCDataloader whose epochs follow the trainer's ``current_epoch``."""

    def __init__(self, *args: Any, epoch_source: Callable[[], int | None], batch_limit: Callable[[], float], **kwargs):
        super().__init__(*args, **kwargs)
        self._epoch_source = epoch_source
        self._batch_limit = batch_limit

    def requested_epoch(self) -> int | None:
        return self._epoch_source()  # a loaded state still wins: it names its own epoch

    def epoch_batch_limit(self) -> float:
        # Lightning ends an epoch at its batch limit without asking for more batches.
        return self._batch_limit()

    def __len__(self) -> int:
        # Lightning reads the length once, as the limit of every epoch: after an epoch resumed on another
        # cluster shape (its length is the batches counted before it and this rank's share of the rest),
        # the whole epochs that follow must fit too. An epoch shorter than the limit ends with its batches.
        numbered = super().__len__()
        sampler = self.sampler
        if isinstance(sampler, ElasticDistributedSampler) and self.batch_size is not None:
            return max(numbered, epoch_batches(sampler.layout(), WHOLE_EPOCH, self.batch_size, self.drop_last))
        return numbered

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            super().load_state_dict(state)
        except (TypeError, ValueError) as exc:
            exc.add_note(_CANNOT_RESUME)
            raise


# ---------------------------------------------------------------------------- the data flow, logged


class DataFlowLogger(pl.Callback):
    """Logs the training loader's data flow at the end of each training epoch, through the trainer's loggers.

    :class:`RPCDataModule` adds one to its trainer. The figures cover the
    epoch's training batches, from the end of the previous training epoch
    (see :class:`~rpcdl.data.flow.FlowFigures`): ``rpcdl/data_wait_fraction``
    (of the loop's time, spent blocked on the loader), ``rpcdl/batches_per_second``
    and ``rpcdl/workers_needed`` (workers of the measured speed that keep this
    rank fed; absent until measured). Each rank logs its own.

    Args:
        datamodule: whose training loader to read.
    """

    def __init__(self, datamodule: RPCDataModule):
        self.datamodule = datamodule
        self._baseline: tuple[RPCDataloader | None, FlowSnapshot] = (None, FlowSnapshot())

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = self.datamodule.loaders.get("train")
        if loader is None:
            return
        now = loader.data_flow()
        previous_loader, previous = self._baseline
        figures = now.since(previous if previous_loader is loader else FlowSnapshot())
        self._baseline = (loader, now)
        metrics = {
            "rpcdl/data_wait_fraction": figures.data_wait_fraction,
            "rpcdl/batches_per_second": figures.batches_per_second,
        }
        if math.isfinite(figures.workers_needed):
            metrics["rpcdl/workers_needed"] = figures.workers_needed
        pl_module.log_dict(metrics, on_step=False, on_epoch=True)


_CANNOT_RESUME = (
    "RPCDataModule: this checkpoint's position in the training epoch does not fit this run's training data "
    "(above: what differs). Resume it with the same train_dataset, shuffle and seed (any number of ranks, batch "
    "size and workers will do), or start the epoch again: resume from a checkpoint saved at an epoch's end "
    "(ModelCheckpoint(save_on_train_epoch_end=True)), whose position, the start of the next epoch, any "
    "training data resumes."
)


# ---------------------------------------------------------------------------- the data module


class RPCDataModule(pl.LightningDataModule):
    """A LightningDataModule whose datasets live on rpcdl workers.

    Each dataset is given as a recipe, built on every worker of this rank
    (nothing is loaded in the training process). In a distributed run, rank
    ``r`` of ``W`` uses ``workers[r::W]`` first (for a changing source, a share
    that joins disturb little) and the other ranks' workers when its own are
    all gone or hung: no rank fails while any worker serves. Each rank reads a
    disjoint shard of the indices (DistributedSampler semantics, the same
    shuffle on every rank).
    Every training epoch the shard is reshuffled for that epoch and the workers
    are reseeded, so random augmentations differ between epochs and workers and
    the same ``seed`` draws them again. ``teardown`` frees the remote datasets
    and stops the local workers the module started. ``state_dict`` holds the
    global position in the training epoch (the samples consumed in the epoch's
    order, the same on every rank): a checkpoint saved mid-epoch or at an
    epoch's end resumes with the samples not yet seen, each once, on any number
    of ranks, batch size and workers (see :doc:`/guides/resume`).

    Each training epoch it logs ``rpcdl/data_wait_fraction``,
    ``rpcdl/batches_per_second`` and ``rpcdl/workers_needed`` through the
    trainer's loggers (:class:`DataFlowLogger`), and with ``RPCDL_METRICS_PORT``
    set it serves the process's Prometheus metrics (see :func:`rpcdl.serve_metrics`).

    Args:
        workers: where the workers are: a list of ``HOST:PORT``; a path to a file
            listing them, one per line (``~`` and ``$VARIABLES`` expanded), as
            ``rpcdl worker --address-file`` writes it, watched (a line added
            joins, a line removed drains; ``#`` comments skipped; an empty or
            missing file is waited for), from Python, LightningCLI's command
            line or YAML alike; ``"dns://NAME:PORT"`` (every address
            of a headless Service, resolved again every few seconds);
            ``"redis://HOST:PORT[/DB]?key=KEY"`` (the registry workers join with
            ``rpcdl worker --register``); an :class:`rpcdl.WorkerSource`; or
            ``None``: ``$RPCDL_WORKERS`` (addresses, or one of those sources),
            else ``num_local_workers`` worker processes on loopback that the
            module starts (each rank its own) and stops. ``setup()`` waits for
            the fleet to come up, up to ``$RPCDL_START_TIMEOUT`` seconds (600).
        train_dataset, val_dataset, test_dataset, predict_dataset: how to build
            each dataset on the workers: ``{"class_path": "pkg.mod.Dataset",
            "init_args": {...}}``, a class path string, or (from Python) a class
            or any callable returning a map-style dataset. ``None``: no such split.
            Init arguments that are themselves ``{"class_path", "init_args"}``
            mappings (a transform, say) are built on the workers too.
        batch_size: samples per batch.
        eval_batch_size: samples per batch of the val, test and predict loaders
            (default: ``batch_size``).
        shuffle: reshuffle the training samples every epoch.
        collate_fn: merges samples into a batch, on the workers (default: torch's
            ``default_collate``). In YAML, a dotted path to the function.
        pin_memory: receive batches into pinned memory when CUDA is available.
        prefetch_factor: calls in flight or ready per worker (a call carries one
            batch, or a chunk of small ones: see :class:`~rpcdl.RPCDataloader`).
        drop_last: drop the last incomplete training batch.
        timeout: seconds a worker has to deliver a batch before its batches go to
            the others; ``0``: no timeout, as torch's DataLoader.
        seed: base seed of the shuffle and of the workers' random generators.
            ``None``: the seed of ``seed_everything`` (``$PL_GLOBAL_SEED``), else 0.
        num_local_workers: worker processes to start when no workers are given.
        max_batches_per_call: the most consecutive batches one call fetches when
            batches are small and quick to make (``1``: a call per batch; see
            :class:`~rpcdl.RPCDataloader`).

    Example::

        >>> data = RPCDataModule(
        ...     workers=["cpu01:6543", "cpu02:6543"],
        ...     train_dataset={"class_path": "rpcdl.examples.digits.DigitsDataset",
        ...                    "init_args": {"split": "train", "augment": True}},
        ...     val_dataset={"class_path": "rpcdl.examples.digits.DigitsDataset", "init_args": {"split": "val"}},
        ...     batch_size=32, seed=0)  # doctest: +SKIP
        >>> pl.Trainer(max_epochs=5).fit(model, datamodule=data)  # doctest: +SKIP
    """

    def __init__(
        self,
        workers: list[str] | str | PurePath | WorkerSource | None = None,
        train_dataset: str | dict[str, Any] | Callable[..., Dataset] | None = None,
        val_dataset: str | dict[str, Any] | Callable[..., Dataset] | None = None,
        test_dataset: str | dict[str, Any] | Callable[..., Dataset] | None = None,
        predict_dataset: str | dict[str, Any] | Callable[..., Dataset] | None = None,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        shuffle: bool = True,
        collate_fn: Callable | None = None,
        pin_memory: bool = False,
        prefetch_factor: int = 2,
        drop_last: bool = False,
        timeout: float = 120.0,
        seed: int | None = None,
        num_local_workers: int = 2,
        max_batches_per_call: int = 32,
    ):
        super().__init__()
        check_positive_int(batch_size, "batch_size")
        check_positive_int(prefetch_factor, "prefetch_factor")
        check_positive_int(num_local_workers, "num_local_workers")
        check_max_batches_per_call(max_batches_per_call)
        check_int(eval_batch_size, "eval_batch_size", minimum=1, optional=True)
        check_loader_timeout(timeout)
        check_int(seed, "seed", optional=True, wrong_type=TypeError)
        if isinstance(collate_fn, str):
            collate_fn = import_object(collate_fn)
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be a function (or its dotted path), got {collate_fn!r}")
        if workers is not None and not isinstance(workers, (str, os.PathLike)) and not hasattr(workers, "addresses"):
            resolve_workers(workers)  # a list: check it now; files and the environment are read in setup()
        self.workers_argument = workers
        specs = {"train": train_dataset, "val": val_dataset, "test": test_dataset, "predict": predict_dataset}
        self.recipes = {split: dataset_recipe(spec, f"{split}_dataset") for split, spec in specs.items()}
        if not any(self.recipes.values()):
            raise ValueError("RPCDataModule needs at least one of train_dataset, val_dataset, test_dataset, "
                             "predict_dataset")  # fmt: skip
        for split, recipe in self.recipes.items():
            if recipe is None:
                # Lightning skips a split whose hook is not overridden: keep the base class's for absent splits.
                hook = f"{split}_dataloader"
                setattr(self, hook, getattr(pl.LightningDataModule, hook).__get__(self))
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.shuffle = bool(shuffle)
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.drop_last = drop_last
        self.timeout = float(timeout)
        self.seed = seed
        self.num_local_workers = num_local_workers
        self.max_batches_per_call = max_batches_per_call

        self.all_workers: list[str] = []
        """Every worker of the job, once set up."""
        self.workers: list[str] = []
        """The workers this rank uses, once set up."""
        self.datasets: dict[str, RPCDataset] = {}
        """The remote datasets built by :meth:`setup`, by split."""
        self.loaders: dict[str, RPCDataloader] = {}
        """The last loader handed to the trainer, by split (kept after teardown for their counters)."""
        self.rank, self.world_size = 0, 1
        self.fleet: Fleet | None = None
        """The workers this module follows, once set up (every rank's, with this rank's share)."""
        self.started_workers: LocalWorkers | None = None
        """The worker processes this module started (when given no workers), until teardown."""
        self._local_context: contextlib.AbstractContextManager | None = None
        self._base_seed: int | None = None
        self._pending_train_state: dict[str, Any] | None = None

    # ------------------------------------------------------------------ Lightning hooks

    def setup(self, stage: str | None = None) -> None:
        """Connect to the workers (or start local ones) and build this stage's datasets on them."""
        trainer = self.trainer
        if trainer is not None:
            self.rank, self.world_size = trainer.global_rank, trainer.world_size
            serve_metrics_from_environment(trainer.local_rank)
            if not any(isinstance(callback, DataFlowLogger) for callback in trainer.callbacks):
                trainer.callbacks.append(DataFlowLogger(self))
        if self._base_seed is None:
            self._base_seed = self._default_seed()
        if self.fleet is None:
            self._connect()
        splits = _STAGE_SPLITS.get(stage, _SPLITS) if stage is not None else _SPLITS
        for split in splits:
            recipe = self.recipes[split]
            if recipe is not None and split not in self.datasets:
                factory, kwargs = recipe
                self.datasets[split] = RPCDataset(self.fleet, factory, **kwargs)
        if self._local_context is None:  # a changing source may have come up meanwhile
            self._note_membership()

    def train_dataloader(self) -> RPCDataloader:
        """The training loader: this rank's shard, reshuffled and reseeded every epoch."""
        loader = self._loader("train")
        if self._pending_train_state is not None:
            loader.load_state_dict(self._pending_train_state)
            self._pending_train_state = None
        return loader

    def val_dataloader(self) -> RPCDataloader:
        """The validation loader: this rank's shard, in order."""
        return self._loader("val")

    def test_dataloader(self) -> RPCDataloader:
        """The test loader: this rank's shard, in order."""
        return self._loader("test")

    def predict_dataloader(self) -> RPCDataloader:
        """The predict loader: every sample once across ranks, in order."""
        return self._loader("predict")

    def teardown(self, stage: str | None = None) -> None:
        """Free the remote datasets and stop the local workers this module started."""
        for dataset in self.datasets.values():
            dataset.release()
        self.datasets.clear()
        if self.fleet is not None:  # the next setup() follows the source again
            self.fleet.close()
            self.fleet = None
        if self._local_context is not None:
            context, self._local_context, self.started_workers = self._local_context, None, None
            self.workers, self.all_workers = [], []
            context.__exit__(None, None, None)

    def state_dict(self) -> dict[str, Any]:
        """The seed and the training loader's global position in its epoch (see
        :meth:`rpcdl.RPCDataloader.state_dict`): every rank's is the same but for its rank."""
        state: dict[str, Any] = {"seed": self._base_seed if self._base_seed is not None else self._default_seed()}
        train = self.loaders.get("train")
        if train is not None:
            state["train_loader"] = train.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`, saved on any number of ranks: the next training epoch continues
        where it stopped, its samples not consumed split among this run's ranks."""
        seed = state_dict.get("seed")
        if seed is not None:
            if self.seed is not None and seed != self.seed:
                warnings.warn(
                    f"the checkpoint was written with seed={seed}, this RPCDataModule has seed={self.seed}: "
                    "the checkpoint's seed is used to continue the same random streams",
                    stacklevel=2,
                )
            self._base_seed = int(seed)
        train_state = state_dict.get("train_loader")
        if train_state is not None:
            if "train" in self.loaders:
                self.loaders["train"].load_state_dict(train_state)
            else:
                self._pending_train_state = dict(train_state)

    # ------------------------------------------------------------------ details

    @property
    def batches_served(self) -> dict[str, int]:
        """Batches each worker delivered to this module's loaders so far."""
        counts = dict.fromkeys(self.workers, 0)
        for loader in self.loaders.values():
            for address, count in loader.batches_served.items():
                counts[address] = counts.get(address, 0) + count
        return counts

    def _default_seed(self) -> int:
        if self.seed is not None:
            return self.seed
        with contextlib.suppress(ValueError):
            return int(os.environ.get("PL_GLOBAL_SEED", ""))
        return 0

    def _connect(self) -> None:
        source = _source(self.workers_argument)
        if source is None:
            self._local_context = local_workers(self.num_local_workers)
            self.started_workers = self._local_context.__enter__()
            self.fleet = Fleet(list(self.started_workers))  # each rank its own workers: all its own
            self.all_workers = list(self.started_workers)
            self.workers = list(self.all_workers)
            log.info("started %d local workers: %s", len(self.workers), ", ".join(self.workers))
            return
        self.fleet = Fleet(source, self.rank, self.world_size)
        count = len(self.fleet.membership().addresses)
        if not self.fleet.changing and count < self.world_size:
            warnings.warn(
                f"{count} workers for {self.world_size} ranks: ranks share workers; start at least one per rank",
                stacklevel=3,
            )
        self._note_membership()

    def _note_membership(self) -> None:
        """Record the fleet's workers now, and this rank's share of them."""
        membership = self.fleet.membership()
        self.all_workers = list(membership.addresses)
        self.workers = [address for address in membership.addresses if address in membership.own]

    def _current_epoch(self) -> int | None:
        trainer = self.trainer
        return trainer.current_epoch if trainer is not None else None

    def _train_batch_limit(self) -> float:
        trainer = self.trainer
        limit = getattr(trainer, "num_training_batches", float("inf")) if trainer is not None else float("inf")
        return limit if isinstance(limit, (int, float)) and limit > 0 else float("inf")

    def _loader(self, split: str) -> RPCDataloader:
        if self.recipes[split] is None:
            raise RuntimeError(f"this RPCDataModule has no {split}_dataset; set it to load the {split} split")
        dataset = self.datasets.get(split)
        if dataset is None:
            raise RuntimeError(f"the {split} dataset is not built yet: call setup() first (the Trainer does)")
        training = split == "train"
        if split == "predict":
            sampler: Sampler = _UnpaddedShard(len(dataset), self.rank, self.world_size)
        else:
            sampler = ElasticDistributedSampler(
                dataset, num_replicas=self.world_size, rank=self.rank,
                shuffle=self.shuffle and training, seed=self._base_seed, drop_last=False,
            )  # fmt: skip
        loader = _TrainerLoader(
            dataset,
            batch_size=self.batch_size if training else self.eval_batch_size,
            sampler=sampler,
            collate_fn=self.collate_fn,
            pin_memory=self.pin_memory,
            drop_last=self.drop_last and training,
            timeout=self.timeout,
            prefetch_factor=self.prefetch_factor,
            max_batches_per_call=self.max_batches_per_call,
            seed=derive_seed(self._base_seed, self.rank, _SPLITS.index(split)),
            epoch_source=self._current_epoch,
            batch_limit=self._train_batch_limit if training else lambda: float("inf"),
        )
        self.loaders[split] = loader
        return loader

    def __repr__(self) -> str:
        splits = [split for split, recipe in self.recipes.items() if recipe is not None]
        return f"RPCDataModule(workers={self.workers or self.workers_argument!r}, splits={splits})"


def cli_main(args: Any = None, **kwargs: Any) -> Any:
    """Run a ``LightningCLI`` whose model and data module are given as class paths.

    The files in ``configs/`` are written for it. ``kwargs`` go to ``LightningCLI``.

    Example::

        $ python -m rpcdl.integrations.lightning fit --config configs/digits.yaml
    """
    from lightning.pytorch.cli import LightningCLI

    return LightningCLI(args=args, **kwargs)


if __name__ == "__main__":
    cli_main()
