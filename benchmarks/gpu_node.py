"""A GPU node fed by rpcdl: images/s of a real training step against the GPU alone and torch's DataLoader.

Issue 26, item 8. The trainer process is held to ``--trainer-cores`` cores (2
by default, ``os.sched_setaffinity``), as a node's share per GPU is; the data
comes from worker processes on the other cores of the machine, one core each,
that decode JPEGs (generated in memory with PIL, 256 to 320 pixels a side) and
take a random resized crop of 224 x 224 (64 x 64 with ``--quick``) with a
random flip; batches of uint8 [3, side, side]. The step is a ResNet-50
(torchvision's when installed, else the same network defined here) in bf16
autocast with SGD, on the GPU. Systems, each in a process of its own, taking
turns round after round:

- ``gpu``: the GPU alone, on one batch already on the device: the ceiling;
- ``rpcdl-tcp``: :class:`rpcdl.RPCDataloader` over the worker processes,
  ``RPCDL_SHM_BYTES=0`` (the path batches from other hosts take);
- ``rpcdl-shm``: the same over shared memory (the default on one host);
- ``torch``: ``torch.utils.data.DataLoader`` with as many worker processes, on
  the same worker cores;
- ``torch-own``: ``torch.utils.data.DataLoader`` with 2 worker processes on the
  trainer's own cores (what a node does without rpcdl);
- ``decode``: rpcdl over shared memory, no step: what the workers make.

Printed: each system's images/s (median over the rounds) and its ratio to the
GPU alone and to torch's DataLoader on the same cores::

    python benchmarks/gpu_node.py                       # a GPU host: ResNet-50, bf16, batches of 256
    python benchmarks/gpu_node.py --device cpu --quick  # anywhere, in seconds: a tiny network, small crops

Not a test: it asserts nothing about speed (tests/test_gpu_node_bench.py runs
the quick mode, to keep it working).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

SYSTEMS = ("gpu", "rpcdl-tcp", "rpcdl-shm", "torch", "torch-own", "decode")
CROP = 224
QUICK_CROP = 64  # --quick: a tiny network on a CPU needs no full-size picture to run every path


# ---------------------------------------------------------------------------- data, on the workers


class JpegDataset:
    """Synthetic JPEGs decoded and randomly cropped per sample: the CPU work of an image pipeline.

    Args:
        length: samples per epoch.
        distinct: how many distinct JPEGs to make (samples cycle through them).
        seed: the pictures drawn.
        crop: the side of the square crops, in pixels.
    """

    def __init__(self, length: int, distinct: int = 64, seed: int = 0, crop: int = CROP):
        import numpy as np
        from PIL import Image

        self.length = length
        self.crop = crop
        generator = np.random.default_rng(seed)
        self.jpegs = []
        for _ in range(distinct):
            height, width = (int(side) for side in generator.integers(256, 321, 2))
            y, x = np.mgrid[0:height, 0:width]
            channels = [
                (generator.uniform(0, 255) + generator.uniform(-0.5, 0.5) * x + generator.uniform(-0.5, 0.5) * y)
                + 40 * np.sin(x / generator.uniform(5, 40)) * np.cos(y / generator.uniform(5, 40))
                for _ in range(3)
            ]
            picture = np.clip(np.stack(channels, axis=-1) + generator.normal(0, 12, (height, width, 3)), 0, 255)
            encoded = io.BytesIO()
            Image.fromarray(picture.astype(np.uint8)).save(encoded, format="JPEG", quality=90)
            self.jpegs.append(encoded.getvalue())

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        import random

        import numpy as np
        from PIL import Image

        picture = Image.open(io.BytesIO(self.jpegs[index % len(self.jpegs)])).convert("RGB")
        width, height = picture.size
        scale = random.uniform(0.35, 1.0)
        side = max(16, int(min(width, height) * scale**0.5))
        left, top = random.randint(0, width - side), random.randint(0, height - side)
        crop = picture.resize((self.crop, self.crop), Image.BILINEAR, box=(left, top, left + side, top + side))
        if random.random() < 0.5:
            crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(crop).transpose(2, 0, 1).copy())


# ---------------------------------------------------------------------------- the model, on the trainer


class Bottleneck(nn.Module):
    """A ResNet bottleneck block: 1x1, 3x3 (with the stride), 1x1 convolutions, and the shortcut."""

    def __init__(self, inputs: int, planes: int, stride: int):
        super().__init__()
        outputs = planes * 4
        self.body = nn.Sequential(
            nn.Conv2d(inputs, planes, 1, bias=False),
            nn.BatchNorm2d(planes),
            nn.ReLU(inplace=True),
            nn.Conv2d(planes, planes, 3, stride, 1, bias=False),
            nn.BatchNorm2d(planes),
            nn.ReLU(inplace=True),
            nn.Conv2d(planes, outputs, 1, bias=False),
            nn.BatchNorm2d(outputs),
        )
        same = stride == 1 and inputs == outputs
        self.shortcut = (
            nn.Identity()
            if same
            else nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))
        )
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


def resnet(classes: int, blocks: tuple[int, ...] = (3, 4, 6, 3), width: int = 64) -> nn.Module:
    """A bottleneck ResNet as torchvision defines it: ResNet-50 by default."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 7, 2, 3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    inputs = width
    for stage, count in enumerate(blocks):
        planes = width * 2**stage
        for block in range(count):
            layers.append(Bottleneck(inputs, planes, 2 if block == 0 and stage > 0 else 1))
            inputs = planes * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, classes)]
    return nn.Sequential(*layers)


def model(quick: bool) -> nn.Module:
    """ResNet-50 (torchvision's where installed), or with ``quick`` a tiny one for a CPU."""
    if quick:
        return resnet(1000, (1, 1), width=8)
    try:
        import torchvision
    except ImportError:
        return resnet(1000)
    return torchvision.models.resnet50(num_classes=1000)


class Trainer:
    """One training step on ``device``: uint8 images to normalized floats there, forward, backward, SGD."""

    def __init__(self, device: str, quick: bool):
        self.device = torch.device(device)
        self.model = model(quick).to(self.device).to(memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.mean = torch.tensor([0.485, 0.456, 0.406], device=self.device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor([0.229, 0.224, 0.225], device=self.device).view(1, 3, 1, 1) * 255
        self.autocast = self.device.type == "cuda"

    def step(self, images: torch.Tensor) -> None:
        images = images.to(self.device, non_blocking=True)
        inputs = ((images.float() - self.mean) / self.std).contiguous(memory_format=torch.channels_last)
        labels = torch.randint(0, 1000, (len(images),), device=self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = torch.nn.functional.cross_entropy(self.model(inputs), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


# ---------------------------------------------------------------------------- one system, in its own process


def _worker_processes(cores: list[int], env: dict[str, str], scratch: str) -> tuple[list, list[str]]:
    workers = []
    for core in cores:
        workers.append(
            subprocess.Popen(
                [sys.executable, "-m", "rpcdl", "worker", "--port", "0", "--log-level", "WARNING"],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                cwd=scratch,
                preexec_fn=lambda core=core: os.sched_setaffinity(0, {core}),
            )
        )
    return workers, [worker.stdout.readline().strip() for worker in workers]


def _pin_torch_worker(cores: list[int], worker_id: int) -> None:
    os.sched_setaffinity(0, {cores[worker_id % len(cores)]})


def run_system(
    system: str,
    args: argparse.Namespace,
    next_round: Callable[[], bool] = lambda: bool(sys.stdin.readline()),
    say: Callable[[dict[str, Any]], None] = lambda message: print(json.dumps(message), flush=True),
) -> None:
    """Measure ``system`` for one round each time ``next_round()`` is true (by default a line read from
    stdin); ``say`` it is ready, then each round's images/s (by default as a JSON line on stdout)."""
    import functools

    trainer_cores, worker_cores = json.loads(args.cores)
    os.sched_setaffinity(0, set(trainer_cores))
    torch.set_num_threads(len(trainer_cores))
    trainer = None if system == "decode" else Trainer(args.device, args.quick)
    length = args.batch_size * (args.warmup + args.steps)
    distinct = 8 if args.quick else 64
    crop = QUICK_CROP if args.quick else CROP
    pin = args.device.startswith("cuda")
    workers: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as scratch:
        if system == "gpu":
            batch = JpegDataset(args.batch_size, distinct=8, crop=crop)
            images = torch.stack([batch[index] for index in range(args.batch_size)]).to(trainer.device)
            loader: Any = [images] * (args.warmup + args.steps)
        elif system.startswith("rpcdl") or system == "decode":
            import rpcdl

            env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
            if system == "rpcdl-tcp":
                os.environ["RPCDL_SHM_BYTES"] = env["RPCDL_SHM_BYTES"] = "0"  # this trainer and its workers
            workers, addresses = _worker_processes(worker_cores, env, scratch)
            dataset = rpcdl.RPCDataset(addresses, JpegDataset, length, distinct, crop=crop)
            loader = rpcdl.RPCDataloader(
                dataset, batch_size=args.batch_size, shuffle=True, pin_memory=pin, prefetch_factor=args.prefetch
            )
        else:
            from torch.utils.data import DataLoader

            cores = worker_cores if system == "torch" else trainer_cores
            count = len(worker_cores) if system == "torch" else len(trainer_cores)
            loader = DataLoader(
                JpegDataset(length, distinct, crop=crop),
                batch_size=args.batch_size,
                shuffle=True,
                num_workers=count,
                pin_memory=pin,
                persistent_workers=True,
                prefetch_factor=args.prefetch,
                worker_init_fn=functools.partial(_pin_torch_worker, cores),
            )
        try:
            say({"ready": system})
            while next_round():
                say({"images_per_second": _one_round(loader, trainer, args)})
        finally:
            for worker in workers:
                worker.terminate()
                worker.wait(timeout=30)
                worker.stdout.close()


def _forked_system(system: str, args: argparse.Namespace, connection: Any, drivers_end: Any) -> None:
    drivers_end.close()  # the fork copied it: held here, it would keep a dead driver's pipe open
    run_system(system, args, connection.recv, connection.send)


def _measure_forked(system: str, args: argparse.Namespace) -> float:
    """One round of ``system`` in a process forked from this one, which imported torch already: on a CPU
    (``--device cpu``, where nothing initialized a device that a fork would break) that spares each system
    the seconds of a new interpreter importing torch."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    here, there = context.Pipe()
    process = context.Process(target=_forked_system, args=(system, args, there, here), name=f"gpu-node-{system}")
    process.start()
    there.close()
    try:
        here.recv()  # ready
        here.send(True)
        return here.recv()["images_per_second"]
    finally:
        here.send(False)
        process.join(timeout=120)
        here.close()


def _one_round(loader: Any, trainer: Trainer | None, args: argparse.Namespace) -> float:
    """One pass: ``warmup`` steps, then images/s over ``steps`` more."""
    started, images = 0.0, 0
    for index, batch in enumerate(loader):
        if trainer is not None:
            trainer.step(batch)
        if index + 1 == args.warmup:
            if trainer is not None:
                trainer.synchronize()
            started = time.perf_counter()
        elif index + 1 > args.warmup:
            images += len(batch)
    if trainer is not None:
        trainer.synchronize()
    return images / (time.perf_counter() - started)


# ---------------------------------------------------------------------------- the driver


def split_cores(trainer_cores: int) -> tuple[list[int], list[int]]:
    """The trainer's cores (the first ``trainer_cores`` this process may use, one left at least) and the others."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        raise SystemExit("gpu_node.py needs 2 cores at least: one for the trainer, one for a worker")
    count = max(1, min(trainer_cores, len(allowed) - 1))
    return allowed[:count], allowed[count:]


def driver(args: argparse.Namespace) -> dict[str, Any]:
    trainer_cores, worker_cores = split_cores(args.trainer_cores)
    if args.workers:
        worker_cores = worker_cores[: args.workers]
    args.cores = json.dumps([trainer_cores, worker_cores])
    print(
        f"device {args.device}, trainer on cores {trainer_cores}, {len(worker_cores)} workers on cores "
        f"{worker_cores}, batches of {args.batch_size}, {args.steps} steps after {args.warmup}, "
        f"load average {harness.load_average()}",
        flush=True,
    )
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--device",
        args.device,
        "--batch-size",
        str(args.batch_size),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--prefetch",
        str(args.prefetch),
        "--cores",
        args.cores,
        *(["--quick"] if args.quick else []),
    ]

    def measure(system: str) -> float:
        if args.device == "cpu":
            return _measure_forked(system, args)
        process = subprocess.Popen(
            [*command, "--system", system], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            json.loads(process.stdout.readline())  # ready
            process.stdin.write("go\n")
            process.stdin.flush()
            return json.loads(process.stdout.readline())["images_per_second"]
        finally:
            process.stdin.close()
            process.wait(timeout=120)
            process.stdout.close()

    def show(index: int, this_round: dict[str, float]) -> None:
        for system, value in this_round.items():
            print(f"round {index} {system}: {value:.1f} images/s", flush=True)

    figures = harness.interleave(
        {system: (lambda system=system: measure(system)) for system in args.systems},
        args.rounds,
        rotate=True,
        after_round=show,
    )
    medians = harness.medians(figures)
    report: dict[str, Any] = {
        "device": args.device,
        "device_name": _device_name(args.device),
        "trainer_cores": trainer_cores,
        "worker_cores": worker_cores,
        "batch_size": args.batch_size,
        "images_per_second": figures,
        "medians": medians,
        "ratios": {},
    }
    print(f"\n{report['device_name']}: images/s, median of {args.rounds} round(s)")
    for system, value in medians.items():
        ratios = {
            baseline: value / medians[baseline]
            for baseline in ("gpu", "torch")
            if baseline in medians and baseline != system
        }
        report["ratios"][system] = ratios
        shown = ", ".join(f"{ratio:.2f}x {name}" for name, ratio in ratios.items())
        print(f"  {system:10s} {value:10.1f}  {shown}")
    harness.save_json(args.json, report)
    return report


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return "CPU"


def main() -> None:
    parser = harness.parser(__doc__, rounds=3, json_file=True)
    parser.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny network, small crops and batches, a few steps")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--trainer-cores", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0, help="worker processes (default: one per other core)")
    parser.add_argument("--batch-size", type=int, default=None, help="default 256, 8 with --quick")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per round (default 50, 4 quick)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before measuring (default 10, 2 quick)")
    parser.add_argument("--prefetch", type=int, default=4, help="batches in flight per worker")
    parser.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--cores", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.batch_size = args.batch_size or (8 if args.quick else 256)
    args.steps = args.steps or (4 if args.quick else 50)
    args.warmup = args.warmup or (2 if args.quick else 10)
    if args.system:
        run_system(args.system, args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
