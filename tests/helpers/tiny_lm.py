"""A tiny Llama-style model directory with its own tokenizer, built offline (for hf:DIR tests).

``tiny_lm_dir(path)`` writes ``config.json`` (LlamaConfig: hidden 32, 2 layers, unless asked), the
model's weights (``save_pretrained``) and a WordLevel tokenizer trained with the
``tokenizers`` library on ``CORPUS`` (``PreTrainedTokenizerFast`` with EOS and pad
tokens), all in one folder. The ``tiny_lm`` fixture in ``tests/conftest.py`` makes one per session.
"""
from __future__ import annotations

from pathlib import Path

WORDS = "the a cat dog bird sat ran flew on under over mat log tree and then slept quickly slowly".split()


def corpus_lines(count: int = 200, *, seed: int = 0) -> list[str]:
    """Short sentences over ``WORDS`` with a learnable order (subject, verb, place)."""
    import random

    generator = random.Random(seed)
    lines = []
    for _ in range(count):
        subject, verb, place = generator.choice(WORDS[2:5]), generator.choice(WORDS[5:8]), generator.choice(WORDS[11:14])
        lines.append(f"the {subject} {verb} {generator.choice(WORDS[8:11])} the {place} and then slept")
    return lines


def train_tokenizer(lines: list[str]):
    """A WordLevel tokenizer trained on ``lines``, wrapped for transformers, with <eos>, <pad> and <unk>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["<pad>", "<eos>", "<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def tiny_lm_dir(
    path: str | Path, *, tokenizer: bool = True, weights: bool = True, seed: int = 0, hidden: int = 32, layers: int = 2,
    context: int = 128,
) -> Path:
    """Write a tiny LlamaForCausalLM (and, by default, its tokenizer) to ``path``; returns ``path``. Its MLP is twice
    ``hidden`` wide, with two attention heads and one key-value head; ``context``: its context length."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text_tokenizer = train_tokenizer(corpus_lines())
    config = LlamaConfig(
        vocab_size=len(text_tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=context, eos_token_id=text_tokenizer.eos_token_id,
        pad_token_id=text_tokenizer.pad_token_id, bos_token_id=None, architectures=["LlamaForCausalLM"],
    )
    if weights:
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(path)
    else:  # no model built: a wide one takes seconds to initialise
        config.save_pretrained(path)
    if tokenizer:
        text_tokenizer.save_pretrained(path)
    return path
