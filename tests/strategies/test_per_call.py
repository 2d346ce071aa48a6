"""A layer one forward calls several times (ALBERT's shared layer): one checkpoint candidate per call."""
import copy

import pytest
import torch

from autofit.errors import UserError
from autofit.measure.blocks import profile_blocks
from autofit.measure.boundaries import block_boundaries
from strategies import (
    ActivationOffload, CheckpointConfig, Checkpointing, OffloadConfig, check_one_mode_per_block, checkpoint_granularities,
    resolve_blocks,
)
from tests.helpers.models import SharedLayerLM, shared_layer_spec

CALLS = [f"layer#{k}" for k in range(SharedLayerLM.CALLS)]


def tokens(n: int = 2) -> torch.Tensor:
    return torch.randint(0, SharedLayerLM.VOCAB, (n, SharedLayerLM.SEQ_LEN))


def test_each_call_of_the_shared_layer_is_a_candidate_and_names_by_call_are_taken():
    model = SharedLayerLM()
    assert checkpoint_granularities(model) == [["embed", "layer", "norm", "head"]]  # the module tree alone cannot tell
    assert checkpoint_granularities(model, example_inputs=tokens())[-1] == ["embed", *CALLS, "norm", "head"]
    assert resolve_blocks(model, "layer#0,layer#2,head") == ["layer#0", "layer#2", "head"]
    with pytest.raises(UserError, match="blocks layer and layer#1 nest"):
        resolve_blocks(model, "layer,layer#1")
    with pytest.raises(UserError, match=r"norm#1 not found.*named per call, LAYER#0"):  # a leaf is never offered per call
        resolve_blocks(model, "norm#1")
    with pytest.raises(UserError, match="block layer / layer#1 is both in offload and in checkpoint"):
        check_one_mode_per_block({"offload": ["layer"], "checkpoint": ["layer#1"]})
    check_one_mode_per_block({"offload": ["layer#0"], "checkpoint": ["layer#1"]})  # two calls, two modes


def test_the_listing_gives_each_call_its_own_saved_bytes_and_an_equal_share_of_the_layers_flops():
    profiles = {p.name: p for p in profile_blocks(shared_layer_spec(), micro_batch_size=2, simulate=True)}
    assert [name for name in profiles if "#" in name] == CALLS
    calls = [profiles[name] for name in CALLS]
    assert len({(p.saved_bytes, p.input_bytes, p.forward_flops) for p in calls}) == 1 and calls[0].saved_bytes > 0
    assert 0.2 < calls[0].forward_share < 0.25  # the head, the embedding and the norm hold the rest


def test_boundaries_hear_each_named_call_counted_from_each_forward():
    model, seen = SharedLayerLM(), []
    with block_boundaries(model, ["layer#1", "layer#3", "head"], enter=lambda name, args: seen.append(name),
                          leave=lambda name, args, kwargs, output: seen.append("/" + name)):
        model(tokens())
        model(tokens())
    assert seen == ["layer#1", "/layer#1", "layer#3", "/layer#3", "head", "/head"] * 2


def test_checkpointed_calls_recompute_each_step_and_give_the_plain_gradients():
    """Calls 0 and 2 fully, call 1 selectively: each step recomputes exactly those (the count starts again at
    every forward), and every gradient equals plain PyTorch's to the bit."""
    torch.manual_seed(0)
    plain = SharedLayerLM()
    model = Checkpointing(CheckpointConfig(blocks=["layer#0", "layer#2"], selective_blocks=["layer#1"])).apply(copy.deepcopy(plain))
    assert Checkpointing.applied_blocks(model) == ["layer#0", "layer#2"]
    assert Checkpointing.applied_selective_blocks(model) == ["layer#1"]
    runs = []
    model.layer.norm1.register_forward_pre_hook(lambda *_: runs.append(1))  # in every forward, and in each recomputation
    for step in range(2):
        batch = tokens()
        for net in (plain, model):
            net.zero_grad()
            net(batch).square().mean().backward()
        assert len(runs) == 7 * (step + 1)  # 4 calls + 3 recomputations, in both steps
        for (name, p), q in zip(plain.named_parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad), name


def test_offloaded_calls_give_the_plain_gradients():
    torch.manual_seed(0)
    plain = SharedLayerLM()
    model = ActivationOffload(OffloadConfig(blocks=["layer#1", "layer#3"]), device="cpu").apply(copy.deepcopy(plain))
    assert ActivationOffload.applied_blocks(model) == ["layer#1", "layer#3"]
    batch = tokens()
    for net in (plain, model):
        net(batch).square().mean().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))


def test_a_call_the_forward_never_makes_is_one_line_at_the_forward():
    model = Checkpointing(CheckpointConfig(blocks=["layer#4"])).apply(SharedLayerLM())
    with pytest.raises(UserError, match=r"checkpoint block layer#4: layer runs 4 time\(s\) in a forward \(layer#0 to #3\)"):
        model(tokens())


def test_a_call_outside_the_models_forward_runs_as_it_is_after_one_warning():
    """A loop that calls the layer itself (not through the model the plan was applied to) gives it no call number."""
    model = Checkpointing(CheckpointConfig(blocks=["layer#0"])).apply(SharedLayerLM())
    x = model.embed(tokens())
    with pytest.warns(UserWarning, match="layer ran outside a forward of the model its checkpoint plan was applied to"):
        model.layer(x)
    model.layer(x)  # once
    runs = []
    model.layer.norm1.register_forward_pre_hook(lambda *_: runs.append(1))
    model(tokens()).sum().backward()
    assert len(runs) == 5  # inside the model's forward again: call 0 recomputes
