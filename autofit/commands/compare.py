"""`autofit compare`: the before/after memory table for any model."""
from __future__ import annotations

import sys
from pathlib import Path

import typer

from autofit.cli import app
from autofit.commands.common import DEVICES, INPUT_SHAPE, MODEL_ARG, NUM_CLASSES, SEQ_LEN, TASK, load_model_spec, one_of
from autofit.config import DeviceChoice
from autofit.errors import UserError


@app.command()
def compare(
    model: str = MODEL_ARG,
    batch_size: int = typer.Option(..., "--batch-size", "-n", help="Global batch: samples per optimizer step, the same in every row."),
    budget: str = typer.Option(None, "--budget", "-b", help='Adds autofit\'s own plan at this budget, e.g. "64MB" or "16GiB".'),
    data: str = typer.Option(None, "--data", help="An image folder (train/ and val/ inside, or class folders) to train each row on."),
    train_steps: int = typer.Option(0, "--train-steps", help="Optimizer steps each row trains with --data."),
    device: str = typer.Option("cpu", help=f"{one_of(DeviceChoice)}."),
    steps: int = typer.Option(2, help="Probe steps per row for its peak; the first is a warm-up."),
    rounds: int = typer.Option(3, "--rounds", help="Speed: timing rounds, each one step of every row (interleaved)."),
    all_rows: bool = typer.Option(False, "--all-rows", help="Also the AMP rows a first look finds far slower than fp32 (fp16 on a CPU)."),
    resume: bool = typer.Option(False, "--resume", help="Go on from the rows an interrupted compare wrote to --out-dir."),
    out_dir: str = typer.Option("runs/compare", "--out-dir", help="Where compare.md, compare.json and compare.png go."),
    input_shape: str = INPUT_SHAPE,
    num_classes: int | None = NUM_CLASSES,
    task: str | None = TASK,
    seq_len: int | None = SEQ_LEN,
) -> None:
    """fp32, AMP, checkpointing every block, both, and autofit's plan: peak memory and speed (interleaved rounds, with
    their noise) side by side; rows are written as they finish, and --resume goes on after an interruption."""
    from autofit.tools.compare import compare as run_compare
    from autofit.tools.compare import format_table, load_comparison, save_comparison
    from autofit.device import device_info
    from autofit.atomic import check_writable
    from autofit.model_checks import check_model_runs
    from autofit.progress import print_progress
    from autofit.units import parse_budget

    if device not in DEVICES:
        raise UserError(f"--device {device!r} is unknown; use {one_of(DeviceChoice)}")
    info = device_info(device)  # one line when no GPU is visible
    budget_bytes = None if budget is None else parse_budget(budget, device_total_bytes=info.total_bytes)
    if data is not None and train_steps < 1:
        raise UserError(f"--train-steps {train_steps} must be at least 1 with --data; e.g. --train-steps 50")
    if data is None and train_steps:
        raise UserError("--train-steps needs --data DIR (an image folder to train on)")
    check_writable(Path(out_dir) / "compare.json", option="--out-dir")
    earlier = load_comparison(out_dir) if resume else None
    if resume and earlier is None:
        raise UserError(f"--resume: {str(Path(out_dir) / 'compare.json')!r} does not exist; run without --resume first")
    spec = load_model_spec(model, input_shape=input_shape, num_classes=num_classes, task=task, seq_len=seq_len)
    check_model_runs(spec)
    try:
        comparison = run_compare(
            spec, global_batch_size=batch_size, device=device, budget_bytes=budget_bytes, data=data,
            train_steps=train_steps, probe_steps=steps, rounds=rounds, progress=print_progress,
            # Each finished row and round is written at once: an interrupted compare keeps them (--resume goes on).
            on_update=lambda so_far: save_comparison(so_far, out_dir, chart=False), resume=earlier, all_rows=all_rows,
        )
    except KeyboardInterrupt:
        kept = Path(out_dir) / "compare.json"
        print(
            f"autofit: compare interrupted; the finished rows are in {kept}" if kept.is_file() else "autofit: compare interrupted before a row finished",
            file=sys.stderr,
        )
        if kept.is_file():
            print("continue with the same command and --resume", file=sys.stderr)
        raise typer.Exit(130) from None
    print(format_table(comparison))
    paths = save_comparison(comparison, out_dir)
    print(f"\nwrote {paths['markdown']}, {paths['json']}, {paths['png']}")
