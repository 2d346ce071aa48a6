"""Precision: fp32, bf16 autocast, fp16 autocast with a GradScaler, or bf16 weights with an fp32 master on the host.

"bf16-master" computes as bf16 autocast does, but the device holds the weights in bf16 (2 bytes per
parameter) while an fp32 master copy and the optimizer's state live on the host, where the update runs
(ZeRO-Offload's layout; ``strategies.optimizer_state.MasterWeights``). Its arithmetic is bf16 autocast over
bf16-rounded weights, updated in fp32: a declared precision choice, like bf16 itself.

"bf16-pure" keeps the weights and AdamW's state in bf16 on the device (no master: 2 + 4 bytes per parameter
instead of 4 + 8), updated with stochastic rounding (torchao's AdamW, as torchtune trains): the update loses
what bf16 cannot hold, on average exactly, so it is lossy and searched only with ``--allow-lossy-optimizer``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from autofit.errors import UserError
from strategies.base import Strategy

PrecisionChoice = Literal["fp32", "bf16", "fp16", "bf16-master", "bf16-pure"]
"""A configuration's precision: the closed set the plan file, ``TrainingConfig`` and the CLI share."""
MASTER_WEIGHTS: PrecisionChoice = "bf16-master"
"""bf16 weights on the device, their fp32 master copy and the optimizer's state on the host."""
PURE_BF16: PrecisionChoice = "bf16-pure"
"""bf16 weights and AdamW state on the device, updated with stochastic rounding (torchao): lossy, a declared choice."""
PRECISIONS: tuple[PrecisionChoice, ...] = get_args(PrecisionChoice)
_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, MASTER_WEIGHTS: torch.bfloat16, PURE_BF16: torch.bfloat16}


def precision_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision (None for fp32): the one map from plan names to dtypes."""
    if precision not in _DTYPES:
        raise UserError(f"precision {precision!r} is unknown; choose one of {', '.join(PRECISIONS)}")
    return _DTYPES[precision]


@dataclass(kw_only=True, slots=True)
class PrecisionConfig:
    precision: PrecisionChoice = "fp32"
    """One of "fp32", "bf16" (autocast), "fp16" (autocast + GradScaler) or "bf16-master" (bf16 autocast over bf16
    weights, their fp32 master and the optimizer on the host)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise UserError(f"precision {self.precision!r} is unknown; choose one of {', '.join(PRECISIONS)}")


class Precision(Strategy):
    """Autocast for the forward, loss scaling for backward and step.

    fp32 is the same object with autocast disabled and the scaler disabled, so
    a step never asks which precision it runs.

    Args:
        config: which precision.
        device_type: "cpu" or "cuda".
        use_scaler: False keeps fp16's scaler off (the simulated meter cannot
            run its data-dependent inf check; its memory is a few scalars).
        init_scale: fp16's first loss scale (GradScaler's default 2^16).
        sharded_gradients: each rank holds only a shard of the gradients
            (FSDP2), so an inf on one rank must skip the step on all: fp16
            then uses ``ShardedGradScaler``, which all-reduces what each rank
            found. DDP's gradients are identical on every rank already.
    """

    def __init__(
        self,
        config: PrecisionConfig,
        *,
        device_type: str,
        use_scaler: bool = True,
        init_scale: float = 2.0**16,
        sharded_gradients: bool = False,
    ) -> None:
        self.config = config
        self.device_type = device_type
        self.dtype = precision_dtype(config.precision)
        enabled = config.precision == "fp16" and use_scaler
        if enabled and sharded_gradients:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device_type, init_scale=init_scale)
        else:
            self.scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, enabled=enabled)

    def forward_context(self) -> AbstractContextManager:
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer, *, before_step: Callable[[], None] = lambda: None) -> bool:
        """Step (unless fp16 found inf/nan gradients) and update the scale; ``before_step`` runs on the unscaled
        gradients just before the step (gradient clipping).

        Returns:
            True when the optimizer stepped.
        """
        if not self.scaler.is_enabled():
            before_step()
            optimizer.step()
            return True
        scale_before = self.scaler.get_scale()
        self.scaler.unscale_(optimizer)  # what ``before_step`` sees (a clip) are the true gradients, not the scaled ones
        before_step()
        self.scaler.step(optimizer)
        self.scaler.update()
        # GradScaler lowers the scale exactly when it skipped the step.
        return self.scaler.get_scale() >= scale_before
