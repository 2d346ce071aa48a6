"""What a run shows: a header, a line per epoch and per micro-batch change, and a progress bar on a terminal.

In a log file (stdout not a terminal) the bar is off and the lines say it
all. Ranks other than 0, and ``verbose=False``, get a console that shows nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from autofit.apply import AppliedPlan
from autofit.keywords import as_flags
from autofit.plan_file import Plan
from autofit.training.data import TrainData
from autofit.units import format_bytes


class RunConsole:
    """The run's lines and its progress bar (use it as a context manager: the bar runs inside); ``spell`` words
    the lines for whoever started the run (``TrainSettings.spell``)."""

    def __init__(self, *, verbose: bool, budget_bytes: int, spell: Callable[[str], str] = as_flags) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._console = Console(quiet=not verbose, highlight=False, soft_wrap=True)
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TextColumn("{task.fields[samples_per_s]:.0f} samples/s"),
            TextColumn(f"mem {{task.fields[memory]}} peak {{task.fields[peak]}} / budget {format_bytes(budget_bytes)}"),
            TimeRemainingColumn(),
            console=self._console,
            # A bar is for a terminal; in a log file the per-epoch lines say it all.
            disable=not (verbose and self._console.is_terminal),
        )
        self._bar = None
        self._spell = spell

    def print(self, text: str) -> None:
        self._console.print(self._spell(text), markup=False, highlight=False)

    def start_epoch(self, epoch: int, *, epochs: int, steps: int, done: int) -> None:
        """A bar for epoch ``epoch`` (counted from 1) of ``steps`` steps, ``done`` of them already (a resume)."""
        self._bar = self._progress.add_task(
            f"epoch {epoch}/{epochs}", total=steps, completed=done, loss=float("nan"), samples_per_s=0.0, memory="-", peak="-",
        )

    def step(self, record: dict) -> None:
        """Advance the bar by the step that metrics.jsonl's ``record`` describes."""
        self._progress.update(
            self._bar, advance=1, loss=record["loss"], samples_per_s=record["samples_per_s"],
            memory=format_bytes(record["memory_bytes"]), peak=format_bytes(record["peak_bytes"]),
        )

    def __enter__(self) -> RunConsole:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)


def header(plan: Plan, data: TrainData, applied: AppliedPlan, *, memory_note: str, log_dir: Path) -> str:
    """What the run trains on, with which plan, and where its files go."""
    classes = f", {len(data.classes)} classes" if data.classes else ""
    val = f" / {len(data.val)} val" if data.val is not None else " (no validation data)"
    skipped = f"; skipped {data.skipped_images} unreadable image(s)" if data.skipped_images else ""
    blocks = f"checkpoint {len(plan.config.checkpoint)} block(s)"
    if plan.config.levers():
        blocks += f", levers {plan.config.levers()}"
    if plan.config.compile:
        blocks += ", torch.compile (its first steps compile)"
    if plan.config.max_grad_norm is not None:
        blocks += f", gradients clipped to norm {plan.config.max_grad_norm:g}"
    world_size = applied.env.world_size
    ranks = f"{world_size} processes ({plan.config.sharding}) x " if world_size > 1 else ""
    where = f"{applied.device.type} per process; rank 0's " if world_size > 1 else f"{applied.device}; "
    return (
        f"data {data.source}: {len(data.train)} train{val} samples{classes}{skipped}\n"
        f"plan: batch {plan.config.global_batch_size} = {ranks}micro-batch {applied.micro_batch_size} x {applied.grad_accum_steps}, "
        f"{plan.config.precision}, {blocks}, budget {format_bytes(plan.budget_bytes)} on {where}{memory_note}\n"
        f"logs and weights: {log_dir}"
    )


def oom_line(oom: dict) -> str:
    return (
        f"out of memory at micro-batch {oom['previous_micro_batch_size']}: now {oom['micro_batch_size']} "
        f"x {oom['grad_accum_steps']} (global batch {oom['global_batch_size']} unchanged)"
    )


def epoch_line(record: dict, *, epochs: int) -> str:
    parts = [f"epoch {record['epoch']}/{epochs}: train loss {record['train_loss']:.4f}"]
    if record["val_loss"] is not None:
        parts.append(f"val loss {record['val_loss']:.4f}")
    if record["val_accuracy"] is not None:
        parts.append(f"val accuracy {record['val_accuracy']:.4f}")
    if record.get("val_perplexity") is not None:
        parts.append(f"val perplexity {record['val_perplexity']:.2f}")
    return ", ".join(parts) + f" ({record['samples_per_s']:.0f} samples/s)"


def final_line(best: dict, best_path: Path | None, *, held_epoch: int | None = None) -> str:
    """The run's last line: its best epoch and where its weights are (best.pt; None when it could not be saved).

    Args:
        held_epoch: the epoch whose weights best.pt holds (None: unknown, taken to be the best's).
    """
    if best_path is None:
        weights = "its weights were not kept (best.pt was lost); last.pt holds the last epoch's"
    elif held_epoch is not None and held_epoch != best["epoch"]:
        weights = (f"its weights were not kept (the save of best.pt was cut short); {best_path} holds epoch {held_epoch}'s, "
                   "last.pt the last epoch's")
    else:
        weights = f"weights: {best_path}"
    when = f"epoch {best['epoch']}" if best.get("kind") != "stop" else f"at step {best['step']}, --max-steps"
    if best["val_accuracy"] is not None:
        return f"validation accuracy {best['val_accuracy']:.4f} (best, {when}); {weights}"
    return f"best {when} (loss {best['val_loss'] if best['val_loss'] is not None else best['train_loss']:.4f}); {weights}"
