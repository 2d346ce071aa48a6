"""``run_training``: the one path from ``autofit train`` and ``autofit.fit()`` into the loop.

Each front end turns its inputs into a model, a plan and data (the command
from a plan file and the model file it names, ``fit`` from Python objects,
planning first when it has no plan); from there both go through here.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from torch import nn

from autofit.plan_file import Plan
from autofit.training.data import TrainData
from autofit.distributed import init_distributed, same_on_all_ranks
from autofit.training.threads import plan_threads
from autofit.training.loop import TrainResult, TrainSettings, default_log_dir, train


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
        settings: epochs, log dir, resume, ...; without a log dir, runs/<date>-<time>.

    Returns:
        The loop's ``TrainResult``.

    Raises:
        UserError: as ``train``; TrainingInterrupted on Ctrl-C.
    """
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
    # The threads the plan's speed was timed with (``training.threads``); PyTorch's setting is put back after.
    with plan_threads(plan, say=print if settings.verbose else lambda line: None):
        return train(
            model, plan=plan, data=data, loss_fn=loss_fn, build_optimizer=build_optimizer, model_source=model_source,
            settings=settings,
        )
