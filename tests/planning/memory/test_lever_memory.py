"""The memory model with the levers against the cpu meter: step in backward, host optimizer state, offload,
8-bit optimizer state.

The LM and the CNN of tests/helpers/models.py in fp32 and bf16, traced at 2 and 8
samples (offload's extra trace included), each lever alone and mixed with
each other and with checkpointing, in one micro-step and in several
(3 + 3 + 2). On the CPU the meters count host state and offloaded storages
as host bytes, so the device peak is what the model predicts.
"""
import dataclasses
import functools

import pytest

from autofit.measure.probe import probe
from autofit.planning.costs import CostModel, PrecisionCosts, SpeedCosts, memory_costs
from autofit.planning.memory.levers import LeverChoice, add_eight_bit
from autofit.planning.memory.optimizer import eight_bit_record
from tests.helpers.planning import grid_spec

pytestmark = pytest.mark.usefixtures("quiet_process")  # conftest's

TOLERANCE = 0.002
"""Of the measured peak; the issue asks for 1%. Measured: the step in backward and host state within 0.03%,
8-bit state within 0.016% (the LM, every other block checkpointed, 3+3+2), offload within 0.19% (bf16, a
selective block between offloaded ones) and -0.14% (a micro-batch between the traced sizes: saved tensors under
``MIN_OFFLOAD_BYTES`` at one of them only)."""


@functools.cache
def lever_model(layout: str, precision: str) -> CostModel:
    memory = memory_costs(grid_spec(layout), precision=precision, low=2, high=8, device_type="cpu", offload=True)
    model = CostModel(blocks=memory.high.blocks, global_batch_size=8, device_type="cpu", estimated=False)
    no_speed = SpeedCosts(sizes=[1], step_seconds=[1.0], forward_seconds=[1.0], block_seconds=[[]], optimizer_seconds=0.0)
    model.precisions[precision] = PrecisionCosts(precision=precision, memory=memory, speed=no_speed)
    return model


@functools.cache
def eight_bit_model(layout: str, precision: str) -> CostModel:
    """``lever_model`` with 8-bit state's record in every trace (as the planner adds it with --allow-lossy-optimizer)."""
    model = lever_model(layout, precision)
    record = eight_bit_record(grid_spec(layout), device_type="cpu")
    memory = dataclasses.replace(model.precisions[precision].memory)
    memory.low, memory.high = add_eight_bit(memory.low, record), add_eight_bit(memory.high, record)
    costs = dataclasses.replace(model.precisions[precision], memory=memory)
    return dataclasses.replace(model, precisions={precision: costs})


def miss(layout: str, precision: str, *, micro_batch_size: int, global_batch_size: int, **levers) -> float:
    """(predicted - measured) / measured for one configuration (block names in ``levers``)."""
    cost_model = eight_bit_model if levers.get("optimizer_state") == "8bit" else lever_model
    model = dataclasses.replace(cost_model(layout, precision), global_batch_size=global_batch_size)
    blocks = model.blocks

    def indices(key: str) -> frozenset[int]:
        return frozenset(blocks.index(b) for b in levers.get(key, []))

    choice = LeverChoice(
        offload=indices("offload"), optimizer_in_backward=levers.get("optimizer_in_backward", False),
        optimizer_state=levers.get("optimizer_state", "device"),
    )
    predicted = model.peak_bytes(
        precision, micro_batch_size, set(indices("checkpoint")), indices("selective_checkpoint"), levers=choice,
    )
    measured = probe(
        grid_spec(layout), micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, precision=precision,
        steps=1, **levers,
    ).peak_bytes
    return (predicted - measured) / measured


def gradient_cases(blocks: list[str]) -> dict[str, dict]:
    return {
        "step in backward, 8": dict(micro_batch_size=8, global_batch_size=8, optimizer_in_backward=True),
        "step in backward, 2": dict(micro_batch_size=2, global_batch_size=2, optimizer_in_backward=True),
        "step in backward, checkpointed": dict(micro_batch_size=2, global_batch_size=2, optimizer_in_backward=True, checkpoint=blocks[::2]),
        "host state, 8": dict(micro_batch_size=8, global_batch_size=8, optimizer_state="host"),
        "host state, 3+3+2": dict(micro_batch_size=3, global_batch_size=8, optimizer_state="host"),
        "host state, selective": dict(micro_batch_size=3, global_batch_size=8, optimizer_state="host", selective_checkpoint=blocks[1:]),
        "both, 2": dict(micro_batch_size=2, global_batch_size=2, optimizer_in_backward=True, optimizer_state="host"),
    }


def eight_bit_cases(blocks: list[str]) -> dict[str, dict]:
    return {
        "8": dict(micro_batch_size=8, global_batch_size=8, optimizer_state="8bit"),
        "2": dict(micro_batch_size=2, global_batch_size=2, optimizer_state="8bit"),
        "3+3+2": dict(micro_batch_size=3, global_batch_size=8, optimizer_state="8bit"),
        "checkpointed, 3+3+2": dict(micro_batch_size=3, global_batch_size=8, optimizer_state="8bit", checkpoint=blocks[::2]),
        "selective, 3+3+2": dict(micro_batch_size=3, global_batch_size=8, optimizer_state="8bit", selective_checkpoint=blocks[1:]),
        "step in backward, 2": dict(micro_batch_size=2, global_batch_size=2, optimizer_state="8bit", optimizer_in_backward=True),
        "step in backward, 8": dict(micro_batch_size=8, global_batch_size=8, optimizer_state="8bit", optimizer_in_backward=True),
    }


def offload_cases(blocks: list[str]) -> dict[str, dict]:
    return {
        "all, 8": dict(micro_batch_size=8, global_batch_size=8, offload=blocks),
        "all, 3+3+2": dict(micro_batch_size=3, global_batch_size=8, offload=blocks),
        "first": dict(micro_batch_size=3, global_batch_size=8, offload=blocks[:1]),
        "alternate": dict(micro_batch_size=8, global_batch_size=8, offload=blocks[1::2]),
        "beside full checkpointing": dict(micro_batch_size=3, global_batch_size=8, offload=blocks[1:], checkpoint=blocks[:1]),
        "with step in backward": dict(micro_batch_size=2, global_batch_size=2, offload=blocks[1:], optimizer_in_backward=True),
        "with host state": dict(micro_batch_size=3, global_batch_size=8, offload=blocks[::2], optimizer_state="host"),
        "beside selective, host state": dict(
            micro_batch_size=3, global_batch_size=8, offload=blocks[::2], selective_checkpoint=blocks[1:2], optimizer_state="host",
        ),
    }


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["lm", "cnn"])
def test_gradient_levers_predicted_peak_is_the_measured_peak(layout, precision):
    """The step in backward and host state free gradients as they are accumulated, and host state its state."""
    blocks = lever_model(layout, precision).blocks
    misses = {label: miss(layout, precision, **case) for label, case in gradient_cases(blocks).items()}
    assert all(abs(m) <= TOLERANCE for m in misses.values()), {k: f"{v:+.4%}" for k, v in misses.items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["lm", "cnn"])
def test_offload_predicted_peak_is_the_measured_peak(layout, precision):
    """Offloaded blocks' saved tensors leave the device between forward and backward; a storage two blocks save
    (a CNN block's ReLU output, the next convolution's input) leaves only when both are offloaded."""
    blocks = lever_model(layout, precision).blocks
    misses = {label: miss(layout, precision, **case) for label, case in offload_cases(blocks).items()}
    assert all(abs(m) <= TOLERANCE for m in misses.values()), {k: f"{v:+.4%}" for k, v in misses.items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["lm", "cnn"])
def test_eight_bit_state_predicted_peak_is_the_measured_peak(layout, precision):
    """torchao's 8-bit AdamW holds uint8 codes, block scales and maps for the LM's four 4096-element weights and fp32
    moments for its other parameters (and for all of the CNN's, none of which is that large), with or without the
    step in backward; its step makes temporaries of about six fp32 copies of a parameter, one parameter at a time."""
    blocks = lever_model(layout, precision).blocks
    misses = {label: miss(layout, precision, **case) for label, case in eight_bit_cases(blocks).items()}
    assert all(abs(m) <= TOLERANCE for m in misses.values()), {k: f"{v:+.4%}" for k, v in misses.items()}


def test_eight_bit_state_frees_what_its_layout_says():
    """The LM's 8-bit state, counted as the meters count it: each quantized moment is one byte per element, one fp32
    scale per 256 elements and a 256-entry fp32 map; the other parameters' moments stay fp32 (4096 elements is the
    least torchao quantizes). Without the record (no --allow-lossy-optimizer) 8-bit state is not modelled."""
    record = eight_bit_record(grid_spec("lm"), device_type="cpu")
    params = list(grid_spec("lm").build_model().parameters())
    quantized = [p.numel() for p in params if p.numel() >= 4096 and p.numel() % 256 == 0]
    assert len(quantized) == 6
    step_bytes = 4 * len(params)  # torch's and torchao's step counter: a 0-d fp32 tensor per parameter
    per_moment = [n + 4 * (n // 256) + 4 * 256 for n in quantized]
    fp32_moments = 4 * sum(p.numel() for p in params) - 4 * sum(quantized)
    assert record.state_bytes == 2 * (sum(per_moment) + fp32_moments) + step_bytes
    with pytest.raises(ValueError):
        lever_model("lm", "fp32").peak_bytes("fp32", 2, set(), frozenset(), levers=LeverChoice(optimizer_state="8bit"))
    plain = lever_model("lm", "fp32").peak_bytes("fp32", 8, set(), frozenset())
    saved = plain - eight_bit_model("lm", "fp32").peak_bytes("fp32", 8, set(), frozenset(), levers=LeverChoice(optimizer_state="8bit"))
    assert saved == 2 * sum(4 * n - m for n, m in zip(quantized, per_moment))


def test_levers_change_the_prediction_as_they_change_the_peak():
    """What each lever frees in the LM (checked against the meter above): at two samples, whose peak is the
    optimizer step's, host state its state and the gradients, the step in backward the gradients alone, and
    offload nothing; at eight, whose peak is the activations', offload about half of it."""
    model = lever_model("lm", "fp32")
    every = frozenset(range(len(model.blocks)))

    def peak(size: int, **levers) -> float:
        return dataclasses.replace(model, global_batch_size=size).peak_bytes("fp32", size, set(), frozenset(), levers=LeverChoice(**levers))

    plain, step, host = peak(2), peak(2, optimizer_in_backward=True), peak(2, optimizer_state="host")
    assert host < step < plain and peak(2, offload=every) == plain
    assert peak(8, offload=every) < 0.7 * peak(8)


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_offload_is_not_modelled_without_its_trace():
    """The planner traces offload for a GPU only: traces without it still model the gradient levers."""
    memory = memory_costs(grid_spec("lm"), precision="fp32", low=2, high=8, device_type="cpu")
    assert memory.has_levers()
    memory.peak_bytes(8, global_batch_size=8, checkpoint=set(), levers=LeverChoice(optimizer_in_backward=True))
    with pytest.raises(ValueError):
        memory.peak_bytes(8, global_batch_size=8, checkpoint=set(), levers=LeverChoice(offload=frozenset({0})))


def test_lever_record_survives_the_store():
    """A study keeps the cost model as plain data: the lever record (8-bit state's too) comes back and predicts the same."""
    import json

    model = lever_model("cnn", "fp32")
    back = CostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    choice = LeverChoice(offload=frozenset({1, 2}), optimizer_state="host")
    assert back.peak_bytes("fp32", 3, set(), frozenset(), levers=choice) == model.peak_bytes("fp32", 3, set(), frozenset(), levers=choice)
    eight_bit = eight_bit_model("lm", "fp32")
    back = CostModel.from_dict(json.loads(json.dumps(eight_bit.to_dict())))
    choice = LeverChoice(optimizer_state="8bit", optimizer_in_backward=True)
    assert back.peak_bytes("fp32", 2, set(), frozenset(), levers=choice) == eight_bit.peak_bytes("fp32", 2, set(), frozenset(), levers=choice)


def test_step_in_backward_counts_each_parameters_step():
    """AdamW (its for-loop kernel, the CPU's default) makes temporaries of about 2.5 times a parameter in its step:
    stepped in backward, beside the activations, the wide head's weight raises the peak (16.1 MB against 10.8 MB
    plain), and the model says so, so the search never takes it for a saving."""
    from autofit.spec import default_optimizer
    from tests.helpers.models import conv_then_wide_spec

    spec = dataclasses.replace(conv_then_wide_spec(), build_optimizer=default_optimizer)
    memory = memory_costs(spec, precision="fp32", low=2, high=8, device_type="cpu")
    predicted = memory.peak_bytes(8, global_batch_size=8, checkpoint=set(), levers=LeverChoice(optimizer_in_backward=True))
    measured = probe(spec, micro_batch_size=8, global_batch_size=8, optimizer_in_backward=True, steps=1).peak_bytes
    assert abs(predicted - measured) <= 0.001 * measured
    assert predicted > memory.peak_bytes(8, global_batch_size=8, checkpoint=set())
