"""Training curves from ``metrics.jsonl``: loss, accuracy, learning rate, samples/s, memory.

A run is a folder holding ``metrics.jsonl`` (one JSON object per line, written
by ``autofit train``): ``{"kind": "step"|"epoch", "epoch", "step", "loss",
"lr", "samples_per_s", "memory_bytes", "peak_bytes", "budget_bytes"}`` and, for
epochs, ``"train_loss", "val_loss", "val_accuracy"``. Any key may be missing;
a panel without data says so. Several runs are overlaid, one colour each.

The run's copy of its plan (run_plan.json), when present, adds the planned
peak (the probe's measured bytes, the number the budget was compared with).
On the CPU the training loop logs the process's resident set, which includes
the interpreter, while the budget counts tensor bytes: the panel draws the
tensor bytes the run counted (``tensor_peak_bytes``) against the budget, the
resident set beside them, each labelled, rather than suggest an overrun.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from autofit.errors import UserError
from autofit.training.rundir import RUN_PLAN

METRICS_FILE = "metrics.jsonl"
PLAN_FILES = (RUN_PLAN, "plan.json")
"""Where a run keeps its plan: run_plan.json; plan.json in a run of an autofit that wrote it there."""
MIB = 2**20


@dataclass(kw_only=True, slots=True)
class Run:
    name: str
    """The run folder, relative to the log dir ("." when the log dir is the run)."""
    steps: list[dict] = field(default_factory=list)
    epochs: list[dict] = field(default_factory=list)
    plan: dict = field(default_factory=dict)
    """The run's plan (``PLAN_FILES``; {} when absent or unreadable)."""

    @property
    def device_type(self) -> str | None:
        device = self.plan.get("device")
        return device.get("type") if isinstance(device, dict) else None

    @property
    def planned_peak_bytes(self) -> int | None:
        measured = self.plan.get("measured")
        peak = measured.get("peak_bytes") if isinstance(measured, dict) else None
        return peak if isinstance(peak, (int, float)) and peak > 0 else None


def read_metrics(path: str | Path) -> tuple[list[dict], list[dict]]:
    """Step and epoch records of one metrics.jsonl.

    Lines that are not JSON objects are skipped: the last line of a run that
    was killed mid-write may be cut short.
    """
    steps, epochs = [], []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        if record.get("kind") == "epoch":
            epochs.append(record)
        elif record.get("kind", "step") == "step":  # not "oom" or "unreadable" events
            steps.append(record)
    return steps, epochs


def find_runs(log_dir: str | Path) -> list[Run]:
    """Every folder at or below ``log_dir`` that holds a metrics.jsonl.

    Raises:
        UserError: the folder is missing or holds no run.
    """
    root = Path(log_dir)
    if not root.is_dir():
        raise UserError(f"--log-dir {str(log_dir)!r} is not a directory; give the folder `autofit train` wrote (e.g. runs or runs/NAME)")
    runs = []
    for path in sorted(root.rglob(METRICS_FILE)):
        steps, epochs = read_metrics(path)
        if steps or epochs:
            name = path.parent.relative_to(root).as_posix()
            runs.append(Run(name=name if name != "." else root.name or ".", steps=steps, epochs=epochs, plan=_read_plan(path.parent)))
    if not runs:
        raise UserError(f"--log-dir {str(log_dir)!r} holds no {METRICS_FILE} with records; train first with `autofit train`")
    return runs


def _read_plan(run_dir: Path) -> dict:
    path = next((run_dir / name for name in PLAN_FILES if (run_dir / name).exists()), None)
    try:
        plan = json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}
    return plan if isinstance(plan, dict) else {}


def _series(records: list[dict], y_key: str, *, x_keys=("step", "epoch"), scale: float = 1.0) -> tuple[list[float], list[float]]:
    """(x, y) of the records that have ``y_key`` and one of ``x_keys``; x falls back to the record's position."""
    xs, ys = [], []
    for position, record in enumerate(records):
        y = record.get(y_key)
        if not isinstance(y, (int, float)) or isinstance(y, bool):
            continue
        x = next((record[k] for k in x_keys if isinstance(record.get(k), (int, float))), position)
        xs.append(float(x))
        ys.append(float(y) / scale)
    return xs, ys


def memory_curves(run: Run) -> list[tuple[str, str, dict]]:
    """The memory panel's curves of ``run``: (metrics key, label, line style), the quantity the budget bounds first.

    On a GPU the gauge's peak is the device's, which the budget bounds. On the CPU the budget bounds tensor bytes
    (what the planner's tracker counts): the run counts them on a step now and then (``tensor_peak_bytes``, the
    last counted step's), drawn solid beside the process's resident set (peak and now), which counts the
    interpreter too and is labelled so, thin: a resident set far above a small budget is not an overrun.
    """
    on_cpu = run.device_type == "cpu" or (run.device_type is None and any("tensor_peak_bytes" in r for r in run.steps))
    if not on_cpu:
        return [("peak_bytes", "peak", {}), ("memory_bytes", "in use", {"alpha": 0.5, "linestyle": ":"})]
    return [
        ("tensor_peak_bytes", "tensor bytes at the peak (what the budget bounds)", {"linewidth": 2}),
        ("peak_bytes", "resident set, peak (interpreter included)", {"alpha": 0.5, "linewidth": 1}),
        ("memory_bytes", "resident set, now", {"alpha": 0.35, "linestyle": ":"}),
    ]


def plot_runs(runs: list[Run], out: str | Path, *, title: str | None = None) -> Path:
    """Draw the curves of ``runs`` into a PNG at ``out``.

    Panels: loss (steps, and train/validation loss per epoch), validation
    accuracy, learning rate, samples/s, and memory (``memory_curves``: the
    quantity the budget bounds, labelled, against the budget, dashed). The x
    axis is the optimizer step.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    out = Path(out)
    if out.suffix.lower() != ".png":
        raise UserError(f"--out {str(out)!r} must end in .png")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    loss_ax, acc_ax, lr_ax, speed_ax, memory_ax, legend_ax = axes.flat
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = {ax: False for ax in axes.flat}

    def draw(ax, xy, *, colour, label, **style):
        xs, ys = xy
        if xs:
            ax.plot(xs, ys, color=colour, label=label, **style)
            drawn[ax] = True

    for index, run in enumerate(runs):
        colour = colours[index % len(colours)]
        name = run.name
        draw(loss_ax, _series(run.steps, "loss"), colour=colour, label=f"{name} step", alpha=0.45, linewidth=1)
        draw(loss_ax, _series(run.epochs, "train_loss"), colour=colour, label=f"{name} train", marker="o", linewidth=1.5)
        draw(loss_ax, _series(run.epochs, "val_loss"), colour=colour, label=f"{name} val", marker="s", linestyle="--")
        draw(acc_ax, _series(run.epochs, "val_accuracy"), colour=colour, label=name, marker="o")
        draw(lr_ax, _series(run.steps or run.epochs, "lr"), colour=colour, label=name)
        draw(speed_ax, _series(run.steps, "samples_per_s"), colour=colour, label=name)
        for key, label, style in memory_curves(run):
            draw(memory_ax, _series(run.steps, key, scale=MIB), colour=colour, label=f"{name} {label}", **style)
        budgets = [r["budget_bytes"] for r in run.steps + run.epochs if isinstance(r.get("budget_bytes"), (int, float)) and r["budget_bytes"] > 0]
        if budgets:
            memory_ax.axhline(budgets[-1] / MIB, color=colour, linestyle="--", linewidth=1.5, label=f"{name} budget")
            drawn[memory_ax] = True
        if run.planned_peak_bytes:
            memory_ax.axhline(run.planned_peak_bytes / MIB, color=colour, linestyle="-.", linewidth=1, label=f"{name} planned peak")
            drawn[memory_ax] = True

    memory_heading = "memory against the budget"
    if any(run.device_type == "cpu" for run in runs):
        memory_heading += "\n(cpu: the budget bounds tensor bytes; the resident set counts the interpreter too)"
    for ax, heading, y_label in (
        (loss_ax, "loss", "loss"),
        (acc_ax, "validation accuracy", "accuracy"),
        (lr_ax, "learning rate", "lr"),
        (speed_ax, "throughput", "samples/s"),
        (memory_ax, memory_heading, "MiB"),
    ):
        ax.set_title(heading)
        ax.set_xlabel("step")
        ax.set_ylabel(y_label)
        ax.grid(True, alpha=0.3)
        if drawn[ax]:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data in metrics.jsonl", ha="center", va="center", transform=ax.transAxes, color="grey")
    legend_ax.axis("off")
    summary = [f"{run.name}: {len(run.steps)} steps, {len(run.epochs)} epochs" for run in runs]
    legend_ax.text(0.0, 1.0, "runs\n" + "\n".join(summary), va="top", ha="left", fontsize=10, family="monospace")
    figure.suptitle(title or ("training curves: " + ", ".join(run.name for run in runs)))
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out
