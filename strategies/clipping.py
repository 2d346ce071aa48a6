"""Gradient clipping: the global norm of a step's gradients clipped before the optimizer steps."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from strategies.base import Strategy


@dataclass(kw_only=True, slots=True)
class ClippingConfig:
    max_grad_norm: float | None = None
    """Clip the total 2-norm of all gradients to this; None clips nothing (``TrainingConfig`` checks the value)."""


class GradientClipping(Strategy):
    """``torch.nn.utils.clip_grad_norm_``'s arithmetic over the step's accumulated gradients, once per step.

    Under FSDP2 the gradients are DTensor shards: their norm is reduced over
    the ranks (``full_tensor``) and each rank scales its own shards, as
    torchtitan does. Off (no ``max_grad_norm``) it does nothing.
    """

    def __init__(self, config: ClippingConfig) -> None:
        self.config = config

    def clip(self, parameters: Iterable[torch.Tensor]) -> None:
        """Scale the gradients of ``parameters`` (those the optimizer steps from: ``stepped_parameters``, which for
        host state are the host copies, not the model's) so that their global norm is at most ``max_grad_norm``
        (nothing when off)."""
        if self.config.max_grad_norm is None:
            return
        parameters = [p for p in parameters if p.grad is not None]
        # The same two calls clip_grad_norm_ makes, with the norm of sharded gradients made whole in between.
        total_norm = torch.nn.utils.get_total_norm([p.grad for p in parameters], norm_type=2.0)
        if hasattr(total_norm, "full_tensor"):  # a DTensor: each rank holds a partial norm
            total_norm = total_norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(parameters, self.config.max_grad_norm, total_norm)
