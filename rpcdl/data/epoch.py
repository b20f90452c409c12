"""One epoch of an :class:`~rpcdl.RPCDataloader`: its batches, in order, with its position kept.

An epoch is a :class:`~rpcdl.data.chunked_pass.ChunkedPass` over the
sampler's batches: each call fetches a chunk of consecutive batches on a
worker, as many as take about 2 ms there and answer at most
:data:`TARGET_CHUNK_BYTES`, up to the loader's ``max_batches_per_call``. Small
batches then cost one call per chunk instead of one per batch; a batch of a
few hundred KB or more, or a slow one, still has its own call. Each batch
keeps its own seed and its own error, and the position counts batches
yielded, so a resumed epoch starts at the first batch not yielded, wherever
its chunk began.

Threading: an epoch belongs to the thread that advances it (see :mod:`rpcdl.data.scheduler`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data._utils.collate import default_collate, default_convert

from ..errors import is_transient
from ..rpc.client import rpc_async
from ..rpc.rref import RRefNotFound, remote_id
from ..seeding import derive_seed, set_random_seeds
from .chunked_pass import ChunkedPass
from .fetch import fetch_batches_at, fetch_samples_at
from .scheduler import NoWorkersLeft, Task, WorkerSlot

__all__ = ["TARGET_CHUNK_BYTES", "EpochIterator"]

#: The size of the answer a chunk of batches aims at, in bytes. Enough batches to make a call's overhead
#: small, few enough that the batches in flight stay a few MB and that a chunk crosses a slow link quickly.
TARGET_CHUNK_BYTES = 256 * 1024


class EpochIterator(Iterator[Any]):
    """One epoch of ``loader``, started by the first ``next()`` (see the module)."""

    def __init__(self, loader: Any):
        self.loader = loader
        self.epoch: int | None = None
        self.started = False
        self.finished = False

    def _start(self) -> None:
        loader = self.loader
        self.started = True
        self.epoch, self.generator_state, resume = loader._begin_epoch()
        skip_prefix = resume["yielded_prefix"] if resume else 0
        skip = set(resume["yielded_extra"]) if resume else set()
        self._yielded_prefix = skip_prefix
        self._yielded_extra: set[int] = set(skip)
        source = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
        batches = (
            (seq, indices) for seq, indices in itertools.islice(enumerate(source), skip_prefix, None) if seq not in skip
        )
        batched = loader.batch_sampler is not None
        self._fetch = fetch_batches_at if batched else fetch_samples_at
        # torch's default collate (convert) function is named by None: nothing to pickle per call.
        default = default_collate if batched else default_convert
        self._collate_fn = None if loader.collate_fn is default else loader.collate_fn
        if loader.seed is not None:
            self._reseed_workers()
        self._pass = ChunkedPass(
            loader._pool, batches, self._call, loader._chunk_sizer, loader._batches_served, in_order=loader.in_order
        )

    def __next__(self) -> Any:
        if self.finished:
            raise StopIteration
        if not self.started:
            self._start()
        self.loader._iterator = self
        try:
            item = next(self._pass)
        except (StopIteration, NoWorkersLeft):
            self.finished = True
            raise
        except Exception:
            if self._pass.source_failed:  # the sampler raised, after its batches pulled before were yielded
                self.finished = True
            raise
        seq, indices = item.payload
        self._mark_yielded(seq)
        if item.error is not None:
            raise self._annotate(item.error, seq, indices, item.worker)
        return item.value

    def close(self) -> None:
        """Stop the epoch; answers still in flight are dropped when they arrive."""
        self.finished = True
        if self.started:
            self._pass.close()

    def state_dict(self) -> dict[str, Any]:
        """The position: the epoch, the batches yielded, and the sampler's generator at the epoch's start."""
        return {
            "epoch": self.epoch,
            "yielded_prefix": self._yielded_prefix,
            "yielded_extra": sorted(self._yielded_extra),
            "generator_state": self.generator_state,
        }

    def _call(self, task: Task, slot: WorkerSlot) -> torch.futures.Future:
        loader = self.loader
        rref = loader.dataset.rref(slot.address)
        if rref is None:
            raise RRefNotFound(f"the dataset is not built on worker {slot.address}")
        if loader.seed is None:
            chunk = [(indices, None) for _, indices in task.payload]
        else:
            chunk = [(indices, derive_seed(loader.seed, self.epoch, seq)) for seq, indices in task.payload]
        return rpc_async(
            slot.address, self._fetch, (remote_id(rref), chunk, self._collate_fn),
            pin_memory=loader.pin_memory, timeout=loader._call_timeout,
        )  # fmt: skip

    def _mark_yielded(self, seq: int) -> None:
        if seq == self._yielded_prefix:
            self._yielded_prefix += 1
            while self._yielded_prefix in self._yielded_extra:
                self._yielded_extra.discard(self._yielded_prefix)
                self._yielded_prefix += 1
        else:
            self._yielded_extra.add(seq)

    def _annotate(self, exc: BaseException, seq: int, indices: Any, worker: str) -> BaseException:
        if isinstance(indices, (list, tuple)) and len(indices) > 16:
            shown = f"{list(indices[:16])} ... ({len(indices)} in all)"
        else:
            shown = repr(indices)
        exc.add_note(f"while loading batch {seq} of epoch {self.epoch} (indices {shown}) on worker {worker}")
        return exc

    def _reseed_workers(self) -> None:
        base = derive_seed(self.loader.seed, self.epoch)
        futures = [
            rpc_async(slot.address, set_random_seeds, (base, slot.index), timeout=self.loader._revival_wait())
            for slot in self.loader._pool.active()
        ]
        for future in futures:
            try:
                future.wait()
            except Exception as exc:
                if not is_transient(exc):
                    raise
