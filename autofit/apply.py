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

A plan for several processes (``world_size`` > 1) is applied the same way in
each process that ``torchrun --nproc-per-node N`` starts: ``apply_plan`` joins
the process group, shards the model (FSDP2) or wraps it (DDP), and its
``micro_batches`` yield only this rank's share of each global batch, so the
code above does not change. ``.env`` says which rank this process is.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from autofit.training.distributed import (
    DistributedConfig,
    DistributedEnv,
    RankSplit,
    gradient_sync,
    init_distributed,
    launched_world_size,
    micro_batch_count,
    shard_model,
    sharded_precision,
    unwrap_model,
)
from autofit.errors import UserError
from autofit.plan_file import Plan
from autofit.measure.probe import check_precision_supported
from autofit.spec import model_fingerprint
from strategies import BatchSplit, BatchSplitConfig, CheckpointConfig, Checkpointing, Precision


@dataclass(kw_only=True, slots=True)
class AppliedPlan:
    """A model rewritten for a plan, and the helpers one training step needs."""

    model: nn.Module
    """The model passed in, rewritten in place and moved to ``device``; on several processes
    sharded in place (FSDP2) or wrapped in ``DistributedDataParallel`` (DDP)."""
    precision: Precision
    """Autocast for the forward, GradScaler for backward and step (both off for fp32)."""
    split: BatchSplit | RankSplit
    """Cuts a global batch into weighted micro-batches (this rank's share of it on several processes)."""
    device: torch.device
    env: DistributedEnv
    """This process's rank among ``world_size`` (rank 0 of 1 for a one-device plan)."""

    @property
    def module(self) -> nn.Module:
        """The user's model (``model`` without a DDP wrapper): its own parameter names."""
        return unwrap_model(self.model)

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
        """Micro-batches per optimizer step in this process."""
        config = self.split.config
        return micro_batch_count(config.global_batch_size, world_size=self.env.world_size, micro_batch_size=config.micro_batch_size)

    def halve_micro_batch(self) -> None:
        """After an out-of-memory error: half the micro-batch, so twice the accumulation.

        The global batch, and with it the gradient of a step, stays the same.

        Raises:
            UserError: the micro-batch is already 1 sample, or the plan runs on
                several processes: the other ranks are waiting inside the
                step's collectives, which one rank cannot leave or redo alone.
        """
        config = self.split.config
        if self.env.world_size > 1:
            raise UserError(
                f"out of memory on rank {self.env.rank} of {self.env.world_size} at micro-batch {config.micro_batch_size} "
                "(ranks step together: one cannot lower its micro-batch alone); re-plan with a lower --budget "
                f"(what one GPU really has free) for --gpus {self.env.world_size}, or with more --gpus"
            )
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
            names and the state_dict do not change). On several processes
            every rank passes its own copy; rank 0's weights are the ones trained.
        plan: a ``Plan`` (``autofit.load_plan("plan.json")``).
        device: where to train; default the plan's device (on several
            processes: GPU ``LOCAL_RANK`` of that type, or the CPU).

    Returns:
        An ``AppliedPlan``: ``.model``, ``.autocast()``, ``.scaler``,
        ``.micro_batches(inputs, targets)``, ``.device``, ``.env``.

    Raises:
        UserError: the plan was made for another model (its fingerprint differs),
            asks for a device this process cannot use, or for another number of
            processes than torchrun started.

    Example:
        >>> applied = apply_plan(model, load_plan("plan.json"))
        >>> with applied.autocast():
        ...     output = applied.model(inputs)
    """
    expected = plan.model.fingerprint
    actual = model_fingerprint(model)
    if expected and expected != actual:
        raise UserError(
            f"the plan was made for another model (fingerprint {expected}, this model's is {actual}: "
            f"parameter names or shapes differ); re-plan with `autofit plan` for this model"
        )
    device = torch.device(device or plan.device.type)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("the plan is for a CUDA device, but none is visible; re-plan with --device cpu or train on a GPU machine")
    check_precision_supported(plan.precision, device.type)
    env = _join_processes(DistributedConfig(world_size=plan.world_size, sharding=plan.sharding), device=device)

    # The order is fixed, and each step says why it comes where it does.
    # 1. Checkpointing first: it finds blocks by their module names and patches
    #    their forward; any wrapper applied before it would rename or hide them.
    model = Checkpointing(CheckpointConfig(blocks=list(plan.checkpoint))).apply(model)
    model = model.to(env.device)
    # 2. Sharding (FSDP2 / DDP; unchanged on one device): after checkpointing, so
    #    each sharded unit holds its checkpointed block (the recompute in backward
    #    then gathers the parameters it needs), and before the optimizer is built,
    #    which must see the sharded parameters.
    model = shard_model(model, sharding=plan.sharding, precision=plan.precision, device=env.device)
    # 3. Precision: the forward's autocast and the GradScaler (one that agrees
    #    across ranks on skipped fp16 steps under FSDP). They shape the step, not
    #    the model, so they wrap whatever the steps above produced.
    precision = sharded_precision(plan.precision, sharding=plan.sharding, device_type=env.device.type)
    # 4. Batch split last: it only decides how a global batch reaches the model;
    #    on several processes each rank takes its share, and gradients are
    #    reduced once, after the last micro-batch.
    config = BatchSplitConfig(global_batch_size=plan.global_batch_size, micro_batch_size=plan.micro_batch_size)
    split = (
        BatchSplit(config) if env.world_size == 1
        else RankSplit(config, rank=env.rank, world_size=env.world_size, sync=gradient_sync(model, sharding=plan.sharding))
    )
    return AppliedPlan(model=model, precision=precision, split=split, device=env.device, env=env)


def _join_processes(config: DistributedConfig, *, device: torch.device) -> DistributedEnv:
    """This process's place: rank 0 of 1 for a one-device plan, else join torchrun's process group."""
    launched = launched_world_size()
    if config.world_size > 1 and launched == 1:
        raise UserError(
            f"the plan trains on {config.world_size} processes ({config.sharding}) but this is one process; start it with "
            f"`torchrun --nproc-per-node {config.world_size} ...` (`autofit train` prints the whole command), "
            "or re-plan for a single device"
        )
    if launched != config.world_size:
        raise UserError(
            f"the plan is for {config.world_size} process(es) but torchrun started {launched}; "
            f"use --nproc-per-node {config.world_size}, or re-plan with --gpus {launched}"
        )
    if config.sharding == "none":
        return DistributedEnv(rank=0, world_size=1, local_rank=0, device=device)
    return init_distributed(device_type=device.type, backend=config.backend)
