"""``autofit capacity --plot``: predicted peak memory against the batch in one step (and, with --longest, against the
sequence length), with each card's usable memory a line."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class Panel:
    """One axis of the figure: peaks (label -> bytes at each of ``xs``) against ``xs``."""

    xs: list[int]
    curves: dict[str, list[float]]
    xlabel: str
    title: str
    marks: dict[str, int] = field(default_factory=dict)
    """Label -> an x to mark with a vertical line (a card's answer, which another configuration may reach)."""


def plot_capacity(panels: list[Panel], cards: dict[str, float], out: str | Path) -> Path:
    """Draw each panel's curves side by side, with a horizontal line per card (name -> the largest peak its headroom
    leaves) on each, in GiB, to ``out`` (PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(panels), figsize=(9 * len(panels), 6), squeeze=False)
    for axis, panel in zip(axes[0], panels):
        for label, peaks in panel.curves.items():
            axis.plot(panel.xs, [p / 2**30 for p in peaks], marker=".", label=label)
        for name, usable in cards.items():
            axis.axhline(usable / 2**30, linestyle="--", linewidth=1, color="grey")
            axis.annotate(name, (panel.xs[0], usable / 2**30), fontsize=8, va="bottom")
        for name, x in panel.marks.items():
            axis.axvline(x, linestyle=":", linewidth=1, color="black")
            axis.annotate(name, (x, 0), fontsize=8, rotation=90, va="bottom", ha="right")
        axis.set_xscale("log", base=2)
        axis.set_xlabel(panel.xlabel)
        axis.set_ylabel("predicted peak (GiB, before headroom)")
        axis.set_title(panel.title)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return Path(out)
