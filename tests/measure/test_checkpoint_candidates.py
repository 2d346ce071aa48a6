"""Block discovery: every layout's blocks are found, nothing the forward never calls is offered."""
import pytest
import torch
import torchvision
from torch import nn

from autofit.errors import UserError
from strategies import CheckpointConfig, Checkpointing, checkpoint_candidates, checkpoint_granularities
from strategies.checkpointing import resolve_blocks
from tests.helpers.models import ConvBN, DictCNN, StagedCNN, TinyUNet, transformer_module

IMAGES = torch.randn(2, 3, 16, 16)


def calls_in_a_training_step(model: nn.Module, names: list[str], inputs: torch.Tensor) -> dict[str, int]:
    """How often each named block's forward runs in one forward and backward (twice when it recomputes).

    Counted at each block's first child: the recomputation calls the block's own forward directly.
    """
    modules = dict(model.named_modules())
    counts = dict.fromkeys(names, 0)
    handles = [
        next(modules[n].children()).register_forward_pre_hook(lambda m, a, n=n: counts.__setitem__(n, counts[n] + 1))
        for n in names
    ]
    model(inputs).float().sum().backward()
    for handle in handles:
        handle.remove()
    return counts


def test_unet_offers_its_decoder_blocks_and_its_bottleneck():
    model = TinyUNet()
    expected = ["encoder.0", "encoder.1", "bottleneck", "decoder.1", "decoder.3"]  # not the up-convolutions
    assert checkpoint_candidates(model) == expected
    assert checkpoint_candidates(model, example_inputs=IMAGES) == expected
    Checkpointing(CheckpointConfig(blocks="all")).apply(model)
    assert set(calls_in_a_training_step(model, expected, IMAGES).values()) == {2}  # every one recomputes


def test_module_dict_blocks_are_found_and_an_unused_head_is_dropped():
    model = DictCNN()
    structural = checkpoint_candidates(model)
    assert structural[:3] == ["blocks.first", "blocks.second", "blocks.third"]
    assert "blocks" not in structural and "heads" not in structural  # containers are never called
    called = checkpoint_candidates(model, example_inputs=IMAGES)
    assert called == ["blocks.first", "blocks.second", "blocks.third", "heads.classify"]
    Checkpointing(CheckpointConfig(blocks=called)).apply(model)
    assert set(calls_in_a_training_step(model, called[:3], IMAGES).values()) == {2}


def test_stages_and_their_blocks_are_two_granularities():
    model = StagedCNN()
    stages = ["stages.0", "stages.1"]
    blocks = ["stages.0.blocks.0", "stages.0.blocks.1", "stages.1.blocks.0", "stages.1.blocks.1"]
    assert checkpoint_granularities(model) == [stages, blocks]
    assert checkpoint_granularities(model, example_inputs=IMAGES) == [stages, blocks]
    assert checkpoint_candidates(model) == blocks  # the default: the blocks inside the stages
    assert resolve_blocks(model, "all") == blocks
    assert resolve_blocks(model, "stages.0,stages.1.blocks.1") == ["stages.0", "stages.1.blocks.1"]  # mixed, not nested
    with pytest.raises(UserError, match="stages.0 and stages.0.blocks.1 nest"):
        resolve_blocks(model, "stages.0,stages.0.blocks.1")
    with pytest.raises(UserError, match="or coarser: stages.0, stages.1"):
        resolve_blocks(model, "stages.0.downsample")


def test_blocks_come_in_the_order_the_forward_calls_them():
    class Backwards(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(ConvBN(3 if i == 3 else 8, 8) for i in range(4))

        def forward(self, x):
            for block in reversed(self.blocks[1:]):  # blocks.0 is never called
                x = block(x)
            return x

    model = Backwards()
    assert checkpoint_candidates(model) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert checkpoint_candidates(model, example_inputs=IMAGES) == ["blocks.3", "blocks.2", "blocks.1"]


def test_a_block_that_runs_inside_another_is_not_offered_with_it():
    class Apply(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, inner=None):
            x = self.a(x)
            return self.b(inner(x) if inner is not None else x)

    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Apply(), Apply()])

        def forward(self, x):
            return self.blocks[0](x, inner=self.blocks[1])

    assert checkpoint_candidates(Nested()) == ["blocks.0", "blocks.1"]
    assert checkpoint_candidates(Nested(), example_inputs=torch.randn(2, 4)) == ["blocks.0"]


def test_one_level_layouts_keep_their_blocks():
    module = transformer_module("sdpa")
    tokens, _ = module.example_batch(2)
    assert checkpoint_candidates(module.TinyTransformer("sdpa"), example_inputs=tokens) == [f"layers.{i}" for i in range(3)]
    resnet = torchvision.models.resnet18(num_classes=10)
    expected = [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    assert checkpoint_granularities(resnet, example_inputs=torch.randn(2, 3, 32, 32)) == [expected]


def test_the_finding_forward_changes_nothing_and_survives_a_data_dependent_model():
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(ConvBN(3, 8), ConvBN(8, 8))

        def forward(self, x):
            return self.blocks(x) if x.sum() > 0 else -self.blocks(x)  # fake tensors cannot branch on values

    model = StagedCNN()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    checkpoint_candidates(model, example_inputs=IMAGES)
    after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(1))  # no random numbers drawn
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # BatchNorm's counters too
    assert checkpoint_candidates(DataDependent(), example_inputs=IMAGES) == ["blocks.0", "blocks.1"]
