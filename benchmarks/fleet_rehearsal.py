"""A rehearsal of a changing fleet on this machine: workers started, stopped, hung and replaced through a file
source while a loader trains, every epoch checked for every sample exactly once.

Usage::

    python benchmarks/fleet_rehearsal.py [--epochs 8] [--log benchmarks/fleet_rehearsal.log]

Real ``rpcdl worker`` processes on loopback; the trainer reads ``workers.txt``
(a :class:`rpcdl.data.sources.FileSource`, watched every 0.5 s). A script of
fleet events runs on its own thread during training:

1. a third worker starts and is appended to the file (a join mid-epoch);
2. the first worker is killed (SIGKILL) and removed from the file;
3. the second worker is stopped (SIGSTOP) and left stopped for two epochs,
   then continued (SIGCONT);
4. a replacement starts on a new port and is listed (a node back under a new
   address).

Each epoch logs its time, the longest wait for one batch, the batches each
worker served, and whether every sample came exactly once. It reports no speed
claim: the wait of the slowest batch is compared with the loader's timeout
(120 s), which is what a hung worker used to cost.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

import rpcdl
from rpcdl.data.sources import FileSource, Fleet
from rpcdl.local import child_environment, read_ready_line
from rpcdl.processes import stop_process

SAMPLES = 2000
BATCH = 8
STEP_SECONDS = 0.01  # the "training step" per batch


class Slow(Dataset):
    """Sample ``i`` is ``i``, after 1 ms of "decoding"."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.001)
        return torch.tensor(index)


def start_worker() -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "rpcdl", "worker", "--port", "0", "--log-level", "WARNING"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=child_environment())
    return process, read_ready_line(process, 60.0)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--log", default=str(Path(__file__).with_name("fleet_rehearsal.log")))
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s.%(msecs)03d %(name)s %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.FileHandler(args.log, mode="w"), logging.StreamHandler()],
    )
    say = logging.getLogger("rehearsal").info
    processes: list[subprocess.Popen] = []
    directory = Path(tempfile.mkdtemp(prefix="rpcdl-rehearsal-"))
    listing = directory / "workers.txt"
    lines: list[str] = []

    def list_workers(addresses: list[str]) -> None:
        lines[:] = addresses
        listing.write_text("".join(f"{a}\n" for a in addresses))

    try:
        started = [start_worker() for _ in range(2)]
        processes += [p for p, _ in started]
        list_workers([a for _, a in started])
        say("machine: %s", harness.describe_machine())
        say("fleet: %s", lines)
        dataset = rpcdl.RPCDataset(Fleet(FileSource(listing), interval=0.5), Slow, SAMPLES)
        loader = rpcdl.RPCDataloader(dataset, batch_size=BATCH, shuffle=True, max_batches_per_call=1)
        epoch_started = threading.Event()
        epochs_done = [0]

        def events() -> None:
            epoch_started.wait()
            time.sleep(1.0)
            process, address = start_worker()
            processes.append(process)
            list_workers([*lines, address])
            say("EVENT join: started %s and listed it", address)
            time.sleep(2.0)
            first = started[0]
            first[0].kill()
            first[0].wait()
            list_workers([a for a in lines if a != first[1]])
            say("EVENT kill: SIGKILLed %s and removed it from the file", first[1])
            time.sleep(2.0)
            second = started[1]
            second[0].send_signal(signal.SIGSTOP)
            say("EVENT hang: SIGSTOPped %s, left listed", second[1])
            stopped_at = epochs_done[0]
            while epochs_done[0] < stopped_at + 2:
                time.sleep(0.2)
            second[0].send_signal(signal.SIGCONT)
            say("EVENT resume: SIGCONT %s", second[1])
            time.sleep(1.0)
            process, address = start_worker()
            processes.append(process)
            list_workers([*lines, address])
            say("EVENT replace: a node back under a new address %s", address)

        script = threading.Thread(target=events, name="rehearsal-events", daemon=True)
        script.start()
        failures = 0
        for epoch in range(args.epochs):
            seen: list[int] = []
            longest, before, began = 0.0, time.monotonic(), time.monotonic()
            served_before = loader.batches_served
            for batch in loader:
                epoch_started.set()
                longest = max(longest, time.monotonic() - before)
                seen.extend(int(i) for i in batch)
                time.sleep(STEP_SECONDS)
                before = time.monotonic()
            epochs_done[0] += 1
            once = sorted(seen) == list(range(SAMPLES))
            failures += not once
            served = {a: n - served_before.get(a, 0) for a, n in loader.batches_served.items()}
            say(
                "epoch %d: %.2fs, longest wait for a batch %.2fs (timeout %gs), exactly once: %s, served: %s",
                epoch, time.monotonic() - began, longest, loader.timeout, once,
                {a: n for a, n in served.items() if n},
            )  # fmt: skip
            say("states: %s", loader.worker_states())
        script.join(timeout=30)
        say("%d of %d epochs delivered every sample exactly once", args.epochs - failures, args.epochs)
        sys.exit(1 if failures else 0)
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
            stop_process(process, grace=5.0)
        rpcdl.shutdown()


if __name__ == "__main__":
    main()
