"""Detector-shaped models (torchvision detection's interface) and their per-sample batches."""
import torch
from torch import nn
from torch.nn import functional as F

from autofit.model_io import per_sample


class ListDetector(nn.Module):
    """torchvision detection's interface: a list of images of any size and a list of target dicts in, a dict of
    losses out (each a mean over the images, as a detector's losses are)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.box = nn.Linear(4, 4)

    def forward(self, images, targets):
        features = [self.conv(image[None]).mean(dim=(2, 3))[0] for image in images]  # each (4,)
        boxes = torch.stack([self.box(f) for f in features])  # (N, 4)
        wanted = torch.stack([t["boxes"][0] for t in targets])
        return {"loss_box": F.smooth_l1_loss(boxes, wanted), "loss_size": torch.stack([f.pow(2).mean() for f in features]).mean()}


def detection_batch(n: int):
    """n images of 3 channels and different sizes (the first dimension of each is 3, never n)."""
    generator = torch.Generator().manual_seed(1)
    images = [torch.randn(3, 5 + i, 7, generator=generator) for i in range(n)]
    targets = [{"boxes": torch.rand(2, 4, generator=generator), "labels": torch.tensor([1, 2])} for _ in range(n)]
    return per_sample(((images, targets), None))


class EvalDetections(ListDetector):
    """Losses when training, detections in eval mode (torchvision detection), with a BatchNorm and a dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.drop = nn.BatchNorm2d(3), nn.Dropout(0.5)

    def forward(self, images, targets):
        images = [self.drop(self.norm(image[None]))[0] for image in images]
        if not self.training:
            return [{"boxes": self.box(self.conv(image[None]).mean(dim=(2, 3))), "scores": torch.ones(1)} for image in images]
        return super().forward(images, targets)
