"""``autofit.fit``: plan (unless a plan is given), then train with the shared loop."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from autofit.errors import UserError
from autofit.fit_settings import FitKeywords, FitSettings, fit_settings
from autofit.plan_file import Plan, load_plan

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

    from autofit.training.data import TrainData


@dataclass(kw_only=True, slots=True)
class FitResult:
    plan: Plan
    """The plan trained with (its ``history`` lists changes made while training)."""
    history: list[dict]
    """One record per epoch: train_loss, val_loss, val_accuracy, samples_per_s, peak_bytes, ..."""
    best_path: Path | None
    """best.pt (best validation accuracy); load it with ``autofit.training.weights.load_checkpoint``."""
    last_path: Path
    log_dir: Path


def fit(model: nn.Module, settings: FitSettings | None = None, **keywords: Unpack[FitKeywords]) -> FitResult:
    """Fit ``model``'s training into ``budget`` and train it.

    Without ``plan``, it plans first (``autofit.planning.planner.make_plan``): probes
    the model on example batches, searches precision, checkpointing and
    micro-batch size for ``batch_size`` samples per step under ``budget``.

    Args:
        model: the model; trained in place.
        settings: the other arguments as one ``autofit.FitSettings``, each field documented there.
        keywords: ``FitSettings``' fields one by one, over ``settings``' own (or alone): ``train_data`` (needed),
            ``val_data``, ``batch_size`` and ``budget`` (to plan), ``epochs``, ``plan`` (train with it instead of
            planning), ``example_batch``, ``loss_fn``, ``count_items``, ``optimizer``, ``collate``, ``lr``,
            ``schedule``, ``warmup_steps``, ``max_grad_norm``, ``init_from``, ``lora``, ``merge``, ``device``,
            ``input_shape``, ``log_dir``, ``resume``, ``data_changed``, ``overwrite``, ``num_workers``, ``seed``,
            ``max_steps``, ``verbose``.

    A plan for several processes trains when this is called in every process
    of ``torchrun --nproc-per-node N your_script.py``; the process group stays
    joined afterwards (``autofit.distributed.cleanup()`` leaves it).

    Returns:
        A ``FitResult``: ``.plan``, ``.history``, ``.best_path``.

    Raises:
        UserError: a bad or unknown argument, data or plan; the message names it (by its keyword here) and the way out.

    Example:
        >>> result = autofit.fit(model, budget="8GB", train_data=train, val_data=val, batch_size=256, epochs=10)
        >>> result.history[-1]["val_accuracy"], result.best_path
    """
    from autofit.model_io import Loss
    from autofit.spec import default_optimizer
    from autofit.training.run import run_training

    if not isinstance(model, nn.Module):
        raise UserError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    asked = fit_settings(settings, keywords)
    train = asked.train_settings()
    # The run's folder is checked first: its refusal would otherwise come after minutes of planning.
    plan = _given_plan(asked, log_dir=train.log_dir)
    weights_note = _load_weights(model, asked.init_from) if not asked.resume else ""
    model, adapters = _with_adapters(model, asked.lora, plan=plan)
    if asked.merge and adapters is None:
        raise UserError("merge=True merges LoRA adapters into the base, and this run trains none; drop merge, or give lora=...")
    data, shape = _read_data(asked, plan=plan)
    plan = _plan_for(model, plan, asked, data=data, input_shape=shape, adapters=adapters)
    if asked.merge and plan.config.world_size > 1:
        raise UserError("merge=True runs on one process; drop it, and merge the saved adapter with PEFT's merge_and_unload")
    result = run_training(
        model, plan=plan, data=data, source=plan.model.source or f"python:{type(model).__name__}", input_shape=shape,
        loss_fn=Loss(asked.loss_fn, count_items=asked.count_items), build_optimizer=asked.optimizer or default_optimizer,
        settings=train, max_grad_norm=asked.max_grad_norm, weights_note=weights_note,
    )
    return FitResult(plan=result.plan, history=result.history, best_path=result.best_path,
                     last_path=result.last_path, log_dir=result.log_dir)


def _given_plan(asked: FitSettings, *, log_dir: Path | None) -> Plan | None:
    """The plan ``asked`` names (read if a path), or on resume the run's saved one; None to plan. A new run's
    ``log_dir`` that holds a run is refused here, before minutes of planning."""
    plan = load_plan(asked.plan) if isinstance(asked.plan, (str, Path)) else asked.plan
    if asked.resume and plan is None:
        from autofit.plan_file import plan_from_dict
        from autofit.training.resume import read_saved_run

        saved = read_saved_run(log_dir)
        return plan_from_dict(saved["plan"], where=f"the plan saved in {log_dir / 'last.pt'}")
    if not asked.resume and log_dir is not None:
        from autofit.training.rundir import check_fresh_start

        check_fresh_start(log_dir, overwrite=asked.overwrite)
    return plan


def _load_weights(model: nn.Module, init_from) -> str:
    """Load ``init_from`` (a state dict or a path to one) into ``model``; the note the run records ("" without)."""
    if init_from is None:
        return ""
    from autofit.training.weights import load_into, state_dict_from

    where = "init_from" if isinstance(init_from, dict) else str(init_from)
    load_into(model, init_from if isinstance(init_from, dict) else state_dict_from(init_from), where=where)
    return f"from {where}"


def _read_data(asked: FitSettings, *, plan: Plan | None) -> tuple[TrainData, tuple[int, ...] | None]:
    """The datasets (or the image folder ``train_data`` names), and the input shape saved with the weights."""
    from autofit.model_checks import CheckedCollate
    from autofit.training.data import datasets_data, image_folder_data, input_shape_from

    train_data, input_shape = asked.train_data, asked.input_shape
    if isinstance(train_data, (str, Path)):
        if asked.val_data is not None:
            raise UserError(f"train_data is the image folder {str(train_data)!r}: its val/ is the validation data; drop val_data")
        if asked.collate is not None:
            raise UserError(f"train_data is the image folder {str(train_data)!r}, whose images stack; drop collate")
        shape = input_shape_from(input_shape or (plan.model.input_shape if plan else None))
        return image_folder_data(train_data, input_shape=shape), shape
    checked = CheckedCollate(asked.collate, owner="fit()") if asked.collate is not None else None
    return datasets_data(train_data, asked.val_data, collate=checked), (input_shape_from(input_shape) if input_shape else None)


def _plan_for(
    model: nn.Module, plan: Plan | None, asked: FitSettings, *, data: TrainData, input_shape: tuple[int, ...] | None,
    adapters: str | None = None,
) -> Plan:
    """``plan``, or without one a plan for ``asked.batch_size`` samples per step under its ``budget`` (probing ``model``).

    The plan records the model's fingerprint and input shape when it has none.
    """
    from autofit.spec import model_fingerprint

    batch_size = asked.batch_size
    if plan is None:
        if batch_size is None:
            raise UserError("fit() needs batch_size (samples per optimizer step) to plan, or a plan=")
        from autofit.planning.planner import make_plan
        from autofit.planning.request import PlanRequest
        from autofit.spec import spec_from_model

        spec = spec_from_model(
            model, asked.example_batch or _examples_from(data.train, collate=data.collate), loss_fn=asked.loss_fn,
            count_items=asked.count_items, optimizer=asked.optimizer, collate=data.collate,
        )
        request = PlanRequest(budget=asked.budget, batch_size=batch_size, device=asked.device, max_grad_norm=asked.max_grad_norm)
        plan = make_plan(spec, request)
    elif batch_size is not None and batch_size != plan.config.global_batch_size:
        raise UserError(
            f"batch_size {batch_size} differs from the plan's global batch {plan.config.global_batch_size}; "
            "drop batch_size or re-plan for it"
        )
    model_info = plan.model
    if adapters is not None and model_info.lora is None:
        model_info = replace(model_info, lora=adapters)
    if model_info.fingerprint is None:
        model_info = replace(model_info, fingerprint=model_fingerprint(model))
    if input_shape is not None and model_info.input_shape is None:
        model_info = replace(model_info, input_shape=list(input_shape))
    return replace(plan, model=model_info)


def _with_adapters(model: nn.Module, lora: str | None, *, plan: Plan | None) -> tuple[nn.Module, str | None]:
    """``model`` with the LoRA adapters asked for (or its plan's), and their settings' text; (model, None) without."""
    from autofit.adapters import lora_model, parse_lora, planned_lora

    if plan is None:
        settings = parse_lora(lora) if lora is not None else None
    else:
        settings = planned_lora(lora, plan.model.lora, flag="lora=", spell=lambda value: f"lora={value!r}")
    if settings is None:
        return model, None
    from strategies.optimizer_state import quiet_torch_pytree

    # torchao, imported by PEFT: its enums "need no pytree registration"; a caller of fit keeps its own logging after.
    with quiet_torch_pytree():
        return lora_model(model, settings), settings.text()


def _examples_from(dataset, *, collate: Callable | None = None) -> Callable[[int], tuple]:
    """example_batch for the planner: the first ``batch_size`` samples of the dataset (repeated if short), collated
    by ``collate`` (default ``collate_pairs``)."""
    from autofit.training.data import collate_pairs

    def example_batch(batch_size: int) -> tuple:
        return (collate or collate_pairs)([dataset[i % len(dataset)] for i in range(batch_size)])

    return example_batch
