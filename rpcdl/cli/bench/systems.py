"""The systems compared: rpcdl, torch's DataLoader and a raw loopback socket."""

from __future__ import annotations

import collections
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ...local import child_environment
from ...processes import stop_process
from .workloads import (
    LENGTH,
    PREFETCH,
    REQUEST,
    RPCDL,
    SLOWDOWN,
    SOCKET,
    TORCH,
    increment,
    noop,
    recv_exact_into,
    set_slowdown,
    slow_torch_worker,
)

# ---------------------------------------------------------------------------- systems


def calls_in_a_window(count: int, window: int, call_async: Callable[[], Any]) -> None:
    """Make ``count`` calls with ``call_async()``, at most ``window`` in flight: a sliding window.

    Before each call past the window, the oldest call in flight is waited for;
    then all are. This is the ``calls(count, window)`` capability of the
    systems whose calls return futures.

    Args:
        count: how many calls.
        window: how many may be in flight at once (at least 1).
        call_async: starts one call and returns its future (anything with ``wait()``).

    Example::

        >>> import torch
        >>> def done():
        ...     future = torch.futures.Future()
        ...     future.set_result(None)
        ...     return future
        >>> calls_in_a_window(10, 3, done)
    """
    in_flight: collections.deque = collections.deque()
    for _ in range(count):
        if len(in_flight) >= window:
            in_flight.popleft().wait()
        in_flight.append(call_async())
    for future in in_flight:
        future.wait()


@dataclass
class LoaderSpec:
    """A data loading run: the dataset (built where the system loads), batches, workers."""

    dataset: Callable[..., Any]
    args: tuple
    batch_size: int
    workers: int
    slow_worker: int | None = None  # index of the worker made SLOWDOWN times slower


class Bench(Protocol):
    """What a system needs of the bench that runs it (:class:`rpcdl.cli.bench.scenarios.Bench`)."""

    def worker_addresses(self, count: int) -> list[str]:
        """The addresses of ``count`` rpcdl workers."""
        ...


class System:
    """Something measured side by side. Subclasses implement the capabilities they have.

    Capabilities: ``call()`` (one no-op round trip, blocking), ``calls(count,
    window)`` (``count`` no-op calls with ``window`` in flight), ``stream(size,
    count)`` (receive ``count`` messages of ``size`` bytes), ``loader(spec)``
    (an iterable whose iterations are epochs) and ``mapper(workers)`` (an
    endless iterator of ``increment`` applied to 0, 1, 2, ... over ``workers``
    workers, in order; freed by :meth:`release_mapper`). A system lacking one
    is left out of the scenarios that need it.
    """

    name = "system"

    def start(self, bench: Bench) -> None:
        """Prepare (start processes); called once before the first scenario that uses it."""

    def stop(self) -> None:
        """Free what :meth:`start` and the loaders took."""

    def release_loader(self, loader: Any) -> None:
        """Free one loader made by :meth:`loader` (its worker processes or remote datasets)."""

    def release_mapper(self, mapper: Any) -> None:
        """Free one iterator made by :meth:`mapper`."""


class RpcdlSystem(System):
    name = RPCDL

    def __init__(self) -> None:
        self.bench: Bench | None = None
        self._first_worker: str | None = None
        self._rpc_sync: Callable[..., Any] | None = None

    def start(self, bench: Bench) -> None:
        from ...rpc.client import rpc_sync  # here: the command line starts without torch

        self.bench = bench
        self._rpc_sync = rpc_sync

    def call(self) -> None:
        # as the floors' calls: nothing but the call in the timed loop (no import statement, no lookup)
        self._rpc_sync(self._first_worker or self._first_worker_address(), noop)

    def _first_worker_address(self) -> str:
        self._first_worker = self.bench.worker_addresses(1)[0]  # never restarted during a run
        return self._first_worker

    def calls(self, count: int, window: int) -> None:
        from ...rpc.client import rpc_async

        address = self.bench.worker_addresses(1)[0]
        calls_in_a_window(count, window, lambda: rpc_async(address, noop))

    def loader(self, spec: LoaderSpec) -> Any:
        from ...data.dataloader import RPCDataloader
        from ...data.dataset import RPCDataset
        from ...rpc.client import rpc_sync

        addresses = self.bench.worker_addresses(spec.workers)
        for index, address in enumerate(addresses):
            rpc_sync(address, set_slowdown, (SLOWDOWN if index == spec.slow_worker else 1.0,))
        dataset = RPCDataset(addresses, spec.dataset, *spec.args)
        return RPCDataloader(dataset, batch_size=spec.batch_size, prefetch_factor=PREFETCH)

    def mapper(self, workers: int) -> Iterator[int]:
        import itertools

        from torchdata.nodes import IterableWrapper

        from rpcdl.integrations.torchdata import RPCMapper

        node = RPCMapper(IterableWrapper(itertools.count()), self.bench.worker_addresses(workers), increment)
        node.reset()
        return node

    def release_mapper(self, mapper: Any) -> None:
        mapper.reset()  # ends its pass: answers still in flight are dropped

    def release_loader(self, loader: Any) -> None:
        from ...rpc.client import rpc_sync

        for address in loader.workers:
            rpc_sync(address, set_slowdown, (1.0,))
        loader.dataset.release()


class Releasable:
    """A loader or mapper of another library, held by this object alone, whose processes stop when it is released.

    torch's DataLoader (persistent workers) and torchdata's ParallelMapper stop
    their worker processes when their iterator is collected, and have no public
    method to stop them earlier. The bench holds this object instead, and
    :meth:`release` lets go of the only reference, so their own finalizers run.

    Args:
        held: the loader (an iterable of epochs) or mapper (an iterator); nothing else may refer to it.
    """

    def __init__(self, held: Any) -> None:
        self._held: Any = held  # then _RELEASED

    def __iter__(self) -> Iterator[Any]:
        return iter(self._held)

    def __next__(self) -> Any:
        return next(self._held)

    def release(self) -> None:
        """Let go of the loader or mapper, and collect what is left of it."""
        import gc

        self._held = _RELEASED
        gc.collect()  # what is left of its iterator may be held in reference cycles


class _Released:
    """What a :class:`Releasable` holds once released."""

    def __iter__(self) -> Iterator[Any]:
        raise RuntimeError("this loader or mapper was released: make a new one")

    def __next__(self) -> Any:
        raise RuntimeError("this loader or mapper was released: make a new one")


_RELEASED = _Released()


class TorchLoaderSystem(System):
    """torch.utils.data.DataLoader with as many worker processes as rpcdl has workers."""

    name = TORCH

    def loader(self, spec: LoaderSpec) -> Any:
        import functools
        import warnings

        from torch.utils.data import DataLoader

        # more worker processes than CPUs is the point of the io scenario: no warning about it
        warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
        return Releasable(
            DataLoader(
                spec.dataset(*spec.args),
                batch_size=spec.batch_size,
                num_workers=spec.workers,
                persistent_workers=True,
                prefetch_factor=PREFETCH,
                worker_init_fn=functools.partial(slow_torch_worker, spec.slow_worker),
            )
        )

    def release_loader(self, loader: Any) -> None:
        loader.release()


def start_peer(module: str, server: str) -> tuple[subprocess.Popen, socket.socket]:
    """Start ``module.server()`` in a process of its own on loopback (it prints its port) and connect to it."""
    process = subprocess.Popen(
        [sys.executable, "-c", f"from {module} import {server}; {server}()"],
        stdout=subprocess.PIPE,
        text=True,
        env=child_environment(),
    )
    port = int(process.stdout.readline())
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return process, sock


class SocketSystem(System):
    """A raw loopback TCP connection to a minimal Python peer: the transport's ceiling."""

    name = SOCKET
    message = 64  # bytes per echo, about an rpcdl no-op call

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.sock: socket.socket | None = None

    def start(self, bench: Bench) -> None:
        self.process, self.sock = start_peer("rpcdl.cli.bench.workloads", "socket_server")
        self._echo = REQUEST.pack(b"E", self.message, 0) + bytes(self.message)
        self._answer = memoryview(bytearray(LENGTH.size + self.message))

    def stop(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self.process is not None:
            stop_process(self.process)

    def call(self) -> None:
        self.sock.sendall(self._echo)
        recv_exact_into(self.sock, self._answer)

    def calls(self, count: int, window: int) -> None:
        while count > 0:
            batch = min(window, count)
            self.sock.sendall(self._echo * batch)
            for _ in range(batch):
                recv_exact_into(self.sock, self._answer)
            count -= batch

    def stream(self, size: int, count: int) -> None:
        header = memoryview(bytearray(LENGTH.size))
        target = memoryview(bytearray(size))
        self.sock.sendall(REQUEST.pack(b"S", size, count))
        for _ in range(count):
            recv_exact_into(self.sock, header)
            recv_exact_into(self.sock, target)
