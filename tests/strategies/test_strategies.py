import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from autofit.apply import apply_config
from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.step import train_step
from strategies import (
    BatchSplit,
    BatchSplitConfig,
    CheckpointConfig,
    Checkpointing,
    Precision,
    PrecisionConfig,
    checkpoint_candidates,
)
from tests.helpers.models import transformer_module


class GradRecorder(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it stepped with."""

    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for group in self.param_groups for p in group["params"]]
        return super().step(closure)


def tiny_transformer():
    torch.manual_seed(0)
    module = transformer_module("sdpa")
    return module.TinyTransformer("sdpa"), module.example_batch


def plain_gradients(model, inputs, targets):
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(inputs), targets).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def autofit_gradients(model, inputs, targets, *, micro_batch_size, blocks=(), precision="fp32"):
    config = TrainingConfig(global_batch_size=len(targets), micro_batch_size=micro_batch_size, precision=precision, checkpoint=list(blocks))
    applied = apply_config(model, config, device="cpu")
    optimizer = GradRecorder(applied.model.parameters(), lr=0.0)
    train_step(applied, inputs, targets, loss_fn=torch.nn.functional.cross_entropy, optimizer=optimizer)
    return optimizer.grads


def assert_all_close(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("micro_batch_size", [8, 2, 3])  # 8x1, 2x4, 3+3+2
def test_batch_split_gives_the_global_batch_gradient(micro_batch_size):
    model, example_batch = tiny_transformer()
    inputs, targets = example_batch(8)
    expected = plain_gradients(model, inputs, targets)
    assert_all_close(autofit_gradients(copy.deepcopy(model), inputs, targets, micro_batch_size=micro_batch_size), expected)


def test_split_sizes_and_weights():
    config = BatchSplitConfig(global_batch_size=8, micro_batch_size=3)
    assert config.sizes() == [3, 3, 2] and config.grad_accum_steps == 3
    assert config.size_counts() == [(3, 2), (2, 1)] and config.last_size == 2
    even = BatchSplitConfig(global_batch_size=9, micro_batch_size=3)
    assert even.size_counts() == [(3, 3)] and even.last_size == 3 and even.sizes() == [3, 3, 3]
    huge = BatchSplitConfig(global_batch_size=10**12, micro_batch_size=7)  # counted, never listed
    assert huge.size_counts() == [(7, 10**12 // 7), (10**12 % 7, 1)] and huge.last_size == 10**12 % 7
    pieces = list(BatchSplit(config).micro_batches(torch.arange(8), torch.arange(8)))
    assert [len(p[0]) for p in pieces] == [3, 3, 2]
    assert [p[2] for p in pieces] == [3 / 8, 3 / 8, 2 / 8]


@pytest.mark.parametrize("pick", ["one", "every-other", "all"])
def test_checkpointing_any_blocks_keeps_gradients(pick):
    model, example_batch = tiny_transformer()
    inputs, targets = example_batch(4)
    candidates = checkpoint_candidates(model)
    blocks = {"one": candidates[1:2], "every-other": candidates[::2], "all": candidates}[pick]
    expected = plain_gradients(model, inputs, targets)
    ours = autofit_gradients(copy.deepcopy(model), inputs, targets, micro_batch_size=2, blocks=blocks)
    assert_all_close(ours, expected)


def test_checkpointing_keeps_parameter_names():
    model, _ = tiny_transformer()
    keys = list(model.state_dict())
    Checkpointing(CheckpointConfig(blocks=checkpoint_candidates(model))).apply(model)
    assert list(model.state_dict()) == keys


def test_candidates_are_the_repeated_blocks():
    import torchvision

    assert checkpoint_candidates(tiny_transformer()[0]) == ["layers.0", "layers.1", "layers.2"]
    resnet = torchvision.models.resnet18(num_classes=10)
    assert checkpoint_candidates(resnet) == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]


def test_unknown_block_lists_the_candidates():
    model, _ = tiny_transformer()
    with pytest.raises(UserError, match="layers.0, layers.1, layers.2"):
        Checkpointing(CheckpointConfig(blocks=["nope"])).apply(model)


def test_flop_counter_shows_the_recompute():
    model, example_batch = tiny_transformer()
    inputs, targets = example_batch(4)

    def step_flops(blocks):
        counter = FlopCounterMode(display=False)
        with counter:
            autofit_gradients(copy.deepcopy(model), inputs, targets, micro_batch_size=4, blocks=blocks)
        return counter.get_total_flops()

    with FlopCounterMode(display=False) as forward_counter:
        model(inputs)
    forward = forward_counter.get_total_flops()
    blocks = checkpoint_candidates(model)
    extra = step_flops(blocks) - step_flops([])
    # Every checkpointed block runs its forward again in backward, up to its last saved
    # tensor (non-reentrant checkpointing stops early): two thirds of each block here.
    assert 0.6 * forward < extra <= forward


def test_precision_is_an_object_not_a_branch():
    fp32 = Precision(PrecisionConfig(precision="fp32"), device_type="cpu")
    bf16 = Precision(PrecisionConfig(precision="bf16"), device_type="cpu")
    fp16 = Precision(PrecisionConfig(precision="fp16"), device_type="cpu")
    layer = torch.nn.Linear(4, 4)
    with fp32.forward_context():
        assert layer(torch.ones(1, 4)).dtype == torch.float32
    with bf16.forward_context():
        assert layer(torch.ones(1, 4)).dtype == torch.bfloat16
    assert not fp32.scaler.is_enabled() and not bf16.scaler.is_enabled() and fp16.scaler.is_enabled()
    with pytest.raises(UserError, match="fp8"):
        PrecisionConfig(precision="fp8")


def test_fp16_scaler_skips_a_step_with_inf_gradients():
    layer = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    fp16 = Precision(PrecisionConfig(precision="fp16"), device_type="cpu")
    before = layer.weight.detach().clone()
    fp16.backward(layer(torch.tensor([[float("inf"), 1.0]])).sum())
    assert fp16.optimizer_step(optimizer) is False
    assert torch.equal(layer.weight, before)


def test_checkpointed_block_frees_its_autocast_weight_copies():
    """Autocast's cache would keep a checkpointed block's bf16 weight copies alive until autocast exits."""
    from autofit.measure.tracker import StorageTracker

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256, bias=False))
    Checkpointing(CheckpointConfig(blocks=checkpoint_candidates(model))).apply(model)
    bf16 = Precision(PrecisionConfig(precision="bf16"), device_type="cpu")
    tracker = StorageTracker()
    with tracker, bf16.forward_context():
        x = torch.randn(4, 256, requires_grad=True)
        out = model(x)
        live = tracker.current_bytes
        assert torch.is_autocast_cache_enabled()  # the rest of the model keeps the cache
    weight_copy = 256 * 256 * 2
    assert live < weight_copy  # the input, the block output and the output: no weight copy
    out.float().sum().backward()  # the recomputation casts its own copies again
    assert x.grad is not None
    del out


def test_checkpointing_under_bf16_keeps_gradients():
    model, example_batch = tiny_transformer()
    inputs, targets = example_batch(4)
    plain = autofit_gradients(copy.deepcopy(model), inputs, targets, micro_batch_size=4, precision="bf16")
    checkpointed = autofit_gradients(
        copy.deepcopy(model), inputs, targets, micro_batch_size=4, blocks=checkpoint_candidates(model), precision="bf16"
    )
    for a, b in zip(checkpointed, plain):
        assert torch.equal(a, b)  # the recomputation casts the same weights to the same values


def test_checkpointing_turns_off_a_kv_cache():
    """A Hugging Face-style config.use_cache would make recomputed blocks append keys and values twice."""
    from types import SimpleNamespace

    class WithConfig(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(use_cache=True)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    untouched = Checkpointing(CheckpointConfig(blocks=[])).apply(WithConfig())
    assert untouched.config.use_cache is True  # nothing recomputes: the cache stays as the user set it
    model = Checkpointing(CheckpointConfig(blocks=["layers.1"])).apply(WithConfig())
    assert model.config.use_cache is False
    inner = torch.nn.Sequential(WithConfig())  # a wrapper around such a model
    Checkpointing(CheckpointConfig(blocks=["0.layers.0"])).apply(inner)
    assert inner[0].config.use_cache is False


@pytest.mark.parametrize("build", ["InplaceCNN", "inplace_vgg"], ids=["in the block", "after the block"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_selective_checkpointing_recomputes_an_output_changed_in_place(one_thread, build, precision):
    """A kept convolution output that ReLU(inplace=True) or ``+=`` then overwrites, inside the block or after it:
    its convolution runs again in backward, and 3 AdamW steps give plain training's weights."""
    from tests.helpers import models

    torch.manual_seed(0)
    model = getattr(models, build)()
    reference = copy.deepcopy(model)
    data = [models._small_images(4) for _ in range(3)]

    def train(trained, selective):
        config = TrainingConfig(global_batch_size=4, micro_batch_size=4, precision=precision, selective_checkpoint=selective)
        applied = apply_config(trained, config, device="cpu")
        optimizer = applied.build_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-2))
        for inputs, targets in data:
            train_step(applied, inputs, targets, loss_fn=torch.nn.functional.cross_entropy, optimizer=optimizer)

    train(reference, [])
    train(model, checkpoint_candidates(model))
    assert Checkpointing.applied_selective_blocks(model) == checkpoint_candidates(reference)
    for (name, ours), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(ours, theirs), name


def test_an_output_changed_in_place_counts_as_recomputed():
    """The speed model's share of a block that selective checkpointing recomputes: both convolutions of an
    InplaceBlock are overwritten in place, so all of it; without the in-place ops they are kept."""
    from autofit.planning.speed.estimated import selective_shares
    from tests.helpers import models

    def shares(model):
        applied = apply_config(model, TrainingConfig(global_batch_size=2, micro_batch_size=2), device="cpu")
        return selective_shares(applied, models._small_images(2)[0], blocks=checkpoint_candidates(model),
                                flops_per_s={"conv": 1e9, "matmul": 1e9}, bytes_per_s=1e9)

    in_place = models.InplaceCNN()
    assert shares(in_place) == [1.0, 1.0, 1.0]
    for block in in_place.blocks:
        block.relu.inplace = False
        block.forward = lambda x, block=block: block.relu(block.conv2(block.relu(block.conv1(x))) + x)
    assert all(share < 0.5 for share in shares(in_place))
