"""Systems for ``rpcdl bench`` that need packages rpcdl does not depend on.

- :class:`RpcdataloaderSystem`: rpcdataloader 0.2.1 (the seed project), its
  own worker processes on loopback, its RPCDataset and RPCDataloader;
- :class:`TorchRpcSystem`: ``torch.distributed.rpc`` (TensorPipe) between this
  process and one worker process on loopback, for the call scenarios. It uses
  TensorPipe's ``uv`` (TCP) transport, as between hosts: its default on one
  host, the ``shm`` transport, keeps a thread busy-polling in each process even
  when idle (3.0 s of CPU in 3 s idle in each, measured here), and alive for
  the whole run it would take both cores of a 2-core machine from every other
  system being measured. Once shut down, it cannot start again in the same
  process, so it cannot be started only for its own rounds.

Each is left out when its package is missing or it cannot start here.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from typing import Any

from rpcdl.cli.bench.scenarios import Bench
from rpcdl.cli.bench.systems import LoaderSpec, System, calls_in_a_window
from rpcdl.cli.bench.workloads import PREFETCH, SLOWDOWN, noop, set_slowdown
from rpcdl.local import child_environment
from rpcdl.processes import stop_process, stop_processes

# rpcdataloader's run_worker binds a given port and prints nothing: bind port 0
# instead (the system picks a free one) and print the address when listening.
_RPCDATALOADER_WORKER = """
import rpcdataloader.rpc as rpc
_bind = rpc._create_server
def _create_server(address, *, family):
    server = _bind((address[0], 0), family=family)
    print("127.0.0.1:%d" % server.getsockname()[1], flush=True)
    return server
rpc._create_server = _create_server
rpc.run_worker("127.0.0.1", 0)
"""


def _environment() -> dict[str, str]:
    return {**child_environment(), "PYTHONWARNINGS": "ignore"}


class RpcdataloaderSystem(System):
    """rpcdataloader 0.2.1: a new connection and thread per call, its own workers."""

    name = "rpcdataloader"

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen] = []
        self.addresses: list[str] = []

    def start(self, bench: Bench) -> None:
        import rpcdataloader  # noqa: F401  (fails here when it is not installed)

        self.workers(1)

    def workers(self, count: int) -> list[str]:
        while len(self.addresses) < count:
            process = subprocess.Popen(
                [sys.executable, "-c", _RPCDATALOADER_WORKER], stdout=subprocess.PIPE, text=True, env=_environment()
            )
            self.processes.append(process)
            address = process.stdout.readline().strip()
            if not address:
                raise RuntimeError(f"an rpcdataloader worker exited with code {process.wait()} before listening")
            self.addresses.append(address)
        return self.addresses[:count]

    def stop(self) -> None:
        stop_processes(self.processes)

    def call(self) -> None:
        from rpcdataloader import rpc_async

        rpc_async(self.addresses[0], noop).wait()

    def calls(self, count: int, window: int) -> None:
        from rpcdataloader import rpc_async

        calls_in_a_window(count, window, lambda: rpc_async(self.addresses[0], noop))

    def loader(self, spec: LoaderSpec) -> Any:
        from rpcdataloader import RPCDataloader, RPCDataset, rpc_async

        addresses = self.workers(spec.workers)
        for index, address in enumerate(addresses):
            rpc_async(address, set_slowdown, (SLOWDOWN if index == spec.slow_worker else 1.0,)).wait()
        dataset = RPCDataset(addresses, spec.dataset, *spec.args)
        return RPCDataloader(dataset, batch_size=spec.batch_size, prefetch_factor=PREFETCH)

    def release_loader(self, loader: Any) -> None:
        from rpcdataloader import rpc_async

        for address in loader.dataset.workers:
            rpc_async(address, set_slowdown, (1.0,)).wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _torch_rpc_options(port: int) -> Any:
    from torch.distributed import rpc

    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=4, _transports=["uv"]
    )  # see the module: not shm, which busy-polls


def torch_rpc_worker(port: int) -> None:
    """The worker side of :class:`TorchRpcSystem` (rank 1): serves until the client shuts down."""
    from torch.distributed import rpc

    warnings.simplefilter("ignore")
    rpc.init_rpc("worker1", rank=1, world_size=2, rpc_backend_options=_torch_rpc_options(port))
    rpc.shutdown()


class TorchRpcSystem(System):
    """torch.distributed.rpc with the TensorPipe backend: this process is rank 0, one worker is rank 1."""

    name = "torch.distributed.rpc"

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.ready = False

    def start(self, bench: Bench) -> None:
        from torch.distributed import rpc

        if not rpc.is_available():
            raise RuntimeError("this torch build has no torch.distributed.rpc")
        warnings.filterwarnings("ignore", module="torch.distributed")
        port = _free_port()
        here = os.path.dirname(os.path.abspath(__file__))
        code = f"import sys; sys.path.insert(0, {here!r}); import baselines; baselines.torch_rpc_worker({port})"
        self.process = subprocess.Popen([sys.executable, "-c", code], env=_environment())
        rpc.init_rpc("client", rank=0, world_size=2, rpc_backend_options=_torch_rpc_options(port))
        self.ready = True

    def stop(self) -> None:
        from torch.distributed import rpc

        if self.ready:
            rpc.shutdown()
        if self.process is not None:
            stop_process(self.process)

    def call(self) -> None:
        from torch.distributed import rpc

        rpc.rpc_sync("worker1", noop)

    def calls(self, count: int, window: int) -> None:
        from torch.distributed import rpc

        calls_in_a_window(count, window, lambda: rpc.rpc_async("worker1", noop))


def available() -> list[System]:
    """The baselines whose packages are installed here."""
    systems: list[System] = []
    try:
        import rpcdataloader  # noqa: F401

        systems.append(RpcdataloaderSystem())
    except ImportError:
        pass
    try:
        from torch.distributed import rpc

        if rpc.is_available():
            systems.append(TorchRpcSystem())
    except ImportError:
        pass
    return systems
