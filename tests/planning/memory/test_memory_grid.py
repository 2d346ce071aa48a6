"""The memory model against the cpu meter on four layouts, every precision, checkpoint set and step shape.

A CNN with BatchNorm, a pre-norm causal LM, a ViT with LayerNorm and a U-Net
with skips (tests/helpers/models.py), each in fp32, bf16 and fp16, with no block, the
first, every other and every block checkpointed, in one micro-step and in
several (3 + 3 + 2 samples, between the traced sizes 2 and 8): the predicted
peak is compared with a real probe's peak in every cell. The LM and the CNN
also with blocks checkpointed selectively, alone and mixed with full
checkpointing and none. The optimizer is AdamW with
foreach kernels (as on a GPU; fewer operators to trace, so the grid stays fast).
"""
import dataclasses
import functools

import pytest
import torch

from autofit.measure.probe import probe
from autofit.planning.costs import CostModel, PrecisionCosts, SpeedCosts, memory_costs
from strategies import PRECISIONS, checkpoint_candidates
from tests.helpers.planning import grid_spec
from tests.helpers.models import BiasedLM, SharedLayerLM, relu_chain_spec, shared_layer_spec

pytestmark = pytest.mark.usefixtures("quiet_process")  # conftest's

GLOBAL_BATCH = 8
MICRO_BATCHES = (8, 3)
"""One micro-step, and three (3 + 3 + 2, as the planner splits 8 in three) at a size the traces at 2 and 8 do not hold."""
TOLERANCE = 0.001
"""Of the measured peak. The issue asks for 1%; the worst cell measured 0.015% (fp32, a transformer, blocks checkpointed)."""
GRADSCALER_BYTES = 12
"""fp16's GradScaler keeps its scale, growth tracker and found-inf flag (4 bytes each); the simulation runs without it."""


def checkpoint_sets(blocks: list[str]) -> dict[str, list[str]]:
    return {"none": [], "first": blocks[:1], "alternate": blocks[::2], "all": blocks}


def mixed_modes(blocks: list[str]) -> dict[str, tuple[list[str], list[str]]]:
    """(fully, selectively) checkpointed blocks: selective alone, and mixed with full checkpointing and none."""
    return {
        "selective all": ([], blocks),
        "selective second": ([], blocks[1:2]),
        "full first, selective rest": (blocks[:1], blocks[1:]),
        "selective first, none, full last": (blocks[-1:], blocks[:1]),
        "full, selective alternating": (blocks[::2], blocks[1::2]),
    }


def memory_model(spec, precision: str) -> CostModel:
    memory = memory_costs(spec, precision=precision, low=2, high=GLOBAL_BATCH, device_type="cpu")
    model = CostModel(blocks=memory.high.blocks, global_batch_size=GLOBAL_BATCH, device_type="cpu", estimated=False)
    no_speed = SpeedCosts(sizes=[1], step_seconds=[1.0], forward_seconds=[1.0], block_seconds=[[]], optimizer_seconds=0.0)
    model.precisions[precision] = PrecisionCosts(precision=precision, memory=memory, speed=no_speed)
    return model


@functools.cache
def grid_memory_model(layout: str, precision: str) -> CostModel:
    """A layout's memory model, traced once: the full, the selective and the what-each-mode-frees tests read it."""
    return memory_model(grid_spec(layout), precision)


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("layout", ["cnn", "lm", "vit", "unet"])
def test_predicted_peak_is_the_measured_peak(layout, precision):
    spec = grid_spec(layout)
    model = grid_memory_model(layout, precision)
    assert len(model.blocks) >= 3  # first, alternate and all differ
    misses = {}
    for micro_batch_size in MICRO_BATCHES:
        for label, blocks in checkpoint_sets(model.blocks).items():
            chosen = {model.blocks.index(b) for b in blocks}
            predicted = model.peak_bytes(precision, micro_batch_size, chosen)
            measured = probe(
                spec, micro_batch_size=micro_batch_size, global_batch_size=GLOBAL_BATCH, precision=precision,
                checkpoint=blocks, steps=1,
            ).peak_bytes
            misses[micro_batch_size, label] = (predicted - measured) / measured
    assert all(abs(miss) <= TOLERANCE for miss in misses.values()), {k: f"{v:+.4%}" for k, v in misses.items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["lm", "cnn"])
def test_selective_checkpointing_predicted_peak_is_the_measured_peak(layout, precision):
    """Selective blocks keep every saved op's output (a projection's too): the model predicts what they free, and
    what their recomputation holds, from the plain and all-selective traces."""
    spec = grid_spec(layout)
    model = grid_memory_model(layout, precision)
    memory = model.precisions[precision].memory
    assert memory.selective_drops(GLOBAL_BATCH) is not None
    misses = {}
    for micro_batch_size in MICRO_BATCHES:
        for label, (full, selective) in mixed_modes(model.blocks).items():
            predicted = model.peak_bytes(
                precision, micro_batch_size, {model.blocks.index(b) for b in full}, frozenset(model.blocks.index(b) for b in selective),
            )
            measured = probe(
                spec, micro_batch_size=micro_batch_size, global_batch_size=GLOBAL_BATCH, precision=precision,
                checkpoint=full, selective_checkpoint=selective, steps=1,
            )
            assert measured.selective_checkpoint == selective and measured.checkpoint == full
            misses[micro_batch_size, label] = (predicted - measured.peak_bytes) / measured.peak_bytes
    assert all(abs(miss) <= TOLERANCE for miss in misses.values()), {k: f"{v:+.4%}" for k, v in misses.items()}


def test_selective_frees_less_than_full_checkpointing():
    """What each mode frees per block: selective keeps the attention and matmul outputs (the LM frees about a third
    of full checkpointing's bytes); the CNN's convolution outputs are what BatchNorm saves anyway (it frees only
    the statistics)."""
    for layout, least, most in (("lm", 0.2, 0.5), ("cnn", 0.0, 0.2)):
        memory = grid_memory_model(layout, "fp32").precisions["fp32"].memory
        full, selective = memory.high.drop_bytes, memory.high.selective_drop_bytes
        assert all(least * f < s < most * f for f, s in zip(full, selective)), (layout, full, selective)


@pytest.mark.parametrize("layout, precision", [("cnn", "bf16"), ("lm", "bf16"), ("vit", "bf16"), ("unet", "bf16"), ("unet", "fp16")])
def test_simulated_meter_is_the_cpu_meter(layout, precision):
    """Over fake tensors, as the memory model traces: bf16 BatchNorm statistics as the CPU kernel keeps them (fp32)."""
    spec = grid_spec(layout)
    blocks = checkpoint_candidates(spec.build_model(), example_inputs=spec.example_batch(2)[0])[::2]
    settings = dict(micro_batch_size=3, global_batch_size=GLOBAL_BATCH, precision=precision, checkpoint=blocks, steps=1)
    simulated = probe(spec, simulate=True, **settings).peak_bytes
    measured = probe(spec, **settings).peak_bytes
    assert 0 <= measured - simulated <= (GRADSCALER_BYTES if precision == "fp16" else 0)


def test_keyword_inputs_of_a_checkpointed_block_stay_alive():
    """A block's keyword inputs (an attention bias) are kept by its checkpoint: they are not bytes it drops."""
    spec = dataclasses.replace(grid_spec("lm"), build_model=BiasedLM)
    model = memory_model(spec, "fp32")
    for micro_batch_size in MICRO_BATCHES:
        predicted = model.peak_bytes("fp32", micro_batch_size, {0})
        measured = probe(
            spec, micro_batch_size=micro_batch_size, global_batch_size=GLOBAL_BATCH, checkpoint=model.blocks[:1], steps=1,
        ).peak_bytes
        assert abs(predicted - measured) <= 0.0002 * measured  # counted as dropped, the bias made it 0.1% under


@pytest.mark.slow  # probes
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_each_call_of_a_shared_layer_is_a_block_and_its_peak_is_the_measured_peak(precision):
    """ALBERT-style, one layer called 4 times: each call saves its own activations (the model counts them per
    call), and checkpointing some calls, fully or selectively, lowers the peak as predicted. Under autocast the
    calls share the cached copies of the layer's weights, which no call's checkpoint frees alone: the model is
    never under the meter, and over it by at most those copies."""
    spec = shared_layer_spec()
    model = memory_model(spec, precision)
    calls = [f"layer#{k}" for k in range(SharedLayerLM.CALLS)]
    assert [b for b in model.blocks if "#" in b] == calls
    trace = model.precisions[precision].memory.high
    drops = [trace.drop_bytes[model.blocks.index(c)] for c in calls]
    assert len(set(drops)) == 1 and drops[0] > 0
    shared = max(trace.shared_call_bytes, default=0)
    assert (shared > 0) == (precision == "bf16")
    # One probe per step shape (kept few: each probe is a real step): a call alone, and calls in each mode.
    for micro_batch_size, full, selective in ((GLOBAL_BATCH, calls[1:2], []), (3, calls[::2], calls[3:])):
        predicted = model.peak_bytes(
            precision, micro_batch_size, {model.blocks.index(b) for b in full}, frozenset(model.blocks.index(b) for b in selective),
        )
        measured = probe(
            spec, micro_batch_size=micro_batch_size, global_batch_size=GLOBAL_BATCH, precision=precision, checkpoint=full,
            selective_checkpoint=selective, steps=1,
        )
        assert measured.checkpoint == full and measured.selective_checkpoint == selective
        over = predicted - measured.peak_bytes
        assert 0 <= over <= shared + TOLERANCE * measured.peak_bytes, (full, selective, predicted, measured.peak_bytes)
    # Every call checkpointed: well under the plain peak (what a plan at half of it needs).
    plain, every = (model.peak_bytes(precision, GLOBAL_BATCH, chosen) for chosen in (set(), {model.blocks.index(c) for c in calls}))
    assert every < 0.6 * plain


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_input_only_the_checkpoint_keeps_counts_against_it(precision):
    """Blocks that start with a matmul save, under bf16 autocast, their input's cast and not the input: plain
    training frees the input after the block, a checkpoint (full or selective) keeps it until the block's
    backward (the model predicted 6% under the meter for one such block checkpointed before it counted this)."""
    spec = dataclasses.replace(relu_chain_spec(), build_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True))
    model = memory_model(spec, precision)
    blocks = model.blocks
    misses = {}
    for micro_batch_size in MICRO_BATCHES:
        for full, selective in (([blocks[1]], []), ([], [blocks[1]]), ([blocks[0]], [blocks[2]])):
            predicted = model.peak_bytes(
                precision, micro_batch_size, {blocks.index(b) for b in full}, frozenset(blocks.index(b) for b in selective),
            )
            measured = probe(
                spec, micro_batch_size=micro_batch_size, global_batch_size=GLOBAL_BATCH, precision=precision,
                checkpoint=full, selective_checkpoint=selective, steps=1,
            ).peak_bytes
            misses[micro_batch_size, tuple(full), tuple(selective)] = (predicted - measured) / measured
    assert all(abs(miss) <= TOLERANCE for miss in misses.values()), {k: f"{v:+.4%}" for k, v in misses.items()}


def test_selective_freeing_bytes_at_some_sizes_only_leaves_the_model_linear():
    """The digits CNN in bf16: selective frees bytes at the global batch but not at one sample, so the traces
    differ in that part only; the model then leaves selective out instead of treating the sizes as unlike
    (which kept the global batch's bytes at every size: 34.9 MiB predicted at one sample, 2.8 measured)."""
    from autofit.spec import load_spec
    from tests.helpers import EXAMPLES

    spec = load_spec(str(EXAMPLES / "digits_cnn.py"))
    costs = memory_costs(spec, precision="bf16", low=1, high=64, device_type="cpu")
    peaks = [costs.peak_bytes(size, global_batch_size=64, checkpoint=set()) for size in (1, 2, 16, 32, 64)]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1] / 8
    one = probe(spec, micro_batch_size=1, global_batch_size=2, precision="bf16", steps=2)
    host = 62 * costs.low.host_sample_bytes  # the host's copy of the samples a 2-sample probe does not hold
    assert abs(costs.peak_bytes(1, global_batch_size=64, checkpoint=set()) - (one.peak_bytes + host)) <= 0.01 * one.peak_bytes
