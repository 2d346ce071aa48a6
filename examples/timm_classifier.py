"""A small timm ConvNeXt for scikit-learn's digits, built from a config (random weights, nothing downloaded).

    pip install 'autofit[hf]' scikit-learn
    autofit plan examples/timm_classifier.py --budget 64MB --batch-size 32
    autofit train --plan plan.json --epochs 2

``timm.create_model`` takes the architecture's own arguments: here a
four-stage ConvNeXt (one block per stage, 8 to 32 channels) for 1x32x32 images and 10 classes.
Its stages (``stages.0`` .. ``stages.3``) are the checkpoint candidates. For a
stock timm model with its default config, ``timm:NAME`` needs no model file:

    autofit plan timm:convnext_atto --input-shape 3x64x64 --num-classes 10 --budget 1GB --batch-size 32
"""
from __future__ import annotations

import torch
from torch import nn

INPUT_SHAPE = (1, 32, 32)
NUM_CLASSES = 10
CONFIG = {"depths": (1, 1, 1, 1), "dims": (8, 16, 24, 32), "in_chans": INPUT_SHAPE[0], "num_classes": NUM_CLASSES, "drop_path_rate": 0.0}
"""ConvNeXt's constructor arguments (timm.models.convnext.ConvNeXt)."""


def build_model() -> nn.Module:
    import timm

    return timm.create_model("convnext_atto", pretrained=False, **CONFIG)


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(batch_size, *INPUT_SHAPE), torch.randint(0, NUM_CLASSES, (batch_size,))


def _digits_split(part: str) -> torch.utils.data.Dataset:
    """The digits as (1, 32, 32) tensors in [0, 1], split 80/20 as examples/make_digits.py does."""
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
