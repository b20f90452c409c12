"""Image batches across real links: rpcdl beside rpcdataloader and raw streams, on the same shaped links.

Two worker hosts, each a network namespace behind its own veth link shaped by
``tbf`` (see ``tests/netns_cluster.py``); the trainer is this process. For
each link rate, every system moves the same batches of 64 x uint8[3, 224, 224]
(random bytes drawn once and reused: incompressible) from both hosts, round
after round, interleaved; the table gives medians in MB/s and rpcdl's ratio to
each other system of the same run. The raw streams are the floors: a bare
TCP stream for rpcdl, and a bare TLS stream (the TLS context, certificates and
client context rpcdl's TLS workers and trainer use) for rpcdl over TLS. Needs
root and iproute2.

``--cases compression`` measures lz4 compression (:mod:`rpcdl.transport.compression`):
compressible batches (:class:`~rpcdl.cli.bench.workloads.SmoothImageDataset`,
drawn once, about 3x with lz4) at 1 Gbit/s with rpcdl workers started with
``--compression off``, ``on`` and ``auto``, beside a raw socket moving the same
number of (uncompressed) bytes, which is the link's raw rate (one worker host,
one link: on a small machine two would compete for its cores); and the
incompressible batches at 10 Gbit/s with ``auto`` against ``off``: there
``auto`` must cost nothing. MB/s count the bytes of the batches delivered,
decompressed.

Example::

    sudo python benchmarks/links.py --rates 10gbit 1gbit --rounds 5 --json links.json
    sudo python benchmarks/links.py --cases compression --rounds 5
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the cluster in a box and the certificates
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
from netns_cluster import Cluster, Host, unavailable
from pki import make_ca, make_certificate

import rpcdl
from rpcdl.cli.bench.workloads import (
    IMAGE_BATCH,
    IMAGE_BATCH_BYTES,
    LENGTH,
    REQUEST,
    ImageDataset,
    SmoothImageDataset,
    recv_exact_into,
)
from rpcdl.local import child_environment, stop_process

TOKEN = "links-benchmark-token"

_RPCDATALOADER_WORKER = """
import sys
import rpcdataloader.rpc as rpc
_bind = rpc._create_server
def _create_server(address, *, family):
    server = _bind((address[0], 0), family=family)
    print("%s:%d" % (address[0], server.getsockname()[1]), flush=True)
    return server
rpc._create_server = _create_server
rpc.run_worker(sys.argv[1], 0)
"""

_SOCKET_PEER = "import sys; from rpcdl.cli.bench.workloads import socket_server; socket_server(sys.argv[1])"

# The floor of TLS on the same link: a raw stream over the TLS rpcdl's workers
# serve (the same context, certificate and key), a bare loop of sendall.
_TLS_SOCKET_PEER = """
import os, socket, sys
from rpcdl.transport.security import server_tls_context
from rpcdl.cli.bench.workloads import LENGTH, REQUEST
address, cert, key = sys.argv[1:4]
listener = socket.create_server((address, 0))
print(listener.getsockname()[1], flush=True)
connection = server_tls_context(cert, key).wrap_socket(listener.accept()[0], server_side=True)
request = b""
while len(request) < REQUEST.size:
    request += connection.recv(REQUEST.size - len(request))
kind, size, count = REQUEST.unpack(request)
payload = memoryview(bytearray(os.urandom(16)) * (size // 16) + bytearray(size % 16))
for _ in range(count):
    connection.sendall(LENGTH.pack(size))
    connection.sendall(payload)
connection.close()
"""


def _cpu_seconds(processes) -> float:
    """User and system CPU seconds of ``processes`` (``subprocess.Popen``) still alive."""
    total = 0.0
    for process in processes:
        try:
            times = psutil.Process(process.pid).cpu_times()
        except psutil.Error:  # exited
            continue
        total += times.user + times.system
    return total


class Meter:
    """CPU seconds per GB of a measurement: this process's and the hosts' processes' together.

    Every process on the path counts (the trainer, the workers or peers); the
    kernel's work on the links counts where it runs in their context.
    """

    def __init__(self, cluster: Cluster, gigabytes: float):
        self.cluster = cluster
        self.gigabytes = gigabytes  # what each measurement moves
        self.samples: dict[str, list[float]] = {}

    def processes(self) -> list:
        return [process for host in self.cluster.hosts for process in host.processes]

    def measure(self, name: str, run: Callable[[], float], extra_cpu: Callable[[], float] = lambda: 0.0) -> float:
        """Run ``run`` (returns MB/s); record CPU s/GB under ``name``; return the MB/s."""
        processes = self.processes()  # those started meanwhile (raw peers) report through ``extra_cpu``
        before = time.process_time() + _cpu_seconds(processes)
        mb_s = run()
        after = time.process_time() + _cpu_seconds(processes) + extra_cpu()
        self.samples.setdefault(name, []).append((after - before) / self.gigabytes)
        return mb_s


def _start(host: Host, command: list[str]) -> str:
    """Start ``command`` on ``host``; return the first line it prints (an address or a port)."""
    import subprocess

    process = host.popen(command, stdout=subprocess.PIPE, text=True, env=child_environment())
    line = process.stdout.readline().strip()
    if not line:
        stop_process(process, grace=1.0)
        raise RuntimeError(f"{command[:3]} on {host.namespace} exited before it was ready")
    return line


class Systems:
    """The systems over one cluster: each ``measure_*`` moves ``batches`` per host and returns MB/s.

    rpcdl runs twice: over plain TCP, and over TLS (its own workers, with
    certificates for the hosts' addresses from a CA made for the run).
    """

    def __init__(self, cluster: Cluster, directory: Path, batches: int, parallel: int = 1):
        self.cluster = cluster
        self.batches = batches
        self.directory = directory
        token_file = directory / "token"
        token_file.write_text(TOKEN)
        worker_options = ["--token-file", str(token_file), "--log-level", "WARNING", "--parallel", str(parallel)]
        self.rpcdl_workers = [cluster.start_worker(host.index, *worker_options) for host in cluster.hosts]
        make_ca(directory, "ca")
        self.ca = str(directory / "ca.pem")
        tls_workers = []
        for host in cluster.hosts:
            make_certificate(directory, "ca", f"host{host.index}", f"IP:{host.address}")
            tls = [
                "--tls-cert",
                str(directory / f"host{host.index}.pem"),
                "--tls-key",
                str(directory / f"host{host.index}.key"),
            ]
            tls_workers.append(cluster.start_worker(host.index, *worker_options, *tls))
        self.rpcdataloader_workers = [
            _start(host, [sys.executable, "-c", _RPCDATALOADER_WORKER, host.address]) for host in cluster.hosts
        ]
        length = batches * IMAGE_BATCH * len(cluster.hosts)
        self.rpcdl_loader = rpcdl.RPCDataloader(
            rpcdl.RPCDataset(self.rpcdl_workers, ImageDataset, length), batch_size=IMAGE_BATCH
        )
        with self._tls():
            self.tls_loader = rpcdl.RPCDataloader(
                rpcdl.RPCDataset(tls_workers, ImageDataset, length), batch_size=IMAGE_BATCH
            )
        from rpcdataloader import RPCDataloader, RPCDataset

        self.rpcdataloader_loader = RPCDataloader(
            RPCDataset(self.rpcdataloader_workers, ImageDataset, length), batch_size=IMAGE_BATCH
        )

    def close(self) -> None:
        """Free the remote datasets while their workers still listen (rpcdataloader frees them on collection)."""
        self.rpcdl_loader.dataset.release()
        with self._tls():
            self.tls_loader.dataset.release()
        del self.rpcdataloader_loader
        gc.collect()
        rpcdl.shutdown()

    def _epoch(self, loader) -> float:
        started = time.perf_counter()
        count = sum(1 for _ in loader)
        return count * IMAGE_BATCH_BYTES / (time.perf_counter() - started) / 1e6

    def measure_rpcdl(self) -> float:
        return self._epoch(self.rpcdl_loader)

    @contextlib.contextmanager
    def _tls(self) -> Iterator[None]:
        """Connections made meanwhile verify the workers with the run's CA (RPCDL_TLS_CA)."""
        os.environ["RPCDL_TLS_CA"] = self.ca
        try:
            yield
        finally:
            del os.environ["RPCDL_TLS_CA"]

    def measure_rpcdl_tls(self) -> float:
        with self._tls():
            return self._epoch(self.tls_loader)

    def measure_rpcdataloader(self) -> float:
        return self._epoch(self.rpcdataloader_loader)

    def measure_socket(self, peer_cpu: list[float] | None = None) -> float:
        return socket_rate(self.cluster, self.batches, peer_cpu)

    def measure_tls_socket(self, peer_cpu: list[float] | None = None) -> float:
        return socket_rate(self.cluster, self.batches, peer_cpu, tls=self)


def socket_rate(
    cluster: Cluster, batches: int, peer_cpu: list[float] | None = None, tls: Systems | None = None
) -> float:
    """One raw TCP stream from each host at once, ``batches`` image batches per host; MB/s.

    ``peer_cpu`` gets the CPU seconds the peers spent. With ``tls`` (the systems
    whose TLS workers' certificates and CA to use), each stream is TLS.
    """
    import socket

    from rpcdl.transport.security import client_tls_context

    connections = []
    for host in cluster.hosts:
        if tls is None:
            port = int(_start(host, [sys.executable, "-c", _SOCKET_PEER, host.address]))
            connections.append(socket.create_connection((host.address, port), timeout=60))
            continue
        pem, key = (str(tls.directory / f"host{host.index}.{suffix}") for suffix in ("pem", "key"))
        port = int(_start(host, [sys.executable, "-c", _TLS_SOCKET_PEER, host.address, pem, key]))
        plain = socket.create_connection((host.address, port), timeout=60)
        connections.append(client_tls_context(tls.ca).wrap_socket(plain, server_hostname=host.address))

    def drain(connection: socket.socket) -> None:
        header = memoryview(bytearray(LENGTH.size))
        target = memoryview(bytearray(IMAGE_BATCH_BYTES))
        connection.sendall(REQUEST.pack(b"S", IMAGE_BATCH_BYTES, batches))
        for _ in range(batches):
            recv_exact_into(connection, header)
            recv_exact_into(connection, target)

    threads = [threading.Thread(target=drain, args=(c,), name=f"links-drain-{i}") for i, c in enumerate(connections)]
    peers = [host.processes[-1] for host in cluster.hosts]
    peers_started = _cpu_seconds(peers)  # ready and connected: their start-up does not count
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if peer_cpu is not None:  # the peers exit when their connection closes: count their CPU first
        peer_cpu.append(_cpu_seconds(peers) - peers_started)
    for connection in connections:
        connection.close()
    return len(connections) * batches * IMAGE_BATCH_BYTES / elapsed / 1e6


class CompressionRun:
    """rpcdl workers started with each ``--compression`` mode on every host, and a loader over each."""

    def __init__(self, cluster: Cluster, directory: Path, batches: int, dataset: type, modes: list[str]):
        token_file = directory / "token"
        token_file.write_text(TOKEN)
        options = ["--token-file", str(token_file), "--log-level", "WARNING"]
        length = batches * IMAGE_BATCH * len(cluster.hosts)
        self.workers: dict[str, list[str]] = {}
        self.loaders: dict[str, rpcdl.RPCDataloader] = {}
        for mode in modes:
            self.workers[mode] = [cluster.start_worker(h.index, *options, "--compression", mode) for h in cluster.hosts]
            dataset_here = rpcdl.RPCDataset(self.workers[mode], dataset, length)
            self.loaders[mode] = rpcdl.RPCDataloader(dataset_here, batch_size=IMAGE_BATCH)

    def measure(self, mode: str) -> float:
        started = time.perf_counter()
        count = sum(1 for _ in self.loaders[mode])
        return count * IMAGE_BATCH_BYTES / (time.perf_counter() - started) / 1e6

    def states(self, mode: str) -> list[dict]:
        """What each worker's connection to this process chose (``rpcdl.stats(...)["compression"]``)."""
        return [rpcdl.stats(worker)["compression"] for worker in self.workers[mode]]

    def close(self) -> None:
        for loader in self.loaders.values():
            loader.dataset.release()
        rpcdl.shutdown()


COMPRESSION_HOSTS = 1  # one link: on a small machine two hosts' compression and decompression compete for its cores
COMPRESSION_CASES = (  # (link, dataset, modes)
    ("1gbit", SmoothImageDataset, ["off", "on", "auto"]),
    ("10gbit", ImageDataset, ["off", "auto"]),
)


def run_compression(rate: str, dataset: type, modes: list[str], rounds: int, batches: int) -> dict:
    with tempfile.TemporaryDirectory() as directory, Cluster(COMPRESSION_HOSTS, rate=rate) as cluster:
        run = CompressionRun(cluster, Path(directory), batches, dataset, modes)
        measures: dict[str, Callable[[], float]] = {mode: (lambda m=mode: run.measure(m)) for mode in modes}
        measures["socket"] = lambda: socket_rate(cluster, batches)
        samples = harness.interleave(  # the warm-up lets 'auto' decide
            measures,
            rounds,
            warmup=1,
            after_round=lambda round_, r: print(
                f"  {rate} {dataset.__name__} round {round_}: " + ", ".join(f"{n} {v:,.0f}" for n, v in r.items())
            ),
        )
        states = {mode: run.states(mode) for mode in modes}
        run.close()
    return {
        "samples_mb_s": samples,
        "median_mb_s": harness.medians(samples),
        "states": states,
    }


def print_compression(results: dict) -> None:
    print("\nCompression: MB/s of batches delivered (decompressed), medians; socket = the link's raw rate")
    columns = [("link", 8), ("data", 18), ("off", 6), ("on", 6), ("auto", 6), ("socket", 6), ("on/socket", 9)]
    print("  ".join(f"{name:>{width}}" for name, width in [*columns, ("auto/off", 8)]))
    for key, result in results.items():
        rate, data = key.split(" ")
        m = result["median_mb_s"]
        on = f"{m['on']:>6,.0f}" if "on" in m else f"{'-':>6}"
        on_socket = f"{m['on'] / m['socket']:>9.2f}" if "on" in m else f"{'-':>9}"
        print(
            f"{rate:>8}  {data:>18}  {m['off']:>6,.0f}  {on}  {m['auto']:>6,.0f}  {m['socket']:>6,.0f}  "
            f"{on_socket}  {m['auto'] / m['off']:>8.2f}"
        )
        for mode, states in result["states"].items():
            chosen = "; ".join(f"{s['mode']} active={s['active']} ratio={s['ratio']} ({s['reason']})" for s in states)
            print(f"{'':>10}{mode}: {chosen}")


def run_rate(
    rate: str, rounds: int, batches: int, parallel: int = 1
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """MB/s of each system over ``rounds`` rounds, and the CPU seconds per GB each spent (all processes)."""
    with tempfile.TemporaryDirectory() as directory, Cluster(2, rate=rate) as cluster:
        systems = Systems(cluster, Path(directory), batches, parallel)
        meter = Meter(cluster, len(cluster.hosts) * batches * IMAGE_BATCH_BYTES / 1e9)
        peer_cpu: list[float] = []
        measures: dict[str, Callable[[], float]] = {
            "rpcdl": lambda: meter.measure("rpcdl", systems.measure_rpcdl),
            "rpcdl TLS": lambda: meter.measure("rpcdl TLS", systems.measure_rpcdl_tls),
            "rpcdataloader": lambda: meter.measure("rpcdataloader", systems.measure_rpcdataloader),
            "socket": lambda: meter.measure("socket", lambda: systems.measure_socket(peer_cpu), lambda: peer_cpu[-1]),
            "TLS socket": lambda: meter.measure(
                "TLS socket", lambda: systems.measure_tls_socket(peer_cpu), lambda: peer_cpu[-1]
            ),
        }
        samples = harness.interleave(  # the warm-up opens connections, builds datasets, grows heaps
            measures,
            rounds,
            warmup=1,
            after_warmup=meter.samples.clear,
            after_round=lambda round_, r: print(
                f"  {rate} round {round_}: "
                + ", ".join(f"{n} {v:,.0f} ({meter.samples[n][-1]:.2f} CPU s/GB)" for n, v in r.items())
            ),
        )
        systems.close()
    return samples, meter.samples


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, rounds=5, json_file=True)
    parser.add_argument("--rates", nargs="+", default=["10gbit", "1gbit"], help="link rates (tbf), e.g. 10gbit 1gbit")
    parser.add_argument("--batches", type=int, default=12, help="batches per host per round (default: %(default)s)")
    parser.add_argument(
        "--parallel", type=int, default=1, help="rpcdl workers' --parallel: calls run at once (default: %(default)s)"
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=["systems", "compression"],
        default=["systems", "compression"],
        help="what to measure: the systems side by side at --rates, and/or compression (default: both)",
    )
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason is not None:
        print(f"links: cannot make a cluster in a box: {reason}", file=sys.stderr)
        return 2
    os.environ["RPCDL_TOKEN"] = TOKEN  # the trainer's side of the token the workers were given
    print(harness.describe_machine())
    results: dict = {}
    if "compression" in args.cases:
        compression = {}
        for rate, dataset, modes in COMPRESSION_CASES:
            compression[f"{rate} {dataset.__name__}"] = run_compression(rate, dataset, modes, args.rounds, args.batches)
        print_compression(compression)
        results["compression"] = compression
    if "systems" not in args.cases:
        harness.save_json(args.json, results)
        return 0
    for rate in args.rates:
        samples, cpu = run_rate(rate, args.rounds, args.batches, args.parallel)
        medians = harness.medians(samples)
        cpu_medians = {name: round(value, 3) for name, value in harness.medians(cpu).items()}
        results[rate] = {"samples_mb_s": samples, "median_mb_s": medians, "cpu_s_per_gb": cpu_medians}
    print("\nMB/s, medians; ratios are rpcdl's (or rpcdl TLS's) to the other system in the same run")
    print(f"{'link':>8}  {'rpcdl':>7}  {'TLS':>7}  {'rpcdataloader':>13}  {'socket':>7}  ", end="")
    print(f"{'/socket':>7}  {'/rpcdataloader':>14}  {'TLS/plain':>9}  {'TLS socket':>10}  {'TLS/TLS socket':>14}")
    for rate, result in results.items():
        if rate == "compression":
            continue
        m = result["median_mb_s"]
        print(
            f"{rate:>8}  {m['rpcdl']:>7,.0f}  {m['rpcdl TLS']:>7,.0f}  {m['rpcdataloader']:>13,.0f}  "
            f"{m['socket']:>7,.0f}  {m['rpcdl'] / m['socket']:>7.2f}  {m['rpcdl'] / m['rpcdataloader']:>14.2f}  "
            f"{m['rpcdl TLS'] / m['rpcdl']:>9.2f}  {m['TLS socket']:>10,.0f}  {m['rpcdl TLS'] / m['TLS socket']:>14.2f}"
        )
        cpu = result["cpu_s_per_gb"]
        print(f"{'':>8}  CPU s per GB, all processes: " + ", ".join(f"{n} {v:.2f}" for n, v in cpu.items()))
    harness.save_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
