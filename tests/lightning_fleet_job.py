"""A two-rank DDP training on CPU whose rank 1 loses all its own workers mid-epoch (tests/test_fleet_cluster.py).

Usage: python tests/lightning_fleet_job.py OUT_DIR  (workers from $RPCDL_WORKERS)

Rank 1 uses workers[1::2]. At its 4th training batch it writes OUT_DIR/ready
and waits for OUT_DIR/killed: the test kills rank 1's workers meanwhile. The
fit must complete, each rank writing what it saw to OUT_DIR/fit/rank{0,1}.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from helpers_lightning import RecordingModel, quiet_trainer
from probe_dataset import probe_spec

from rpcdl.integrations.lightning import RPCDataModule

SAMPLES = 128
BATCH_SIZE = 4


class PausingModel(RecordingModel):
    """Rank 1 stops at its 4th batch of epoch 0 until the test has killed its workers."""

    def __init__(self, out_dir: str):
        super().__init__(record_to=f"{out_dir}/fit")
        self.out_dir = Path(out_dir)

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.current_epoch == 0 and batch_idx == 3:
            (self.out_dir / "ready").write_text("")
            deadline = time.monotonic() + 60
            while not (self.out_dir / "killed").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return super().training_step(batch, batch_idx)


def main(out_dir: str) -> None:
    data = RPCDataModule(
        train_dataset=probe_spec(SAMPLES), batch_size=BATCH_SIZE, shuffle=True, seed=1234, max_batches_per_call=1
    )
    trainer = quiet_trainer(strategy="ddp", devices=2, max_epochs=2)
    trainer.fit(PausingModel(out_dir), datamodule=data)


if __name__ == "__main__":
    main(sys.argv[1])
