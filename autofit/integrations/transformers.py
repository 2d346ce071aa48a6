"""transformers' ``Trainer`` training with a plan: ``AutofitTrainer`` and ``trainer_arguments``.

Much of a plan is the Trainer's own settings (the micro-batch is ``per_device_train_batch_size``, the accumulation
``gradient_accumulation_steps``, the precision ``bf16``/``fp16``, clipping ``max_grad_norm``): ``trainer_arguments``
gives them, and ``AutofitTrainer`` sets them, refusing in one line a ``TrainingArguments`` value that contradicts the
plan. The rest is autofit's own, and ``apply_plan`` (the one owner of the strategies) applies it to the model before
the Trainer sees it: which blocks recompute, offload, the chunked loss, NF4 frozen weights, compile. The optimizer
the Trainer builds (its ``optim``, learning rate and weight-decay groups) is built through the plan
(``AppliedPlan.build_optimizer``), which puts its state on the host or in 8 bits, keeps bf16 weights' fp32 masters on
the host, or steps each parameter in backward.

Micro-batches are weighted by the items their loss averages over (tokens that are not -100, shifted for a causal
LM; else samples): each micro-batch's mean loss times its share of the step's items, so a step's gradient is the
whole batch's mean however the plan splits it. transformers does the same by handing the model
``num_items_in_batch``; a model whose forward autofit replaced (the chunked loss) computes a mean, so this Trainer
weights every loss itself, the same way for every model and for ``compute_loss_func``.

Everything else is the user's Trainer: callbacks, logging, evaluation, ``save_model``, ``push_to_hub``.

Example:
    >>> trainer = AutofitTrainer(model=model, args=TrainingArguments("out", max_steps=10), plan="plan.json",
    ...                          train_dataset=dataset)
    >>> trainer.train()
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers import __version__ as transformers_version

from autofit.apply import AppliedPlan, apply_plan
from autofit.errors import UserError
from autofit.keywords import python_api
from autofit.model_io import IGNORE_INDEX, zero_loss
from autofit.plan_file import Plan, load_plan
from autofit.training.threads import plan_threads
from strategies import MASTER_WEIGHTS, PURE_BF16

logger = logging.getLogger(__name__)

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
"""A ``TrainingArguments`` value equal to its default was not chosen: the plan's replaces it."""
BATCH_SPLIT = ("per_device_train_batch_size", "gradient_accumulation_steps")
"""The arguments that split a step's batch: the plan's to choose, checked together (their product)."""


def as_plan(plan: Plan | str | Path) -> Plan:
    """``plan`` itself, or the plan file at that path (``load_plan``'s one-line errors)."""
    return plan if isinstance(plan, Plan) else load_plan(plan)


def trainer_arguments(plan: Plan | str | Path) -> dict:
    """The plan's values as ``TrainingArguments`` keyword arguments, for scripts that build the arguments themselves.

    ``per_device_train_batch_size`` × ``gradient_accumulation_steps`` is the plan's global batch; ``bf16``/``fp16`` its
    precision (bf16 also for bf16 weights, "bf16-master" and "bf16-pure", which compute under bf16 autocast);
    ``max_grad_norm`` the plan's clipping, or 0 with the step in backward (which cannot clip); ``gradient_checkpointing``
    and ``torch_compile`` False, because the plan decides which blocks recompute and whether to compile, and
    ``AutofitTrainer`` applies both.

    Raises:
        UserError: the plan cannot train under a Trainer (``refusal``), in one line.

    Example:
        >>> args = TrainingArguments("out", learning_rate=2e-5, **trainer_arguments("plan.json"))
    """
    plan = as_plan(plan)
    config = plan.config
    reason = refusal(plan)
    if reason:
        raise UserError(reason)
    values = {
        "per_device_train_batch_size": config.micro_batch_size,
        "gradient_accumulation_steps": config.grad_accum_steps,
        "bf16": config.precision in ("bf16", MASTER_WEIGHTS, PURE_BF16),
        "fp16": config.precision == "fp16",
        "gradient_checkpointing": False,
        "torch_compile": False,
    }
    if config.max_grad_norm is not None:
        values["max_grad_norm"] = config.max_grad_norm
    elif config.optimizer_in_backward:
        values["max_grad_norm"] = 0.0
    return values


def refusal(plan: Plan) -> str | None:
    """Why transformers' Trainer cannot train ``plan``, as one line with the way out; None when it can.

    A plan for several processes shards or wraps the model itself (``apply_plan`` under torchrun), while the Trainer
    wraps it again through accelerate; and a global batch that the micro-batch does not divide ends each step with a
    smaller micro-batch, which the Trainer's data loader (one batch size) cannot give.
    """
    config = plan.config
    if config.world_size > 1:
        return (
            f"AutofitTrainer trains plans for one process, and this plan is for {config.world_size} ({config.sharding}): "
            "the Trainer shards through accelerate, autofit through apply_plan; train it with `autofit train` or your own "
            "loop under torchrun (docs/multi-gpu.md), or re-plan with --gpus 1"
        )
    if config.micro_batch_size * config.grad_accum_steps != config.global_batch_size:
        return (
            f"the plan's micro-batch {config.micro_batch_size} does not divide its global batch {config.global_batch_size}, "
            "and the Trainer's data loader gives every micro-batch the same size; re-plan with a global batch that is a "
            f"multiple of {config.micro_batch_size}"
        )
    return None


def _contradictions(args: TrainingArguments, wanted: dict, *, global_batch_size: int) -> dict:
    """The values ``args`` must take for the plan; one line for a value the user chose that contradicts it.

    The batch split is the plan's to choose: arguments whose per-device batch × accumulation is the plan's global
    batch (the run ``autofit plan --from-trainer-args`` planned) take the plan's split; another global batch is refused.
    """
    micro, steps = (getattr(args, name) for name in BATCH_SPLIT)
    chosen = (micro, steps) != tuple(_DEFAULTS[name] for name in BATCH_SPLIT)
    if chosen and micro * steps != global_batch_size:
        raise UserError(
            f"TrainingArguments per_device_train_batch_size={micro} x gradient_accumulation_steps={steps} is a global "
            f"batch of {micro * steps}, the plan's is {global_batch_size}; leave both out (AutofitTrainer sets "
            f"{wanted['per_device_train_batch_size']} x {wanted['gradient_accumulation_steps']}) or re-plan for your run "
            "(`autofit plan --from-trainer-args`)"
        )
    changes = {name: wanted[name] for name in BATCH_SPLIT if getattr(args, name) != wanted[name]}
    for name, value in wanted.items():
        given = getattr(args, name)
        if name in BATCH_SPLIT or given == value:
            continue
        if given != _DEFAULTS[name]:
            raise UserError(
                f"TrainingArguments {name}={given!r} contradicts the plan's {name}={value!r}; leave {name} out "
                "(AutofitTrainer takes it from the plan) or re-plan for the run you want (`autofit plan --from-trainer-args`)"
            )
        changes[name] = value
    return changes


def loss_items(inputs: dict, *, shifted: bool) -> int | torch.Tensor:
    """What a batch's loss averages over: its labels that are not -100 (after the first token of each sequence for a
    causal LM, which shifts them), or its samples where there are no integer labels."""
    labels = inputs.get("labels") if isinstance(inputs, dict) else None
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
        if shifted and labels.ndim > 1:
            labels = labels[..., 1:]
        return (labels != IGNORE_INDEX).sum()
    tensors = [t for t in (inputs.values() if isinstance(inputs, dict) else inputs) if isinstance(t, torch.Tensor)]
    return len(tensors[0]) if tensors else 1


def shifts_labels(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers causal LM (its loss predicts each label from the tokens before it)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return type(inner).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def _clipping(max_grad_norm: float):
    """A step pre-hook clipping the optimizer's own gradients to ``max_grad_norm`` (``clip_grad_norm_``)."""

    def clip(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)

    return clip


class AutofitTrainer(Trainer):
    """A transformers ``Trainer`` that trains with an autofit plan; otherwise the Trainer, unchanged.

    Args:
        model: the model the plan was made for (with its LoRA adapters for a ``--lora`` plan: a PEFT model); it is
            rewritten in place by ``apply_plan`` before the Trainer sees it.
        args: ``TrainingArguments``; the plan sets ``per_device_train_batch_size``, ``gradient_accumulation_steps``,
            ``bf16``/``fp16`` (``trainer_arguments``). A value left at its default takes the plan's.
        plan: a ``Plan`` or the path of a plan.json.
        **kwargs: the Trainer's own (``train_dataset``, ``data_collator``, ``callbacks``, ...).

    Raises:
        UserError: one line, before anything trains: the plan cannot train under a Trainer (``refusal``), an argument
            contradicts it or trains on another device, the model is not the plan's, a plan with adapters got a model without them, or an
            ``optimizers=`` optimizer for a plan whose levers shape the optimizer.

    Attributes:
        applied: the ``AppliedPlan`` (``applied.config`` is what trains).
    """

    # Each micro-batch's loss is weighted by its share of the step's items (``compute_loss``): the Trainer must not
    # divide it by the accumulation steps again.
    loss_is_scaled_for_ga = True

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None, *, plan: Plan | str | Path,
                 **kwargs) -> None:
        if not hasattr(Trainer, "loss_is_scaled_for_ga"):
            # An older Trainer divides every micro-batch's loss by the accumulation steps again: a wrong gradient.
            raise UserError(f"AutofitTrainer needs transformers 5 or newer (this is {transformers_version}); pip install -U transformers")
        plan = as_plan(plan)
        if model is None:
            raise UserError("AutofitTrainer needs model=: the plan is applied to it (model_init= re-creates it unplanned)")
        wanted = trainer_arguments(plan)
        args = args if args is not None else TrainingArguments(output_dir="trainer_output")
        changes = _contradictions(args, wanted, global_batch_size=plan.config.global_batch_size)
        if changes:
            args = dataclasses.replace(args, **changes)  # __post_init__ again: bf16/fp16 decide mixed_precision there
        if args.device.type != plan.device.type:
            way_out = "pass use_cpu=True" if plan.device.type == "cpu" else f"train where {plan.device.type} is"
            raise UserError(
                f"the plan is for {plan.device.type} and the Trainer trains on {args.device.type}; {way_out}, or re-plan "
                f"with --device {args.device.type}"
            )
        if plan.model.lora and not callable(getattr(model, "get_base_model", None)):
            raise UserError(
                f"the plan trains LoRA adapters ({plan.model.lora}) but the model has none; pass "
                f"peft.get_peft_model(model, config), or autofit.adapters.lora_model(model, parse_lora({plan.model.lora!r}))"
            )
        config = plan.config
        shapes_optimizer = config.updates_on_host or config.optimizer_state != "device" or config.optimizer_in_backward \
            or config.precision == PURE_BF16
        if shapes_optimizer and kwargs.get("optimizers", (None, None))[0] is not None:
            raise UserError(
                f"the plan shapes the optimizer ({config.levers() or config.precision}), so it cannot use one built "
                "before: leave optimizers= out (args.optim and its settings choose the kind) or re-plan without those levers"
            )
        self.plan = plan
        self.applied: AppliedPlan = python_api(apply_plan)(model, plan)
        self._shifted = shifts_labels(self.applied.module)
        super().__init__(self.applied.model, args, **kwargs)
        # The model is never told the step's items (``num_items_in_batch``): it returns its micro-batch's mean, which
        # ``compute_loss`` weights. (A forward autofit replaced, the chunked loss, has no such argument.)
        self.model_accepts_loss_kwargs = False

    def train(self, *args, **kwargs):
        """The Trainer's ``train``, on the CPU with the intra-op threads the plan's speed was timed with (as
        ``autofit train`` does: on a busy machine more threads train several times slower)."""
        with plan_threads(self.plan, say=logger.info):
            return super().train(*args, **kwargs)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer (``args.optim``, its learning rate and weight-decay groups), built through the plan."""
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        if "params" in optimizer_kwargs or not isinstance(optimizer_cls, type):
            raise UserError(
                f"optim={self.args.optim!r} builds its own parameter groups, which autofit cannot shape; "
                "choose an optim such as adamw_torch"
            )
        decay = set(self.get_decay_parameter_names(opt_model))
        # By the model's names: the host state's optimizer is built over host copies, which require no gradient.
        trainable = {name for name, p in self.applied.module.named_parameters() if p.requires_grad}
        weight_decay = self.args.weight_decay

        def build(named_parameters: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
            named = [(name, p) for name, p in named_parameters if name in trainable]
            groups = [
                {"params": [p for name, p in named if name in decay], "weight_decay": weight_decay},
                {"params": [p for name, p in named if name not in decay], "weight_decay": 0.0},
            ]
            return optimizer_cls([g for g in groups if g["params"]], **optimizer_kwargs)

        self.optimizer = self.applied.build_optimizer(build)
        if self.plan.config.updates_on_host:
            # Backward hands each gradient to the host copy the optimizer steps, and the Trainer clears the model's
            # gradients (``model.zero_grad()``), not the optimizer's: the host gradients are cleared after each step,
            # or the next step would add to them.
            self.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: optimizer.zero_grad(set_to_none=True))
            if self.args.max_grad_norm > 0:
                # The Trainer's clipping finds no gradient on the model (it logs grad_norm 0): the same clipping runs
                # here, over the host gradients, before the step.
                self.optimizer.register_step_pre_hook(_clipping(self.args.max_grad_norm))
        return self.optimizer

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The step's micro-batches, and the items their loss averages over (``loss_items``), summed: the weights' denominator."""
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        total = sum(loss_items(batch, shifted=self._shifted) for batch in batch_samples)
        return batch_samples, total

    def compute_loss(self, model: nn.Module, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
        """The Trainer's loss (the model's own, ``compute_loss_func``'s or label smoothing's: a mean over the
        micro-batch); in training, times the micro-batch's share of the step's items."""
        weighted = model.training and num_items_in_batch is not None
        count = loss_items(inputs, shifted=self._shifted) if weighted else None
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=None)
        if weighted:
            # A micro-batch with no counted item adds nothing (its mean would be 0/0).
            loss = zero_loss(outputs) if int(count) == 0 else loss * (count / num_items_in_batch)
        return (loss, outputs) if return_outputs else loss
