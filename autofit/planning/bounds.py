"""Bounds a plan can check from sizes alone, before anything is traced.

A GPU plan keeps the model's state either on the device (its weights and optimizer state there, the gradients
stepped away in backward at best) or on the host (host optimizer state and bf16 masters: the trained weights'
fp32 copies, their gradients and the optimizer's state, all on the host). Where neither place can hold it, no
configuration can fit, whatever the activations do: the plan says so in seconds, not after its traces.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from strategies import PURE_BF16
from strategies.optimizer_state import held_weight_bytes
from autofit.errors import UserError
from autofit.planning.context import PlanContext, meta_model_of
from autofit.spec import wants_names
from autofit.units import format_bytes

EIGHT_BIT_STATE_SHARE = 0.25
"""8-bit optimizer state over fp32 state: one byte of each four (block scales left out: a lower bound)."""
BF16_STATE_SHARE = 0.5
"""bf16-pure's optimizer state over fp32 state: the state takes the weights' bf16."""


@dataclass(frozen=True, kw_only=True)
class StateSizes:
    """The model's state in bytes, counted on the meta device (no memory, no step)."""

    weight_bytes: int
    """Every parameter and buffer as the model holds them."""
    cast_weight_bytes: int
    """The same with the trained weights in bf16 (bf16-master and bf16-pure)."""
    trained_bytes: int
    """The trained parameters in fp32: what host state and bf16 masters copy to the host."""
    state_bytes: int
    """The optimizer's state for the trained parameters, as the model file's optimizer makes it."""

    def device_bytes(self, *, pure_bf16: bool, eight_bit: bool) -> int:
        """The least a configuration that keeps everything on the device holds there (no gradient, no activation)."""
        share = EIGHT_BIT_STATE_SHARE if eight_bit else 1.0
        least = self.weight_bytes + int(self.state_bytes * share)
        if pure_bf16:
            least = min(least, self.cast_weight_bytes + int(self.state_bytes * min(share, BF16_STATE_SHARE)))
        return least

    @property
    def host_bytes(self) -> int:
        """The least a configuration that steps on the host keeps there: fp32 copies, gradients and the state."""
        return 2 * self.trained_bytes + self.state_bytes


def state_sizes(context: PlanContext) -> StateSizes | None:
    """The model's ``StateSizes``, its optimizer stepped once over meta tensors; None where the optimizer cannot
    step there (then nothing is said before the traces, which measure it)."""
    model = meta_model_of(context.spec)
    trained = [p for p in model.parameters() if p.requires_grad]
    try:
        build = context.spec.build_optimizer
        optimizer = build(list(model.named_parameters()) if wants_names(build) else list(model.parameters()))
        for param in trained:
            param.grad = torch.zeros_like(param)
        optimizer.step()
    except Exception:  # a model file's optimizer may do anything a meta tensor cannot; the traces will say
        return None
    state = [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return StateSizes(
        weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()) + buffers,
        cast_weight_bytes=held_weight_bytes(model, cast=True) + buffers,
        trained_bytes=sum(p.numel() * 4 for p in trained),
        state_bytes=sum(t.numel() * t.element_size() for t in state if t.dim() > 0),
    )


def check_state_fits(context: PlanContext, *, allow_lossy_optimizer: bool, allow_lossy_base: bool) -> None:
    """Refuse a GPU plan whose state fits neither the device nor the host (``StateSizes``), naming the bytes
    and the flags that change them.

    Raises:
        UserError: the least the device and the host would each need are both more than they have.
    """
    if context.device != "cuda" or context.host_budget_bytes is None or allow_lossy_base:
        return  # the CPU is its own host; NF4 weights are sized by their traces
    sizes = state_sizes(context)
    if sizes is None or not sizes.trained_bytes:
        return
    device = sizes.device_bytes(pure_bf16=PURE_BF16 in context.precisions, eight_bit=allow_lossy_optimizer)
    if device <= context.budget_bytes or sizes.host_bytes <= context.host_budget_bytes:
        return
    note = context.host_budget_note
    raise UserError(
        f"no configuration fits: on the device the weights and optimizer state alone need {format_bytes(device)}, more than "
        f"--budget {format_bytes(context.budget_bytes)}, and stepped on the host they need {format_bytes(sizes.host_bytes)} of "
        f"host memory at least (fp32 copies, gradients and optimizer state), more than the host's "
        f"{format_bytes(context.host_budget_bytes)} ({note if note.startswith('--') else note.split(' (')[0]}); give "
        "--host-memory for the machine that trains, or train fewer parameters (--lora)"
    )
