"""One optimizer step over a global batch: the code the probe measures and the loop runs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autofit._torch_private import tree_map
from autofit.apply import AppliedPlan


@dataclass(slots=True)
class StepResult:
    loss: torch.Tensor
    """Mean loss over the global batch (detached, still on the device: no sync)."""
    stepped: bool
    """False when fp16's GradScaler skipped the step (inf/nan gradients)."""


def to_device(tree, device: torch.device | str):
    """Copy a batch to the device. On the CPU too, so memory counts the same as on a GPU."""
    if isinstance(tree, torch.Tensor):  # the usual case, without tree_map's 20 µs
        return tree.to(device, copy=True, non_blocking=True)
    return tree_map(lambda t: t.to(device, copy=True, non_blocking=True) if isinstance(t, torch.Tensor) else t, tree)


def train_step(applied: AppliedPlan, inputs, targets, *, loss_fn, optimizer: torch.optim.Optimizer) -> StepResult:
    """Forward and backward every micro-batch, then one optimizer step.

    ``inputs``/``targets`` are the whole global batch on the host; each
    micro-batch is copied to the device only when it is used. Every strategy
    acts through ``applied``'s hooks; this code never asks which are on.
    """
    total_loss = None
    for micro_inputs, micro_targets, weight in applied.micro_batches(inputs, targets):
        micro_inputs, micro_targets = to_device(micro_inputs, applied.device), to_device(micro_targets, applied.device)
        with applied.forward_context():
            output = applied.model(micro_inputs)
            loss = loss_fn(output, micro_targets).float()
            if weight != 1.0:  # one micro-batch: x 1.0 is exact, and one kernel less
                loss = loss * weight
        applied.backward(loss)
        total_loss = loss.detach() if total_loss is None else total_loss + loss.detach()
    stepped = applied.optimizer_step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=total_loss, stepped=stepped)
