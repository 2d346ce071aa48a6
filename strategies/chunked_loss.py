"""Chunked output layer and loss: a causal language model's logits never exist whole.

A transformers causal LM computes ``lm_head(hidden)`` for every token, (B, T, V)
logits (with a 128k vocabulary at 2,048 tokens, 1 GiB per sample-batch of 1 in
fp32), upcasts them to fp32 for the cross-entropy, and backward makes their
gradient as large again. Chunked, the head and the loss run over one chunk of
tokens at a time, each chunk under ``torch.utils.checkpoint``: backward
recomputes that chunk's logits, so at most one chunk's logits and their
gradient are alive. The arithmetic is the model's own loss (transformers'
``ForCausalLMLoss``: labels shifted left, ``-100`` skipped, the mean over the
labels that count), summed per chunk and divided once; a micro-batch with no
label that counts has loss 0 where the model's own would be 0/0.

Which models: transformers ``...ForCausalLM`` / ``...LMHeadModel`` of a model
type whose forward is the base model, then the output layer on its last
hidden state and nothing else (``CHUNKABLE_MODEL_TYPES``; heads with logit
soft-capping or scaling are not). ``chunkable`` says why not for any other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from strategies.base import Strategy

IGNORE_INDEX = -100
"""The label the loss skips (transformers' and PyTorch's)."""

DEFAULT_LOSS_CHUNKS = 8
"""Chunks the planner tries (torchtune's CEWithChunkedOutputLoss uses 8)."""

CHUNKABLE_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gpt2", "phi3", "olmo", "olmo2", "starcoder2", "gpt_neox", "smollm3",
})
"""transformers model types whose causal-LM forward is ``head(base(...).last_hidden_state)`` and the shifted
cross-entropy: chunking them computes the same loss."""


@dataclass(kw_only=True, slots=True)
class ChunkedLossConfig:
    chunks: int = 1
    """Chunks of tokens the output layer and the loss run over (1: the model's own forward, unchanged)."""


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside: under PEFT's adapters (``get_base_model``), the causal LM they were added to,
    whose forward PEFT calls with the labels; else ``model`` itself."""
    inner = getattr(model, "get_base_model", None)
    return inner() if callable(inner) else model


def chunkable(model: nn.Module) -> str | None:
    """Why ``model``'s output layer and loss cannot be chunked, as the rest of a sentence; None when they can."""
    model = causal_lm(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    name = type(model).__name__
    if model_type is None or not (name.endswith("ForCausalLM") or name.endswith("LMHeadModel")):
        return "is for transformers causal language models (hf: --task causal-lm)"
    if model_type not in CHUNKABLE_MODEL_TYPES:
        return (
            f"is not known to compute the same loss for model type {model_type!r} (it covers "
            f"{', '.join(sorted(CHUNKABLE_MODEL_TYPES))})"
        )
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or getattr(model, "base_model", model) is model:
        return f"needs a linear output layer after a base model, which {name} does not have"
    return None


class ChunkedLoss(Strategy):
    """The output layer and the loss per chunk of tokens, recomputed in backward (off with 1 chunk)."""

    def __init__(self, config: ChunkedLossConfig) -> None:
        self.config = config

    def apply(self, model: nn.Module) -> nn.Module:
        if self.config.chunks <= 1:
            return model
        reason = chunkable(model)
        if reason is not None:
            raise ValueError(f"a chunked loss {reason}")
        # The instance's forward: FSDP2's and DDP's wrappers and hooks call it as they call the class's (and PEFT's
        # adapters call the causal LM's).
        inner = causal_lm(model)
        inner.forward = _ChunkedForward(inner, self.config.chunks)
        return model


class _ChunkedForward:
    """``model.forward`` with the output layer and the loss chunked; without labels, the model's own forward."""

    def __init__(self, model: nn.Module, chunks: int) -> None:
        self.own_forward = model.forward
        self.base = model.base_model
        self.head = model.get_output_embeddings()
        self.chunks = chunks

    def __call__(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        if labels is None:  # nothing to score: logits, as the model gives them
            return self.own_forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = self.base(input_ids=input_ids, attention_mask=attention_mask, **kwargs)[0]
        loss = chunked_causal_loss(hidden, labels, self.head, chunks=self.chunks)
        return CausalLMOutputWithPast(loss=loss)


def chunked_causal_loss(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module, *, chunks: int) -> torch.Tensor:
    """The mean cross-entropy of ``head(hidden)`` against ``labels`` shifted left (``-100`` skipped), per chunk.

    Args:
        hidden: (B, T, H) the base model's last hidden state.
        labels: (B, T) the tokens (``-100`` where nothing is predicted).
        head: the output layer, (.., H) -> (.., V).
        chunks: how many chunks of the B·T tokens (fewer when there are fewer tokens).
    """
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    total = None
    for part, targets in zip(flat.chunk(chunks), shifted.chunk(chunks)):
        value = checkpoint(_chunk_loss_sum, part, targets, head, use_reentrant=False)
        total = value if total is None else total + value
    count = (shifted != IGNORE_INDEX).sum()
    return total / count.clamp(min=1)


def _chunk_loss_sum(hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """One chunk's summed cross-entropy, its logits upcast to fp32 as transformers' loss does."""
    return F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
