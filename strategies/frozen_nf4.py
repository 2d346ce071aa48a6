"""Frozen weights in 4-bit NF4 (QLoRA's base): torchao's ``NF4Tensor`` in place of each frozen linear weight.

An adapter's base (``--lora``) does not train, so its weights need no
gradient or optimizer state, but they are most of the model's bytes. Here
each frozen ``nn.Linear`` weight becomes an NF4 tensor (torchao's
``to_nf4``: 4-bit normal-float codes in blocks of 64, each block's scale
quantized in 8 bits per 256 blocks; about 0.52 bytes per weight against fp32's 4): ``F.linear`` on it
dequantizes the weight for that one product, in forward and again in
backward (torchao's ``linear_nf4``), so the dense weight never stays. The
adapters, and every weight that trains, stay as they were.

It changes the frozen weights (each rounded to one of 16 levels of its block):
a declared, lossy choice (``--allow-lossy-base``), as torchtune's QLoRA
recipes make it. The arithmetic is otherwise plain: a run with it gives the
gradients of a plain run over the dequantized weights
(tests/strategies/test_frozen_nf4.py).

Weights whose element count NF4's blocks do not divide (a multiple of
64 x 256 = 16,384 elements) stay dense, and so does a language model's output
layer (as in torchtune's QLoRA). Applied after the move to the device
(quantized there) and after bf16-master's cast of frozen weights to bf16 (the
NF4 weight then dequantizes to bf16); one process only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autofit.errors import UserError
from strategies.base import Strategy
from strategies.chunked_loss import causal_lm

NF4_BLOCK_ELEMENTS = 64 * 256
"""Elements NF4 quantizes together: blocks of 64 weights, their scales in blocks of 256; a weight's count must divide by it."""


@dataclass(kw_only=True, slots=True)
class FrozenNF4Config:
    enabled: bool = False


def nf4_weights(model: nn.Module) -> list[nn.Linear]:
    """The linear layers whose weight NF4 would hold: frozen, of a size its blocks divide, not shared with another
    module (a tied output layer: its embedding would keep the dense weight beside the NF4 one), and not a language
    model's output layer (as torchtune's QLoRA leaves it: dequantizing its vocabulary-sized weight for every chunk
    of tokens would take several times its bytes at once)."""
    users: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            users[id(param)] = users.get(id(param), 0) + 1
    output = _output_layer(model)
    return [
        module for module in model.modules()
        if isinstance(module, nn.Linear) and not module.weight.requires_grad and module.weight.is_floating_point()
        and module.weight.numel() % NF4_BLOCK_ELEMENTS == 0 and users[id(module.weight)] == 1
        and module.weight is not output
    ]


def _output_layer(model: nn.Module) -> torch.Tensor | None:
    """A transformers model's output layer weight (under PEFT's wrapper too), or None."""
    get = getattr(causal_lm(model), "get_output_embeddings", None)
    layer = get() if callable(get) else None
    return getattr(layer, "weight", None)


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a parameter's data) is torchao's NF4 tensor."""
    return type(tensor).__name__ == "NF4Tensor" or type(getattr(tensor, "data", None)).__name__ == "NF4Tensor"


def nf4_quantizer():
    """torchao's ``to_nf4`` (a dense tensor to its NF4 tensor).

    Raises:
        UserError: torchao is missing.
    """
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        raise UserError("frozen weights in NF4 need torchao: pip install torchao (or 'autofit[hf]')") from None
    return to_nf4


class FrozenNF4(Strategy):
    """Off: the model as it is. On: every frozen linear weight NF4 can take replaced by its NF4 tensor, in place
    (the module and its parameter names stay; the parameter's data is the NF4 tensor)."""

    def __init__(self, config: FrozenNF4Config) -> None:
        self.config = config

    def apply(self, model: nn.Module) -> nn.Module:
        if not self.config.enabled:
            return model
        to_nf4 = nf4_quantizer()
        with torch.no_grad():
            for linear in nf4_weights(model):
                if is_nf4(linear.weight):  # applied again (a smaller micro-batch): once
                    continue
                linear.weight = nn.Parameter(to_nf4(linear.weight.detach()), requires_grad=False)
        return model
