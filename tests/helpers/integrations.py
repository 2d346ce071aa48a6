"""Small data for the trainer integrations' tests (tests/integrations/): padded text for the tiny LM, and a CNN with a
tiny image folder for Lightning."""
from __future__ import annotations

from pathlib import Path

import torch

TRAINER_QUIET = dict(report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, optim="adamw_torch")
"""TrainingArguments every test shares: nothing logged or saved, the plain (not fused) AdamW, which on this CPU is
a quarter of a second faster per step."""


def padded_text(tiny_lm: Path, *, count: int = 8, seq_len: int = 16) -> list[dict]:
    """``count`` samples of the tiny LM's corpus, padded to ``seq_len`` (a different amount each: the loss averages over
    tokens, so micro-batches weigh differently), as the dicts a Trainer's default collator stacks."""
    from transformers import AutoTokenizer

    from tests.helpers.tiny_lm import corpus_lines

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm)
    samples = []
    for i, line in enumerate(corpus_lines(count)):
        words = line.split()[: seq_len - 3 * (i % 3)]
        encoded = tokenizer(" ".join(words), padding="max_length", max_length=seq_len, truncation=True, return_tensors="pt")
        input_ids, attention_mask = encoded["input_ids"][0], encoded["attention_mask"][0]
        samples.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": input_ids.masked_fill(attention_mask == 0, -100)})
    return samples


def logged_losses(trainer) -> list[float]:
    """The per-step training losses a Trainer logged (``logging_steps=1``)."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def small_cnn() -> torch.nn.Module:
    """A CNN of two blocks (``features.0``, ``features.1``) for 1x8x8 images in 2 classes."""
    from torch import nn

    torch.manual_seed(0)
    block = lambda c_in, c_out: nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))  # noqa: E731
    return nn.Sequential(
        nn.Sequential(block(1, 8), block(8, 16)), nn.Flatten(), nn.Linear(16 * 2 * 2, 2),
    )
