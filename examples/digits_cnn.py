"""A small residual CNN for scikit-learn's digits, upscaled to 1x32x32.

The model file of the README's quick start:

    python examples/make_digits.py data/digits
    autofit plan examples/digits_cnn.py --budget 64MB --batch-size 64 --out plan.json
    autofit train --plan plan.json --data data/digits --epochs 4

The two stages are ``nn.Sequential``s of same-typed ``ResidualBlock``s, so
their children (``stage1.0`` .. ``stage1.3``, ``stage2.0`` .. ``stage2.3``) are
the checkpoint candidates. There is no BatchNorm: its statistics would depend on how a
global batch is split into micro-batches, and a plan must not change the
gradient.

Without ``--data``, ``autofit train`` uses ``train_dataset()``/``val_dataset()``
below: the same digits and the same 80/20 split, straight from scikit-learn.
"""
from __future__ import annotations

import torch
from torch import nn

INPUT_SHAPE = (1, 32, 32)
"""(C, H, W): the 8x8 digits are resized to 32x32 so the activations are worth planning."""
NUM_CLASSES = 10
PIXEL_MEAN, PIXEL_STD = 0.25, 0.33
"""About the digits' pixel statistics: standardised inputs train faster."""


class ResidualBlock(nn.Module):
    """x + conv(relu(conv(x))), then relu; keeps (B, C, H, W)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        return torch.relu(x + self.conv2(torch.relu(self.conv1(x))))


class DigitsCNN(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU())  # (B, 16, 32, 32)
        self.stage1 = nn.Sequential(*(ResidualBlock(16) for _ in range(4)))
        self.down = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU())  # (B, 32, 16, 16)
        self.stage2 = nn.Sequential(*(ResidualBlock(32) for _ in range(4)))
        self.head = nn.Sequential(nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 8 * 8, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1, 32, 32) -> (B, num_classes)
        x = (x - PIXEL_MEAN) / PIXEL_STD  # pixels in [0, 1], as an image folder gives them
        return self.head(self.stage2(self.down(self.stage1(self.stem(x)))))


def build_model() -> nn.Module:
    return DigitsCNN()


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(batch_size, *INPUT_SHAPE), torch.randint(0, NUM_CLASSES, (batch_size,))


def build_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=2e-3)


def _digits_split(part: str) -> torch.utils.data.Dataset:
    """The digits as (1, 32, 32) tensors in [0, 1]; the same split as examples/make_digits.py."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    labels = torch.tensor(digits.target)
    train_idx, val_idx = train_test_split(range(len(labels)), test_size=0.2, stratify=digits.target, random_state=0)
    index = torch.tensor(train_idx if part == "train" else val_idx)
    resized = nn.functional.interpolate(images[index], size=INPUT_SHAPE[1:], mode="bilinear", align_corners=False)
    dataset = torch.utils.data.TensorDataset(resized, labels[index])
    dataset.classes = [str(d) for d in range(NUM_CLASSES)]
    return dataset


def train_dataset() -> torch.utils.data.Dataset:
    return _digits_split("train")


def val_dataset() -> torch.utils.data.Dataset:
    return _digits_split("val")
