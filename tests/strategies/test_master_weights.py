"""bf16 weights on the device with an fp32 master and the optimizer on the host (precision "bf16-master").

Its arithmetic is a reference loop's, bit for bit: bf16 autocast over bf16 weights, each gradient added in
fp32 on the master, torch's AdamW on the masters, the device's weights the masters rounded to bf16.
"""
import copy

import pytest
import torch
from torch.nn import functional as F

from autofit.apply import apply_config
from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.measure.probe import probe
from autofit.step import train_step
from strategies import stepped_parameters
from tests.helpers.models import layout_specs


def batches(steps: int = 4):
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 3, 16, 16, generator=generator), torch.randint(0, 10, (8,), generator=generator)) for _ in range(steps)]


def build(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def reference(model: torch.nn.Module, data, *, micro_batch_size: int) -> tuple[dict, list]:
    """Plain PyTorch: fp32 masters, bf16 weights, autocast, gradients added on the masters in fp32, AdamW there."""
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().clone().float() for p in params]
    with torch.no_grad():  # normalization layers keep fp32 weights (beside fp32 running statistics)
        for module in model.modules():
            if not isinstance(module, (torch.nn.BatchNorm2d, torch.nn.LayerNorm)):
                for p in module.parameters(recurse=False):
                    p.data = p.data.to(torch.bfloat16)
    optimizer = build(masters)
    for inputs, targets in data:
        parts = range(0, len(inputs), micro_batch_size)
        for start in parts:
            x, y = inputs[start:start + micro_batch_size], targets[start:start + micro_batch_size]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y).float()
            (loss if len(parts) == 1 else loss * (len(x) / len(inputs))).backward()
            for param, master in zip(params, masters):
                grad = param.grad.float()
                master.grad = grad if master.grad is None else master.grad + grad
                param.grad = None
        optimizer.step()
        with torch.no_grad():
            for param, master in zip(params, masters):
                param.copy_(master)
        optimizer.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, masters


def autofit_run(model: torch.nn.Module, data, *, micro_batch_size: int):
    config = TrainingConfig(global_batch_size=8, micro_batch_size=micro_batch_size, precision="bf16-master")
    applied = apply_config(model, config, device="cpu")
    optimizer = applied.build_optimizer(build)
    for inputs, targets in data:
        train_step(applied, inputs, targets, loss_fn=F.cross_entropy, optimizer=optimizer)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, optimizer


@pytest.mark.parametrize("micro_batch_size", [8, 4])
def test_bf16_master_equals_its_reference_loop_bit_for_bit(micro_batch_size):
    model = layout_specs()["cnn"].build_model()
    expected, expected_masters = reference(copy.deepcopy(model), batches(), micro_batch_size=micro_batch_size)
    weights, optimizer = autofit_run(model, batches(), micro_batch_size=micro_batch_size)
    for name, value in expected.items():
        assert weights[name].dtype == value.dtype and torch.equal(weights[name], value), name
    assert any(value.dtype == torch.bfloat16 for value in weights.values())
    for master, value in zip(optimizer.copies, expected_masters):
        assert master.dtype == torch.float32 and torch.equal(master, value)


def test_the_device_holds_half_the_weights_and_the_host_the_masters_and_state():
    spec = layout_specs()["lm"]
    bf16 = probe(spec, micro_batch_size=4, precision="bf16", steps=2)
    master = probe(spec, micro_batch_size=4, precision="bf16-master", steps=2)
    assert master.breakdown["parameters"] < 0.55 * bf16.breakdown["parameters"]  # 2 bytes a weight; norms keep 4
    assert master.breakdown["optimizer_state"] == 0 and master.host_peak_bytes >= 3 * bf16.breakdown["parameters"]
    simulated = probe(spec, micro_batch_size=4, precision="bf16-master", steps=2, simulate=True)
    assert simulated.peak_bytes == master.peak_bytes and simulated.host_peak_bytes == master.host_peak_bytes


@pytest.mark.gpu
def test_the_weights_reach_the_card_already_in_bf16():
    """The cast happens on the host: the card never holds the fp32 weights (an 8B model's would not fit its 24 GiB)."""
    model = layout_specs()["lm"].build_model()
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    apply_config(model, TrainingConfig(global_batch_size=8, micro_batch_size=8, precision="bf16-master"), device="cuda")
    assert torch.cuda.max_memory_allocated() - before < 0.6 * fp32_bytes  # 2 bytes a weight; norms keep 4


def test_the_masters_survive_a_saved_optimizer_state():
    model = layout_specs()["cnn"].build_model()
    weights, optimizer = autofit_run(model, batches(2), micro_batch_size=8)
    state = copy.deepcopy(optimizer.state_dict())
    other = layout_specs()["cnn"].build_model()
    applied = apply_config(other, TrainingConfig(global_batch_size=8, micro_batch_size=8, precision="bf16-master"), device="cpu")
    restored = applied.build_optimizer(build)
    restored.load_state_dict(state)
    for master, value in zip(restored.copies, optimizer.copies):
        assert torch.equal(master, value)
    for (name, param), value in zip(other.named_parameters(), weights.values()):
        assert torch.equal(param, value), name


@pytest.mark.parametrize("choices, words", [
    (dict(optimizer_state="host"), "leave optimizer_state at device"),  # built in Python: the keyword
    (dict(optimizer_in_backward=True), "cannot run with bf16-master"),
])
def test_impossible_companions_are_one_line(choices, words):
    with pytest.raises(UserError, match=words):
        TrainingConfig(global_batch_size=8, micro_batch_size=8, precision="bf16-master", **choices)


def test_simulated_for_a_gpu_the_host_update_steps_one_parameter_at_a_time():
    """On a card PyTorch's AdamW steps all its CUDA parameters at once (a temporary copy of each); the host's update
    of the masters runs on CPU tensors, one parameter at a time, and is simulated so."""
    spec = layout_specs()["lm"]
    on_cpu = probe(spec, micro_batch_size=4, precision="bf16-master", steps=2, simulate=True)
    for_cuda = probe(spec, micro_batch_size=4, precision="bf16-master", steps=2, simulate=True, device="cuda")
    assert for_cuda.host_peak_bytes < 1.1 * on_cpu.host_peak_bytes  # each of its small tensors rounded to 512 bytes (1.23x stepping all at once)


@pytest.mark.parametrize("state", [{"optimizer_state": "host"}, {"precision": "bf16-master"}])
def test_clipping_acts_on_the_gradients_the_host_steps_from(state):
    """Host state and bf16 masters move each gradient to the host as backward makes it: clipping must scale those
    (``stepped_parameters``), or it clips nothing and the step is the unclipped one."""

    def built() -> torch.nn.Module:
        torch.manual_seed(0)
        return layout_specs()["cnn"].build_model()

    def stepped(config: TrainingConfig) -> list[torch.Tensor]:
        """The fp32 values the optimizer updated (the host's copies or masters; the parameters on the device)."""
        applied = apply_config(built(), config, device="cpu")
        optimizer = applied.build_optimizer(lambda params: torch.optim.SGD(params, lr=1.0))
        train_step(applied, *batches(1)[0], loss_fn=F.cross_entropy, optimizer=optimizer)
        return [p.detach().clone() for p in stepped_parameters(optimizer)]

    start = [p.detach() for p in built().parameters()]
    common = dict(global_batch_size=8, micro_batch_size=8, max_grad_norm=1e-3)
    on_host, on_device = stepped(TrainingConfig(**common, **state)), stepped(TrainingConfig(**common))
    moved = torch.cat([(after - before).flatten() for after, before in zip(on_host, start)]).norm()
    assert moved < 1.01e-3, f"the host step moved the weights by {moved:.3g}: the gradients were not clipped"
    for after, expected in zip(on_host, on_device):  # the same clipped SGD step (bf16 weights' gradients round it)
        torch.testing.assert_close(after, expected, atol=1e-4 if "precision" in state else 1e-7, rtol=0)
