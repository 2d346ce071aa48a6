"""A small ALBERT masked language model built from a transformers config (random weights, nothing downloaded).

    pip install 'autofit[hf]'
    autofit probe examples/albert_masked_lm.py -m 8 --list-blocks --simulate
    autofit plan examples/albert_masked_lm.py --budget 10MB --batch-size 16

ALBERT shares one layer across its depth: ``albert.encoder.albert_layer_groups.0``
runs N_LAYERS times in every forward. Each of those calls is a checkpoint
candidate of its own (``albert.encoder.albert_layer_groups.0#0`` to ``#3``),
so a plan can recompute some of the calls and keep the others.

The data is synthetic: counting sequences with 15% of the tokens masked; the
labels are the masked tokens (-100 elsewhere), and AlbertForMaskedLM returns
the mean loss over them.
"""
from __future__ import annotations

import torch
from torch import nn

from autofit.model_io import count_labels

VOCAB_SIZE = 128
SEQ_LEN = 64
N_LAYERS = 4
D_MODEL = 64
N_HEADS = 4
MASK_TOKEN = 1


def build_model() -> nn.Module:
    from transformers import AlbertConfig, AlbertForMaskedLM

    config = AlbertConfig(
        vocab_size=VOCAB_SIZE, embedding_size=32, hidden_size=D_MODEL, num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS, intermediate_size=4 * D_MODEL, max_position_embeddings=SEQ_LEN,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return AlbertForMaskedLM(config)


count_items = count_labels()
"""Tokens the loss averages over: the masked ones (labels other than -100)."""


def masked_batch(batch_size: int, *, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Counting sequences, 15% of their tokens replaced by MASK_TOKEN; the labels are the tokens replaced."""
    start = torch.randint(2, VOCAB_SIZE, (batch_size, 1), generator=generator)
    tokens = 2 + (start + torch.arange(SEQ_LEN)) % (VOCAB_SIZE - 2)  # (B, T), never MASK_TOKEN
    masked = torch.rand(batch_size, SEQ_LEN, generator=generator) < 0.15
    masked[:, 0] = True  # at least one label per sequence
    return {"input_ids": tokens.masked_fill(masked, MASK_TOKEN), "labels": tokens.masked_fill(~masked, -100)}


def example_batch(batch_size: int):
    return masked_batch(batch_size), None


class MaskedSequences(torch.utils.data.Dataset):
    """Samples are dicts holding their labels: the loop calls model(**batch)."""

    def __init__(self, samples: int, *, seed: int) -> None:
        self.batch = masked_batch(samples, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.batch["input_ids"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self.batch.items()}


def train_dataset() -> torch.utils.data.Dataset:
    return MaskedSequences(256, seed=0)


def val_dataset() -> torch.utils.data.Dataset:
    return MaskedSequences(64, seed=1)
