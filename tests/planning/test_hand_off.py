"""The planning hand-off, one way: the search is a pure function of a cost model, the usable bytes and what is
allowed (no model, no context); the verification returns what it learnt instead of changing the cost model."""
import copy
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from autofit.config import TrainingConfig
from autofit.planning.costs import CostModel, MemoryCosts, PrecisionCosts, SpeedCosts
from autofit.planning.memory.segments import Segment
from autofit.planning.memory.traces import MemoryTrace
from autofit.planning.records import Measurement
from autofit.planning.search.space import Allowed, score_all
from autofit.planning.verify.candidates import verify


def trace(micro_batch_size: int) -> MemoryTrace:
    """Two blocks whose activations grow with the micro-batch: 1 000 bytes a sample live in forward and backward,
    300 of them each block's to drop; 500 bytes of state at the optimizer step."""
    return MemoryTrace(
        micro_batch_size=micro_batch_size, blocks=["b0", "b1"], drop_bytes=[300 * micro_batch_size] * 2,
        segments=[
            Segment(peak_bytes=1000 * micro_batch_size, dropped=[0, 1], phase="first"),
            Segment(peak_bytes=500, dropped=[], phase="optimizer"),
        ],
        prefix_shaped=True,
    )


def hand_built() -> CostModel:
    """A cost model written by hand: larger micro-batches are much faster per sample, recomputing is cheap."""
    speed = SpeedCosts(
        sizes=[1, 4], step_seconds=[1.0, 1.2], forward_seconds=[0.3, 0.4], block_seconds=[[0.01, 0.01], [0.012, 0.012]],
        optimizer_seconds=0.1,
    )
    memory = MemoryCosts(low=trace(1), high=trace(4))
    return CostModel(
        blocks=["b0", "b1"], global_batch_size=8, device_type="cpu", estimated=True,
        precisions={"fp32": PrecisionCosts(precision="fp32", memory=memory, speed=speed)},
    )


ALLOWED = Allowed(precisions=("fp32",), micro_batch_sizes=(8, 4, 2, 1), slack=0.0)


def best(evaluations):
    return max((e for e in evaluations if e.fits), key=lambda e: e.samples_per_s, default=None)


def test_the_search_reads_a_hand_built_record_and_changes_nothing():
    model = hand_built()
    before = copy.deepcopy(model.to_dict())
    started = time.perf_counter()
    roomy, tight, nothing = (best(score_all(model, usable_bytes=usable, allowed=ALLOWED)) for usable in (10_000, 3_000, 400))
    seconds = time.perf_counter() - started
    assert model.to_dict() == before  # the record is only read
    assert seconds < 1.0  # three budgets answered with no model, no trace, no timing
    # Roomy: the whole batch in one micro-batch, nothing checkpointed (8 samples x 1 000 bytes fit).
    assert (roomy.config.micro_batch_size, roomy.config.checkpoint) == (8, ())
    # 3 000 bytes: 8 samples do not fit even with both blocks checkpointed (8 000 - 4 800); 4 samples fit with one
    # block checkpointed (4 000 - 1 200), which beats 2 samples plain (four micro-steps instead of two).
    assert tight.config.micro_batch_size == 4 and len(tight.config.checkpoint) == 1
    assert tight.peak_bytes <= 3_000 and tight.samples_per_s < roomy.samples_per_s
    assert nothing is None  # below the optimizer step's 500 bytes nothing fits


def test_one_record_answers_another_batch():
    model = hand_built()
    bigger = best(score_all(replace(model, global_batch_size=16), usable_bytes=10_000, allowed=ALLOWED))
    assert bigger.config.global_batch_size == 16 and bigger.config.grad_accum_steps == 2
    assert best(score_all(model, usable_bytes=10_000, allowed=ALLOWED)).config.grad_accum_steps == 1


class GpuMeter:
    """``Measurements`` as ``verify`` reads it, on a GPU whose allocator holds 1.5 times the 8 000 bytes the cost
    model predicts for the whole batch in one micro-batch (the one candidate here): it fits, and the race keeps
    the predicted order."""

    slack, model_is_exact = 0.0, False

    def __init__(self) -> None:
        self.peaks, self.predicted = {}, {}

    def usable_bytes(self, precision=None) -> float:
        return 10_000.0

    def scale(self, precision) -> float:
        return 1.0

    def checked_peak(self, config, fresh=False):
        peak = 12_000
        self.peaks[config.key()] = {"peak_bytes": peak, "breakdown": {}}
        return peak, None

    def fits(self, config) -> bool:
        return True

    def race(self, configs, reference=None):
        return configs

    def result(self, config) -> Measurement:
        return Measurement(peak_bytes=self.peaks[config.key()]["peak_bytes"], samples_per_s=1.0, meter="cuda")


def test_verify_returns_its_calibration_and_leaves_the_cost_model_alone():
    model = hand_built()
    evaluations = score_all(model, usable_bytes=10_000, allowed=ALLOWED)
    context = SimpleNamespace(simulate=False, device="cuda", tie=0.02, log=lambda line: None)
    chosen = verify(
        context, model, evaluations, floor_config=TrainingConfig(global_batch_size=8, micro_batch_size=1), floor_bytes=0,
        measurements=GpuMeter(),
    )
    assert chosen.config.micro_batch_size == 8 and chosen.measurement.meter == "cuda"
    assert chosen.memory_scale == pytest.approx(1.5)  # learnt from the measured peaks, returned as a value
    assert model.memory_scale == 1.0  # the planner folds it in; verify changed nothing it did not make


def test_the_cost_model_is_frozen_and_changes_as_new_records():
    """Tracing, timing and calibrating hand the planner a new record: one already handed on never changes."""
    import dataclasses

    model = hand_built()
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.memory_scale = 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.precisions["fp32"].speed = None
    faster = replace(model.precisions["fp32"].speed, optimizer_seconds=0.0)
    changed = model.with_precisions({"fp32": replace(model.precisions["fp32"], speed=faster)})
    assert model.precisions["fp32"].speed.optimizer_seconds == 0.1 and changed.precisions["fp32"].speed is faster
    assert changed.step_seconds("fp32", 8, set()) < model.step_seconds("fp32", 8, set())
