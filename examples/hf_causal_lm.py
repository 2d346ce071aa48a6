"""A small GPT-2 language model built from a transformers config (random weights, nothing downloaded).

    pip install 'autofit[hf]'
    autofit plan examples/hf_causal_lm.py --budget 200MB --batch-size 16
    autofit train --plan plan.json --epochs 2

What the model file declares for a transformers model:

- ``example_batch`` returns ``(inputs, None)``: the inputs are a dict
  (``model(**inputs)``) holding ``input_ids``, ``attention_mask`` and
  ``labels``; there are no separate targets.
- No ``loss_fn``: GPT2LMHeadModel given labels returns its own loss
  (``output.loss``, the mean over labels that are not -100).
- ``count_items``: the labels that loss averages over. The model shifts its
  labels (position t predicts t+1), so the first label of each sequence never
  counts: ``count_labels(shift=True)``. Micro-batches are weighted by these
  tokens, so a padded batch of 8 trains exactly as 4 + 4 or 3 + 3 + 2.

The data is synthetic: sequences that count up from a random token in steps
of 1-3, of random lengths padded to SEQ_LEN, which a two-layer GPT-2 learns
within a few hundred steps.
"""
from __future__ import annotations

import torch
from torch import nn

from autofit.model_io import count_labels

VOCAB_SIZE = 128
SEQ_LEN = 16
N_LAYERS = 2
D_MODEL = 64
N_HEADS = 2


def build_model() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB_SIZE, n_positions=SEQ_LEN, n_embd=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False,  # training keeps no key/value cache
    )
    return GPT2LMHeadModel(config)


count_items = count_labels(shift=True)
"""Tokens the model's loss averages over: labels other than -100, less the first of each sequence."""


def padded_batch(batch_size: int, *, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Counting sequences of random lengths, right-padded; padding has mask 0 and label -100."""
    start = torch.randint(0, VOCAB_SIZE, (batch_size, 1), generator=generator)
    step = torch.randint(1, 4, (batch_size, 1), generator=generator)
    tokens = (start + step * torch.arange(SEQ_LEN)) % VOCAB_SIZE  # (B, T)
    lengths = torch.randint(SEQ_LEN // 2, SEQ_LEN + 1, (batch_size, 1), generator=generator)
    mask = (torch.arange(SEQ_LEN) < lengths).long()  # (B, T)
    tokens = tokens * mask
    return {"input_ids": tokens, "attention_mask": mask, "labels": tokens.masked_fill(mask == 0, -100)}


def example_batch(batch_size: int):
    return padded_batch(batch_size), None


class CountingSequences(torch.utils.data.Dataset):
    """Samples are dicts holding their labels: the loop calls model(**batch)."""

    def __init__(self, samples: int, *, seed: int) -> None:
        self.batch = padded_batch(samples, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.batch["input_ids"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self.batch.items()}


def train_dataset() -> torch.utils.data.Dataset:
    return CountingSequences(512, seed=0)


def val_dataset() -> torch.utils.data.Dataset:
    return CountingSequences(128, seed=1)
