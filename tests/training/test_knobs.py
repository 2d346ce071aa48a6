"""Training knobs: gradient clipping (torch.equal to clip_grad_norm_ in a plain loop), the learning-rate schedules,
weight decay off for biases and norms, and a build_optimizer that takes named parameters."""
import pytest
import torch
from torch import nn

from autofit.apply import apply_config
from autofit.config import TrainingConfig, step_in_backward_refusal
from autofit.errors import UserError
from autofit.spec import decay_groups, default_optimizer
from autofit.step import train_step
from autofit.training.schedule import lr_schedule


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))


def _batches(steps: int = 3, batch: int = 8):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 6, generator=generator) * 10, torch.randint(0, 3, (batch,), generator=generator)) for _ in range(steps)]


@pytest.mark.parametrize("micro_batch_size", [8, 2])
def test_max_grad_norm_equals_clip_grad_norm_in_a_plain_loop(micro_batch_size):
    """fp32, one micro-batch or 4 accumulated: the clipped step's weights are torch.equal to PyTorch's own."""
    ours, theirs = _model(), _model()
    applied = apply_config(ours, TrainingConfig(global_batch_size=8, micro_batch_size=micro_batch_size, max_grad_norm=1.0), device="cpu")
    optimizer = applied.build_optimizer(lambda params: torch.optim.AdamW(params, lr=0.1))
    plain = torch.optim.AdamW(theirs.parameters(), lr=0.1)
    norms = []
    for inputs, targets in _batches():
        train_step(applied, inputs, targets, loss_fn=nn.functional.cross_entropy, optimizer=optimizer)
        for x, y in zip(inputs.split(micro_batch_size), targets.split(micro_batch_size)):
            (nn.functional.cross_entropy(theirs(x), y) * (len(x) / len(inputs))).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0).item())
        plain.step()
        plain.zero_grad()
    assert max(norms) > 1.0  # the clip acted
    for mine, reference in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(mine, reference)


def test_without_max_grad_norm_nothing_is_clipped():
    ours, theirs = _model(), _model()
    applied = apply_config(ours, TrainingConfig(global_batch_size=8, micro_batch_size=8), device="cpu")
    optimizer = applied.build_optimizer(lambda params: torch.optim.SGD(params, lr=0.1))
    plain = torch.optim.SGD(theirs.parameters(), lr=0.1)
    inputs, targets = _batches(1)[0]
    train_step(applied, inputs, targets, loss_fn=nn.functional.cross_entropy, optimizer=optimizer)
    nn.functional.cross_entropy(theirs(inputs), targets).backward()
    plain.step()
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))


def test_clipping_rules_out_the_step_in_backward():
    assert "cannot clip gradients (--max-grad-norm 1)" in step_in_backward_refusal(
        precision="fp32", global_batch_size=8, micro_batch_size=8, world_size=1, max_grad_norm=1.0,
    )
    with pytest.raises(UserError, match=r"optimizer step in backward cannot clip gradients"):
        TrainingConfig(global_batch_size=8, micro_batch_size=8, optimizer_in_backward=True, max_grad_norm=1.0)
    with pytest.raises(UserError, match=r"max_grad_norm=-1.0 must be a positive finite number"):
        TrainingConfig(global_batch_size=8, micro_batch_size=8, max_grad_norm=-1.0)


def test_the_planner_leaves_the_step_in_backward_out_when_clipping_and_says_why(tmp_path):
    import autofit

    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    example = lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,)))  # noqa: E731
    plan = autofit.plan(model, example, budget="1MB", batch_size=8, simulate=True, max_grad_norm=1.0, cache=False)
    assert plan.config.max_grad_norm == 1.0 and not plan.config.optimizer_in_backward
    assert any("optimizer step in backward was left out: it cannot clip gradients" in note for note in plan.notes)
    assert autofit.load_plan(autofit.save_plan(plan, tmp_path / "plan.json")).config.max_grad_norm == 1.0


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedules_warm_up_then_follow_their_kind(kind):
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = lr_schedule(optimizer, kind=kind, warmup_steps=4, total_steps=14)
    rates = []
    for _ in range(16):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[:5] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])
    assert rates[14] == rates[15] == pytest.approx({"constant": 2.0}.get(kind, 0.2))
    if kind == "linear":
        assert rates[9] == pytest.approx(2.0 - 1.8 * 0.5)
    if kind == "cosine":  # past the warm-up, torch's own cosine from 2.0 to 0.2
        reference = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(reference, T_max=10, eta_min=0.2)
        expected = []
        for _ in range(10):
            expected.append(reference.param_groups[0]["lr"])
            reference.step()
            cosine.step()
        assert rates[4:14] == pytest.approx(expected)


def test_schedule_values_are_checked():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(UserError, match=r"--schedule 'step' is unknown; choose cosine\|linear\|constant"):
        lr_schedule(optimizer, kind="step", total_steps=3)
    with pytest.raises(UserError, match=r"--warmup-steps -1 must be 0 or more"):
        lr_schedule(optimizer, warmup_steps=-1, total_steps=3)


def test_default_adamw_decays_matrices_only():
    model = _model()
    optimizer = default_optimizer(model.parameters())
    decayed, undecayed = optimizer.param_groups
    assert decayed["weight_decay"] == 0.01 and [p.ndim for p in decayed["params"]] == [2, 2]
    assert undecayed["weight_decay"] == 0.0 and [p.ndim for p in undecayed["params"]] == [1, 1, 1, 1]
    assert len(decay_groups([nn.Parameter(torch.zeros(3))])) == 1


@pytest.mark.parametrize("optimizer_state", ["device", "host"])
def test_build_optimizer_may_take_named_parameters(optimizer_state):
    """A builder whose first argument is named_parameters gets (name, parameter) pairs, also through a strategy that
    hands it host copies; one that takes params keeps getting parameters."""
    seen = {}

    def build_optimizer(named_parameters):
        named_parameters = list(named_parameters)
        seen["names"] = [name for name, _ in named_parameters]
        no_decay = [p for name, p in named_parameters if name.endswith("bias") or name.startswith("1.")]
        decay = [p for name, p in named_parameters if not (name.endswith("bias") or name.startswith("1."))]
        return torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)

    model = _model()
    applied = apply_config(model, TrainingConfig(global_batch_size=4, micro_batch_size=4, optimizer_state=optimizer_state), device="cpu")
    optimizer = applied.build_optimizer(build_optimizer)
    assert seen["names"] == [name for name, _ in model.named_parameters()]
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 4]
    assert isinstance(applied.build_optimizer(lambda params: torch.optim.SGD(params, lr=1.0)), torch.optim.Optimizer)


def test_a_model_files_named_parameters_builder_still_gets_names(tmp_path):
    """The model file's builder is wrapped to turn its errors into one line; the wrapper keeps its signature."""
    from autofit.spec import load_spec, wants_names

    path = tmp_path / "named.py"
    path.write_text(
        "import torch\n"
        "def build_model():\n    return torch.nn.Linear(2, 2)\n"
        "def example_batch(n):\n    return torch.randn(n, 2), torch.randint(0, 2, (n,))\n"
        "def build_optimizer(named_parameters):\n    return torch.optim.SGD([p for _, p in named_parameters], lr=0.1)\n"
    )
    assert wants_names(load_spec(str(path)).build_optimizer)


def test_fp16_clips_the_unscaled_gradients_as_pytorch_recommends():
    """GradScaler's recipe: unscale_, clip_grad_norm_, step, update; the same weights, torch.equal."""
    ours, theirs = _model(), _model()
    applied = apply_config(ours, TrainingConfig(global_batch_size=8, micro_batch_size=4, precision="fp16", max_grad_norm=1.0), device="cpu")
    optimizer = applied.build_optimizer(lambda params: torch.optim.SGD(params, lr=0.1))
    plain = torch.optim.SGD(theirs.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for inputs, targets in _batches(2):
        train_step(applied, inputs, targets, loss_fn=nn.functional.cross_entropy, optimizer=optimizer)
        for x, y in zip(inputs.split(4), targets.split(4)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(theirs(x), y) * 0.5
            scaler.scale(loss).backward()
        scaler.unscale_(plain)
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
        scaler.step(plain)
        scaler.update()
        plain.zero_grad()
    for mine, reference in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(mine, reference)
