"""An object detector as torchvision gives it: Faster R-CNN (MobileNetV3 320 FPN) on generated boxes.

torchvision's detection models take a list of images and a list of target
dicts (``boxes`` (N, 4) in x1, y1, x2, y2 pixels, ``labels`` (N,)), images of
any size, and return a dict of losses when training:

    autofit plan examples/detection.py --budget 600MB --batch-size 4 --out detection.json
    autofit train --plan detection.json --epochs 2

``collate`` tells autofit how the dataset's ``(image, target)`` samples make a
batch, ``((images, targets), None)``: the model is called as
``model(images, targets)``, its lists hold one entry per sample (micro-batches
take whole images), and training minimises the sum of the loss dict.
Validation reports that loss too (the model computes it only in train mode;
autofit runs it so with its norms and dropout in eval mode).

The data: ``SIZE`` x ``SIZE`` noise images with one to three filled
rectangles, each of a class's colour; generated, so nothing is downloaded.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

SIZE = 128
"""Pixels per side of every generated image (the model resizes to 128 too: ``min_size``/``max_size``)."""
NUM_CLASSES = 3
"""Background and two kinds of rectangle."""
COLOURS = torch.tensor([[0.9, 0.1, 0.1], [0.1, 0.2, 0.9]])
"""RGB of each rectangle class (labels 1 and 2)."""


def build_model() -> nn.Module:
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

    # min_size/max_size: the model's own resize keeps these small images small (its default is 320).
    return fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=NUM_CLASSES, min_size=SIZE, max_size=SIZE,
    )


class Rectangles(Dataset):
    """``count`` generated samples ``(image (3, SIZE, SIZE), {"boxes": (N, 4), "labels": (N,)})``, fixed by ``seed``."""

    def __init__(self, count: int, *, seed: int) -> None:
        self.count, self.seed = count, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.rand(3, SIZE, SIZE, generator=generator) * 0.3
        boxes, labels = [], []
        for _ in range(int(torch.randint(1, 4, (), generator=generator))):
            x1, y1 = (int(v) for v in torch.randint(0, SIZE - 24, (2,), generator=generator))
            w, h = (int(v) for v in torch.randint(16, 48, (2,), generator=generator))
            x2, y2 = min(x1 + w, SIZE), min(y1 + h, SIZE)
            label = int(torch.randint(1, NUM_CLASSES, (), generator=generator))
            image[:, y1:y2, x1:x2] = COLOURS[label - 1, :, None, None]
            boxes.append([x1, y1, x2, y2])
            labels.append(label)
        return image, {"boxes": torch.tensor(boxes, dtype=torch.float32), "labels": torch.tensor(labels)}


def collate(samples: list) -> tuple:
    """``[(image, target), ...]`` -> ``((images, targets), None)``: the model takes both, and computes its own losses."""
    images, targets = zip(*samples)
    return (list(images), list(targets)), None


def example_batch(batch_size: int) -> tuple:
    return collate([Rectangles(batch_size, seed=1)[i] for i in range(batch_size)])


def train_dataset() -> Dataset:
    return Rectangles(64, seed=0)


def val_dataset() -> Dataset:
    return Rectangles(16, seed=1)
