"""`autofit compare`: the before/after memory table for any model."""
from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
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
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines (the table and the files as without it)."),
    input_shape: str = INPUT_SHAPE,
    num_classes: int | None = NUM_CLASSES,
    task: str | None = TASK,
    seq_len: int | None = SEQ_LEN,
) -> None:
    """fp32, AMP, checkpointing every block, both, and autofit's plan: peak memory and speed (interleaved rounds, with
    their noise) side by side; rows are written as they finish, and --resume goes on after an interruption."""
    from autofit.tools.compare import compare as run_compare
    from autofit.tools.compare import Comparison, format_table, load_comparison, save_comparison
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
    finished: list[Comparison] = []

    def keep(so_far: Comparison) -> None:
        # Each finished row (with its first timed step) and round is written at once: a stopped compare keeps them.
        save_comparison(so_far, out_dir, chart=False)
        finished[:] = [so_far]

    try:
        with _signals_stop():
            comparison = run_compare(
                spec, global_batch_size=batch_size, device=device, budget_bytes=budget_bytes, data=data,
                train_steps=train_steps, probe_steps=steps, rounds=rounds, progress=None if quiet else print_progress,
                on_update=keep, resume=earlier, all_rows=all_rows,
            )
    except KeyboardInterrupt as stop:
        number = stop.signal_number if isinstance(stop, Stopped) else signal.SIGINT
        print(f"autofit: {_stopped_line(finished[0] if finished else None, out_dir, signal.Signals(number).name)}", file=sys.stderr)
        raise typer.Exit(128 + number) from None
    print(format_table(comparison))
    paths = save_comparison(comparison, out_dir)
    print(f"\nwrote {paths['markdown']}, {paths['json']}, {paths['png']}")


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (or Ctrl-C's SIGINT) stopped a compare: raised where it runs, so that it ends as Ctrl-C does."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(signal.Signals(signal_number).name)
        self.signal_number = signal_number


@contextmanager
def _signals_stop() -> Iterator[None]:
    """Inside, SIGINT, SIGTERM and SIGHUP raise ``Stopped`` in the main thread (by default SIGTERM and SIGHUP end the
    process at once, saying nothing); on the way out the handlers before are back, so a second signal while the
    rows kept are reported ends the process as it would have."""
    from autofit.training.stops import STOP_SIGNALS

    def stop(signal_number, frame) -> None:
        raise Stopped(signal_number)

    previous = {number: signal.signal(number, stop) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _stopped_line(comparison, out_dir: str, signal_name: str) -> str:
    """What a stopped compare kept: its finished rows, each with its peak and speed, and where; or that it kept none."""
    rows = [] if comparison is None else [row for row in comparison.rows if row.memory_done and row.config]
    if not rows:
        return f"compare stopped by {signal_name} before a row finished; nothing was kept"
    timed = sum(row.samples_per_s is not None for row in rows)
    names = ", ".join(row.name for row in rows)
    kept = f"{len(rows)} finished row{'s' if len(rows) != 1 else ''} ({names})"
    speeds = "each with its peak and speed" if timed == len(rows) else f"{timed} with a speed"
    return (
        f"compare stopped by {signal_name}; kept {kept}, {speeds}, in {Path(out_dir) / 'compare.md'} and compare.json; "
        "continue with the same command and --resume"
    )
