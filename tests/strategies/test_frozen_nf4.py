"""Frozen weights in NF4 (QLoRA's base): the gradients of a plain run over the dequantized weights, and the bytes."""
import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autofit.apply import apply_config
from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.measure.probe import measure
from autofit.model_io import Loss
from autofit.planning.memory.traces import simulation_spec
from autofit.spec import ModelSpec, default_optimizer
from autofit.step import train_step
from strategies import nf4_weights

pytest.importorskip("torchao")
peft = pytest.importorskip("peft")
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4  # noqa: E402

WIDTH = 128  # 128 x 128 = 16,384 elements: one NF4 block of blocks


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 5)

    def forward(self, x):  # (B, WIDTH) -> (B, 5)
        return self.head(F.gelu(self.down(F.gelu(self.up(x)))))


def lora_mlp() -> nn.Module:
    torch.manual_seed(0)
    model = peft.get_peft_model(MLP(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"]))
    for name, param in model.named_parameters():  # the adapters start away from zero, so every gradient is nonzero
        if "lora_B" in name:
            nn.init.normal_(param, std=0.1)
    return model


def batch(n: int = 8):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, WIDTH, generator=generator), torch.randint(0, 5, (n,), generator=generator)


class Recorder(torch.optim.SGD):
    def step(self, closure=None):
        self.grads = {id(p): p.grad.clone() for group in self.param_groups for p in group["params"]}
        return super().step(closure)


def test_the_adapters_get_the_gradients_of_a_plain_run_over_the_dequantized_base():
    model = lora_mlp()
    reference = copy.deepcopy(model)
    with torch.no_grad():  # the plain run: each frozen base weight rounded as NF4 rounds it
        for linear in nf4_weights(reference):
            linear.weight.copy_(to_nf4(linear.weight.detach()).get_original_weight())
    inputs, targets = batch()
    F.cross_entropy(reference(inputs), targets).backward()

    applied = apply_config(model, TrainingConfig(global_batch_size=8, micro_batch_size=4, frozen_nf4=True), device="cpu")
    assert [type(m.weight).__name__ for m in nf4_weights(applied.model)] == ["NF4Tensor", "NF4Tensor"]
    trained = [p for p in applied.model.parameters() if p.requires_grad]
    optimizer = Recorder(trained, lr=0.0)
    train_step(applied, inputs, targets, loss_fn=F.cross_entropy, optimizer=optimizer)
    expected = [p.grad for p in reference.parameters() if p.requires_grad]
    assert len(trained) == len(expected) == 4  # the adapters (A and B) of up and down
    for param, grad in zip(trained, expected, strict=True):
        torch.testing.assert_close(optimizer.grads[id(param)], grad, rtol=1e-5, atol=1e-6)


def test_weights_that_train_or_that_nf4_blocks_do_not_divide_stay_dense():
    model = lora_mlp()
    # up and down are frozen and 128 x 128; the adapters train; the head is frozen too, but its 5 x 128 weights are
    # no multiple of NF4's 16,384-element blocks
    assert [name for name, m in model.named_modules() if m in nf4_weights(model)] == [
        "base_model.model.up.base_layer", "base_model.model.down.base_layer",
    ]


def spec() -> ModelSpec:
    return ModelSpec(
        source="lora mlp", build_model=lora_mlp, example_batch=batch, loss_fn=Loss(F.cross_entropy),
        build_optimizer=default_optimizer,
    )


def test_nf4_holds_the_frozen_weights_in_about_an_eighth_and_both_meters_agree():
    dense = TrainingConfig(global_batch_size=8, micro_batch_size=8)
    nf4 = TrainingConfig(global_batch_size=8, micro_batch_size=8, frozen_nf4=True)
    real_dense = measure(spec(), dense, device="cpu", simulate=False, steps=1)
    real_nf4 = measure(spec(), nf4, device="cpu", simulate=False, steps=1)
    frozen = 2 * WIDTH * WIDTH * 4
    saved = real_dense.breakdown["parameters"] - real_nf4.breakdown["parameters"]
    assert 0.85 * frozen < saved < 0.88 * frozen  # 4 bytes a weight down to about 0.52
    simulated = measure(simulation_spec(spec()), nf4, device="cpu", simulate=True, steps=1)
    assert simulated.peak_bytes == real_nf4.peak_bytes


def test_nf4_on_several_processes_is_refused_in_one_line():
    with pytest.raises(UserError, match="one process only"):
        TrainingConfig(global_batch_size=8, micro_batch_size=4, frozen_nf4=True, sharding="ddp", world_size=2)


LORA_FILE = '''
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

WIDTH = 256


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def build_model():
    return nn.Sequential(*(Block() for _ in range(16)), nn.Linear(WIDTH, 10))


def example_batch(n):
    return torch.randn(n, WIDTH), torch.randint(0, 10, (n,))


def train_dataset():
    return TensorDataset(*example_batch(16))
'''


@pytest.mark.slow  # a plan of a LoRA model, seconds to tens of seconds
def test_qlora_below_the_floor_is_planned_only_with_allow_lossy_base(run_cli, tmp_path, monkeypatch, one_thread):
    """A LoRA base of 8 MiB in fp32, a budget of 5 MB: only NF4 weights fit. Without the flag the floor's line says
    what they would save; with it the plan holds them, re-measures within its budget and trains."""
    from autofit.plan_file import load_plan

    source, out = tmp_path / "lora_mlp.py", tmp_path / "plan.json"
    source.write_text(LORA_FILE)
    args = ["plan", source, "--lora", "r=4,alpha=8,targets=up,down", "--budget", "5MB", "--batch-size", "8",
            "--precisions", "fp32", "--out", out]
    code, _, err = run_cli(*args)
    assert code == 2 and "--allow-lossy-base for frozen weights in NF4 (32 linear layer(s))" in err and "it would fit" in err
    code, stdout, err = run_cli(*args, "--allow-lossy-base")
    assert code == 0, err
    plan = load_plan(out)
    assert plan.config.frozen_nf4 and "frozen weights in NF4 (lossy)" in stdout
    code, stdout, err = run_cli("probe", "--plan", out, "--json")
    assert code == 0, err
    import json

    assert json.loads(stdout)["peak_bytes"] <= plan.budget_bytes
    monkeypatch.chdir(tmp_path)
    code, stdout, err = run_cli("train", "--plan", out, "--max-steps", "2")
    assert code == 0, err
    # best.pt holds the NF4 weights; rebuilt for evaluation or export they are the dense weights they stand for.
    from autofit.training.weights import load_checkpoint, model_from_checkpoint

    checkpoint = load_checkpoint(next((tmp_path / "runs").glob("*/best.pt")))
    name = "base_model.model.0.up.base_layer.weight"
    assert type(checkpoint["model_state"][name]).__name__ == "NF4Tensor"
    model, _ = model_from_checkpoint(checkpoint)
    assert torch.equal(model.state_dict()[name], checkpoint["model_state"][name].get_original_weight())


LORA_TOKENS_FILE = LORA_FILE.replace("WIDTH = 256", "WIDTH, TOKENS = 256, 64").replace(
    """def build_model():
    return nn.Sequential(*(Block() for _ in range(16)), nn.Linear(WIDTH, 10))""",
    """class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(16))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def build_model():
    return Net()""",
).replace("torch.randn(n, WIDTH)", "torch.randn(n, TOKENS, WIDTH)")
"""The LoRA base of ``LORA_FILE`` over 64 tokens a sample: 26 MiB of activations at a batch of 8 beside the 8 MiB base."""


@pytest.mark.slow  # a plan of a LoRA model, seconds to tens of seconds
def test_nf4_is_searched_above_the_floor_and_the_memory_model_bounds_its_peak(run_cli, tmp_path, monkeypatch, one_thread):
    """At 32 MiB, above the lossless floor, the dense base fits a batch of 8 only with blocks checkpointed or the batch
    split (its plain peak is 35 MiB). With --allow-lossy-base the search holds the base in NF4 and does neither, where
    the dequantization costs less than they do: priced near nothing here (this CPU times it at about 3 ns a weight
    element, more than recomputing these small products costs, and the search then keeps the base dense). The memory
    model's peak is above the measured one by at most one dequantization, and `autofit probe --plan` re-measures the
    plan within its budget. Without the flag no plan holds NF4."""
    import json

    from autofit.plan_file import load_plan
    from autofit.planning import lever_timings

    monkeypatch.setattr(lever_timings, "time_nf4_dequantize", lambda device, dtype: 1e-15)
    source, out = tmp_path / "lora_tokens.py", tmp_path / "plan.json"
    source.write_text(LORA_TOKENS_FILE)
    args = ["plan", source, "--lora", "r=4,alpha=8,targets=up,down", "--budget", "32MiB", "--batch-size", "8",
            "--precisions", "fp32", "--simulate", "--no-cache", "--out", out]
    code, _, err = run_cli(*args)
    assert code == 0, err
    dense = load_plan(out).config
    assert not dense.frozen_nf4 and (dense.checkpoint or dense.selective_checkpoint or dense.micro_batch_size < 8)
    code, stdout, err = run_cli(*args, "--allow-lossy-base")
    assert code == 0, err
    plan = load_plan(out)
    config = plan.config
    assert config.frozen_nf4 and config.micro_batch_size == 8 and not config.checkpoint and not config.selective_checkpoint
    assert "frozen weights in NF4: " in stdout and "held in 4-bit NF4" in stdout
    # one dequantization of a 256 x 256 fp32 weight holds about 1.3 MB (codes unpacked, indices, the dense weight)
    assert 0 <= plan.predicted.peak_bytes - plan.measured.peak_bytes <= 2 * 2**20
    code, stdout, err = run_cli("probe", "--plan", out, "--json")
    assert code == 0, err
    assert json.loads(stdout)["peak_bytes"] <= plan.budget_bytes - sum(plan.headroom.values())


@pytest.mark.slow  # a plan of a LoRA model, seconds to tens of seconds
def test_without_torchao_the_search_leaves_nf4_out_and_plans(run_cli, tmp_path, monkeypatch, capsys):
    """--allow-lossy-base where NF4 cannot run (torchao missing): the search says so and plans without it."""
    from autofit.planning import lever_timings

    def missing(*args, **kwargs):
        raise UserError("frozen weights in NF4 need torchao: pip install torchao (or 'autofit[hf]')")

    monkeypatch.setattr(lever_timings, "nf4_time", missing)
    source = tmp_path / "lora_tokens.py"
    source.write_text(LORA_TOKENS_FILE)
    code, _, err = run_cli("plan", source, "--lora", "r=4,alpha=8,targets=up,down", "--budget", "1GB", "--batch-size", "8",
                           "--precisions", "fp32", "--simulate", "--no-cache", "--allow-lossy-base", "--out", tmp_path / "plan.json")
    assert code == 0, err
    assert "left out: frozen weights in NF4 need torchao" in err


def test_merged_weights_of_an_nf4_base_give_the_adapted_models_outputs():
    """``--merge`` over QLoRA: the dequantized base plus PEFT's deltas, under the base model's own names."""
    from autofit.training.hf_export import merged_state_dict

    model = lora_mlp()
    applied = apply_config(model, TrainingConfig(global_batch_size=8, micro_batch_size=8, frozen_nf4=True), device="cpu")
    plain = MLP()
    plain.load_state_dict(merged_state_dict(applied.model))  # strict: every name of the plain model, no adapter's
    inputs, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(plain(inputs), applied.model(inputs), rtol=1e-5, atol=1e-5)
