"""`autofit train`: train the model a plan names, with that plan, in the shared loop.

A plan for N processes runs under ``torchrun --nproc-per-node N -m autofit train ...``;
without torchrun it prints that command and stops.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from autofit.cli import app
from autofit.errors import UserError

if TYPE_CHECKING:
    from autofit.plan_file import Plan


@app.command()
def train(
    plan: Optional[Path] = typer.Option(
        None, "--plan", help="plan.json written by `autofit plan`; on --resume the run's own (saved in last.pt) is used."
    ),
    data: Optional[Path] = typer.Option(
        None, "--data", help="Folder with train/<class>/<image> and val/<class>/<image>, or text for an hf: causal LM "
        "(.txt, .jsonl, .parquet or a datasets folder); default the model file's train_dataset()/val_dataset()."
    ),
    pack: Optional[bool] = typer.Option(
        None, "--pack/--no-pack", help="Text: concatenate documents with EOS and cut the plan's seq_len blocks (default), or pad one document per sample."
    ),
    val_fraction: Optional[float] = typer.Option(
        None, "--val-fraction", help="Text: the share of samples held out for validation (at least one); default 0.05."
    ),
    epochs: Optional[int] = typer.Option(
        None, "--epochs", help="Passes over the training data, in total; default 1, or on --resume the run's own (a larger number trains on)."
    ),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate (see --schedule); default the optimizer's."),
    schedule: Optional[str] = typer.Option(
        None, "--schedule", help="After the warm-up: cosine or linear to a tenth of the peak rate, or constant; default cosine."
    ),
    warmup_steps: Optional[int] = typer.Option(None, "--warmup-steps", help="Optimizer steps of linear warm-up to the peak rate; default 0."),
    max_grad_norm: Optional[float] = typer.Option(
        None, "--max-grad-norm", help="Clip the global gradient norm to this before each optimizer step (clip_grad_norm_); default the plan's (none)."
    ),
    weights: Optional[Path] = typer.Option(
        None, "--weights", help="Start from these weights: a state dict (.pt, .bin, .safetensors), an autofit last.pt/best.pt or a save_pretrained directory."
    ),
    from_config: bool = typer.Option(False, "--from-config", help="hf:DIR: random weights from config.json, not the pretrained weights in DIR."),
    log_dir: Optional[str] = typer.Option(  # a str: Path("") would be the current folder, not the mistake it is
        None, "--log-dir", help="Where metrics.jsonl, TensorBoard events, run_plan.json, last.pt and best.pt go; default runs/<date>-<time>."
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --log-dir from its last.pt, with the settings it saved."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start a new run in a --log-dir that holds one; its files go once the new run has saved."),
    model: Optional[str] = typer.Option(None, "--model", help="The model file, when it is not where the plan says."),
    workers: Optional[int] = typer.Option(
        None, "--workers",
        help="DataLoader worker processes (default: on the CPU the cores the step's threads leave free; on a GPU up to 4).",
    ),
    save_every: Optional[int] = typer.Option(
        None, "--save-every", help="Also save last.pt every N steps (default: at each epoch end and when stopped)."
    ),
    max_steps: Optional[int] = typer.Option(
        None, "--max-steps", help="Stop after this many optimizer steps in all (last.pt saved; --resume continues)."
    ),
    seed: Optional[int] = typer.Option(None, "--seed", help="Fixes the weights' initialisation, the data order and the RNG (default 0)."),
    lora: Optional[str] = typer.Option(
        None, "--lora", help="LoRA adapters: the plan's own (`autofit plan --lora ...` records them); given here it must be the same.",
    ),
    merge: bool = typer.Option(
        False, "--merge", help="Also save the LoRA adapters merged into the base: runs/NAME/hf/merged, loadable with "
        "from_pretrained alone (a resumed run that merged merges again).",
    ),
    data_changed: bool = typer.Option(
        False, "--data-changed", help="On --resume: train on although the data changed since the run began (without it, refused).",
    ),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="No progress bar or lines (metrics.jsonl and TensorBoard still get every step; errors still show).",
    ),
) -> None:
    """Train with a plan: live progress, metrics.jsonl + TensorBoard, last.pt/best.pt; Ctrl-C, SIGTERM and SIGHUP save, --resume continues.

    A plan for several GPUs (or CPU processes) runs under torchrun:
    `torchrun --nproc-per-node N -m autofit train --plan plan.json ...`.
    """
    with _errors_from_rank0_first():
        _train(plan=plan, data=data, epochs=epochs, lr=lr, log_dir=log_dir, resume=resume, overwrite=overwrite, model=model,
               workers=workers, save_every=save_every, max_steps=max_steps, seed=seed, schedule=schedule,
               warmup_steps=warmup_steps, max_grad_norm=max_grad_norm, weights=weights, from_config=from_config,
               pack=pack, val_fraction=val_fraction, lora=lora, merge=merge, data_changed=data_changed, quiet=quiet)


def _train(*, plan: Path | None, data, pack, val_fraction, epochs, lr, log_dir, resume, overwrite, model, workers, save_every,
           max_steps, seed, schedule, warmup_steps, max_grad_norm, weights, from_config, lora, merge, data_changed, quiet=False) -> None:
    import torch

    from autofit.spec import spec_for_plan, weights_held
    from autofit.training.data import check_sample_shape, cli_data, input_shape_from, model_file_data
    from autofit.distributed import cleanup, end_rank, is_rank0
    from autofit.training.loop import TrainSettings
    from autofit.training.stops import TrainingInterrupted
    from autofit.training.run import run_training
    from autofit.training.rundir import log_dir_path
    from autofit.training.weights import initial_model
    from autofit.training.hf_export import pretrained_dir

    log_dir = log_dir_path(log_dir)
    data = Path(data).resolve() if data is not None else None
    model = str(Path(model).resolve()) if model is not None and not model.startswith("torchvision:") else model
    start = _resumed_or_new(plan, log_dir=log_dir, resume=resume, epochs=epochs, merge=merge, data=data, model=model, pack=pack,
                            val_fraction=val_fraction)
    the_plan, data, model, pack, val_fraction = start.plan, start.data, start.model, start.pack, start.val_fraction
    _check_starting_flags(the_plan, lora=lora, merge=merge, resume=resume, weights=weights, from_config=from_config)
    spec = spec_for_plan(the_plan.model, model_file=model)
    if from_config and spec.build_pretrained is None and not spec.source.startswith("hf:"):
        raise UserError(f"--from-config is for an hf:DIR model holding weights; {spec.source} starts from its own initialisation already")
    planned_shape = the_plan.model.input_shape
    shape = input_shape_from(planned_shape) if planned_shape else spec.input_shape
    settings = TrainSettings(
        epochs=epochs, log_dir=log_dir, lr=lr, resume=resume, overwrite=overwrite, seed=seed, num_workers=workers,
        save_every_steps=save_every, max_steps=max_steps, schedule=schedule, warmup_steps=warmup_steps, merge=merge,
        data_changed=data_changed, verbose=not quiet,
        sources={"data": str(data) if data is not None else None, "model": model, "pack": pack, "val_fraction": val_fraction},
    )
    if data is None and (val_fraction is not None or pack is not None):
        flag = "--val-fraction" if val_fraction is not None else ("--pack" if pack else "--no-pack")
        raise UserError(
            f"{flag} shapes text given with --data, and this run takes the model file's own datasets; drop {flag}, or give --data"
        )
    train_data = (
        cli_data(data, spec=spec, input_shape=shape, seq_len=the_plan.model.seq_len, pack=pack is not False, val_fraction=val_fraction)
        if data is not None else model_file_data(spec)
    )
    if data is None and planned_shape:
        check_sample_shape(train_data, shape)
    torch.manual_seed(seed or 0)
    if resume:  # last.pt holds the weights
        network, weights_note = spec.build_model(), ""
    else:
        network, weights_note = initial_model(spec, weights=weights, from_config=from_config)
        weights_note = f"{weights_note}, {weights_held(spec, the_plan.config)}" if weights_note else ""
    try:
        run_training(
            network, plan=the_plan, data=train_data, source=spec.source, source_options=spec.source_options,
            input_shape=shape, loss_fn=spec.loss_fn,
            build_optimizer=spec.build_optimizer, settings=settings, max_grad_norm=max_grad_norm, weights_note=weights_note,
            pretrained_dir=pretrained_dir(spec),
        )
    except TrainingInterrupted as stop:
        if is_rank0():
            _say_stopped(stop, world_size=the_plan.config.world_size)
        cleanup()
        end_rank(stop.exit_code)
        raise typer.Exit(stop.exit_code) from None
    cleanup()
    end_rank(0)


@dataclass(frozen=True, slots=True)
class _RunStart:
    """What a run starts from: its plan, and the data, model file and text settings (a resumed run's own)."""

    plan: Plan
    data: Path | None
    model: str | None
    pack: bool | None
    val_fraction: float | None


def _resumed_or_new(plan: Path | None, *, log_dir: Path, resume: bool, epochs, merge: bool, data: Path | None, model: str | None,
                    pack: bool | None, val_fraction: float | None) -> _RunStart:
    """A resumed run's plan and sources, checked against what is given again; or the plan given for a new run.

    Raises:
        UserError: no plan for a new run, or a value given again that the run's differs from.
        typer.Exit: the run has finished (said in one line).
    """
    from autofit.plan_file import load_plan, plan_from_dict
    from autofit.training.resume import check_same_plan, finished_run, read_saved_run, resumed_value

    if not resume:
        if plan is None:
            raise UserError("--plan plan.json is needed to start a run (`autofit plan` writes one); to continue one, give --log-dir DIR --resume")
        return _RunStart(plan=load_plan(plan), data=data, model=model, pack=pack, val_fraction=val_fraction)
    # The run's own plan and settings; what is given again must agree with them.
    done = finished_run(log_dir, epochs=epochs, merge=merge)
    if done is not None:  # before the data is read: a finished run's data may be gone, and needs not be back
        print(done[0])
        raise typer.Exit(0)
    saved = read_saved_run(log_dir)
    the_plan = plan_from_dict(saved["plan"], where=f"the plan saved in {log_dir / 'last.pt'}")
    if plan is not None:
        check_same_plan(load_plan(plan), the_plan, where=log_dir)
    if "sources" in saved["settings"]:
        recorded = saved["settings"]["sources"]
        data = resumed_value("--data", data, recorded.get("data"), where=log_dir)
        model = model or recorded.get("model")
        # How text was cut and split is part of the data: a resume reads it as the run began.
        if "pack" in recorded:
            pack = resumed_value("--pack", pack, recorded["pack"], where=log_dir)
        if "val_fraction" in recorded:
            val_fraction = resumed_value("--val-fraction", val_fraction, recorded["val_fraction"], where=log_dir)
    return _RunStart(plan=the_plan, data=Path(data) if data is not None else None, model=model, pack=pack, val_fraction=val_fraction)


def _check_starting_flags(the_plan: Plan, *, lora, merge: bool, resume: bool, weights, from_config: bool) -> None:
    """The flags about the processes, adapters and starting weights, against the plan and each other.

    Raises:
        UserError: the wrong number of processes, another LoRA than planned, --merge without adapters or on several
            processes, or starting weights chosen twice or on resume.
    """
    from autofit.distributed import check_launch

    # A plan for N processes: refuse any other number, naming the command that starts N.
    check_launch(the_plan.config.sharding_config())
    if lora is not None:
        from autofit.adapters import planned_lora

        planned_lora(lora, the_plan.model.lora, flag="--lora", spell=lambda value: f"--lora {value}")
    if merge and the_plan.model.lora is None:
        raise UserError("--merge merges LoRA adapters into the base, and this plan trains none; drop --merge, or plan with --lora")
    if merge and the_plan.config.world_size > 1:
        raise UserError(
            "--merge runs on one process; drop it, and merge the saved adapter with PEFT's merge_and_unload after training"
        )
    if resume and (weights is not None or from_config):
        raise UserError("--resume continues from the run's last.pt: drop --weights / --from-config (they choose where a new run starts)")
    if weights is not None and from_config:
        raise UserError("--weights and --from-config both choose the starting weights; give one of them")


def _say_stopped(stop, *, world_size: int) -> None:
    """A signal stopped the run: where it saved, and the command that continues it."""
    again = f"torchrun --nproc-per-node {world_size} -m autofit" if world_size > 1 else "autofit"
    print(
        f"autofit: stopped by {signal.Signals(stop.signal_number).name} at epoch {stop.epoch}, step {stop.step}; "
        f"saved {stop.last_path}; continue with `{again} train --log-dir {stop.last_path.parent} --resume`",
        file=sys.stderr,
    )


@contextmanager
def _errors_from_rank0_first():
    """On ranks other than 0, hold a user error back a few seconds before it is printed.

    Most errors (a bad plan, data, or flag) happen on every rank alike: rank 0
    prints its line and exits, and torchrun then stops the other ranks before
    they repeat it. An error of one rank only (out of memory) still appears.
    """
    try:
        yield
    except UserError:
        if int(os.environ.get("RANK", "0")) != 0:
            time.sleep(3.0)
        raise
