"""A two-process DDP training on CPU through RPCDataModule, run by tests/test_lightning.py.

Usage: python tests/lightning_ddp_job.py OUT_DIR  (workers from $RPCDL_WORKERS)

Lightning's "ddp" strategy starts rank 1 by running this script again. The job
fits twice with the same seed; each rank writes what it saw to
OUT_DIR/run{1,2}/rank{0,1}.json.
"""

from __future__ import annotations

import sys

from helpers_lightning import RecordingModel, quiet_trainer
from probe_dataset import probe_spec

from rpcdl.integrations.lightning import RPCDataModule

SAMPLES = 32
BATCH_SIZE = 4


def main(out_dir: str) -> None:
    for run in (1, 2):
        # workers=None: the addresses in $RPCDL_WORKERS; rank r uses workers[r::2]
        data = RPCDataModule(train_dataset=probe_spec(SAMPLES), batch_size=BATCH_SIZE, shuffle=True, seed=1234)
        model = RecordingModel(record_to=f"{out_dir}/run{run}")
        trainer = quiet_trainer(strategy="ddp", devices=2, max_epochs=2)
        trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main(sys.argv[1])
