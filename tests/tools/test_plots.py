"""`autofit plot`: real PNGs of one run or several, tolerant of missing keys."""
import json

import numpy as np
import pytest
from matplotlib import colors
from matplotlib.image import imread

from autofit.errors import UserError
from autofit.tools.plots import find_runs, plot_runs, read_metrics

BLUE, ORANGE = (np.array(colors.to_rgb(c)) for c in ("#1f77b4", "#ff7f0e"))  # the first two default line colours


def write_run(folder, *, steps=12, epochs=3, lr=1e-3, keys=None, torn_last_line=False):
    """A metrics.jsonl as `autofit train` writes it; ``keys`` keeps only those keys per record."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    step = 0
    per_epoch = steps // epochs
    for epoch in range(epochs):
        for _ in range(per_epoch):
            step += 1
            lines.append({"kind": "step", "epoch": epoch, "step": step, "loss": 2.0 / step, "lr": lr * (1 - step / (steps + 1)),
                          "samples_per_s": 1000.0 + 10 * (step % 3), "memory_bytes": 20_000_000, "peak_bytes": 30_000_000 + 100_000 * step,
                          "budget_bytes": 64_000_000})
        lines.append({"kind": "epoch", "epoch": epoch, "step": step, "train_loss": 1.0 / (epoch + 1), "val_loss": 1.2 / (epoch + 1),
                      "val_accuracy": 0.5 + 0.1 * epoch})
    if keys is not None:
        lines = [{k: v for k, v in record.items() if k in keys} for record in lines]
    text = "\n".join(json.dumps(record) for record in lines) + "\n"
    if torn_last_line:
        text += '{"kind": "step", "st'
    (folder / "metrics.jsonl").write_text(text)
    return folder


def decoded(path):
    image = imread(path)  # (H, W, 4) floats in [0, 1]
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200
    return image[..., :3]


def has_colour(image, rgb, *, tolerance=0.02, at_least=50):
    return int((np.abs(image - rgb).max(axis=2) < tolerance).sum()) >= at_least


@pytest.fixture
def two_runs(tmp_path):
    write_run(tmp_path / "runs" / "alpha", lr=1e-3, torn_last_line=True)
    write_run(tmp_path / "runs" / "beta", lr=3e-3)
    return tmp_path / "runs"


def test_several_runs_overlaid_in_a_real_png(two_runs, tmp_path, run_cli):
    out = tmp_path / "curves.png"
    code, stdout, stderr = run_cli("plot", "--log-dir", two_runs, "--out", out)
    assert code == 0, stderr
    assert "2 runs: alpha, beta" in stdout
    image = decoded(out)
    assert image.var() > 0 and len(np.unique(image.reshape(-1, 3), axis=0)) > 1
    # each run draws in its own colour
    assert has_colour(image, BLUE) and has_colour(image, ORANGE)


def test_one_run_folder(two_runs, tmp_path):
    runs = find_runs(two_runs / "beta")
    assert [r.name for r in runs] == ["beta"] and len(runs[0].steps) == 12 and len(runs[0].epochs) == 3
    image = decoded(plot_runs(runs, tmp_path / "one.png"))
    assert has_colour(image, BLUE) and not has_colour(image, ORANGE)


def test_torn_last_line_is_skipped(two_runs):
    steps, epochs = read_metrics(two_runs / "alpha" / "metrics.jsonl")
    assert len(steps) == 12 and len(epochs) == 3


def test_missing_keys_are_tolerated(tmp_path):
    write_run(tmp_path / "sparse", keys={"kind", "loss", "train_loss"})  # no step, lr, memory, accuracy...
    image = decoded(plot_runs(find_runs(tmp_path / "sparse"), tmp_path / "sparse.png"))
    assert image.var() > 0 and has_colour(image, BLUE)


def test_the_runs_plan_adds_the_planned_peak(two_runs, tmp_path):
    plan = {"device": {"type": "cpu"}, "budget_bytes": 64_000_000, "measured": {"peak_bytes": 50_000_000}}
    (two_runs / "beta" / "run_plan.json").write_text(json.dumps(plan))
    (two_runs / "alpha" / "plan.json").write_text("{not json")
    runs = {run.name: run for run in find_runs(two_runs)}
    assert runs["beta"].planned_peak_bytes == 50_000_000 and runs["beta"].device_type == "cpu"
    assert runs["alpha"].plan == {} and runs["alpha"].planned_peak_bytes is None
    assert decoded(plot_runs(list(runs.values()), tmp_path / "p.png")).var() > 0


def test_bad_log_dirs_are_one_line_errors(tmp_path, run_cli):
    (tmp_path / "empty").mkdir()
    for log_dir, message in ((tmp_path / "missing", "is not a directory"), (tmp_path / "empty", "holds no metrics.jsonl")):
        code, _, stderr = run_cli("plot", "--log-dir", log_dir, "--out", tmp_path / "x.png")
        assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1
    with pytest.raises(UserError, match="must end in .png"):
        plot_runs([], tmp_path / "x.jpg")


def test_a_cpu_runs_memory_panel_draws_what_the_budget_bounds(tmp_path):
    """The CPU budget bounds tensor bytes: the panel drew only the resident set (950 MiB against a 200 MiB budget
    line); now the counted tensor bytes come first, labelled, the resident set labelled as such."""
    from autofit.tools.plots import memory_curves

    folder = write_run(tmp_path / "run")
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if record["kind"] == "step" and record["step"] >= 2:
            record["tensor_peak_bytes"] = 25_000_000
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "run_plan.json").write_text(json.dumps({"device": {"type": "cpu"}}))
    (run,) = find_runs(folder)
    curves = memory_curves(run)
    assert curves[0][:2] == ("tensor_peak_bytes", "tensor bytes at the peak (what the budget bounds)")
    assert [label for _, label, _ in curves[1:]] == ["resident set, peak (interpreter included)", "resident set, now"]
    gpu = find_runs(folder)[0]
    gpu.plan = {"device": {"type": "cuda"}}
    assert [key for key, _, _ in memory_curves(gpu)] == ["peak_bytes", "memory_bytes"]
