"""What the benchmarks run: datasets and functions for the workers, the raw socket peer."""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any

# memory before image: a cold start
SCENARIOS = ("latency", "pipelined", "small", "memory", "image", "straggler", "io", "mapper")
RPCDL = "rpcdl"
TORCH = "torch DataLoader"
SOCKET = "socket"
FRAMED = "framed pickle RPC"
PARALLEL_MAPPER = "ParallelMapper"

SMALL_BATCH = 32
SMALL_FEATURES = 128
IMAGE_BATCH = 64
IMAGE_SHAPE = (3, 224, 224)
IMAGE_BATCH_BYTES = IMAGE_BATCH * IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * IMAGE_SHAPE[2]
IO_DELAY = 0.005
IO_BATCH = 4
STRAGGLER_DELAY = 0.002
STRAGGLER_BATCH = 4
SLOWDOWN = 10.0
PREFETCH = 2
WARMUP_EPOCHS = 2  # per loader, before the measured rounds of the throughput scenarios
PIPELINE_WINDOW = 64
MEMORY_EPOCHS = 10


# ---------------------------------------------------------------------------- run on workers


def noop() -> None:
    """The no-op call of the latency scenarios."""


def increment(x: int) -> int:
    """The trivial function of the mapper scenario."""
    return x + 1


_slowdown = 1.0  # per process: how much slower SleepDataset is here


def set_slowdown(factor: float) -> None:
    """Make :class:`SleepDataset` ``factor`` times slower in this process (the straggler)."""
    global _slowdown
    _slowdown = float(factor)


class SmallDataset:
    """Rows of float32[features]; batches of them are a few KB."""

    def __init__(self, length: int, features: int = SMALL_FEATURES):
        import torch

        self.rows = torch.randn(length, features)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        return self.rows[index]


class ImageDataset:
    """uint8[3, 224, 224] images (a few distinct ones, repeated): batches are MB."""

    def __init__(self, length: int, distinct: int = 8):
        import torch

        self.length = length
        self.images = torch.randint(0, 256, (distinct, *IMAGE_SHAPE), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.images[index % len(self.images)]


class SmoothImageDataset(ImageDataset):
    """uint8[3, 224, 224] images that compress as flat-shaded pictures do (lz4: about 3x): a gradient
    background, a few flat discs and light speckle, drawn once from ``seed`` (deterministic)."""

    def __init__(self, length: int, distinct: int = 8, seed: int = 0):
        import numpy as np
        import torch

        self.length = length
        generator = np.random.default_rng(seed)
        y, x = np.mgrid[0 : IMAGE_SHAPE[1], 0 : IMAGE_SHAPE[2]]
        images = []
        for _ in range(distinct):
            channels = []
            for _ in range(IMAGE_SHAPE[0]):
                gx, gy, base = generator.uniform(-0.5, 0.5), generator.uniform(-0.5, 0.5), generator.uniform(40, 200)
                channel = base + gx * x + gy * y
                for _ in range(6):
                    cy, cx = generator.integers(0, IMAGE_SHAPE[1], 2)
                    radius = generator.integers(10, 60)
                    inside = (y - cy) ** 2 + (x - cx) ** 2 < radius * radius
                    channel = np.where(inside, generator.uniform(0, 255), channel)
                channels.append(channel)
            image = np.stack(channels)
            speckled = generator.random(image.shape) < 0.05
            image = np.where(speckled, image + generator.integers(-3, 4, image.shape), image)
            images.append(np.clip(image, 0, 255).astype(np.uint8))
        self.images = torch.from_numpy(np.stack(images))


class SleepDataset:
    """Sleeps ``delay`` seconds per item (times this process's slowdown): I/O-bound loading."""

    def __init__(self, length: int, delay: float):
        self.length = length
        self.delay = delay

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        time.sleep(self.delay * _slowdown)
        return index


def slow_torch_worker(slow_index: int | None, worker_id: int) -> None:
    """``worker_init_fn`` of torch's DataLoader: slow down one of its worker processes."""
    if worker_id == slow_index:
        set_slowdown(SLOWDOWN)


# ---------------------------------------------------------------------------- raw socket peer


def accept_one(host: str) -> tuple[socket.socket, Any]:
    """Listen on a free port of ``host``, print the port, accept one connection: ``(socket, buffered reader)``."""
    listener = socket.create_server((host, 0))
    print(listener.getsockname()[1], flush=True)
    connection, _ = listener.accept()
    listener.close()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connection, connection.makefile("rb", buffering=1 << 16)


def socket_server(host: str = "127.0.0.1") -> None:
    """A raw peer for the socket baseline, on ``host``: echoes frames, or streams them on request.

    A request is a kind byte and two u64: ``E`` (echo the ``size`` bytes that
    follow), ``S`` (send ``count`` frames of ``size`` bytes). Each answer is a
    u64 length and the bytes. Prints its port, serves one connection, exits.
    """
    connection, reader = accept_one(host)
    payload = memoryview(bytearray(0))
    while True:
        request = reader.read(17)
        if len(request) < 17:
            return
        kind, size, count = REQUEST.unpack(request)
        if kind == b"E":
            connection.sendall(LENGTH.pack(size) + reader.read(size))
        else:
            if payload.nbytes != size:
                payload = memoryview(bytearray(os.urandom(16)) * (size // 16) + bytearray(size % 16))
            for _ in range(count):
                connection.sendall(LENGTH.pack(size))
                connection.sendall(payload)


REQUEST = struct.Struct("!cQQ")
LENGTH = struct.Struct("!Q")


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        received = sock.recv_into(view)
        if not received:
            raise ConnectionError("the socket peer closed the connection")
        view = view[received:]
