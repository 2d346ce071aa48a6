"""``apply_plan``: the one place that applies a plan's strategies, in one fixed order.

The shared loop uses it, and so can anyone who keeps their own loop::

    applied = autofit.apply_plan(model, autofit.load_plan("plan.json"))
    optimizer = torch.optim.AdamW(applied.model.parameters())
    for inputs, targets in loader:                       # one global batch
        for micro_inputs, micro_targets, weight in applied.micro_batches(inputs, targets):
            micro_inputs, micro_targets = micro_inputs.to(applied.device), micro_targets.to(applied.device)
            with applied.autocast():
                loss = loss_fn(applied.model(micro_inputs), micro_targets) * weight
            applied.scaler.scale(loss).backward()
        applied.scaler.step(optimizer)
        applied.scaler.update()
        optimizer.zero_grad()

The scaler is a disabled GradScaler unless the plan says fp16, so this code is
the same for every precision.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from autofit.errors import UserError
from autofit.plan_file import Plan
from autofit.probing import check_precision_supported
from autofit.spec import model_fingerprint
from strategies import BatchSplit, BatchSplitConfig, CheckpointConfig, Checkpointing, Precision, PrecisionConfig


@dataclass(kw_only=True, slots=True)
class AppliedPlan:
    """A model rewritten for a plan, and the helpers one training step needs."""

    model: nn.Module
    """The model passed in, rewritten in place and moved to ``device``."""
    precision: Precision
    """Autocast for the forward, GradScaler for backward and step (both off for fp32)."""
    split: BatchSplit
    """Cuts a global batch into weighted micro-batches."""
    device: torch.device

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The plan's GradScaler; a disabled one (scale 1, plain step) unless fp16."""
        return self.precision.scaler

    def autocast(self) -> AbstractContextManager:
        """The forward's autocast context (a null context for fp32)."""
        return self.precision.forward_context()

    def micro_batches(self, inputs, targets) -> Iterator[tuple[object, object, float]]:
        """Yield (inputs, targets, loss_weight) per micro-batch; the weights sum to 1."""
        return self.split.micro_batches(inputs, targets)

    @property
    def micro_batch_size(self) -> int:
        return self.split.config.micro_batch_size

    @property
    def grad_accum_steps(self) -> int:
        return self.split.config.grad_accum_steps

    def halve_micro_batch(self) -> None:
        """After an out-of-memory error: half the micro-batch, so twice the accumulation.

        The global batch, and with it the gradient of a step, stays the same.

        Raises:
            UserError: the micro-batch is already 1 sample.
        """
        config = self.split.config
        if config.micro_batch_size == 1:
            raise UserError(
                "out of memory with a micro-batch of 1 sample; re-plan with a lower --budget, "
                "more checkpointed blocks or --precision bf16, or free memory on the device"
            )
        self.split = BatchSplit(
            BatchSplitConfig(global_batch_size=config.global_batch_size, micro_batch_size=config.micro_batch_size // 2)
        )


def apply_plan(model: nn.Module, plan: Plan, *, device: str | torch.device | None = None) -> AppliedPlan:
    """Apply ``plan`` to ``model`` and return it with the step helpers.

    Args:
        model: the model the plan was made for; rewritten in place (parameter
            names and the state_dict do not change).
        plan: a ``Plan`` (``autofit.load_plan("plan.json")``).
        device: where to train; default the plan's device.

    Returns:
        An ``AppliedPlan``: ``.model``, ``.autocast()``, ``.scaler``,
        ``.micro_batches(inputs, targets)``, ``.device``.

    Raises:
        UserError: the plan was made for another model (its fingerprint differs),
            asks for a device or sharding this process cannot run.

    Example:
        >>> applied = apply_plan(model, load_plan("plan.json"))
        >>> with applied.autocast():
        ...     output = applied.model(inputs)
    """
    expected = plan.model.get("fingerprint")
    actual = model_fingerprint(model)
    if expected and expected != actual:
        raise UserError(
            f"the plan was made for another model (fingerprint {expected}, this model's is {actual}: "
            f"parameter names or shapes differ); re-plan with `autofit plan` for this model"
        )
    device = torch.device(device or plan.device.get("type") or "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("the plan is for a CUDA device, but none is visible; re-plan with --device cpu or train on a GPU machine")
    if plan.world_size != 1 or plan.sharding != "none":
        raise UserError(
            f"the plan shards over {plan.world_size} processes ({plan.sharding}); this autofit trains on one device: "
            "re-plan for a single device"
        )
    check_precision_supported(plan.precision, device.type)

    # The order is fixed, and each step says why it comes where it does.
    # 1. Checkpointing first: it finds blocks by their module names and patches
    #    their forward; any wrapper applied before it would rename or hide them.
    model = Checkpointing(CheckpointConfig(blocks=list(plan.checkpoint))).apply(model)
    model = model.to(device)
    # 2. Sharding (FSDP2 / DDP) goes here when a plan has world_size > 1: after
    #    checkpointing, so each sharded unit holds its checkpointed block (the
    #    recompute in backward then gathers the parameters it needs), and before
    #    the optimizer is built, which must see the sharded parameters.
    # 3. Precision: the forward's autocast and the GradScaler. They shape the
    #    step, not the model, so they wrap whatever the steps above produced.
    precision = Precision(PrecisionConfig(precision=plan.precision), device_type=device.type)
    # 4. Batch split last: it only decides how a global batch reaches the model.
    split = BatchSplit(BatchSplitConfig(global_batch_size=plan.global_batch_size, micro_batch_size=plan.micro_batch_size))
    return AppliedPlan(model=model, precision=precision, split=split, device=device)
