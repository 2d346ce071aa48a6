"""``run_training``: the one path from ``autofit train`` and ``autofit.fit()`` into the loop.

Each front end turns its inputs into a model, a plan and data (the command
from a plan file and the model file it names, ``fit`` from Python objects,
planning first when it has no plan); from there both go through here.
"""
from __future__ import annotations

import dataclasses
import errno
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import nn

from autofit.plan_file import Plan
from autofit.training.data import TrainData
from autofit.device import steady_host_allocations
from autofit.distributed import init_distributed, is_rank0, same_on_all_ranks
from autofit.errors import UserError
from autofit.training.hf_export import save_for_transformers
from autofit.training.resume import resumed_value
from autofit.training.stops import disk_full_line
from autofit.training.threads import default_workers, plan_threads
from autofit.training.loop import TrainResult, TrainSettings, default_log_dir, finished_result, train


def run_training(
    model: nn.Module,
    *,
    plan: Plan,
    data: TrainData,
    source: str,
    source_options: dict | None = None,
    input_shape: Sequence[int] | None,
    loss_fn: Callable,
    build_optimizer: Callable,
    settings: TrainSettings,
    max_grad_norm: float | None = None,
    weights_note: str = "",
    pretrained_dir: Path | None = None,
) -> TrainResult:
    """Train ``model`` with ``plan`` on ``data`` in the shared loop (``autofit.training.loop.train``).

    Args:
        model: the model the plan was made for (trained in place).
        plan: the plan to train with.
        data: the train (and val) datasets.
        source: the model file, "torchvision:NAME" or "python:CLASS", saved with
            the weights so that ``autofit val`` and ``export`` can rebuild the model.
        source_options: what else rebuilding it takes (an ``hf:`` model's task and sequence length).
        input_shape: (C, H, W) of one sample, saved with the weights; None when unknown.
        loss_fn: (output, target) -> mean loss.
        build_optimizer: params -> Optimizer.
        settings: epochs, log dir, resume, merge (LoRA adapters also saved merged into the base, ``hf/merged``;
            ``hf_export.merged_state_dict``), ...; without a log dir, runs/<date>-<time>.
        max_grad_norm: clip the gradients' global norm to this (the plan's ``max_grad_norm`` from now on); None
            keeps the plan's. On resume it must equal the run's.
        weights_note: where the weights came from ("pretrained from DIR"), printed before training.
        pretrained_dir: the ``hf:`` directory whose tokenizer ``hf/`` gets beside the weights.

    Returns:
        The loop's ``TrainResult``.

    Raises:
        UserError: as ``train``; TrainingInterrupted on Ctrl-C.
    """
    steady_host_allocations()  # as the planner timed the steps
    if plan.config.sharding != "none":
        # Under torchrun: join the processes now, so that all write to rank 0's default log dir.
        init_distributed(device_type=plan.device.type)
    if settings.log_dir is None:
        settings = dataclasses.replace(settings, log_dir=same_on_all_ranks(default_log_dir()))
    model_source = {
        **(source_options or {}),
        "source": source,
        "input_shape": "x".join(map(str, input_shape)) if input_shape else None,
        "num_classes": len(data.classes) if data.classes else plan.model.num_classes,
    }
    finished = finished_result(settings)  # before the lines about threads and workers: nothing will train
    if finished is not None:
        return finished
    plan = with_clipping(plan, max_grad_norm, resume=settings.resume, where=settings.log_dir)
    if weights_note and settings.verbose and is_rank0():
        print(f"weights: {weights_note}", flush=True)
    # The threads the plan's speed was timed with (``training.threads``); PyTorch's setting is put back after.
    say = (lambda line: print(settings.spell(line))) if settings.verbose and is_rank0() else lambda line: None
    with plan_threads(plan, say=say) as threads:
        if settings.num_workers is None:
            workers, line = default_workers(plan.device.type, threads=threads, world_size=plan.config.world_size)
            say(line)
            settings = dataclasses.replace(settings, num_workers=workers)
        result = train(
            model, plan=plan, data=data, loss_fn=loss_fn, build_optimizer=build_optimizer, model_source=model_source,
            settings=settings,
        )
    if result.trained:  # a finished run resumed: its hf/ stays as it is
        _save_for_transformers(model, result, pretrained_dir=pretrained_dir, verbose=settings.verbose)
    return result


def _save_for_transformers(model: nn.Module, result: TrainResult, *, pretrained_dir: Path | None, verbose: bool) -> None:
    """hf/ beside the weights (``hf_export``), where the model is a transformers one.

    Raises:
        UserError: the disk is full.
    """
    try:
        saved = save_for_transformers(model, log_dir=result.log_dir, tokenizer_dir=pretrained_dir, merge=result.merge)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise UserError(disk_full_line(error, result.log_dir)) from None
    if saved is not None and verbose and is_rank0():
        print(f"saved for transformers: {saved} (from_pretrained loads it)", flush=True)
        if result.merge:
            print(f"saved merged: {saved / 'merged'} (the adapters merged into the base; from_pretrained loads it alone)", flush=True)


def with_clipping(plan: Plan, max_grad_norm: float | None, *, resume: bool, where) -> Plan:
    """``plan`` clipping gradients at ``max_grad_norm`` (None: as it does). A resumed run keeps its own.

    Raises:
        UserError: the plan steps in backward (no clipping is possible there), or on resume a value other than
            the run's.
    """
    if max_grad_norm is None or max_grad_norm == plan.config.max_grad_norm:
        return plan
    if resume:
        resumed_value("max_grad_norm", max_grad_norm, plan.config.max_grad_norm, where=where)
    return dataclasses.replace(plan, config=dataclasses.replace(plan.config, max_grad_norm=max_grad_norm))
