"""`autofit plot`: training curves of one run or several, as a PNG."""
from __future__ import annotations

import typer

from autofit.cli import app


@app.command()
def plot(
    log_dir: str = typer.Option("runs", "--log-dir", help="A run folder (holding metrics.jsonl) or a folder of runs."),
    out: str = typer.Option("curves.png", "--out", help="The PNG to write."),
) -> None:
    """Loss, accuracy, learning rate, samples/s and memory against the budget; several runs overlaid."""
    from autofit.atomic import check_writable
    from autofit.tools.plots import find_runs, plot_runs

    check_writable(out, option="--out")
    runs = find_runs(log_dir)
    path = plot_runs(runs, out)
    names = ", ".join(run.name for run in runs)
    print(f"wrote {path} ({len(runs)} run{'s' if len(runs) != 1 else ''}: {names})")
