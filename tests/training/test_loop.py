"""The shared loop: equal to a hand-written loop, resumable, OOM-proof, honest about bad runs."""
import json
import math
import os
import signal
from dataclasses import replace

import pytest
import torch
from torch import nn

from autofit.training.data import TrainData, epoch_order
from autofit.errors import UserError
from autofit.training.schedule import cosine_schedule
from autofit.training.stops import TrainingInterrupted
from autofit.plan_file import DeviceInfo, load_plan
from autofit.spec import model_fingerprint
from autofit.training.weights import load_checkpoint

from tests.helpers.training import CLASSES, SAMPLES, TinyNet, assert_same_weights, fresh_model, make_data, make_plan, optimizer, run


def hand_written(model: nn.Module, *, steps: int, epochs: int, global_batch_size: int = 8) -> nn.Module:
    """Plain PyTorch: whole global batches, mean cross-entropy, AdamW, the same cosine schedule."""
    data = make_data()
    opt = optimizer(model.parameters())
    steps_per_epoch = math.ceil(SAMPLES / global_batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps_per_epoch * epochs, eta_min=1e-3)
    done = 0
    for epoch in range(epochs):
        order = epoch_order(SAMPLES, seed=0, epoch=epoch)
        for start in range(0, SAMPLES, global_batch_size):
            inputs, targets = data.train[order[start:start + global_batch_size]]
            nn.functional.cross_entropy(model(inputs), targets).backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
            done += 1
            if done == steps:
                return model
    return model


def test_weights_equal_a_hand_written_loop_with_accumulation_and_checkpointing(tmp_path):
    """8 = 3 + 3 + 2 micro-batches, every block checkpointed: the same weights as whole batches."""
    model = fresh_model()
    reference = hand_written(fresh_model(), steps=3, epochs=2)
    result = run(model, make_plan(model), tmp_path, max_steps=3)
    assert not result.finished
    assert_same_weights(model, reference, exact=False)
    assert all(getattr(model.blocks[i], "_autofit_checkpointed", False) for i in range(3))


def test_cosine_schedule_matches_pytorch():
    params = [nn.Parameter(torch.zeros(1))]
    ours = torch.optim.SGD(params, lr=0.5)
    theirs = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    a, b = cosine_schedule(ours, total_steps=7), torch.optim.lr_scheduler.CosineAnnealingLR(theirs, T_max=7, eta_min=0.05)
    for _ in range(7):
        assert ours.param_groups[0]["lr"] == pytest.approx(theirs.param_groups[0]["lr"])
        ours.step(), theirs.step()
        a.step(), b.step()


@pytest.mark.parametrize("stop", ["max_steps", "ctrl_c"])
def test_resume_after_a_stop_gives_the_uninterrupted_weights(tmp_path, stop):
    """Stopped mid-epoch (Ctrl-C is a real SIGINT), then resumed: weights, log and history as if never stopped."""
    whole = fresh_model(dropout=0.2)  # dropout: the RNG state must be restored too
    whole_result = run(whole, make_plan(whole), tmp_path / "whole")

    calls = {"n": 0}

    def interrupting_loss(output, target):
        calls["n"] += 1
        if stop == "ctrl_c" and calls["n"] == 3 * 3 + 2:  # inside step 4, on its second micro-batch
            os.kill(os.getpid(), signal.SIGINT)
        return nn.functional.cross_entropy(output, target)

    first = fresh_model(dropout=0.2)
    if stop == "ctrl_c":
        with pytest.raises(TrainingInterrupted) as stopped:
            run(first, make_plan(first), tmp_path / "cut", loss_fn=interrupting_loss)
        assert stopped.value.step == 4
    else:
        assert not run(first, make_plan(first), tmp_path / "cut", max_steps=4).finished
    saved = load_checkpoint(tmp_path / "cut" / "last.pt")
    assert saved["training"]["position"]["global_step"] == 4

    resumed = fresh_model(dropout=0.2)  # a new process would build the model anew
    result = run(resumed, make_plan(resumed), tmp_path / "cut", resume=True)
    assert result.finished
    assert_same_weights(resumed, whole, exact=True)
    assert [r["val_accuracy"] for r in result.history] == [r["val_accuracy"] for r in whole_result.history]
    steps = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["kind"] == "step"] == list(range(1, 11))
    assert [r["epoch"] for r in steps if r["kind"] == "epoch"] == [1, 2]


def test_max_steps_ends_as_an_epoch_does_validated_with_best_pt_and_a_last_line(tmp_path, capsys):
    model = fresh_model()
    result = run(model, make_plan(model), tmp_path, max_steps=3, verbose=True)
    assert not result.finished and result.best_path == tmp_path / "best.pt"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    stop = [r for r in records if r["kind"] == "stop"]
    assert len(stop) == 1 and stop[0]["step"] == 3 and stop[0]["val_accuracy"] is not None
    best = load_checkpoint(tmp_path / "best.pt")
    assert best["training"]["metrics"]["kind"] == "stop"
    for (name, value) in model.state_dict().items():  # best.pt holds the weights at the stop
        assert torch.equal(best["model_state"][name], value), name
    out = capsys.readouterr().out
    assert "stopped at --max-steps 3, step 3 of 5 in epoch 1/" in out
    assert f"(best, at step 3, --max-steps); weights: {tmp_path / 'best.pt'}" in out


def test_cpu_step_records_carry_the_tracked_tensor_peak_beside_the_resident_set(tmp_path):
    model = fresh_model()
    run(model, make_plan(model), tmp_path, max_steps=3)
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][:3]
    assert steps[0]["tensor_peak_bytes"] is None  # the first step warms up; the second is counted
    assert 0 < steps[1]["tensor_peak_bytes"] == steps[2]["tensor_peak_bytes"] < steps[1]["peak_bytes"]


def test_a_run_resumed_at_an_epoch_boundary_validates_that_epoch(tmp_path):
    model = fresh_model()
    run(model, make_plan(model), tmp_path, max_steps=5)  # the last step of epoch 1, before validation
    resumed = fresh_model()
    result = run(resumed, make_plan(resumed), tmp_path, resume=True)
    assert [r["epoch"] for r in result.history] == [1, 2]


class OutOfMemoryAbove(nn.Module):
    """Raises torch.OutOfMemoryError for micro-batches larger than ``limit`` (a data-dependent spike)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.net = TinyNet()

    def forward(self, x):
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate a micro-batch of {x.shape[0]}")
        return self.net(x)


def test_out_of_memory_halves_the_micro_batch_and_keeps_the_global_batch(tmp_path):
    torch.manual_seed(0)
    model = OutOfMemoryAbove(limit=2)
    reference = hand_written(fresh_model(), steps=2, epochs=2)
    result = run(model, make_plan(model, micro_batch_size=8, checkpoint=()), tmp_path, max_steps=2)

    assert_same_weights(model.net, reference, exact=False)  # the global batch of 8 is kept
    assert (result.plan.config.micro_batch_size, result.plan.config.grad_accum_steps, result.plan.config.global_batch_size) == (2, 4, 8)
    assert [(h["previous_micro_batch_size"], h["micro_batch_size"]) for h in result.plan.history] == [(8, 4), (4, 2)]
    saved_plan = load_plan(tmp_path / "run_plan.json")
    assert saved_plan.config.micro_batch_size == 2 and len(saved_plan.history) == 2
    assert load_checkpoint(tmp_path / "last.pt")["plan"]["micro_batch_size"] == 2
    ooms = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"oom"' in line]
    assert [(r["step"], r["micro_batch_size"], r["global_batch_size"]) for r in ooms] == [(1, 4, 8), (1, 2, 8)]


def test_out_of_memory_mid_step_drops_the_partial_gradients(tmp_path):
    """The first micro-batch's backward is done when the second one fails: its gradient must not count twice."""
    failed = {"done": False}

    def failing_once(output, target):
        if failing_once.calls == 1 and not failed["done"]:
            failed["done"] = True
            raise RuntimeError("CUDA error: out of memory")
        failing_once.calls += 1
        return nn.functional.cross_entropy(output, target)

    failing_once.calls = 0
    model = fresh_model()
    reference = hand_written(fresh_model(), steps=2, epochs=2)
    result = run(model, make_plan(model, micro_batch_size=4, checkpoint=()), tmp_path, loss_fn=failing_once, max_steps=2)
    assert failed["done"] and result.plan.config.micro_batch_size == 2
    assert_same_weights(model, reference, exact=False)


def test_out_of_memory_at_one_sample_is_a_user_error(tmp_path):
    model = OutOfMemoryAbove(limit=0)
    with pytest.raises(UserError, match="micro-batch of 1 sample"):
        run(model, make_plan(model, micro_batch_size=2, checkpoint=()), tmp_path, max_steps=1)


def test_other_runtime_errors_are_not_taken_for_out_of_memory(tmp_path):
    def broken(output, target):
        raise RuntimeError("shape mismatch")

    model = fresh_model()
    with pytest.raises(UserError, match=r"your code raised RuntimeError: shape mismatch \(test_loop.py, line \d+, in broken\)") as error:
        run(model, make_plan(model), tmp_path, loss_fn=broken)
    assert isinstance(error.value.__cause__, RuntimeError) and not load_plan(tmp_path / "run_plan.json").history  # no halving


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_repeated_non_finite_loss_stops_with_advice(tmp_path, precision):
    def nan_loss(output, target):
        return nn.functional.cross_entropy(output, target) * float("nan")

    model = fresh_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError, match=r"not finite for 5 steps in a row.*bf16 or fp32 precision") as error:
        run(model, make_plan(model, precision=precision), tmp_path, loss_fn=nan_loss)
    assert "\n" not in str(error.value)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 5
    if precision == "fp16":  # the GradScaler skipped every step: the weights are untouched
        assert not any(line["stepped"] for line in lines)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _nan_loss(output, target):
    return nn.functional.cross_entropy(output, target) * float("nan")


@pytest.mark.parametrize("settings, said", [
    (dict(lr=1e308, max_steps=1), r"the weights are no longer finite \(step 1's update made them so\).*--lr below 1e\+308"),
    (dict(lr=1e308, epochs=1), r"an update overflowed the weights at step \d"),  # PyTorch's "cannot be converted ... without overflow"
    (dict(loss_fn=_nan_loss, epochs=1, data=make_data(24)), r"the weights are no longer finite \(the loss became non-finite at step 1\)"),
], ids=["stop", "overflow", "epoch-end"])
def test_weights_that_are_not_finite_are_never_saved_and_the_run_says_since_when(tmp_path, settings, said):
    """A diverged run stops before its save, in one line: no last.pt or best.pt (nor hf/, written after them) holds
    inf or nan weights. An epoch whose every loss was nan is logged as nan, not 0."""
    model = fresh_model()
    with pytest.raises(UserError, match="training diverged: " + said) as error:
        run(model, make_plan(model), tmp_path, **settings)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "last.pt").exists() and not (tmp_path / "best.pt").exists()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    epochs = [r["train_loss"] for r in records if r["kind"] == "epoch"]
    assert len(epochs) == ("loss_fn" in settings) and all(math.isnan(loss) for loss in epochs)  # was 0.0


def test_metrics_checkpoints_and_logs(tmp_path, monkeypatch):
    from autofit.training.runlog import RunLog

    # TensorBoard then gets the first step and the last of each epoch only; metrics.jsonl every step.
    monkeypatch.setattr(RunLog, "tensorboard_interval_s", 1e9)
    model = fresh_model()
    result = run(model, make_plan(model), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step_keys = {"kind", "epoch", "step", "loss", "lr", "samples_per_s", "memory_bytes", "peak_bytes", "budget_bytes"}
    assert all(step_keys <= set(r) for r in records)
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert len(epochs) == 2 and all({"train_loss", "val_loss", "val_accuracy"} <= set(r) for r in epochs)
    assert all(r["budget_bytes"] == 10**8 and r["peak_bytes"] > 0 and r["samples_per_s"] > 0 for r in records)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, 11))
    assert [e.step for e in events.Scalars("step/loss")] == [1, 5, 10]
    losses = {r["step"]: r["loss"] for r in records if r["kind"] == "step"}
    assert [e.value for e in events.Scalars("step/loss")] == pytest.approx([losses[1], losses[5], losses[10]])
    assert [e.value for e in events.Scalars("epoch/val_accuracy")] == pytest.approx([r["val_accuracy"] for r in records if r["kind"] == "epoch"])
    assert result.history == epochs

    last, best = load_checkpoint(tmp_path / "last.pt"), load_checkpoint(result.best_path)
    assert last["fingerprint"] == model_fingerprint(model)
    assert last["model_source"] == {"source": "tests/training/test_loop.py", "input_shape": "1x4x4", "num_classes": CLASSES}
    assert set(last["training"]) >= {"optimizer", "scaler", "scheduler", "rng", "position"}
    best_epoch = max(epochs, key=lambda r: r["val_accuracy"])
    assert best["training"]["epoch"] == best_epoch["epoch"]
    assert load_plan(tmp_path / "run_plan.json").config.global_batch_size == 8


def test_a_plan_for_another_model_is_refused(tmp_path):
    plan = make_plan(fresh_model())
    other = nn.Sequential(nn.Flatten(), nn.Linear(16, CLASSES))
    with pytest.raises(UserError, match="another model"):
        run(other, plan, tmp_path)


def test_a_log_dir_holding_a_run_is_not_overwritten(tmp_path):
    model = fresh_model()
    run(model, make_plan(model), tmp_path, max_steps=1)
    with pytest.raises(UserError, match="--resume"):
        run(fresh_model(), make_plan(model), tmp_path)


def test_training_without_validation_keeps_the_best_training_loss(tmp_path):
    model = fresh_model()
    result = run(model, make_plan(model), tmp_path, data=make_data(val=False))
    assert result.best_path is not None and all(r["val_accuracy"] is None for r in result.history)


def test_fit_with_a_plan_returns_plan_history_and_best_weights(tmp_path):
    import autofit

    model = fresh_model()
    data = make_data()
    result = autofit.fit(
        model, train_data=data.train, val_data=data.val, plan=make_plan(model), epochs=1,
        optimizer=optimizer, log_dir=tmp_path, verbose=False,
    )
    assert result.plan.config.global_batch_size == 8 and len(result.history) == 1
    assert result.best_path == tmp_path / "best.pt" and result.best_path.exists()
    with pytest.raises(UserError, match="batch_size 16 differs"):
        autofit.fit(fresh_model(), train_data=data.train, plan=make_plan(model), batch_size=16, log_dir=tmp_path / "x")


class WideConvNet(nn.Module):
    """Big activations for few parameters: (B, 3, 256, 256) -> (B, CLASSES)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Conv2d(c, 64, 3, padding=1), nn.ReLU()) for c in (3, 64, 64, 64)))
        self.head = nn.Linear(64, CLASSES)

    def forward(self, x):
        return self.head(self.blocks(x).mean(dim=(2, 3)))


@pytest.mark.gpu
def test_a_real_cuda_out_of_memory_is_recovered(tmp_path):
    """Capped at 3 GiB, a micro-batch of 32 (about 4 GiB of activations) runs out of memory for real."""
    torch.manual_seed(0)
    model = WideConvNet()
    data = torch.utils.data.TensorDataset(torch.randn(64, 3, 256, 256), torch.randint(0, CLASSES, (64,)))
    plan = replace(make_plan(model, global_batch_size=32, micro_batch_size=32, checkpoint=()), device=DeviceInfo(type="cuda"))
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(3 * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    try:
        result = run(model, plan, tmp_path, data=TrainData(train=data, val=None), epochs=1)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert result.plan.history and result.plan.config.micro_batch_size < 32 and result.plan.config.global_batch_size == 32
    assert "out of memory" in result.plan.history[0]["error"].lower()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == 2 and all(math.isfinite(r["loss"]) for r in steps)
    assert all(0 < r["peak_bytes"] <= 3 * 2**30 for r in steps)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_training_in_mixed_precision(tmp_path, precision):
    model = fresh_model()
    plan = replace(make_plan(model, precision=precision), device=DeviceInfo(type="cuda"))
    result = run(model, plan, tmp_path)
    assert result.finished and all(math.isfinite(r["train_loss"]) for r in result.history)
    assert next(model.parameters()).device.type == "cuda"
    saved = load_checkpoint(tmp_path / "last.pt")
    assert ("scale" in saved["training"]["scaler"]) == (precision == "fp16")


def test_fit_without_a_plan_plans_then_trains(tmp_path):
    pytest.importorskip("autofit.planning.planner")
    import autofit

    model = fresh_model()
    data = make_data()
    result = autofit.fit(
        model, train_data=data.train, val_data=data.val, budget="64MB", batch_size=8, epochs=1,
        optimizer=optimizer, log_dir=tmp_path, verbose=False,
    )
    assert result.plan.config.global_batch_size == 8 and result.plan.budget_bytes == 64 * 10**6
    assert result.plan.model.fingerprint == model_fingerprint(model)
    assert len(result.history) == 1 and result.best_path.exists()
    assert load_plan(tmp_path / "run_plan.json").config.global_batch_size == 8


@pytest.mark.parametrize("choices", [
    dict(precision="bf16"),
    dict(precision="fp16"),
    dict(checkpoint=["blocks.0"], selective_checkpoint=["blocks.1"], offload=["blocks.2"]),
    dict(micro_batch_size=8, optimizer_in_backward=True),
    dict(optimizer_state="host"),
    dict(optimizer_state="8bit"),
    dict(micro_batch_size=8, optimizer_in_backward=True, optimizer_state="8bit"),
], ids=lambda choices: "+".join(f"{k}={v}" for k, v in choices.items()))
def test_every_lever_the_planner_can_choose_trains_end_to_end_on_the_cpu(tmp_path, choices):
    """A plan with 8-bit state used to crash in training: torchao's compiled step met the budget watch's tracker."""
    if choices.get("optimizer_state") == "8bit":
        pytest.importorskip("torchao")
    model = fresh_model()
    plan = make_plan(model, checkpoint=())
    plan = replace(plan, config=replace(plan.config, **choices))
    result = run(model, plan, tmp_path, epochs=1)
    assert result.finished and all(math.isfinite(r["train_loss"]) for r in result.history)
    assert result.plan.config == plan.config and result.best_path.is_file()
