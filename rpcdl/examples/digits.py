"""scikit-learn's bundled 8x8 digits: a dataset with worker-side augmentation and a small CNN.

The dataset is built on the rpcdl workers, so its random augmentation is drawn
there, from generators rpcdl seeds per batch. ``configs/digits.yaml`` and
``rpcdl demo`` train :class:`rpcdl.examples.digits_model.DigitsCNN` on it.
This module does not import Lightning: workers need only torch and scikit-learn.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ..checks import check_int, check_number

_SPLITS = ("train", "val", "all")


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 digits as float32 images scaled to [0, 1] and int64 labels (scikit-learn's copy, on disk).

    Raises:
        ImportError: scikit-learn is not installed (the message says how to install it).

    Example::

        >>> images, labels = load_digits()  # doctest: +SKIP
        >>> images.shape, labels.shape  # doctest: +SKIP
        ((1797, 8, 8), (1797,))
    """
    try:
        from sklearn import datasets
    except ImportError:
        raise ImportError(
            "the digits example needs scikit-learn: pip install 'rpcdl[demo]' (or pip install scikit-learn)"
        ) from None
    bunch = datasets.load_digits()
    return bunch.images.astype(np.float32) / 16.0, bunch.target.astype(np.int64)


class DigitsDataset(Dataset):
    """The 1797 8x8 images of scikit-learn's digits, split into train and val by a seed.

    Samples are ``(image, label)``: a float tensor of shape ``(1, 8, 8)`` with
    values in [0, 1] (plus noise when augmenting) and an int64 class in 0..9.
    With ``augment``, each image is shifted by up to ``max_shift`` pixels in each
    direction and gets Gaussian noise of standard deviation ``noise_std``, drawn
    from torch's default generator of the process that loads it: on an rpcdl
    worker, the generator the loader seeds for the batch.

    Args:
        split: ``"train"``, ``"val"`` or ``"all"``.
        val_fraction: share of the images held out for ``"val"``.
        split_seed: seed of the train/val permutation (the same on every worker).
        augment: draw a random shift and noise for every sample.
        max_shift: largest shift in pixels, in each direction.
        noise_std: standard deviation of the added noise.

    Example::

        >>> train = DigitsDataset("train", augment=True)  # doctest: +SKIP
        >>> image, label = train[0]  # doctest: +SKIP
        >>> image.shape  # doctest: +SKIP
        torch.Size([1, 8, 8])
    """

    def __init__(
        self,
        split: str = "train",
        val_fraction: float = 0.2,
        split_seed: int = 0,
        augment: bool = False,
        max_shift: int = 1,
        noise_std: float = 0.05,
    ):
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction!r}")
        check_int(max_shift, "max_shift", minimum=0, maximum=3, meaning="pixels")
        check_number(noise_std, "noise_std", minimum=0)
        images, labels = load_digits()
        order = np.random.default_rng(split_seed).permutation(len(labels))
        n_val = round(len(labels) * val_fraction)
        keep = {"train": order[n_val:], "val": order[:n_val], "all": order}[split]
        self.split = split
        self.images = torch.from_numpy(images[keep]).unsqueeze(1)
        self.labels = torch.from_numpy(labels[keep])
        self.augment = augment
        self.max_shift = max_shift
        self.noise_std = float(noise_std)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.augment:
            image = self.random_shift(image)
            if self.noise_std:
                image = image + self.noise_std * torch.randn_like(image)
        return image, self.labels[index]

    def random_shift(self, image: torch.Tensor) -> torch.Tensor:
        """Move ``image`` by a random offset of up to ``max_shift`` pixels, filling with zeros."""
        if not self.max_shift:
            return image
        s = self.max_shift
        dy, dx = (int(v) for v in torch.randint(-s, s + 1, (2,)))
        padded = F.pad(image, (s, s, s, s))
        height, width = image.shape[-2:]
        return padded[..., s + dy : s + dy + height, s + dx : s + dx + width]

    def __repr__(self) -> str:
        return f"DigitsDataset(split={self.split!r}, size={len(self)}, augment={self.augment})"


def digits_cnn(channels: int = 16, hidden: int = 64) -> nn.Sequential:
    """The network of ``DigitsCNN``: two 3x3 convolutions, a pooling, two linear layers."""
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * channels * 4 * 4, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )
