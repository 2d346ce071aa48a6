"""One optimizer step over a global batch: the code the probe measures and the loop runs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autofit._torch_private import tree_map
from autofit.apply import AppliedPlan
from autofit.model_io import as_loss, call_model


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

    Args:
        inputs: a tensor, a tuple/list (``model(*x)``) or a dict (``model(**x)``).
        targets: what ``loss_fn`` compares the output with; None when the labels
            are in the inputs and the model returns its own loss.
        loss_fn: ``(output, targets) -> loss``, a ``model_io.Loss`` (weights by its
            ``count_items``), or None for the model's own loss.
    """
    loss_fn = as_loss(loss_fn)
    total_loss = None
    for micro_inputs, micro_targets, weight in applied.micro_batches(inputs, targets, count=loss_fn.count):
        micro_inputs, micro_targets = to_device(micro_inputs, applied.device), to_device(micro_targets, applied.device)
        with applied.forward_context():
            output = call_model(applied.model, micro_inputs)
            loss = loss_fn.weighted(output, micro_targets, weight=weight)
        applied.backward(loss)
        total_loss = loss.detach() if total_loss is None else total_loss + loss.detach()
    stepped = applied.optimizer_step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=total_loss, stepped=stepped)
