"""``autofit.fit``: plan (unless a plan is given), then train with the shared loop."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from autofit.errors import UserError
from autofit.plan_file import Plan, load_plan

if TYPE_CHECKING:
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


def fit(
    model: nn.Module,
    *,
    train_data,
    val_data=None,
    batch_size: int | None = None,
    budget: str | int = "16GB",
    epochs: int | None = None,
    plan: Plan | str | Path | None = None,
    example_batch: Callable[[int], tuple] | None = None,
    loss_fn: Callable | None = None,
    count_items: Callable | None = None,
    optimizer: Callable | None = None,
    collate: Callable | None = None,
    lr: float | None = None,
    schedule: str | None = None,
    warmup_steps: int | None = None,
    max_grad_norm: float | None = None,
    init_from=None,
    lora: str | None = None,
    merge: bool = False,
    device: str = "cpu",
    input_shape: str | None = None,
    log_dir: str | Path | None = None,
    resume: bool = False,
    data_changed: bool = False,
    overwrite: bool = False,
    num_workers: int | None = None,
    seed: int | None = None,
    max_steps: int | None = None,
    verbose: bool = True,
) -> FitResult:
    """Fit ``model``'s training into ``budget`` and train it.

    Without ``plan``, it plans first (``autofit.planning.planner.make_plan``): probes
    the model on example batches, searches precision, checkpointing and
    micro-batch size for ``batch_size`` samples per step under ``budget``.

    Args:
        model: the model; trained in place.
        train_data: a map-style dataset of (input, target) or of dicts holding
            their labels (transformers' way: ``model(**batch)`` returns the loss), or an image folder
            path holding train/<class>/* and val/<class>/* (then ``val_data``
            is its val/ and ``input_shape`` or the plan gives the image size).
        val_data: a dataset for validation after each epoch (best.pt follows
            its accuracy); None validates nothing.
        batch_size: samples per optimizer step (the global batch); needed to plan.
        budget: memory budget, e.g. "16GB", "512MiB" (ignored with ``plan``).
        epochs: passes over ``train_data`` in all; default 1, or on resume the run's own.
        plan: a Plan or a plan.json path to train with instead of planning; on
            resume the run's saved plan is used (a plan given must train as it does).
        example_batch: batch_size -> (inputs, targets) for the planner's probes;
            default: the first samples of ``train_data``.
        loss_fn: (output, targets) -> loss, a mean or (loss_sum, item_count); default the
            model's own ``output.loss``, else cross-entropy of the output's logits.
        count_items: (inputs, targets) -> items the loss averages over (e.g.
            ``autofit.model_io.count_labels(shift=True)`` for a causal LM's tokens);
            micro-batches are weighted by them. Default: samples.
        optimizer: params -> Optimizer; default AdamW(lr=1e-3).
        collate: samples -> (inputs, targets) for samples that do not stack, whose lists hold one entry per sample
            (torchvision detection: ``lambda s: (tuple(map(list, zip(*s))), None)``, the model called as
            ``model(images, targets)`` and trained on the sum of its loss dict); ``example_batch``'s lists too.
        lr: peak learning rate; default the optimizer's.
        schedule: after the warm-up, "cosine" (default) or "linear" to a tenth of the peak, or "constant".
        warmup_steps: optimizer steps of linear warm-up to the peak rate; default 0.
        max_grad_norm: clip the gradients' global norm to this before each step (``clip_grad_norm_``); planning
            then leaves out the optimizer step in backward, which cannot clip. Default: no clipping (or the plan's).
        init_from: weights to start from: a state dict, or a path to one (.pt, .bin, .safetensors, an autofit
            last.pt/best.pt, a save_pretrained directory); keys and shapes must match ``model``'s.
        lora: LoRA adapters over ``model`` (PEFT), e.g. "r=16,alpha=32,targets=q_proj,v_proj": its weights (after
            ``init_from``) are frozen and the adapters, added to it in place, train (``autofit.adapters``). A plan
            made with adapters brings its own; one given here must be the same.
        merge: with adapters, also save them merged into the base (``log_dir/hf/merged``, loadable with
            ``from_pretrained`` alone); the returned model keeps its adapters.
        device: "cpu" or "cuda", where to plan (and so train).
        input_shape: "CxHxW" images from a folder are resized to.
        log_dir: where metrics, run_plan.json, last.pt and best.pt go; default runs/<time>. One that holds a run
            is refused (before planning) unless ``resume`` or ``overwrite``.
        resume: continue the run in ``log_dir`` from its last.pt, with its saved
            settings (``lr``, ``seed`` given again must equal them).
        data_changed: with ``resume``, train on although the image folder or the datasets' sizes changed since the
            run began (without it, such a resume is refused).
        overwrite: start a new run in a ``log_dir`` that holds one, deleting its
            files once the new run has saved its first checkpoint (without it,
            such a start is refused).
        num_workers: DataLoader worker processes; None: on the CPU the cores the step's threads leave free, on a GPU up to 4.
        seed: fixes the data order and the RNG; default 0, or on resume the run's own.
        max_steps: stop (after saving last.pt) after this many optimizer steps.
        verbose: progress bar and a line per epoch.

    A plan for several processes trains when this is called in every process
    of ``torchrun --nproc-per-node N your_script.py``; the process group stays
    joined afterwards (``autofit.distributed.cleanup()`` leaves it).

    Returns:
        A ``FitResult``: ``.plan``, ``.history``, ``.best_path``.

    Raises:
        UserError: a bad argument, data or plan; the message names it (by its keyword here) and the way out.

    Example:
        >>> result = autofit.fit(model, budget="8GB", train_data=train, val_data=val, batch_size=256, epochs=10)
        >>> result.history[-1]["val_accuracy"], result.best_path
    """
    from autofit.keywords import in_python
    from autofit.model_io import Loss
    from autofit.spec import default_optimizer
    from autofit.training.loop import TrainSettings
    from autofit.training.run import run_training

    if not isinstance(model, nn.Module):
        raise UserError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    folder = str(Path(train_data).resolve()) if isinstance(train_data, (str, Path)) else None
    settings = TrainSettings(
        epochs=epochs, log_dir=log_dir, lr=lr, resume=resume, overwrite=overwrite, seed=seed,
        num_workers=num_workers, max_steps=max_steps, verbose=verbose, sources={"data": folder, "model": None},
        schedule=schedule, warmup_steps=warmup_steps, spell=in_python, merge=merge, data_changed=data_changed,
    )
    if isinstance(plan, (str, Path)):
        plan = load_plan(plan)
    # The run's folder is checked first: its refusal would otherwise come after minutes of planning.
    if resume and plan is None:
        from autofit.plan_file import plan_from_dict
        from autofit.training.resume import read_saved_run

        saved = read_saved_run(settings.log_dir)
        plan = plan_from_dict(saved["plan"], where=f"the plan saved in {settings.log_dir / 'last.pt'}")
    elif not resume and settings.log_dir is not None:
        from autofit.training.rundir import check_fresh_start

        check_fresh_start(settings.log_dir, overwrite=overwrite)
    weights_note = ""
    if init_from is not None and not resume:
        from autofit.training.weights import load_into, state_dict_from

        where = "init_from" if isinstance(init_from, dict) else str(init_from)
        load_into(model, init_from if isinstance(init_from, dict) else state_dict_from(init_from), where=where)
        weights_note = f"from {where}"
    model, adapters = _with_adapters(model, lora, plan=plan)
    if merge and adapters is None:
        raise UserError("merge=True merges LoRA adapters into the base, and this run trains none; drop merge, or give lora=...")
    data, shape = _read_data(train_data, val_data, input_shape=input_shape, plan=plan, collate=collate)
    plan = _plan_for(model, plan, data=data, input_shape=shape, batch_size=batch_size, budget=budget, device=device,
                     example_batch=example_batch, loss_fn=loss_fn, count_items=count_items, optimizer=optimizer,
                     max_grad_norm=max_grad_norm, adapters=adapters)
    if merge and plan.config.world_size > 1:
        raise UserError("merge=True runs on one process; drop it, and merge the saved adapter with PEFT's merge_and_unload")
    result = run_training(
        model, plan=plan, data=data, source=plan.model.source or f"python:{type(model).__name__}",
        input_shape=shape, loss_fn=Loss(loss_fn, count_items=count_items), build_optimizer=optimizer or default_optimizer,
        settings=settings, max_grad_norm=max_grad_norm, weights_note=weights_note,
    )
    return FitResult(plan=result.plan, history=result.history, best_path=result.best_path,
                     last_path=result.last_path, log_dir=result.log_dir)


def _read_data(
    train_data, val_data, *, input_shape: str | None, plan: Plan | None, collate: Callable | None = None,
) -> tuple[TrainData, tuple[int, ...] | None]:
    """The datasets (or the image folder ``train_data`` names), and the input shape saved with the weights."""
    from autofit.model_checks import CheckedCollate
    from autofit.training.data import datasets_data, image_folder_data, input_shape_from

    if isinstance(train_data, (str, Path)):
        if val_data is not None:
            raise UserError(f"train_data is the image folder {str(train_data)!r}: its val/ is the validation data; drop val_data")
        if collate is not None:
            raise UserError(f"train_data is the image folder {str(train_data)!r}, whose images stack; drop collate")
        shape = input_shape_from(input_shape or (plan.model.input_shape if plan else None))
        return image_folder_data(train_data, input_shape=shape), shape
    checked = CheckedCollate(collate, owner="fit()") if collate is not None else None
    return datasets_data(train_data, val_data, collate=checked), (input_shape_from(input_shape) if input_shape else None)


def _plan_for(
    model: nn.Module, plan: Plan | None, *, data: TrainData, input_shape: tuple[int, ...] | None, batch_size: int | None,
    budget, device: str, example_batch, loss_fn, count_items, optimizer, max_grad_norm: float | None = None,
    adapters: str | None = None,
) -> Plan:
    """``plan``, or without one a plan for ``batch_size`` samples per step under ``budget`` (probing ``model``).

    The plan records the model's fingerprint and input shape when it has none.
    """
    from autofit.spec import model_fingerprint

    if plan is None:
        if batch_size is None:
            raise UserError("fit() needs batch_size (samples per optimizer step) to plan, or a plan=")
        from autofit.planning.planner import make_plan
        from autofit.planning.request import PlanRequest
        from autofit.spec import spec_from_model

        spec = spec_from_model(
            model, example_batch or _examples_from(data.train, collate=data.collate), loss_fn=loss_fn,
            count_items=count_items, optimizer=optimizer, collate=data.collate,
        )
        plan = make_plan(spec, PlanRequest(budget=budget, batch_size=batch_size, device=device, max_grad_norm=max_grad_norm))
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
