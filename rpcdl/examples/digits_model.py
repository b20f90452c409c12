"""The LightningModule of the digits example: a small CNN that logs its validation accuracy."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from .digits import digits_cnn


class DigitsCNN(pl.LightningModule):
    """A small CNN classifying 8x8 digits; logs ``train_loss``, ``val_loss`` and ``val_acc``.

    Args:
        channels: channels of the first convolution (the second has twice as many).
        hidden: width of the hidden linear layer.
        lr: learning rate of Adam.
        weight_decay: weight decay of Adam.

    Example::

        >>> model = DigitsCNN(lr=3e-3)  # doctest: +SKIP
        >>> model(torch.zeros(4, 1, 8, 8)).shape  # doctest: +SKIP
        torch.Size([4, 10])
    """

    def __init__(self, channels: int = 16, hidden: int = 64, lr: float = 3e-3, weight_decay: float = 0.0):
        super().__init__()
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr!r}")
        self.save_hyperparameters()
        self.net = digits_cnn(channels, hidden)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True, batch_size=len(labels))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        accuracy = (logits.argmax(dim=1) == labels).float().mean()
        self.log("val_loss", loss, batch_size=len(labels), sync_dist=True)
        self.log("val_acc", accuracy, prog_bar=True, batch_size=len(labels), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        images, labels = batch
        accuracy = (self(images).argmax(dim=1) == labels).float().mean()
        self.log("test_acc", accuracy, batch_size=len(labels), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images = batch[0] if isinstance(batch, (list, tuple)) else batch
        return self(images).argmax(dim=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
