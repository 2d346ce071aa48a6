"""Identical blocks traced once: a model's run of identical blocks traced at two short lengths gives its whole trace.

The contract: every trace the memory model reads (plain, all-checkpointed,
all-selective, all-offloaded, with the output layer and loss chunked) is the
one tracing the whole model gives, value for value.
"""
import pytest
import torch
from torch import nn

from autofit.planning.memory import repeats
from autofit.planning.memory.repeats import Repeat, find_repeat
from autofit.planning.memory.traces import add_chunk_deltas, add_offloaded, simulation_spec, trace_memory_sizes

pytestmark = pytest.mark.slow  # the whole module plans or trains real models (tens of seconds each)

LAYERS = 16


@pytest.fixture(scope="module")
def deep_lm(tmp_path_factory):
    """A tiny Llama with ``LAYERS`` decoder layers (a run long enough to be traced short)."""
    from autofit.spec import load_spec
    from tests.helpers.tiny_lm import tiny_lm_dir

    path = tiny_lm_dir(tmp_path_factory.mktemp("deep-lm"), tokenizer=False, weights=False, layers=LAYERS)
    return simulation_spec(load_spec(f"hf:{path}", task="causal-lm", seq_len=8))


def _all_traces(spec, *, precision: str, device_type: str, size: int, levers: bool) -> list:
    traces = trace_memory_sizes(spec, sizes=[size], precision=precision, device_type=device_type)
    if levers:
        traces = add_offloaded(traces, spec, precision=precision, device_type=device_type)
        traces = add_chunk_deltas(traces, spec, precision=precision, device_type=device_type, chunks=4)
    return traces


@pytest.mark.parametrize("precision, device_type, size, levers", [("bf16", "cuda", 1, True), ("fp32", "cpu", 2, False)])
def test_traces_from_short_runs_equal_the_whole_models(deep_lm, monkeypatch, precision, device_type, size, levers):
    expanded = []
    real_expand = repeats.expand

    def counted(*args, **kwargs):
        expanded.append(real_expand(*args, **kwargs))
        return expanded[-1]

    monkeypatch.setattr("autofit.planning.memory.traces.expand", counted)
    settings = dict(precision=precision, device_type=device_type, size=size, levers=levers)
    short = _all_traces(deep_lm, **settings)
    assert len(expanded) == (5 if levers else 3) and all(trace is not None for trace in expanded)  # every run short, lined up
    monkeypatch.setattr(repeats, "SHORTEN_FROM", 10**6)
    whole = _all_traces(deep_lm, **settings)
    assert len(expanded) == (5 if levers else 3)  # traced whole
    assert short == whole
    assert whole[0].blocks == [f"model.layers.{i}" for i in range(LAYERS)]


class _Block(nn.Module):
    def __init__(self, width: int, index: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.layer_idx = index  # the block's own index: the same in every block

    def forward(self, x):
        return torch.relu(self.linear(x))


def _chain(widths: list[int]) -> nn.Sequential:
    return nn.Sequential(*(_Block(width, i) for i, width in enumerate(widths)))


def test_a_run_of_identical_blocks_is_found_and_a_different_block_ends_it():
    names = [str(i) for i in range(20)]
    assert find_repeat(_chain([8] * 20), names) == Repeat(container="", first=0, length=20, start=0)
    # A wider block in the middle leaves two runs, each too short to trace short.
    assert find_repeat(_chain([8] * 10 + [16] + [8] * 9), names) is None
    assert find_repeat(_chain([16] + [8] * 19), names) == Repeat(container="", first=1, length=19, start=1)
    # An attribute that differs (not the block's index) makes blocks different too.
    model = _chain([8] * 20)
    model[7].linear.extra = 3
    assert find_repeat(model, names) is None


def test_the_short_model_keeps_the_runs_ends_and_names_them_as_it_does():
    repeat = Repeat(container="", first=1, length=19, start=1)
    model = _chain([16] + [8] * 19 + [4])
    ends = [model[1], model[2], model[18], model[19], model[20]]
    repeat.shorten(model, 5)
    assert len(model) == 7
    assert [model[i] for i in (1, 2, 4, 5, 6)] == ends
    names = [str(i) for i in range(21)] + ["20.linear"]
    assert repeat.short_names(names, 5) == ["0", "1", "2", "3", "4", "5", "6", "6.linear"]


def test_per_block_values_of_the_short_model_widen_to_every_block():
    repeat = Repeat(container="", first=1, length=19, start=1)
    short = ["0", "1", "2", "3", "3.linear", "4", "5", "6"]  # the model cut to 5: block 3 is the one core block kept
    values = ["in", "edge", "edge2", "core", "core.linear", "end", "end2", "out"]
    whole = repeat.widen(short, values, 5)
    assert whole == ["in", "edge", "edge2", *["core", "core.linear"] * 15, "end", "end2", "out"]


def test_speed_estimated_on_the_short_model_equals_the_whole_models(deep_lm):
    """FLOPs, each block's FLOPs and selective shares counted with the run cut short are the whole model's."""
    from autofit.planning.memory.repeats import repeat_in
    from autofit.planning.memory.traces import traced_candidates
    from autofit.planning.speed.estimated import flop_speed_costs

    repeat = repeat_in(deep_lm, traced_candidates(deep_lm, micro_batch_size=1))
    assert repeat is not None and repeat.length == LAYERS
    settings = dict(precisions=["fp32", "bf16"], sizes=[1, 2], device_type="cuda", device_name="NVIDIA H200")
    short = flop_speed_costs(deep_lm, repeat=repeat, **settings)
    assert short == flop_speed_costs(deep_lm, **settings)
    assert len(short["bf16"].block_seconds[0]) == LAYERS
