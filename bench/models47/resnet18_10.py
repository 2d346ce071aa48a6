"""torchvision ResNet-18, 10 classes, 64x64 images (issue #48's compare case)."""
import torch
import torchvision


def build_model() -> torch.nn.Module:
    return torchvision.models.resnet18(num_classes=10)


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(batch_size, 3, 64, 64), torch.randint(0, 10, (batch_size,))
