"""DDP trainings on CPU (gloo) that checkpoint on one world size and resume on another, run by
tests/test_resume_anywhere_lightning.py.

Usage (workers from $RPCDL_WORKERS):
  python tests/lightning_resume_job.py save OUT_DIR
      4 ranks fit one epoch, save OUT_DIR/mid.ckpt after batch 1 and OUT_DIR/end.ckpt at the epoch's end;
      each rank writes what it saw to OUT_DIR/save/rank{r}.json and its data module's state at each save
      to OUT_DIR/states/{mid,end}-rank{r}.json.
  python tests/lightning_resume_job.py resume OUT_DIR DEVICES
      DEVICES ranks resume from mid.ckpt, then from end.ckpt, and fit to the end of epoch 1; what each
      rank saw goes to OUT_DIR/resume{DEVICES}-{mid,end}/rank{r}.json.

Lightning's "ddp" strategy starts the other ranks by running this script again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
from helpers_lightning import RecordingModel, quiet_trainer
from probe_dataset import probe_spec

from rpcdl.integrations.lightning import RPCDataModule

SAMPLES = 40
BATCH_SIZE = 2
SAVED_AFTER_BATCH = 1


class SaveAndRecordStates(pl.Callback):
    """Save mid.ckpt after batch SAVED_AFTER_BATCH and end.ckpt at the epoch's end; every rank writes its state."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir

    def _save(self, trainer: pl.Trainer, name: str) -> None:
        trainer.save_checkpoint(self.out_dir / f"{name}.ckpt")  # every rank calls it; rank 0 writes
        states = self.out_dir / "states"
        states.mkdir(parents=True, exist_ok=True)
        state = trainer.datamodule.state_dict()
        (states / f"{name}-rank{trainer.global_rank}.json").write_text(json.dumps(state))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == SAVED_AFTER_BATCH:
            self._save(trainer, "mid")

    def on_train_epoch_end(self, trainer, pl_module):
        self._save(trainer, "end")


def _trainer(devices: int, epochs: int, callbacks: list) -> pl.Trainer:
    return quiet_trainer(
        strategy="ddp", devices=devices, max_epochs=epochs, num_sanity_val_steps=0, callbacks=callbacks
    )


def _data() -> RPCDataModule:
    return RPCDataModule(train_dataset=probe_spec(SAMPLES), batch_size=BATCH_SIZE, shuffle=True, seed=1234)


def main(mode: str, out_dir: str, devices: str = "4") -> None:
    out = Path(out_dir)
    if mode == "save":
        model = RecordingModel(record_to=str(out / "save"))
        _trainer(4, 1, [SaveAndRecordStates(out)]).fit(model, datamodule=_data())
        return
    for name in ("mid", "end"):
        model = RecordingModel(record_to=str(out / f"resume{devices}-{name}"))
        _trainer(int(devices), 2, []).fit(model, datamodule=_data(), ckpt_path=str(out / f"{name}.ckpt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
