"""Small data for the trainer integrations' tests (tests/integrations/): padded text for the tiny LM, and a CNN with a
tiny image folder for Lightning."""
from __future__ import annotations

from pathlib import Path

import torch

TRAINER_QUIET = dict(report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, optim="adamw_torch")
"""TrainingArguments every test shares: nothing logged or saved, the plain (not fused) AdamW, which on this CPU is
a quarter of a second faster per step."""


def padded_text(tiny_lm: Path, *, count: int = 8, seq_len: int = 16) -> list[dict]:
    """``count`` samples of the tiny LM's corpus, cut to different lengths and padded to ``seq_len`` (the loss averages
    over tokens, so micro-batches weigh differently from their sample counts), as the dicts a Trainer's default
    collator stacks."""
    from transformers import AutoTokenizer

    from tests.helpers.tiny_lm import corpus_lines

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm)
    samples = []
    for i, line in enumerate(corpus_lines(count)):
        words = line.split()[: 9 - 2 * (i % 4)]  # 9, 7, 5, 3 words: micro-batches of 2 hold 16 and 8 tokens
        encoded = tokenizer(" ".join(words), padding="max_length", max_length=seq_len, truncation=True, return_tensors="pt")
        input_ids, attention_mask = encoded["input_ids"][0], encoded["attention_mask"][0]
        samples.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": input_ids.masked_fill(attention_mask == 0, -100)})
    return samples


def logged_losses(trainer) -> list[float]:
    """The per-step training losses a Trainer logged (``logging_steps=1``)."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def small_cnn() -> torch.nn.Module:
    """A CNN of two blocks (``features.0``, ``features.1``) for 3x8x8 images (an image folder of greyscale PNGs, read as RGB) in 2 classes."""
    from torch import nn

    torch.manual_seed(0)
    block = lambda c_in, c_out: nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))  # noqa: E731
    return nn.Sequential(
        nn.Sequential(block(3, 8), block(8, 16)), nn.Flatten(), nn.Linear(16 * 2 * 2, 2),
    )


def image_loader(root: Path, *, batch_size: int):
    """A tiny image folder (4 greyscale 8x8 PNGs per class, ``tests/helpers/images.py``) in a DataLoader, in file order."""
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms

    from tests.helpers.images import write_images

    if not root.exists():
        write_images(root, per_class=4, seed=0)
    return DataLoader(datasets.ImageFolder(root, transform=transforms.ToTensor()), batch_size=batch_size, shuffle=False)


def classifier(**optimizer_options):
    """A LightningModule over ``small_cnn`` (its ``model``) that records each micro-batch's loss in ``losses``."""
    import lightning

    class Classifier(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = small_cnn()
            self.losses: list[float] = []

        def training_step(self, batch, batch_index):
            images, labels = batch
            loss = torch.nn.functional.cross_entropy(self.model(images), labels)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, **optimizer_options)

    return Classifier()


LIGHTNING_QUIET = dict(
    accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
"""lightning.Trainer arguments every test shares: one CPU process, nothing logged, saved or printed."""
