"""`autofit compare`: the before/after table on a tiny CNN, its files, and equal numerics."""
import json
import os

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from autofit.tools.compare import SLOW_FACTOR, compare, configurations, format_table, to_markdown
from autofit.errors import UserError
from autofit.spec import load_spec
from tests.helpers.regions import write_image_folder

TINY_CNN = '''
import torch
from torch import nn

INPUT_SHAPE = (1, 8, 8)


class Block(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU())

    def forward(self, x):
        return x + self.body(x)


class TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.blocks = nn.Sequential(Block(8), Block(8))
        self.head = nn.Linear(8 * 8 * 8, 3)

    def forward(self, x):  # (B, 1, 8, 8)
        return self.head(self.blocks(self.stem(x)).flatten(1))


def build_model():
    return TinyCNN()


def example_batch(n):
    return torch.rand(n, 1, 8, 8), torch.randint(0, 3, (n,))
'''


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def cnn_file(tmp_path):
    path = tmp_path / "tiny_cnn.py"
    path.write_text(TINY_CNN)
    return path


@pytest.fixture
def data_dir(tmp_path):
    kinds = ["top", "bottom", "left"]
    write_image_folder(tmp_path / "data" / "train", {k: [k] * 8 for k in kinds})
    write_image_folder(tmp_path / "data" / "val", {k: [k] * 3 for k in kinds})
    return tmp_path / "data"


def test_rows_cover_each_technique():
    names = [c.name for c in configurations(global_batch_size=16, amp_precisions=["bf16", "fp16"])]
    assert names == [
        "fp32", "bf16 AMP", "fp16 AMP", "checkpoint all", "bf16 AMP + checkpoint all", "fp16 AMP + checkpoint all",
        "selective checkpoint all", "optimizer step in backward",
    ]
    levers = ["selective checkpoint all", "optimizer step in backward"]
    assert [c.name for c in configurations(global_batch_size=16, amp_precisions=[])] == ["fp32", "checkpoint all", *levers]
    # the GPU levers are rows on a GPU only (on the CPU the host is the device)
    on_gpu = [c.name for c in configurations(global_batch_size=16, amp_precisions=[], device="cuda")]
    assert on_gpu == ["fp32", "checkpoint all", *levers, "offload all", "optimizer state on the host"]
    # a causal LM's chunked loss is a row where it applies
    chunked = [c.config for c in configurations(global_batch_size=16, amp_precisions=[], loss_chunks=8)]
    assert [c.loss_chunks for c in chunked] == [1, 1, 1, 1, 8]


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_cli_table_markdown_png_and_training(cnn_file, data_dir, tmp_path, run_cli):
    out_dir = tmp_path / "out"
    code, stdout, stderr = run_cli(
        "compare", cnn_file, "--batch-size", 8, "--data", data_dir, "--train-steps", 4, "--steps", 2, "--out-dir", out_dir,
        "--all-rows",
    )
    assert code == 0, stderr
    for header in ("configuration", "peak memory", "% of fp32", "vs fp32", "loss @4", "accuracy @4"):
        assert header in stdout
    rows = {row["name"]: row for row in json.loads((out_dir / "compare.json").read_text())["rows"]}
    assert {"fp32", "bf16 AMP", "fp16 AMP", "checkpoint all", "bf16 AMP + checkpoint all"} <= set(rows)  # the CPU runs both AMPs
    fp32 = rows["fp32"]
    assert fp32["memory_ratio"] == 1.0 and fp32["speed_ratio"] == 1.0
    # what each technique is for, measured
    assert rows["checkpoint all"]["peak_bytes"] < fp32["peak_bytes"]
    assert rows["bf16 AMP"]["peak_bytes"] < fp32["peak_bytes"]
    assert rows["bf16 AMP + checkpoint all"]["peak_bytes"] < min(rows["bf16 AMP"]["peak_bytes"], rows["checkpoint all"]["peak_bytes"])
    assert rows["checkpoint all"]["checkpoint_blocks"] == 2
    assert rows["checkpoint all"]["activation_bytes"] < fp32["activation_bytes"]
    # the levers beyond the recipe, measured: selective recomputes less and so frees less than full checkpointing;
    # the step in backward frees each gradient as it is made
    assert rows["checkpoint all"]["peak_bytes"] <= rows["selective checkpoint all"]["peak_bytes"] <= fp32["peak_bytes"]
    assert rows["optimizer step in backward"]["peak_bytes"] < fp32["peak_bytes"]
    for name in ("selective checkpoint all", "optimizer step in backward"):  # same arithmetic: the same training
        assert rows[name]["eval_loss"] == pytest.approx(fp32["eval_loss"], rel=1e-6)
        assert rows[name]["eval_accuracy"] == fp32["eval_accuracy"]
    # checkpointing recomputes, it does not change the training: the same loss and accuracy from the same seed
    for name in ("fp32", "bf16 AMP"):
        plain, checkpointed = rows[name], rows[f"{name} + checkpoint all" if name != "fp32" else "checkpoint all"]
        assert checkpointed["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6)
        assert checkpointed["eval_accuracy"] == plain["eval_accuracy"]
    for row in rows.values():
        assert 0.0 <= row["eval_accuracy"] <= 1.0 and np.isfinite(row["eval_loss"]) and row["samples_per_s"] > 0
    markdown = (out_dir / "compare.md").read_text()
    assert "| configuration |" in markdown and "| fp32 | 8 x 1 |" in markdown and markdown.count("\n| ") >= 6
    image = imread(out_dir / "compare.png")[..., :3]
    assert image.var() > 0 and len(np.unique(image.reshape(-1, 3), axis=0)) > 1


def test_training_sees_the_same_batches_for_every_row(cnn_file, data_dir):
    from autofit.config import TrainingConfig
    from autofit.tools.compare import TrainingData

    spec = load_spec(str(cnn_file))
    first = TrainingData.load(spec, data_dir, global_batch_size=8, steps=5, seed=0)
    again = TrainingData.load(spec, data_dir, global_batch_size=8, steps=5, seed=0)
    assert len(first.batches) == 5 and all(len(targets) == 8 for _, targets in first.batches)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first.batches, again.batches))
    # micro-batches of 3 (3 + 3 + 2) train the same model as the full batch of 8, up to float rounding
    whole = first.train_and_score(spec, TrainingConfig(global_batch_size=8, micro_batch_size=8), device="cpu", seed=0)
    split = first.train_and_score(spec, TrainingConfig(global_batch_size=8, micro_batch_size=3), device="cpu", seed=0)
    assert (split.train_loss, split.eval_loss, split.eval_accuracy) == pytest.approx((whole.train_loss, whole.eval_loss, whole.eval_accuracy), rel=1e-4)
    assert whole.skipped_steps == split.skipped_steps == 0


def test_without_data_there_are_no_training_columns(cnn_file):
    comparison = compare(load_spec(str(cnn_file)), global_batch_size=4, probe_steps=2)
    table = format_table(comparison)
    assert "accuracy" not in table and "loss" not in table and "fits" not in table
    assert all(row.eval_accuracy is None for row in comparison.rows)
    assert to_markdown(comparison).count("\n| ") == len(comparison.rows) + 1


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_plan_row_at_the_budget(cnn_file):
    pytest.importorskip("autofit.planning.planner")
    spec = load_spec(str(cnn_file))
    from autofit.measure.probe import probe

    budget = int(probe(spec, micro_batch_size=8, steps=2).peak_bytes * 0.8)  # fp32 does not fit
    comparison = compare(spec, global_batch_size=8, budget_bytes=budget, probe_steps=2)
    plan = next((row for row in comparison.rows if row.name.startswith("autofit plan")), None)
    assert plan is not None, [r.name for r in comparison.rows]
    assert plan.note == "" and plan.fits_budget is True
    assert comparison.rows[0].fits_budget is False
    assert "fits" in format_table(comparison)


def test_bad_inputs_are_one_line_errors(cnn_file, data_dir, tmp_path, run_cli):
    cases = [
        (("--batch-size", 8, "--train-steps", 3), "needs --data"),
        (("--batch-size", 8, "--data", data_dir), "--train-steps 0 must be at least 1"),
        (("--batch-size", 8, "--data", tmp_path / "nowhere", "--train-steps", 2), "is not a directory"),
        (("--batch-size", 0), "must be at least 1"),
        (("--batch-size", 8, "--budget", "lots"), "not a memory size"),
        (("--batch-size", 8, "--device", "tpu"), "unknown"),
        (("--batch-size", 8, "--resume"), "does not exist; run without --resume first"),
        (("--batch-size", 8, "--rounds", 0), "--rounds 0 must be at least 1"),
    ]
    write_image_folder(tmp_path / "four", {k: [k] for k in ("a", "b", "c", "d")})
    cases.append((("--batch-size", 2, "--data", tmp_path / "four", "--train-steps", 1), "has 4 classes"))
    for args, message in cases:
        code, stdout, stderr = run_cli("compare", cnn_file, *args, "--out-dir", tmp_path / "o")
        assert code == 2, (args, stdout, stderr)
        assert message in stderr and len(stderr.strip().splitlines()) == 1, (args, stderr)


def test_the_plan_row_measures_the_plan_with_its_levers(monkeypatch):
    """The "autofit plan" row is the plan's own configuration, memory levers included (not just its recipe part)."""
    import autofit.planning.planner as planner
    from autofit.config import TrainingConfig
    from autofit.plan_file import Plan
    from autofit.tools.compare import plan_configuration

    chosen = Plan(budget_bytes=1, config=TrainingConfig(
        global_batch_size=1, precision="fp32", checkpoint=["layers.0"], micro_batch_size=1, selective_checkpoint=["layers.1"],
        offload=[], optimizer_in_backward=True, optimizer_state="device",
    ))
    monkeypatch.setattr(planner, "make_plan", lambda *args, **kwargs: chosen)
    row = plan_configuration(None, budget_bytes=1, global_batch_size=1, device="cpu")
    assert row.name == "autofit plan: fp32 + checkpoint 1 block + selective 1 + step in backward"
    config = row.config
    assert (config.selective_checkpoint, config.offload, config.optimizer_in_backward, config.optimizer_state) == (
        ("layers.1",), (), True, "device",
    )
    assert config == chosen.config  # the row measures exactly the plan


def test_rows_are_written_as_they_finish_and_resume_measures_only_the_rest(cnn_file, tmp_path, monkeypatch):
    """An interrupted compare keeps its finished rows; --resume does not measure them again."""
    import autofit.measure.probe as probe
    from autofit.tools.compare import load_comparison, save_comparison

    spec, out_dir = load_spec(str(cnn_file)), tmp_path / "out"
    measured, real_measure = [], probe.measure

    def counting(spec, config, **kwargs):
        measured.append(config.key())
        return real_measure(spec, config, **kwargs)

    monkeypatch.setattr(probe, "measure", counting)
    lines = []

    def interrupt_after_one_row(so_far):
        save_comparison(so_far, out_dir, chart=False)
        if sum(row.memory_done for row in so_far.rows) == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compare(spec, global_batch_size=4, on_update=interrupt_after_one_row, progress=lines.append, rounds=2)
    rows = [line for line in lines if line.startswith("row ")]
    total = int(rows[0].split(" of ")[1].split(":")[0])  # the AMP rows this CPU runs, and the levers'
    assert rows == [f"row 1 of {total}: fp32"] and len(measured) == 1
    kept = load_comparison(out_dir)
    assert [row.name for row in kept.rows] == ["fp32"] and kept.rows[0].peak_bytes > 0
    first = measured[0]
    lines.clear()
    resumed = compare(spec, global_batch_size=4, resume=kept, progress=lines.append, rounds=2)
    assert first not in measured[1:] and len(measured) == total  # the fp32 row was not measured again
    assert f"row 1 of {total}: fp32 (kept from the earlier run)" in lines and f"row 2 of {total}: bf16 AMP" in lines
    assert resumed.rows[0].peak_bytes == kept.rows[0].peak_bytes
    timed = [row for row in resumed.rows if row.peak_bytes is not None]
    assert all(row.samples_per_s > 0 and 1 <= len(row.seconds) <= 2 for row in timed)
    # every row twice, but one far slower than fp32 in the first round (fp16 here, at times): once, no noise to show
    assert all(len(row.seconds) == 2 and row.noise is not None for row in timed if row.speed_ratio > 1 / SLOW_FACTOR)
    assert any(line.startswith("speed: round 2 of 2, one step of each of") for line in lines)
    with pytest.raises(UserError, match="--resume: the earlier compare ran with global_batch_size 4, this one 8"):
        compare(spec, global_batch_size=8, resume=kept)


def test_differences_within_the_noise_are_marked(cnn_file):
    from autofit.tools.compare import Comparison, Row, fill_ratios, versus

    def row(name, seconds):
        return Row(name=name, precision="fp32", checkpoint_blocks=0, micro_batch_size=4, grad_accum_steps=1, peak_bytes=10,
                   seconds=seconds, samples_per_s=4 / min(seconds), noise=sorted(seconds)[1] / min(seconds) - 1)

    comparison = Comparison(model="m", device="cpu", global_batch_size=4, rows=[
        row("fp32", [1.0, 1.1]), row("close", [1.05, 1.06]), row("far", [2.0, 2.02]),
    ])
    fill_ratios(comparison)
    assert [r.within_noise for r in comparison.rows] == [None, True, False]
    assert [versus(r) for r in comparison.rows] == ["1.00x", "~0.95x", "0.50x"]
    assert "~0.95x" in format_table(comparison)


def test_precisions_the_planner_would_leave_out_are_left_out(cnn_file, monkeypatch):
    """The planner's rule (over 3x the fastest, beyond the noise), not a laxer one: fp16 at 5x is left out, bf16 at
    2.5x kept, a precision whose noise could explain its ratio kept."""
    import autofit.planning.speed.measured as measured
    from autofit.tools.compare import left_out_precisions

    seconds = {"fp32": [1.0, 1.0], "bf16": [2.5, 2.5], "fp16": [5.0, 5.0], "noisy": [1.0, 3.5]}

    class FixedTimer:
        def __init__(self, spec, config, **settings):
            self.times = iter(seconds["noisy" if config.precision == "fp16" and noisy else config.precision] * 2)

        def step_seconds(self):
            return next(self.times)

        def close(self):
            pass

    monkeypatch.setattr(measured, "StepTimer", FixedTimer)
    spec = load_spec(str(cnn_file))
    noisy = False
    assert left_out_precisions(spec, ["bf16", "fp16"], device="cpu", seed=0) == {"fp16": (5.0, "fp32")}
    noisy = True  # fastest 3.5x fp32's, but its rounds differ by 3.5x: the noise could explain it
    assert left_out_precisions(spec, ["bf16", "fp16"], device="cpu", seed=0) == {}


def test_left_out_rows_are_said_in_one_line_and_the_plan_searches_without_them(cnn_file, monkeypatch):
    import autofit.tools.compare as compare_module
    from autofit.progress import as_progress
    from autofit.tools.compare import Comparison, contenders_of

    monkeypatch.setattr(compare_module, "runnable_amp_precisions", lambda device: ["bf16", "fp16"])
    monkeypatch.setattr(compare_module, "left_out_precisions", lambda spec, amp, **settings: {"fp16": (21.5, "fp32")})
    asked = {}

    def plan_row(spec, *, left_out, **settings):
        asked["left_out"] = left_out
        return compare_module.Contender(name="autofit plan: fp32", config=compare_module.TrainingConfig(global_batch_size=4, micro_batch_size=4))

    monkeypatch.setattr(compare_module, "plan_configuration", plan_row)
    lines = []
    comparison = Comparison(model="m", device="cpu", global_batch_size=4, budget_bytes=10**9)
    contenders, notes = contenders_of(load_spec(str(cnn_file)), comparison, {}, device="cpu", seed=0, all_rows=False, progress=as_progress(lines.append))
    assert not any("fp16" in c.name for c in contenders) and "bf16 AMP" in [c.name for c in contenders]
    assert [row.name for row in notes] == ["fp16 AMP"] and "21.5x fp32's" in notes[0].note
    said = [line for line in lines if "left out" in line]
    assert said == [
        "left out, as the planner's precision check leaves out a precision over 3x the fastest: fp16 AMP (21.5x fp32's) "
        "at micro-batch 1 (--all-rows keeps them)"
    ]
    assert asked["left_out"] == ["fp16"]


def test_sigterm_keeps_every_finished_row_with_its_speed(cnn_file, tmp_path, monkeypatch, run_cli):
    """SIGTERM in the second row: the first is in compare.md with its speed, one line says so, exit 143."""
    import signal

    import autofit.measure.probe as probe
    import autofit.tools.compare as compare_module

    rows, real_measure, calls = compare_module.configurations, probe.measure, []
    monkeypatch.setattr(compare_module, "configurations", lambda **settings: rows(**settings)[:2])

    def stopped_in_the_second_row(spec, config, **settings):
        calls.append(config)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_measure(spec, config, **settings)

    def default_sigterm(signal_number, frame):  # what the default would do, without ending the test run
        raise SystemExit("SIGTERM reached the default handler")

    monkeypatch.setattr(probe, "measure", stopped_in_the_second_row)
    previous = signal.signal(signal.SIGTERM, default_sigterm)
    try:
        out_dir = tmp_path / "out"
        code, stdout, stderr = run_cli("compare", cnn_file, "-n", 4, "--all-rows", "--rounds", 2, "--out-dir", out_dir)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"autofit: compare stopped by SIGTERM; kept 1 finished row (fp32), each with its peak and speed, in "
        f"{out_dir / 'compare.md'} and compare.json; continue with the same command and --resume"
    )
    markdown = (out_dir / "compare.md").read_text()
    fp32 = next(line for line in markdown.splitlines() if line.startswith("| fp32 |")).split(" | ")
    samples_per_s = fp32[[cell.strip() for cell in markdown.splitlines()[2].split("|")][1:].index("samples/s")]
    assert float(samples_per_s) > 0
    assert signal.getsignal(signal.SIGTERM) is previous or signal.getsignal(signal.SIGTERM) == previous


def test_a_model_that_cannot_train_one_sample_gets_every_row():
    """BatchNorm over one value a channel refuses a batch of one (torchvision's ResNet-18 at 32x32): the first look at
    micro-batch 1 raised a ValueError out of compare; now nothing is left out and every row is measured."""
    from torch import nn

    from autofit.spec import spec_from_model
    from autofit.tools.compare import left_out_precisions

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    spec = spec_from_model(model, lambda n: (torch.rand(n, 4), torch.randint(0, 2, (n,))))
    assert left_out_precisions(spec, ["bf16", "fp16"], device="cpu", seed=0) == {}
