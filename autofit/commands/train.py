"""`autofit train`: train the model a plan names, with that plan, in the shared loop."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from autofit.cli import app
from autofit.errors import UserError


@app.command()
def train(
    plan: Path = typer.Option(..., "--plan", help="plan.json written by `autofit plan`."),
    data: Optional[Path] = typer.Option(
        None, "--data", help="Folder with train/<class>/<image> and val/<class>/<image>; default the model file's train_dataset()/val_dataset()."
    ),
    epochs: int = typer.Option(1, "--epochs", help="Passes over the training data, in total (a resumed run counts the earlier ones)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate, decayed by a cosine to a tenth; default the optimizer's."),
    log_dir: Optional[Path] = typer.Option(
        None, "--log-dir", help="Where metrics.jsonl, TensorBoard events, plan.json, last.pt and best.pt go; default runs/<date>-<time>."
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --log-dir from its last.pt."),
    model: Optional[str] = typer.Option(None, "--model", help="The model file, when it is not where the plan says."),
    workers: int = typer.Option(min(4, max((os.cpu_count() or 1) - 1, 0)), "--workers", help="DataLoader worker processes."),
    save_every: int = typer.Option(0, "--save-every", help="Also save last.pt every N steps (default: at each epoch end and on Ctrl-C)."),
    seed: int = typer.Option(0, "--seed", help="Fixes the weights' initialisation, the data order and the RNG."),
) -> None:
    """Train with a plan: live progress, metrics.jsonl + TensorBoard, last.pt/best.pt; Ctrl-C saves, --resume continues."""
    import torch

    from autofit.data import image_folder_data, input_shape_from, model_file_data
    from autofit.loop import TrainingInterrupted, TrainSettings, default_log_dir
    from autofit.loop import train as run_training
    from autofit.plan_file import load_plan
    from autofit.spec import load_spec

    the_plan = load_plan(plan)
    source = model or the_plan.model.get("source")
    if not source or source.startswith("python:"):
        raise UserError(
            f"the plan names no model file ({source or 'none'}: it was made for a Python object); "
            "give --model FILE defining build_model(), or train it with autofit.fit(model, plan=...)"
        )
    if not source.startswith("torchvision:") and not Path(source).is_file():
        raise UserError(f"the plan's model file {source!r} does not exist here; run from where the plan was made or give --model FILE")
    if resume and log_dir is None:
        raise UserError("--resume needs --log-dir runs/NAME: the folder of the run to continue")
    planned_shape = the_plan.model.get("input_shape")
    shape = input_shape_from(planned_shape) if planned_shape else None
    spec = load_spec(
        source,
        input_shape="x".join(map(str, shape)) if shape else "3x224x224",
        num_classes=the_plan.model.get("num_classes") or 1000,
    )
    shape = shape or spec.input_shape
    settings = TrainSettings(
        epochs=epochs, log_dir=log_dir or default_log_dir(), lr=lr, resume=resume, seed=seed,
        num_workers=workers, save_every_steps=save_every,
    )
    if data is not None:
        train_data = image_folder_data(data, input_shape=input_shape_from(shape))
    else:
        train_data = model_file_data(spec)
    torch.manual_seed(seed)
    network = spec.build_model()
    model_source = {
        "source": source,
        "input_shape": "x".join(map(str, shape)) if shape else None,
        "num_classes": len(train_data.classes) if train_data.classes else the_plan.model.get("num_classes"),
    }
    try:
        run_training(
            network, plan=the_plan, data=train_data, loss_fn=spec.loss_fn, build_optimizer=spec.build_optimizer,
            model_source=model_source, settings=settings,
        )
    except TrainingInterrupted as stop:
        print(
            f"autofit: interrupted at epoch {stop.epoch}, step {stop.step}; saved {stop.last_path}; continue with "
            f"`autofit train --plan {plan} --log-dir {settings.log_dir} --resume`",
            file=sys.stderr,
        )
        raise typer.Exit(130) from None
