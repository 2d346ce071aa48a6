"""The one owner of the strategies: ``apply_config`` builds every strategy and applies them in one fixed order.

The probe, the planner's memory traces and timings, the per-rank simulation,
``compare`` and training all go through it, so what is measured is what trains.
``apply_plan`` is the same for a plan file, and so can anyone who keeps their
own loop::

    applied = autofit.apply_plan(model, autofit.load_plan("plan.json"))
    optimizer = applied.build_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-3))
    for inputs, targets in loader:                       # one global batch
        for micro_inputs, micro_targets, weight in applied.micro_batches(inputs, targets):
            micro_inputs, micro_targets = micro_inputs.to(applied.device), micro_targets.to(applied.device)
            with applied.forward_context():
                loss = loss_fn(applied.model(micro_inputs), micro_targets) * weight
            applied.backward(loss)
        applied.optimizer_step(optimizer)
        optimizer.zero_grad()

``autofit.step.train_step`` is this loop's body for any batch: dict
or tuple inputs (``model_io.call_model``), a model that returns its own loss,
micro-batches weighted by tokens (``model_io.Loss``).

The hooks do nothing for a strategy that is off (fp32 has no autocast and a
disabled GradScaler), so this code is the same for every plan. The optimizer
comes from ``build_optimizer``, because strategies shape it: its state may live
on the host or in 8 bits, and with the step in backward each parameter steps
from its gradient hook (``optimizer_step`` then finds nothing left to step).

A plan for several processes (``world_size`` > 1) is applied the same way in
each process that ``torchrun --nproc-per-node N`` starts: ``apply_plan`` joins
the process group, shards the model (FSDP2) or wraps it (DDP), and its
``micro_batches`` yield only this rank's share of each global batch, so the
code above does not change. ``.env`` says which rank this process is.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from autofit._torch_private import set_cuda_allocator_settings
from autofit.config import TrainingConfig
from autofit.device import check_device
from autofit.errors import UserError
from autofit.keywords import as_flags
from autofit.model_checks import check_trainable
from autofit.plan_file import Plan, load_plan
from autofit.spec import model_fingerprint, wants_names
from autofit.distributed import DistributedEnv, init_distributed, launched_world_size
from strategies import (
    ActivationOffload,
    BatchSplit,
    BatchSplitConfig,
    CheckpointConfig,
    MASTER_WEIGHTS,
    PURE_BF16,
    Checkpointing,
    ChunkedLoss,
    ChunkedLossConfig,
    ClippingConfig,
    Compile,
    CompileConfig,
    FrozenNF4,
    FrozenNF4Config,
    GradientClipping,
    OffloadConfig,
    OptimizerInBackwardConfig,
    OptimizerState,
    OptimizerStateConfig,
    Precision,
    PrecisionConfig,
    Sharding,
    ShardingConfig,
    stepped_parameters,
    StepInBackward,
    Strategy,
    check_one_mode_per_block,
    resolve_blocks,
    unwrap_model,
)


@dataclass(kw_only=True, slots=True)
class AppliedPlan:
    """A model rewritten for a configuration, and the hooks one training step calls.

    The step calls every hook whatever the configuration: a strategy that is
    off does nothing in it.
    """

    config: TrainingConfig
    """The choices applied; after an out-of-memory error, the smaller micro-batch's (``halve_micro_batch``)."""
    model: nn.Module
    """The model passed in, rewritten in place and moved to ``device``; on several processes
    sharded in place (FSDP2) or wrapped in ``DistributedDataParallel`` (DDP)."""
    precision: Precision
    """Autocast for the forward, GradScaler for backward and step (both off for fp32)."""
    split: BatchSplit
    """Cuts a global batch into weighted micro-batches (this rank's share of it on several processes)."""
    device: torch.device
    env: DistributedEnv
    """This process's rank among ``world_size`` (rank 0 of 1 for a one-device plan)."""
    strategies: tuple[Strategy, ...]
    """Every strategy, in the order they were applied."""
    clipping: GradientClipping = field(default_factory=lambda: GradientClipping(ClippingConfig()))
    """Clips the step's gradients before the optimizer steps (nothing without ``config.max_grad_norm``)."""
    spell: Callable[[str], str] = as_flags
    """How its errors name settings: the command line's flags, or for a caller of ``autofit.apply_plan`` the Python
    API's keywords (``autofit.keywords``)."""

    @property
    def module(self) -> nn.Module:
        """The user's model (``model`` without a DDP wrapper): its own parameter names."""
        return unwrap_model(self.model)

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The GradScaler; a disabled one (scale 1, plain step) unless fp16."""
        return self.precision.scaler

    def forward_context(self) -> AbstractContextManager:
        """The context of one micro-batch's forward and loss: every strategy's, entered in order."""
        contexts = [c for c in (s.forward_context() for s in self.strategies) if not isinstance(c, nullcontext)]
        if len(contexts) <= 1:  # the usual case: no ExitStack per micro-batch
            return contexts[0] if contexts else nullcontext()
        stack = ExitStack()
        for context in contexts:
            stack.enter_context(context)
        return stack

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's weighted loss (scaled for fp16)."""
        self.precision.backward(loss)

    def build_optimizer(self, build: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        """The optimizer over ``model``'s parameters, as the strategies shape it.

        Call it once, after ``apply_config`` (the parameters are final: moved,
        sharded) and before training; pass it to ``optimizer_step``.

        Args:
            build: params -> Optimizer, e.g. a model file's ``build_optimizer``; one whose first argument is
                called ``named_parameters`` gets (name, parameter) pairs instead (names as ``module`` spells
                them), so name-based recipes (no decay for biases and norms) carry over.

        Raises:
            UserError: no parameter of the model trains (an optimizer over none cannot be built).

        Returns:
            ``build``'s optimizer; or, by configuration, the same optimizer run
            on the host (``HostOptimizer``), torchao's 8-bit AdamW with its
            hyper-parameters, or one per parameter stepped in backward
            (``OptimizerInBackward``). Each is a ``torch.optim.Optimizer``
            whose ``param_groups`` a learning-rate scheduler can set.
        """
        check_trainable(self.model)
        if wants_names(build):
            build = _with_names(build, self.module)
        for strategy in self.strategies:
            build = strategy.wrap_optimizer_builder(build)
        return build(list(self.model.parameters()))

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer step, the gradients clipped first (unscaled, for fp16) when the plan clips; False when
        fp16's GradScaler skipped it (inf/nan gradients)."""
        return self.precision.optimizer_step(optimizer, before_step=lambda: self.clipping.clip(stepped_parameters(optimizer)))

    def micro_batches(self, inputs, targets, *, count=None) -> Iterator[tuple[object, object, float]]:
        """Yield (inputs, targets, loss_weight) per micro-batch of this process: ``world_size`` times its share of the
        global batch, so DDP and FSDP2 averaging the ranks' gradients gives the global batch's mean.

        ``count``: ``(inputs, targets) -> items`` the loss averages over (``Loss.count``, e.g.
        tokens that are not padding); the weights are then shares of items, not of samples.
        """
        return self.split.micro_batches(inputs, targets, count=count)

    @property
    def micro_batch_size(self) -> int:
        return self.config.micro_batch_size

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step in this process."""
        return self.split.grad_accum_steps

    def halve_micro_batch(self) -> None:
        """After an out-of-memory error: half the micro-batch, so twice the accumulation.

        ``config`` becomes a new configuration; the global batch, and with it
        the gradient of a step, stays the same.

        Raises:
            UserError: the micro-batch is already 1 sample, the step in backward
                is on (it needs one micro-batch per step), or the plan runs on
                several processes: the other ranks are waiting inside the
                step's collectives, which one rank cannot leave or redo alone.
        """
        if self.env.world_size > 1:
            raise UserError(self.spell(
                f"out of memory on rank {self.env.rank} of {self.env.world_size} at micro-batch {self.micro_batch_size} "
                "(ranks step together: one cannot lower its micro-batch alone); re-plan with a lower --budget "
                f"(what one GPU really has free) for --gpus {self.env.world_size}, or with more --gpus"
            ))
        if self.micro_batch_size == 1:
            raise UserError(self.spell(
                "out of memory with a micro-batch of 1 sample; re-plan with a lower --budget, "
                "more checkpointed blocks or --precision bf16, or free memory on the device"
            ))
        config = self.config.with_micro_batch(self.micro_batch_size // 2)
        split = _batch_split(config, env=self.env, sync=self.split.sync)
        self.strategies = tuple(split if strategy is self.split else strategy for strategy in self.strategies)
        self.config, self.split = config, split


def apply_config(
    model: nn.Module,
    config: TrainingConfig,
    *,
    device: str | torch.device,
    env: DistributedEnv | None = None,
    mesh=None,
    defer_gradient_sync: bool = True,
    use_scaler: bool = True,
    init_scale: float = 2.0**16,
) -> AppliedPlan:
    """Build every strategy of ``config`` and apply them to ``model`` in the one fixed order.

    Longer than the package's other functions on purpose: it reads top to bottom as one ordered story (build the
    strategies, then apply them step by step, each with why it comes where it does), and split it would hide the order.

    Args:
        model: rewritten in place (parameter names and the state_dict do not change).
        config: the strategy choices.
        device: where the model trains (this rank's device on several processes).
        env: this process's place among the ranks; default rank 0 of 1.
        mesh: the ``DeviceMesh`` FSDP2 shards over (default all ranks; the
            per-rank simulation passes one over a fake process group).
        defer_gradient_sync: on several processes, reduce gradients once per step.
        use_scaler: False keeps fp16's GradScaler off (the simulated meter
            cannot run its data-dependent inf check).
        init_scale: fp16's first loss scale; the probe and the timings start
            at 1 so that their few steps step like steady training does.

    Returns:
        An ``AppliedPlan``: the model and the step's hooks.

    Raises:
        UserError: a block name that is not a candidate, or a block in two of
            checkpoint / selective_checkpoint / offload (``config`` refused
            every other impossible choice when it was made).
    """
    device = torch.device(device)
    env = env or DistributedEnv(rank=0, world_size=1, local_rank=0, device=device)
    full = resolve_blocks(model, config.checkpoint)
    selective = resolve_blocks(model, config.selective_checkpoint, what="selective checkpoint")
    offloaded = resolve_blocks(model, config.offload, what="offload")
    check_one_mode_per_block({"checkpoint": full, "selective_checkpoint": selective, "offload": offloaded})
    checkpointing = Checkpointing(CheckpointConfig(blocks=full, selective_blocks=selective))
    offload = ActivationOffload(OffloadConfig(blocks=offloaded), device=env.device)
    chunked_loss = ChunkedLoss(ChunkedLossConfig(chunks=config.loss_chunks))
    sharding = Sharding(
        config.sharding_config(),
        precision=config.precision, device=env.device, mesh=mesh, defer_gradient_sync=defer_gradient_sync,
    )
    precision = Precision(
        PrecisionConfig(precision=config.precision), device_type=env.device.type,
        use_scaler=use_scaler, init_scale=init_scale, sharded_gradients=sharding.sharded,
    )
    optimizer_state = OptimizerState(
        OptimizerStateConfig(optimizer_state=config.optimizer_state), device=env.device,
        master_weights=config.precision == MASTER_WEIGHTS, pure_bf16=config.precision == PURE_BF16,
    )
    step_in_backward = StepInBackward(OptimizerInBackwardConfig(enabled=config.optimizer_in_backward))
    clipping = GradientClipping(ClippingConfig(max_grad_norm=config.max_grad_norm))
    compiled = Compile(CompileConfig(enabled=config.compile))
    frozen_nf4 = FrozenNF4(FrozenNF4Config(enabled=config.frozen_nf4))
    # The order is fixed, and each step says why it comes where it does.
    # 1. Checkpointing first: it finds blocks by their module names and patches
    #    their forward; any wrapper applied before it would rename or hide them.
    model = checkpointing.apply(model)
    # 2. Activation offload next, for the same reason: it also patches blocks'
    #    forward by name (a block is checkpointed or offloaded, not both). Its
    #    pack hook leaves parameters where they are, so under FSDP2 the
    #    gathered parameters are never copied to the host.
    model = offload.apply(model)
    # 2b. The chunked output layer and loss: it replaces the model's own forward (the base model, then the head
    #     per chunk), so it comes after the patches inside the base model and before any wrapper (DDP) or
    #     sharding, whose hooks then run around it as around the model's own forward.
    try:
        model = chunked_loss.apply(model)
    except ValueError as error:
        raise UserError(f"--loss-chunks {config.loss_chunks}: {error}; leave --loss-chunks out") from None
    # 2c. With bf16 weights (precision "bf16-master"), the optimizer's state strategy keeps each trained
    #     weight's fp32 master on the host and casts the weight to bf16 ("bf16-pure": the cast alone): before
    #     the move to the device, so the device never holds the fp32 weights (an 8B model's 32 GB would not fit
    #     the 24 GiB card its plan is for; on an H200 the 0.94B decoder's cast there left 2 GiB in the
    #     allocator's cache), and before the optimizer is built over them. A model already on the device is
    #     cast there. One process only (the configuration refuses sharding with either).
    model = optimizer_state.apply(model)
    if any(t.device != env.device for t in [*model.parameters(), *model.buffers()]):
        model = model.to(env.device)  # (fake tensors cannot be moved, even to where they are)
    # 3. Sharding (FSDP2 / DDP; nothing on one process): after checkpointing, so
    #    each sharded unit holds its checkpointed block (the recompute in backward
    #    then gathers the parameters it needs), and before the optimizer is built,
    #    which must see the sharded parameters.
    model = sharding.apply(model)
    # 3b. (Before the move to the device, above: the bf16 weights' cast.)
    # 3c. Frozen weights in NF4 (QLoRA's base): on the device, so they are quantized there, and after 3b, which
    #     casts frozen weights to bf16 under bf16-master (NF4 then dequantizes to bf16). One process only.
    model = frozen_nf4.apply(model)
    # 4. Precision: the forward's autocast and the GradScaler (a sharded one that
    #    agrees across ranks on skipped fp16 steps under FSDP). They shape the
    #    step, not the model, so they wrap whatever the steps above produced.
    # 5. The optimizer's state, then the step in backward: they shape the
    #    optimizer ``AppliedPlan.build_optimizer`` builds later, over the final
    #    (moved, sharded) parameters. The step in backward comes second because
    #    it builds one optimizer per parameter with whatever the state's choice built.
    # 6. Gradient clipping acts in the optimizer step, after precision's unscale and before the step: it needs
    #    the step's whole (unscaled, under FSDP2 sharded) gradients, which is why the step in backward excludes it.
    # 7. Batch split last: it only decides how a global batch reaches the model;
    #    on several processes each rank takes its share, and gradients are
    #    reduced once, after the last micro-batch (the sharding's sync).
    split = _batch_split(config, env=env, sync=sharding.sync)
    # 8. Compile very last: what it compiles is the forward every step above shaped (the checkpointed blocks, the
    #    chunked loss, the bf16 weights); in place, so the model's names and state_dict stay.
    model = compiled.apply(model)
    strategies = (
        checkpointing, offload, chunked_loss, sharding, precision, optimizer_state, frozen_nf4, step_in_backward, clipping, split,
        compiled,
    )
    return AppliedPlan(
        config=config, model=model, precision=precision, clipping=clipping, split=split, device=env.device, env=env, strategies=strategies,
    )


def _with_names(build: Callable, module: nn.Module) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """``build`` taking (name, parameter) pairs, as a builder of parameters the strategies can wrap.

    Parameters are named by identity; a strategy that hands ``build`` copies in the same order (the host
    optimizer's) gets them named by position among the trainable ones.
    """
    named = list(module.named_parameters())
    by_id = {id(p): name for name, p in named}
    trainable = [name for name, p in named if p.requires_grad]

    def build_named(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        params = list(params)
        if all(id(p) in by_id for p in params):
            return build([(by_id[id(p)], p) for p in params])
        return build(list(zip(trainable, params)))

    return build_named


def _batch_split(config: TrainingConfig, *, env: DistributedEnv, sync) -> BatchSplit:
    return BatchSplit(
        BatchSplitConfig(global_batch_size=config.global_batch_size, micro_batch_size=config.micro_batch_size),
        rank=env.rank, world_size=env.world_size, sync=sync,
    )


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """Names of the blocks ``apply_config`` made recompute their whole forward in backward."""
    return Checkpointing.applied_blocks(model)


def selectively_checkpointed_blocks(model: nn.Module) -> list[str]:
    """Names of the blocks ``apply_config`` checkpointed selectively."""
    return Checkpointing.applied_selective_blocks(model)


def offloaded_blocks(model: nn.Module) -> list[str]:
    """Names of the blocks whose saved activations ``apply_config`` sends to host memory."""
    return ActivationOffload.applied_blocks(model)


def apply_plan(model: nn.Module, plan: Plan | str | Path, *, device: str | torch.device | None = None) -> AppliedPlan:
    """Apply ``plan`` to ``model`` and return it with the step's hooks.

    Args:
        model: the model the plan was made for; rewritten in place (parameter
            names and the state_dict do not change). On several processes
            every rank passes its own copy; rank 0's weights are the ones trained.
        plan: a ``Plan`` (``autofit.load_plan("plan.json")``), or the path of a plan.json.
        device: where to train; default the plan's device (on several
            processes: GPU ``LOCAL_RANK`` of that type, or the CPU).

    Returns:
        An ``AppliedPlan``: ``.model``, ``.forward_context()``, ``.backward(loss)``,
        ``.optimizer_step(optimizer)``, ``.micro_batches(inputs, targets)``, ``.device``, ``.env``.

    Raises:
        UserError: the plan was made for another model (its fingerprint differs),
            asks for a device this process cannot use, or for another number of
            processes than torchrun started.

    Example:
        >>> applied = apply_plan(model, load_plan("plan.json"))
        >>> with applied.forward_context():
        ...     output = applied.model(inputs)
    """
    plan = plan_argument(model, plan)
    expected = plan.model.fingerprint
    actual = model_fingerprint(model)
    if expected and expected != actual:
        raise UserError(
            f"the plan was made for another model (fingerprint {expected}, this model's is {actual}: "
            f"parameter names or shapes differ); re-plan with `autofit plan` for this model"
        )
    device = torch.device(device or plan.device.type)
    config = plan.config
    check_device(device.type, precision=config.precision)
    use_plan_allocator(plan, device=device)
    env = _join_processes(config.sharding_config(), device=device)
    return apply_config(model, config, device=env.device, env=env)


def plan_argument(model, plan) -> Plan:
    """``apply_plan``'s arguments checked: a module, and a ``Plan`` or the path of a plan.json (read, as ``fit``'s
    ``plan=`` is).

    Raises:
        UserError: naming the argument, what it got and the way out.
    """
    if not isinstance(model, nn.Module):
        raise UserError(f"apply_plan's model must be a torch.nn.Module, got {type(model).__name__}; pass the model the plan was made for")
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        return load_plan(plan)
    way = (
        "make it a Plan first with autofit.plan_file.plan_from_dict" if isinstance(plan, dict)
        else "pass autofit.load_plan('plan.json'), its path, or the Plan autofit.plan() returned"
    )
    raise UserError(f"apply_plan's plan must be a Plan or a plan.json path, got {type(plan).__name__}; {way}")


def use_plan_allocator(plan: Plan, *, device: torch.device) -> None:
    """On a GPU, the CUDA allocator settings the plan's peaks were measured or estimated with
    (``device.allocator_settings``), for the segments reserved from here on; nothing for a plan that names none."""
    if device.type == "cuda" and plan.device.allocator_settings:
        set_cuda_allocator_settings(plan.device.allocator_settings)


def _join_processes(config: ShardingConfig, *, device: torch.device) -> DistributedEnv:
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
