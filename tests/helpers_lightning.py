"""A model for the Lightning tests that records which sample came from where (see probe_dataset.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch


def quiet_trainer(**options: Any) -> pl.Trainer:
    """A Lightning trainer on the CPU that logs, checkpoints and prints nothing; ``options`` override or add."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    return pl.Trainer(**{**defaults, **options})


class RecordingModel(pl.LightningModule):
    """Records every training batch: epoch, batch index, sample indices, worker pids and draws."""

    def __init__(self, record_to: str | None = None):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.record_to = record_to
        self.records: list[dict[str, Any]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.records.append(
            {
                "epoch": self.current_epoch,
                "batch": batch_idx,
                "indices": batch["index"].tolist(),
                "pids": batch["pid"].tolist(),
                "noise": batch["noise"].tolist(),
            }
        )
        return self.layer(batch["noise"].float().unsqueeze(1)).pow(2).mean()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_noise", batch["noise"].float().mean(), batch_size=len(batch["index"]))

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return batch["index"]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        if self.record_to:
            path = Path(self.record_to) / f"rank{self.global_rank}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            datamodule = self.trainer.datamodule
            path.write_text(
                json.dumps(
                    {
                        "rank": self.global_rank,
                        "world_size": self.trainer.world_size,
                        "workers": datamodule.workers,
                        "batches_served": datamodule.loaders["train"].batches_served,
                        "records": self.records,
                    }
                )
            )
