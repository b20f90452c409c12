"""A cluster in a box: worker "hosts" in network namespaces, reached over shaped veth links.

Each host is a Linux network namespace joined to this one by a veth pair:
this side holds ``10.N.I.1``, the host ``10.N.I.2`` (``10.N`` a subnet that
no address here is in yet, ``I`` the host's index), so the trainer reaches
its workers at real, non-loopback addresses through a real link. Each
direction of the link is shaped by a ``tbf`` qdisc, and a link can be cut and
restored, or throttled, while a test runs. Nothing outside the namespaces
this object made is ever contacted.

Needs root and iproute2 (``ip`` and ``tc``); :func:`unavailable` says why not,
so tests can skip with the reason.

Threading model: none of its own. A :class:`Cluster` is used from one thread;
its workers are child processes it starts and stops.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

from rpcdl.checks import check_int
from rpcdl.local import child_environment, read_ready_line, stop_process

_NAME_PREFIX = "rpcdl"
_clusters_made = itertools.count()
_SUBNETS = range(100, 250)  # 10.N.0.0/16, N in this range: one per cluster alive on this machine


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30, check=True)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or ``None`` when they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (install iproute2)"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"{_NAME_PREFIX}-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _burst_bytes(rate_bits: int) -> int:
    """A tbf bucket that holds 4 ms at ``rate_bits``: enough for a timer tick at any rate."""
    return max(rate_bits // 8 // 250, 64 * 1024)


def parse_rate(rate: str | int) -> int:
    """``"10gbit"``, ``"1gbit"``, ``"200mbit"``, ``"64kbit"`` or bits per second: bits per second."""
    if isinstance(rate, int):
        return rate
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * factor)
    raise ValueError(f"rate must look like 10gbit, 200mbit or 64kbit, got {rate!r}")


@dataclass
class Host:
    """One worker host: a namespace and the link to it."""

    index: int
    namespace: str
    near_link: str  # this side's end of the veth pair
    far_link: str  # the host's end
    address: str  # the host's IP address
    gateway: str  # this side's IP address on the link
    processes: list[subprocess.Popen] = field(default_factory=list)

    def shape(self, rate: str | int) -> None:
        """Limit the link to ``rate`` in each direction (a ``tbf`` qdisc on both ends)."""
        bits = parse_rate(rate)
        options = ["tbf", "rate", f"{bits}bit", "burst", str(_burst_bytes(bits)), "latency", "50ms"]
        _tc("qdisc", "replace", "dev", self.near_link, "root", *options)
        _tc("-n", self.namespace, "qdisc", "replace", "dev", self.far_link, "root", *options)

    def cut(self) -> None:
        """Take the link down: packets in either direction are lost until :meth:`restore`."""
        _ip("link", "set", self.near_link, "down")

    def restore(self) -> None:
        """Bring the link back up."""
        _ip("link", "set", self.near_link, "up")

    def popen(self, command: Sequence[str], **options) -> subprocess.Popen:
        """Start ``command`` inside this host's namespace."""
        process = subprocess.Popen(["ip", "netns", "exec", self.namespace, *command], **options)
        self.processes.append(process)
        return process


class Cluster:
    """Worker hosts in network namespaces, each behind a veth link shaped to ``rate``.

    Args:
        hosts: how many hosts.
        rate: each link's rate in each direction (``"10gbit"``, ``"1gbit"``...),
            or ``None`` for an unshaped veth.

    Example::

        >>> with Cluster(2, rate="1gbit") as cluster:  # doctest: +SKIP
        ...     workers = [cluster.start_worker(i, token_file=path) for i in range(2)]
        ...     cluster.hosts[0].cut()  # a partition
    """

    def __init__(self, hosts: int, rate: str | int | None = "10gbit"):
        check_int(hosts, "hosts", minimum=1, maximum=200)
        self.rate = rate
        sequence = next(_clusters_made)
        self.tag = f"{os.getpid()}{chr(ord('a') + sequence % 26)}"  # links' names: at most 15 characters
        self._first_subnet = (os.getpid() + sequence) % len(_SUBNETS)
        self.subnet = ""  #: ``10.N``, chosen on entry
        self.hosts: list[Host] = []
        self._count = hosts

    def __enter__(self) -> Cluster:
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(f"cannot make a cluster in a box: {reason}")
        _remove_stale_namespaces()
        with open(os.path.join(tempfile.gettempdir(), "rpcdl-clusters.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another cluster may be choosing its subnet now (pytest -n)
            self.subnet = self._free_subnet()
            try:
                for index in range(self._count):
                    self.hosts.append(self._make_host(index))
            except BaseException:
                self.close()
                raise
        return self

    def _free_subnet(self) -> str:
        taken = _ip("-o", "-4", "addr", "show").stdout
        for offset in range(len(_SUBNETS)):
            subnet = f"10.{_SUBNETS[(self._first_subnet + offset) % len(_SUBNETS)]}"
            if f" {subnet}." not in taken:
                return subnet
        raise RuntimeError(f"cannot make a cluster in a box: every subnet 10.N.0.0/16, N in {_SUBNETS}, is in use")

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _make_host(self, index: int) -> Host:
        namespace = f"{_NAME_PREFIX}-{self.tag}-{index}"  # rpcdl-<pid><letter>-<index>
        host = Host(
            index=index,
            namespace=namespace,
            near_link=f"rd{self.tag}h{index}",
            far_link=f"rd{self.tag}w{index}",
            address=f"{self.subnet}.{index}.2",
            gateway=f"{self.subnet}.{index}.1",
        )
        _ip("netns", "add", namespace)
        _ip("link", "add", host.near_link, "type", "veth", "peer", "name", host.far_link, "netns", namespace)
        _ip("addr", "add", f"{host.gateway}/24", "dev", host.near_link)
        _ip("link", "set", host.near_link, "up")
        _ip("-n", namespace, "addr", "add", f"{host.address}/24", "dev", host.far_link)
        _ip("-n", namespace, "link", "set", host.far_link, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        if self.rate is not None:
            host.shape(self.rate)
        return host

    def start_worker(
        self, index: int, *args: str, env: dict[str, str] | None = None, startup_timeout: float = 60.0
    ) -> str:
        """Start ``rpcdl worker`` on host ``index`` listening on its link address; return ``host:port``.

        ``args`` are more ``rpcdl worker`` options (``--token-file``, ``--tls-cert``...): a
        non-loopback address needs a token. The worker stops when this process dies.
        """
        host = self.hosts[index]
        command = [
            sys.executable,
            "-m",
            "rpcdl",
            "worker",
            "--host",
            host.address,
            "--port",
            "0",
            "--watch-pid",
            str(os.getpid()),
            *args,
        ]
        process = host.popen(command, stdout=subprocess.PIPE, text=True, env=child_environment(env))
        try:
            return read_ready_line(process, startup_timeout)
        except BaseException:
            stop_process(process, grace=1.0)
            raise

    def close(self) -> None:
        """Stop every process started in the hosts and delete the namespaces (their links go with them)."""
        for host in self.hosts:
            for process in host.processes:
                stop_process(process, grace=5.0)
            _ip("link", "del", host.near_link, check=False)
            _ip("netns", "del", host.namespace, check=False)
        self.hosts.clear()


def _remove_stale_namespaces() -> None:
    """Delete namespaces that clusters of processes now dead left behind (a SIGKILLed test run)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != _NAME_PREFIX or not parts[1][:-1].isdigit():
            continue
        if not os.path.exists(f"/proc/{parts[1][:-1]}"):
            _ip("netns", "del", name, check=False)
