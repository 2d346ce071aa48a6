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
import os
from pathlib import Path

from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.plan_file import Plan
from autofit.training.rundir import PREVIOUS, hold_run_directory

MUST_MATCH = ("lr", "seed", "data", "model", "schedule", "warmup_steps")
"""Settings that change what is trained: given again on resume, they must equal the run's."""


def read_saved_run(log_dir: Path | None) -> dict:
    """last.pt's ``plan``, ``settings``, ``position`` and ``history`` (the weights are mapped, not read).

    Raises:
        UserError: no log dir given, no last.pt, or one that holds no training state.
    """
    from autofit.training.weights import load_checkpoint

    if log_dir is None:
        raise UserError("--resume needs --log-dir: the folder of the run to continue, e.g. runs/NAME")
    last_path = log_dir / "last.pt"
    if not last_path.exists() and (log_dir / PREVIOUS).is_dir():
        # An --overwrite run killed before its first save: the earlier run, put aside, is the one to continue. Holding
        # the folder puts it back (``rundir.remove_leftovers``), or says which run holds it now.
        with hold_run_directory(log_dir):
            pass
    if not last_path.exists():
        raise UserError(f"--resume: {last_path} does not exist; give the --log-dir of a run that saved last.pt")
    saved = load_checkpoint(last_path, mmap=True)
    training = saved.get("training")
    if not isinstance(training, dict) or "position" not in training or "plan" not in saved:
        raise UserError(f"--resume: {last_path} holds no training state; is it a best.pt copied over?")
    return {
        "plan": saved["plan"], "settings": saved.get("settings") or {}, "position": training["position"],
        "history": list(training.get("history") or []),
    }


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



def finished_run(log_dir: Path | None, *, epochs: int | None, merge: bool | None = None) -> tuple[str, dict] | None:
    """The line for a resume of a run that has nothing left to do, with last.pt's state (``read_saved_run``); None
    while it has something: epochs to train, or a last act a kill cut short (best.pt not the best epoch's, an ``hf/``
    save under way), which the resume redoes.

    Resuming a finished run does nothing and rewrites nothing (exit 0: what was asked for is done).

    Args:
        epochs: the epochs given now; None keeps the run's.
        merge: ``--merge`` given now: a run that did not merge has that left to do (``hf/merged``).

    Raises:
        UserError: as ``read_saved_run``.
    """
    from autofit.training.state import score
    from autofit.training.weights import load_checkpoint

    saved = read_saved_run(log_dir)
    position, history = saved["position"], saved["history"]
    total = epochs or saved["settings"].get("epochs") or 1
    if position["epoch"] < total or position["step_in_epoch"] != 0 or not history or (log_dir / "hf.partial").exists():
        return None
    if merge and not saved["settings"].get("merge"):
        return None
    best = log_dir / "best.pt"
    try:
        best_epoch = load_checkpoint(best, mmap=True)["training"]["epoch"]
    except (UserError, KeyError, TypeError):
        return None
    if best_epoch != max(history, key=score)["epoch"]:
        return None
    line = (
        f"the run in {log_dir} is finished ({position['epoch']} epoch(s), {position['global_step']} steps); nothing "
        f"to resume and nothing was rewritten: give --epochs above {position['epoch']} to train on, "
        "or start a new run in another --log-dir"
    )
    return line, saved


def data_fingerprint(path: str | Path | None, *, samples: dict[str, int], log_dir: Path | None = None) -> dict:
    """What a run records of its data to tell, on resume, that it changed: the sample counts and, for data read from
    disk, the number of files, their total size and the newest modification time (metadata only: no file is read,
    so a folder of millions of images costs one ``stat`` each).

    Args:
        path: the file or folder the data came from; None for datasets given as objects.
        samples: {"train": n, "val": n}.
        log_dir: the run's folder, left out where it lies inside the data's (its own saves are no change of data).
    """
    fingerprint: dict = {"samples": dict(samples)}
    if path is None or not Path(path).exists():
        return fingerprint
    files = size = newest = 0
    for file in _data_files(Path(path), skip=Path(log_dir).resolve() if log_dir is not None else None):
        try:
            stat = file.stat()
        except OSError:  # gone while walking: counted as absent
            continue
        files, size, newest = files + 1, size + stat.st_size, max(newest, stat.st_mtime_ns)
    return {**fingerprint, "files": files, "bytes": size, "mtime_ns": newest}


def _data_files(path: Path, *, skip: Path | None):
    if not path.is_dir():
        yield path
        return
    for folder, subfolders, names in os.walk(path):
        if skip is not None:
            subfolders[:] = [name for name in subfolders if Path(folder, name).resolve() != skip]
        for name in names:
            yield Path(folder) / name


def check_same_data(recorded: dict | None, now: dict, *, changed_ok: bool, where: Path, data: str | None) -> str | None:
    """Compare the data's fingerprint now with the one the run began with (``data_fingerprint``).

    Returns:
        None when the data is the same (or the run recorded none); with ``changed_ok``, the line that says the run
        goes on over changed data.

    Raises:
        UserError: the data changed and ``changed_ok`` is False.
    """
    if not recorded or recorded == now:
        return None
    changes = [
        f"{name} {_shown(name, recorded.get(name))} -> {_shown(name, now.get(name))}"
        for name in ("samples", "files", "bytes", "mtime_ns") if recorded.get(name) != now.get(name)
    ]
    what = f"the data{f' in {data}' if data else ''} changed since the run in {where} began ({', '.join(changes)})"
    if changed_ok:
        return f"{what}; training goes on over it, as --data-changed asks"
    raise UserError(
        f"--resume: {what}; put the data back as it was, give --data-changed to train on over the new data, "
        "or start a new run in another --log-dir"
    )


def _shown(name: str, value) -> str:
    if name == "mtime_ns" and isinstance(value, int):
        import time

        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value / 1e9))
    if name == "samples" and isinstance(value, dict):
        return "/".join(f"{count} {split}" for split, count in value.items())
    return str(value)
