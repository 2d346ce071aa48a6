import pytest
import torch

from autofit.measure.probe import probe
from tests.helpers.models import resnet_spec, transformer_spec

SPECS = {
    "resnet18": resnet_spec,
    "transformer-mha": lambda: transformer_spec("mha"),
    "transformer-sdpa": lambda: transformer_spec("sdpa"),
}


# Every pair of (model, checkpoint, precision) values at least once, in 6 cells of the 12: each model in
# fp32 and in bf16, with and without checkpointing. The one left out with both levers on, SDPA in bf16
# with its blocks checkpointed, is compared in tests/planning/memory/test_memory_grid.py (the LM, bf16) and below in fp16.
@pytest.mark.parametrize(("precision", "checkpoint", "model"), [
    ("fp32", "none", "resnet18"), ("bf16", "all", "resnet18"),
    ("fp32", "none", "transformer-mha"), ("bf16", "all", "transformer-mha"),
    ("fp32", "all", "transformer-sdpa"), ("bf16", "none", "transformer-sdpa"),
])
def test_simulated_equals_cpu_tracked(model, checkpoint, precision):
    spec = SPECS[model]()
    settings = dict(micro_batch_size=4, grad_accum_steps=2, precision=precision, checkpoint=checkpoint, steps=2)
    real = probe(spec, **settings)
    simulated = probe(spec, simulate=True, **settings)
    assert real.meter == "cpu" and simulated.meter == "simulated"
    assert simulated.samples_per_s is None and real.samples_per_s > 0
    assert simulated.peak_bytes == pytest.approx(real.peak_bytes, rel=0.01)
    for category, value in real.breakdown.items():
        assert simulated.breakdown[category] == pytest.approx(value, rel=0.01, abs=4096)


def test_breakdown_adds_up_and_names_the_parts():
    spec = resnet_spec()
    result = probe(spec, micro_batch_size=4, steps=2)
    model = spec.build_model()
    param_bytes = sum(p.numel() * 4 for p in model.parameters()) + sum(b.numel() * b.element_size() for b in model.buffers())
    assert result.breakdown["parameters"] == param_bytes
    assert result.breakdown["optimizer_state"] >= 2 * sum(p.numel() * 4 for p in model.parameters())  # AdamW: m and v
    assert sum(result.breakdown.values()) == result.peak_bytes


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_checkpointing_and_smaller_micro_batches_lower_activations():
    spec = transformer_spec("sdpa")
    base = probe(spec, micro_batch_size=8, simulate=True, steps=2)
    checkpointed = probe(spec, micro_batch_size=8, checkpoint="all", simulate=True, steps=2)
    smaller = probe(spec, micro_batch_size=2, grad_accum_steps=4, simulate=True, steps=2)
    assert checkpointed.breakdown["activations"] < 0.6 * base.breakdown["activations"]
    assert smaller.breakdown["activations"] < 0.5 * base.breakdown["activations"]
    assert smaller.global_batch_size == base.global_batch_size == 8


def test_simulating_a_big_model_allocates_nothing_real():
    spec = resnet_spec()
    # 4096 images of 3x32x32 would need gigabytes of activations for real.
    result = probe(spec, micro_batch_size=4096, simulate=True, steps=1)
    assert result.peak_bytes > 1.5 * 2**30


@pytest.mark.gpu
def test_cuda_meter_counts_the_allocator_and_the_context():
    spec = resnet_spec()
    cuda = probe(spec, micro_batch_size=32, device="cuda", steps=3)
    simulated = probe(spec, micro_batch_size=32, device="cuda", simulate=True, steps=3)
    assert cuda.meter == "cuda"
    assert cuda.breakdown["context"] > 0
    allocated = cuda.peak_bytes - cuda.breakdown["allocator_cache"] - cuda.breakdown["context"]
    # Beyond the tensors the simulation sees, the allocator holds cuBLAS/cuDNN workspaces:
    # about 92 MiB more than predicted for this small model on an H200 (bench/RESULTS.md).
    assert simulated.peak_bytes <= allocated <= 1.1 * simulated.peak_bytes + 128 * 2**20
    assert torch.cuda.max_memory_allocated() > 0


def test_simulated_equals_cpu_tracked_with_fp16_and_its_scaler():
    # The real run has a GradScaler, the simulated one cannot (data-dependent inf check):
    # its few scalars must not change the count beyond 1%.
    spec = transformer_spec("sdpa")
    settings = dict(micro_batch_size=2, grad_accum_steps=1, precision="fp16", checkpoint="all", steps=2)
    real = probe(spec, **settings)
    simulated = probe(spec, simulate=True, **settings)
    assert simulated.peak_bytes == pytest.approx(real.peak_bytes, rel=0.01)
    assert real.breakdown["optimizer_state"] == simulated.breakdown["optimizer_state"] > 0


def test_simulating_a_gpu_steps_the_optimizer_as_on_the_card():
    """PyTorch's AdamW left to choose steps CUDA tensors with foreach kernels, which hold a temporary copy of every
    parameter at once; over fake CPU tensors it would step one parameter at a time. The simulated meter for a GPU
    steps as the card does: an MLP whose optimizer step is its peak holds each group's parameters once more there."""
    from autofit.spec import ModelSpec, default_optimizer

    def build():
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)], torch.nn.Linear(256, 4))

    spec = ModelSpec(
        source="tests:mlp", build_model=build, build_optimizer=default_optimizer, loss_fn=torch.nn.functional.cross_entropy,
        example_batch=lambda n: (torch.randn(n, 256), torch.randint(0, 4, (n,))), input_shape=(256,),
    )
    parameter_bytes = sum(p.numel() * 4 for p in build().parameters())
    # The default AdamW steps its groups one after the other: the matrices (with weight decay), then the biases.
    matrix_bytes = sum(p.numel() * 4 for p in build().parameters() if p.ndim >= 2)
    on_gpu = probe(spec, micro_batch_size=2, global_batch_size=2, simulate=True, device="cuda", steps=2)
    on_cpu = probe(spec, micro_batch_size=2, global_batch_size=2, simulate=True, device="cpu", steps=2)
    assert on_gpu.breakdown["activations"] >= matrix_bytes  # the step's temporaries: a copy of every parameter of a group
    assert on_cpu.breakdown["activations"] < 0.5 * parameter_bytes  # one parameter's at a time (each an eighth)


def test_simulating_a_gpu_keeps_attention_with_dropout_as_a_fused_kernel_does():
    """On the CPU, attention with dropout keeps its probabilities, mask and dropped probabilities for backward; a
    card's fused kernels keep only the output (GPT-2 on an H200: simulated 3.32 GiB with them, allocated 2.23)."""
    from torch import nn
    from torch.nn import functional as F

    from autofit.spec import ModelSpec, default_optimizer

    class Attention(nn.Module):
        def __init__(self, dropout: float) -> None:
            super().__init__()
            self.qkv, self.out, self.dropout = nn.Linear(32, 96), nn.Linear(32, 4), dropout

        def forward(self, x):  # (B, T, 32): 4 heads of 8
            q, k, v = (t.unflatten(-1, (4, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
            return self.out(y.transpose(1, 2).flatten(2)).mean(1)

    def peak(dropout: float, device: str) -> int:
        spec = ModelSpec(
            source="tests:attention", build_model=lambda: Attention(dropout), build_optimizer=default_optimizer,
            loss_fn=F.cross_entropy, example_batch=lambda n: (torch.randn(n, 256, 32), torch.randint(0, 4, (n,))), input_shape=(256, 32),
        )
        return probe(spec, micro_batch_size=4, simulate=True, device=device, steps=1).peak_bytes

    probabilities = 4 * 4 * 256 * 256 * 4  # batch x heads x T x T, fp32
    assert peak(0.1, "cuda") == peak(0.0, "cuda")
    assert peak(0.1, "cpu") >= peak(0.0, "cpu") + 2 * probabilities  # the CPU's math path keeps them, as it runs there
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # put back
