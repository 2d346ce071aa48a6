"""torch.compile as a measured choice: the same training to rounding, planned only where measured, re-measured by the probe.

Inductor builds C++ kernels here (seconds per model): the planner's run is
made once for the module and its plan read by the tests.
"""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

from autofit._torch_private import is_compiled
from autofit.apply import apply_config
from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.measure.probe import probe_plan
from autofit.plan_file import DeviceInfo, ModelInfo, Plan, load_plan, save_plan
from autofit.planning.planner import plan_with_report
from autofit.planning.request import PlanRequest
from autofit.planning.verify.compiled import KEPT
from autofit.spec import load_spec
from autofit.step import train_step
from tests.helpers import EXAMPLES


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(24, 24), nn.GELU(), nn.LayerNorm(24)) for _ in range(2)))
        self.head = nn.Linear(24, 5)

    def forward(self, x):
        return self.head(self.blocks(x))


def _trained(model: nn.Module, *, compile: bool, steps: int = 4) -> nn.Module:
    config = TrainingConfig(global_batch_size=8, micro_batch_size=4, checkpoint=("blocks.0",), compile=compile)
    applied = apply_config(model, config, device="cpu")
    # SGD: AdamW divides by the gradients' root mean square and turns a rounding difference in a near-zero gradient
    # into a full step (bench/gpu_truth.py's decoder: 9.9e-4 after 4 steps), which is not what this compares.
    optimizer = applied.build_optimizer(lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9))
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        inputs, targets = torch.randn(8, 24, generator=generator), torch.randint(0, 5, (8,), generator=generator)
        train_step(applied, inputs, targets, loss_fn=nn.functional.cross_entropy, optimizer=optimizer)
    assert is_compiled(applied.model) == compile
    return applied.model


def test_a_compiled_plan_trains_to_the_uncompiled_runs_weights_within_rounding():
    """Under SGD, 4 steps of a checkpointed MLP: the same weights to 1e-4 relative (Inductor's kernels round differently)."""
    torch.manual_seed(0)
    model = Net()
    eager = _trained(copy.deepcopy(model), compile=False)
    compiled = _trained(model, compile=True)
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # compiled in place: the same names
    moved = 0
    for name, weight in eager.state_dict().items():
        torch.testing.assert_close(compiled.state_dict()[name], weight, rtol=1e-4, atol=1e-5, msg=name)
        moved += not torch.equal(weight, Net().state_dict()[name])
    assert moved  # the steps trained


def test_compile_is_one_process_only_and_a_plan_file_keeps_it(tmp_path):
    with pytest.raises(UserError, match="compile on several processes"):
        TrainingConfig(global_batch_size=8, micro_batch_size=4, world_size=2, sharding="ddp", compile=True)
    config = TrainingConfig(global_batch_size=8, micro_batch_size=4, compile=True)
    assert config.key() != replace(config, compile=False).key()
    assert config.simplicity() > replace(config, compile=False).simplicity()  # a tie keeps the model uncompiled
    plan = Plan(model=ModelInfo(source="m.py"), device=DeviceInfo(type="cpu"), budget_bytes=10**8, config=config)
    assert load_plan(save_plan(plan, tmp_path / "plan.json")).config.compile


def test_compile_is_not_asked_of_a_simulation():
    spec = load_spec(str(EXAMPLES / "tiny_transformer.py"))
    with pytest.raises(UserError, match="--compile is measured on the device"):
        plan_with_report(spec, PlanRequest(budget="60MB", batch_size=8, simulate=True, compile=True, cache=False))


@pytest.fixture(scope="module")
def compiled_plan(tmp_path_factory):
    """The tiny transformer example planned on the CPU with --compile (one thread: steadier timings), then again from
    the study the first run kept."""
    spec = load_spec(str(EXAMPLES / "tiny_transformer.py"))
    study = f"sqlite:///{tmp_path_factory.mktemp('compile') / 'plans.db'}"
    request = PlanRequest(budget="60MB", batch_size=16, precisions=("fp32",), compile=True, study=study, threads=1)
    first = plan_with_report(spec, request).plan
    return spec, first, plan_with_report(spec, request).plan


@pytest.mark.slow
def test_the_planner_measures_the_compiled_configuration_and_keeps_it_only_if_faster(compiled_plan):
    _, plan, again = compiled_plan
    notes = [n for n in plan.notes if n.startswith("torch.compile")]
    assert len(notes) == 1, plan.notes
    assert ("torch.compile on: measured to fit and to be faster" in notes[0]) == plan.config.compile, notes[0]
    assert "samples/s compiled" in notes[0] and "peak" in notes[0] and "compiling and measuring took" in notes[0]
    # Planned again: the finding comes from the study, nothing is compiled again.
    assert f"{notes[0]} ({KEPT})" in again.notes and again.config == plan.config


@pytest.mark.slow
def test_probe_re_measures_a_compiled_plans_peak_within_its_budget(compiled_plan):
    spec, plan, _ = compiled_plan
    compiled = replace(plan, config=replace(plan.config, compile=True))  # whether or not it was faster here
    result = probe_plan(spec, compiled, steps=2)
    assert result.compile and result.compiled_change_bytes is not None  # the CPU allocator's count of the compiled step
    needed = result.peak_bytes + sum(compiled.headroom.values())
    assert needed <= compiled.budget_bytes
