"""``autofit capacity --plot``: predicted peak memory against the batch in one step, with each card's usable memory."""
from __future__ import annotations

from pathlib import Path


def plot_capacity(curves: dict[str, list[float]], batch_sizes: list[int], cards: dict[str, float], out: str | Path, *, title: str) -> Path:
    """Draw ``curves`` (label -> peak bytes at each of ``batch_sizes``) and a horizontal line per card (name -> the
    largest peak its headroom leaves), in GiB, to ``out`` (PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 6))
    for label, peaks in curves.items():
        axis.plot(batch_sizes, [p / 2**30 for p in peaks], marker=".", label=label)
    for name, usable in cards.items():
        axis.axhline(usable / 2**30, linestyle="--", linewidth=1, color="grey")
        axis.annotate(name, (batch_sizes[0], usable / 2**30), fontsize=8, va="bottom")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("batch in one micro-step (samples)")
    axis.set_ylabel("predicted peak (GiB, before headroom)")
    axis.set_title(title)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return Path(out)
