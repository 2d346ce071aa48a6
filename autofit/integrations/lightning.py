"""Lightning training with a plan: ``AutofitCallback`` and ``trainer_settings``.

A callback rather than a strategy: Lightning's strategy is where it places and wraps the model (one device, DDP,
FSDP), and a plan for one process needs none of that changed. What the plan needs happens at hooks a callback has:
``setup`` runs before Lightning configures the optimizers, so the plan's strategies are applied to the model there
(through ``apply_plan``, the one owner of the strategies) and the module's ``configure_optimizers`` is wrapped so
that its optimizer is rebuilt through the plan's levers; ``on_train_start`` sees the training DataLoader, whose
batch size must be the plan's micro-batch. A strategy would also have to be the user's choice of strategy.

Lightning's own settings carry the rest of the plan: ``precision`` ("32-true", "bf16-mixed", "16-mixed"),
``accumulate_grad_batches`` and ``gradient_clip_val`` (``trainer_settings``); the callback sets the accumulation
when it was left at 1 and refuses, in one line, a value that contradicts the plan.

Micro-batches: Lightning divides each micro-batch's loss by ``accumulate_grad_batches``, equal weights, which is
exact for a loss that is a mean over samples when every micro-batch has the plan's size. A loss averaged over
tokens would need weights by items, which Lightning has no hook for: ``autofit.apply_plan`` in your own loop weights
by items.

Example:
    >>> callback = AutofitCallback("plan.json")
    >>> trainer = lightning.Trainer(callbacks=[callback], **trainer_settings("plan.json"))
    >>> trainer.fit(module, DataLoader(dataset, batch_size=callback.plan.config.micro_batch_size))
"""
from __future__ import annotations

import functools
import inspect
import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from autofit.apply import AppliedPlan, apply_plan
from autofit.errors import UserError
from autofit.keywords import python_api
from autofit.plan_file import Plan, load_plan
from autofit.training.threads import plan_threads
from strategies import MASTER_WEIGHTS, PURE_BF16

logger = logging.getLogger(__name__)

PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
"""A plan's precision as Lightning's ``precision`` names it."""


def as_plan(plan: Plan | str | Path) -> Plan:
    """``plan`` itself, or the plan file at that path (``load_plan``'s one-line errors)."""
    return plan if isinstance(plan, Plan) else load_plan(plan)


def refusal(plan: Plan) -> str | None:
    """Why Lightning cannot train ``plan`` through ``AutofitCallback``, as one line with the way out; None when it can.

    A plan for several processes shards or wraps the model itself (``apply_plan`` under torchrun) where Lightning's
    strategy would wrap it again; bf16 weights (bf16-master, bf16-pure) are autofit's own cast, which Lightning's
    precision plugins do not know (its "bf16-true" casts every weight, with no fp32 master); and a global batch the
    micro-batch does not divide would need a smaller last micro-batch, which one DataLoader batch size cannot give.
    """
    config = plan.config
    if config.world_size > 1:
        return (
            f"AutofitCallback trains plans for one process, and this plan is for {config.world_size} ({config.sharding}): "
            "Lightning's strategy would wrap what apply_plan shards; train it with `autofit train` or your own loop under "
            "torchrun (docs/multi-gpu.md), or re-plan with --gpus 1"
        )
    if config.precision in (MASTER_WEIGHTS, PURE_BF16):
        return (
            f"precision {config.precision} keeps bf16 weights that Lightning's precision plugins do not know; "
            "re-plan with --precision bf16 (Lightning's bf16-mixed) or fp32"
        )
    if config.micro_batch_size * config.grad_accum_steps != config.global_batch_size:
        return (
            f"the plan's micro-batch {config.micro_batch_size} does not divide its global batch {config.global_batch_size}, "
            "and one DataLoader batch size gives every micro-batch the same size; re-plan with a global batch that is a "
            f"multiple of {config.micro_batch_size}"
        )
    return None


def trainer_settings(plan: Plan | str | Path) -> dict:
    """The plan's values as ``lightning.Trainer`` keyword arguments: ``precision``, ``accumulate_grad_batches`` and, when
    the plan clips, ``gradient_clip_val``.

    Raises:
        UserError: Lightning cannot train the plan (``refusal``), in one line.

    Example:
        >>> trainer = lightning.Trainer(max_epochs=3, callbacks=[AutofitCallback(plan)], **trainer_settings(plan))
    """
    plan = as_plan(plan)
    reason = refusal(plan)
    if reason:
        raise UserError(reason)
    settings = {"precision": PRECISIONS[plan.config.precision], "accumulate_grad_batches": plan.config.grad_accum_steps}
    if plan.config.max_grad_norm is not None:
        settings["gradient_clip_val"] = plan.config.max_grad_norm
    return settings


class AutofitCallback(Callback):
    """Applies a plan to a LightningModule's model before Lightning configures its optimizer.

    Args:
        plan: a ``Plan`` or the path of a plan.json.
        module: the attribute of the LightningModule that holds the model the plan was made for (e.g. "model"), so
            that the plan's block names and fingerprint are that model's; None (default): the LightningModule itself.

    Raises:
        UserError: one line, before anything trains: Lightning cannot train the plan (``refusal``); the Trainer's
            ``precision``, ``accumulate_grad_batches`` or ``gradient_clip_val`` contradicts it; the training DataLoader's
            batch size is not the plan's micro-batch; the model is not the plan's; or the plan shapes the optimizer and
            ``configure_optimizers`` returns more than its one optimizer (schedulers too: see ``build_optimizer``).

    Attributes:
        plan: the plan.
        applied: the ``AppliedPlan`` once ``setup`` has run.
    """

    def __init__(self, plan: Plan | str | Path, *, module: str | None = None) -> None:
        self.plan = as_plan(plan)
        reason = refusal(self.plan)
        if reason:
            raise UserError(reason)
        self.module = module
        self.applied: AppliedPlan | None = None
        self._threads = ExitStack()

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self.applied is not None:
            return
        self._check_trainer(trainer)
        model = pl_module if self.module is None else getattr(pl_module, self.module, None)
        if not isinstance(model, nn.Module) or not any(True for _ in model.parameters()):
            where = "the LightningModule" if self.module is None else f"its attribute {self.module!r}"
            raise UserError(
                f"AutofitCallback found no model with parameters in {where} at setup; build the model in __init__ "
                "(not configure_model), or name the attribute that holds it: AutofitCallback(plan, module=\"model\")"
            )
        self.applied = python_api(apply_plan)(model, self.plan)
        # On the CPU, the intra-op threads the plan's speed was timed with, until teardown (as `autofit train` does).
        self._threads.enter_context(plan_threads(self.plan, say=logger.info))
        if self.module is not None and self.applied.model is not model:
            setattr(pl_module, self.module, self.applied.model)
        if _shapes_optimizer(self.plan):
            pl_module.configure_optimizers = _rebuilt_through(self, pl_module.configure_optimizers)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._threads.close()  # PyTorch's thread setting back

    def _check_trainer(self, trainer: Trainer) -> None:
        config = self.plan.config
        if trainer.precision != PRECISIONS[config.precision]:
            raise UserError(
                f"Trainer precision={trainer.precision!r} contradicts the plan's precision {config.precision}; pass "
                f"precision={PRECISIONS[config.precision]!r} (autofit.integrations.lightning.trainer_settings(plan))"
            )
        if trainer.accumulate_grad_batches not in (1, config.grad_accum_steps):
            raise UserError(
                f"Trainer accumulate_grad_batches={trainer.accumulate_grad_batches} contradicts the plan's "
                f"{config.grad_accum_steps} (micro-batches of {config.micro_batch_size} in its global batch "
                f"{config.global_batch_size}); leave it out or pass {config.grad_accum_steps}"
            )
        trainer.accumulate_grad_batches = config.grad_accum_steps
        clip = trainer.gradient_clip_val
        if config.optimizer_in_backward and clip:
            raise UserError(
                f"Trainer gradient_clip_val={clip} cannot clip a plan whose optimizer steps in backward (each parameter "
                "steps before the global norm is known); leave it out or re-plan without the step in backward"
            )
        if config.max_grad_norm is not None and clip != config.max_grad_norm:
            raise UserError(
                f"Trainer gradient_clip_val={clip} contradicts the plan's max_grad_norm {config.max_grad_norm}; "
                f"pass gradient_clip_val={config.max_grad_norm}"
            )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loader = trainer.train_dataloader
        batch_size = getattr(loader, "batch_size", None)
        if batch_size is None:
            batch_size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        micro = self.plan.config.micro_batch_size
        if batch_size is not None and batch_size != micro:
            raise UserError(
                f"the training DataLoader's batch_size {batch_size} is not the plan's micro-batch {micro}; make it "
                f"DataLoader(..., batch_size={micro}): Lightning accumulates {self.plan.config.grad_accum_steps} of them "
                f"into the plan's global batch {self.plan.config.global_batch_size}"
            )

    def build_optimizer(self, build) -> torch.optim.Optimizer:
        """The optimizer ``build`` (params -> Optimizer) makes, as the plan's levers shape it: for a
        ``configure_optimizers`` that also returns learning-rate schedulers, which must see this optimizer.

        Example:
            >>> def configure_optimizers(self):
            ...     optimizer = callback.build_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-3))
            ...     return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 10)}
        """
        if self.applied is None:
            raise UserError("AutofitCallback.build_optimizer is for configure_optimizers: the plan is applied at setup, before it")
        return _closure_first(self.applied.build_optimizer(build))


def _shapes_optimizer(plan: Plan) -> bool:
    """Whether the plan's levers decide the optimizer (its state on the host or in 8 bits, the step in backward)."""
    return plan.config.optimizer_state != "device" or plan.config.optimizer_in_backward


def _rebuilt_through(callback: AutofitCallback, configure_optimizers):
    """``configure_optimizers`` whose one optimizer is rebuilt through the plan (same kind, groups, hyper-parameters)."""

    @functools.wraps(configure_optimizers)
    def configure() -> object:
        result = configure_optimizers()
        if getattr(result, "autofit_built", False):
            return result
        if not isinstance(result, torch.optim.Optimizer):
            raise UserError(
                f"the plan shapes the optimizer ({callback.plan.config.levers()}), and configure_optimizers returned "
                f"{type(result).__name__}; return the optimizer alone, or build it with "
                "callback.build_optimizer(lambda params: ...) before making its schedulers"
            )
        return callback.build_optimizer(_same_optimizer(result, callback.applied.module))

    return configure


def _same_optimizer(optimizer: torch.optim.Optimizer, module: nn.Module):
    """A builder of ``optimizer``'s kind with its groups and hyper-parameters, over the parameters the plan hands it
    (by name: the host state's optimizer gets host copies)."""
    names = {id(p): name for name, p in module.named_parameters()}
    outside = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in names]
    if outside:
        raise UserError(
            f"configure_optimizers optimizes {len(outside)} parameter(s) outside the model the plan is applied to; "
            "name the attribute that holds them all: AutofitCallback(plan, module=...)"
        )
    group_of = {names[id(p)]: index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
    settings = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    # Each group carries every setting; the constructor takes those of its defaults it names (AdamW's defaults hold
    # a "decoupled_weight_decay" its constructor does not take).
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}

    def build(named_parameters: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        groups = [dict(setting, params=[]) for setting in settings]
        for name, param in named_parameters:
            if name in group_of:
                groups[group_of[name]]["params"].append(param)
        return type(optimizer)([group for group in groups if group["params"]], **defaults)

    return build


def _closure_first(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` whose ``step(closure)`` runs the closure first: Lightning's step runs the forward and backward
    inside it, and the host state's and the step in backward's optimizers take no closure."""
    step = optimizer.step

    def step_after_closure(closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step()
        return loss

    optimizer.step = step_after_closure
    optimizer.autofit_built = True
    return optimizer
