"""A Lightning image classifier trained with an autofit plan (docs/integrations.md); also the model file to plan.

    python examples/make_digits.py data/digits
    autofit plan examples/lightning_classifier.py --budget 64MB --batch-size 64 --out plan.json
    python examples/lightning_classifier.py plan.json --data data/digits/train --epochs 2

``AutofitCallback`` applies the plan to the module's ``model`` before Lightning configures the optimizer: the
checkpointed blocks, the optimizer's levers; ``trainer_settings`` gives Lightning the plan's precision and
accumulation, and the DataLoader takes the plan's micro-batch, so a step is the plan's global batch.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

INPUT_SHAPE = (1, 32, 32)
"""(C, H, W): images are read as greyscale and resized to 32x32."""
NUM_CLASSES = 10


def block(channels_in: int, channels_out: int) -> nn.Module:
    """Two convolutions and a halving of the image: a checkpoint candidate."""
    return nn.Sequential(
        nn.Conv2d(channels_in, channels_out, 3, padding=1), nn.ReLU(),
        nn.Conv2d(channels_out, channels_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    )


def build_model() -> nn.Module:
    """(B, 1, 32, 32) -> (B, NUM_CLASSES); its blocks are ``features.0`` .. ``features.2``."""
    model = nn.Sequential()
    model.add_module("features", nn.Sequential(block(1, 16), block(16, 32), block(32, 64)))  # (B, 64, 4, 4)
    model.add_module("flatten", nn.Flatten())
    model.add_module("head", nn.Linear(64 * 4 * 4, NUM_CLASSES))
    return model


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(batch_size, *INPUT_SHAPE), torch.randint(0, NUM_CLASSES, (batch_size,))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="a plan.json for this file's model")
    parser.add_argument("--data", required=True, help="an image folder: one sub-folder per class")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=-1, help="optimizer steps (default: --epochs' worth)")
    args = parser.parse_args()

    import lightning
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms

    import autofit
    from autofit.integrations.lightning import AutofitCallback, trainer_settings

    class Classifier(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model()

        def training_step(self, batch, batch_index):
            images, labels = batch
            loss = nn.functional.cross_entropy(self.model(images), labels)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    plan = autofit.load_plan(args.plan)
    to_input = transforms.Compose([transforms.Grayscale(1), transforms.Resize(INPUT_SHAPE[1:]), transforms.ToTensor()])
    images = datasets.ImageFolder(args.data, transform=to_input)
    # The plan's micro-batch: Lightning accumulates grad_accum_steps of them into the plan's global batch.
    loader = DataLoader(images, batch_size=plan.config.micro_batch_size, shuffle=True, drop_last=True)
    torch.manual_seed(0)
    callback = AutofitCallback(plan, module="model")
    trainer = lightning.Trainer(
        max_epochs=args.epochs, max_steps=args.steps, callbacks=[callback], logger=False, enable_checkpointing=False,
        enable_model_summary=False, **trainer_settings(plan),
    )
    trainer.fit(Classifier(), loader)
    config = plan.config
    print(f"trained {trainer.global_step} step(s) of {config.global_batch_size} images ({config.micro_batch_size} x "
          f"{config.grad_accum_steps}), checkpoint {', '.join(config.checkpoint) or 'none'}: "
          f"loss {float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    main()
