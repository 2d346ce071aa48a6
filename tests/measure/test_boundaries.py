"""block_boundaries: the one place that hooks named blocks' forwards, for profiles, traces and timings."""
import pytest
import torch
from torch import nn

from autofit.measure.boundaries import block_boundaries


def nested() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))


def test_enter_and_leave_follow_the_forward_nested_blocks_too():
    model, seen = nested(), []
    with block_boundaries(
        model, ["", "0", "0.0", "1"],
        enter=lambda name, args: seen.append(("enter", name, tuple(args[0].shape))),
        leave=lambda name, args, kwargs, output: seen.append(("leave", name, tuple(output.shape))),
    ):
        model(torch.ones(3, 4))
    assert seen == [
        ("enter", "", (3, 4)), ("enter", "0", (3, 4)), ("enter", "0.0", (3, 4)), ("leave", "0.0", (3, 4)),
        ("leave", "0", (3, 4)), ("enter", "1", (3, 4)), ("leave", "1", (3, 2)), ("leave", "", (3, 2)),
    ]


def test_callbacks_never_change_the_forward_and_the_hooks_go_when_the_block_ends():
    model = nested()
    expected = model(torch.ones(3, 4))
    calls = []
    with block_boundaries(model, ["0", "1"], enter=lambda name, args: "not an input", leave=lambda *a: calls.append(a[0]) or 0):
        assert torch.equal(model(torch.ones(3, 4)), expected)  # what a callback returns is dropped
    with pytest.raises(RuntimeError, match="boom"):
        with block_boundaries(model, ["0"], enter=lambda name, args: calls.append(name)):
            raise RuntimeError("boom")
    model(torch.ones(3, 4))
    assert calls == ["0", "1"] and not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
