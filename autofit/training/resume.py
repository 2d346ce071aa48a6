"""What a resumed run continues with: the settings and the plan its last.pt recorded, and checks on those given again.

A run saves its settings in last.pt (``TrainSettings.record``: epochs, lr,
seed, save_every_steps, max_steps, and where its data and model came from), so
``autofit train --log-dir DIR --resume`` alone continues it. A setting given
again must equal the recorded one, or the resume is refused with a line
naming it; only what does not change the training may differ: ``epochs``
(a larger number trains on), ``max_steps`` and the DataLoader workers.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.plan_file import Plan

MUST_MATCH = ("lr", "seed", "data", "model", "schedule", "warmup_steps")
"""Settings that change what is trained: given again on resume, they must equal the run's."""


def read_saved_run(log_dir: Path | None) -> dict:
    """last.pt's ``plan``, ``settings`` and ``position`` (the weights are mapped, not read).

    Raises:
        UserError: no log dir given, no last.pt, or one that holds no training state.
    """
    from autofit.training.weights import load_checkpoint

    if log_dir is None:
        raise UserError("--resume needs --log-dir: the folder of the run to continue, e.g. runs/NAME")
    last_path = log_dir / "last.pt"
    if not last_path.exists():
        raise UserError(f"--resume: {last_path} does not exist; give the --log-dir of a run that saved last.pt")
    saved = load_checkpoint(last_path, mmap=True)
    training = saved.get("training")
    if not isinstance(training, dict) or "position" not in training or "plan" not in saved:
        raise UserError(f"--resume: {last_path} holds no training state; is it a best.pt copied over?")
    return {"plan": saved["plan"], "settings": saved.get("settings") or {}, "position": training["position"]}


def resumed_value(name: str, given, recorded, *, where: Path):
    """The value a resumed run uses for a ``MUST_MATCH`` setting: the recorded one.

    Args:
        name: the setting (``lr``, ``seed``, ``data``, ``model``).
        given: what was given now; None when not given.
        recorded: what the run was started with (from last.pt).
        where: the log dir, for the message.

    Raises:
        UserError: ``given`` differs from ``recorded``.
    """
    if given is None or _same(given, recorded):
        return recorded
    started = f"{name} {recorded}" if recorded is not None else f"no {name} given"
    raise UserError(
        f"--resume: {name} {given} differs from the run in {where}, started with {started}; "
        "leave it out to continue as the run began, or start a new run in another --log-dir"
    )


def check_same_plan(given: Plan, saved: Plan, *, where: Path) -> None:
    """Refuse to resume with a plan that trains differently from the one the run saved.

    The micro-batch may be the saved one or the one the run started with (a run
    halves it after running out of memory; its run_plan.json and last.pt say so).

    Raises:
        UserError: naming the first fields that differ.
    """
    differences = []
    choices = [
        (name, getattr(given.config, name), getattr(saved.config, name))
        for name in (f.name for f in dataclasses.fields(TrainingConfig)) if name != "micro_batch_size"
    ]
    for name, mine, theirs in (
        ("model fingerprint", given.model.fingerprint, saved.model.fingerprint),
        ("device", given.device.type, saved.device.type),
        *choices,
        ("budget_bytes", given.budget_bytes, saved.budget_bytes),
    ):
        if mine is not None and theirs is not None and mine != theirs:
            shown = (list(mine), list(theirs)) if isinstance(mine, tuple) else (mine, theirs)
            differences.append(f"{name} {shown[0]!r} (saved: {shown[1]!r})")
    mine, theirs = given.config.micro_batch_size, saved.config.micro_batch_size
    started_with = saved.history[0].get("previous_micro_batch_size") if saved.history else theirs
    if mine not in (theirs, started_with):
        differences.append(f"micro_batch_size {mine} (saved: {theirs})")
    if differences:
        raise UserError(
            f"--resume: the plan given differs from the one the run in {where} trains with: {'; '.join(differences)}; "
            "leave out --plan to continue with the saved one, or start a new run in another --log-dir"
        )


def _same(given, recorded) -> bool:
    if isinstance(given, float) and isinstance(recorded, float):
        return given == recorded or (math.isnan(given) and math.isnan(recorded))
    if isinstance(given, (str, Path)) and isinstance(recorded, (str, Path)):
        return Path(given).expanduser().resolve() == Path(recorded).expanduser().resolve()
    return given == recorded

