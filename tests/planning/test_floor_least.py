"""The floor is the least measured configuration among those check_floor measures, whatever the memory model
predicted (DeepLabV3's stated floor was a configuration measured above another that fits)."""
import pytest
import torch
import autofit.planning.planner as planner
from autofit.planning.request import PlanRequest
from autofit.planning.verify.floor import InfeasibleBudget, check_floor
from tests.helpers.planning import uneven_spec


class Swapped:
    """A memory model that predicts every block checkpointed as it would none and the other way round: the
    floor's two options ordered wrongly, each predicted at the other's peak."""

    def __init__(self, memory, blocks: frozenset[int]) -> None:
        self.memory, self.blocks = memory, blocks

    def peak_bytes(self, micro_batch_size, *, checkpoint, **kwargs) -> float:
        return self.memory.peak_bytes(micro_batch_size, checkpoint=frozenset() if checkpoint else self.blocks, **kwargs)


def _mispredicting(context, costs, measurements):
    memory_for_floor = type(costs).memory_for_floor
    blocks = frozenset(range(len(costs.model.blocks)))
    type(costs).memory_for_floor = lambda self: {p: Swapped(m, blocks) for p, m in memory_for_floor(self).items()}
    try:
        return check_floor(context, costs, measurements)
    finally:
        type(costs).memory_for_floor = memory_for_floor


def _floor(request: PlanRequest, spec=None):
    with pytest.raises(InfeasibleBudget) as error:
        planner.make_plan(spec or uneven_spec(), request)
    return error.value


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_floor_is_the_least_measured_when_the_prediction_orders_it_wrong(monkeypatch):
    request = PlanRequest(budget=1000, batch_size=4, precisions=("fp32",), simulate=True, cache=False)
    right = _floor(request)
    monkeypatch.setattr(planner, "check_floor", _mispredicting)
    wrong = _floor(request)
    assert wrong.floor_bytes == right.floor_bytes
    assert wrong.floor.config == right.floor.config


def _wide_spec():
    """Weights dominate: bf16's floor (fp32 weights, gradients, AdamW state) is several times bf16-master's."""
    from torch import nn

    from autofit.spec import ModelSpec, default_optimizer

    return ModelSpec(
        source="tests:wide", build_model=lambda: nn.Sequential(*(nn.Linear(8192, 8192) for _ in range(6))),
        example_batch=lambda n: (torch.randn(n, 8192), torch.randint(0, 8192, (n,))),
        loss_fn=nn.functional.cross_entropy, build_optimizer=default_optimizer,
    )


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_a_floor_far_over_the_budget_is_measured_only_once_every_precision_is_traced(monkeypatch):
    request = dict(batch_size=4, precisions=("bf16", "bf16-master"), simulate=True, device="cuda", device_memory="24GiB", cache=False)
    floors = {}
    for precision in ("bf16", "bf16-master"):
        with pytest.raises(InfeasibleBudget) as error:
            planner.make_plan(_wide_spec(), PlanRequest(budget=1000, **{**request, "precisions": (precision,)}))
        floors[precision] = error.value.floor_bytes
    budget = int(1.3 * floors["bf16-master"])
    assert budget * 1.1 < floors["bf16"]
    measured = []
    real = planner.check_floor

    def counted(context, costs, measurements):
        measured.append(sorted(costs.memory_for_floor()))
        return real(context, costs, measurements)

    monkeypatch.setattr(planner, "check_floor", counted)
    plan = planner.make_plan(_wide_spec(), PlanRequest(budget=budget, **{**request, "precisions": ("bf16", "fp32", "bf16-master")}))
    assert plan.config.precision == "bf16-master"
    # One check, after bf16-master was traced: bf16's floor alone was not measured first, and fp32 (more weights
    # than bf16-master's, traced after it) was not needed once bf16-master's floor was under the budget.
    assert measured == [["bf16", "bf16-master"]]


def test_precisions_whose_weights_alone_are_over_the_budget_are_traced_no_further(monkeypatch):
    """fp32 weights over what a peak may be: the floor traces bf16-master alone, the search leaves bf16 and fp32 out,
    and the summary says why."""
    request = dict(batch_size=4, simulate=True, device="cuda", device_memory="24GiB", cache=False)
    with pytest.raises(InfeasibleBudget) as error:
        planner.make_plan(_wide_spec(), PlanRequest(budget=1000, **request, precisions=("bf16-master",)))
    budget = int(1.1 * error.value.floor_bytes)  # a peak may be about 1.15 GiB: under the 1.50 GiB of fp32 weights
    measured, lines = [], []
    real = planner.check_floor

    def counted(context, costs, measurements):
        measured.append(sorted(costs.memory_for_floor()))
        return real(context, costs, measurements)

    monkeypatch.setattr(planner, "check_floor", counted)
    report = planner.plan_with_report(
        _wide_spec(), PlanRequest(budget=budget, **request, precisions=("bf16", "fp32", "bf16-master")), log=lines.append,
    )
    assert report.plan.config.precision == "bf16-master"
    assert measured == [["bf16-master"]]
    assert not [line for line in lines if "tracing fp32" in line or "tracing bf16 " in line]
    for precision in ("bf16", "fp32"):
        assert "not traced: its weights alone (1.50 GiB) are more than a peak may be" in report.precision_notes[precision]


def _frozen_base_spec():
    """An adapter's shape: six frozen 8192x8192 layers (1.50 GiB in fp32, 768 MiB in bf16) under a small trained
    head; the trained weights alone are 256 KiB at any precision."""
    from torch import nn

    from autofit.spec import ModelSpec, default_optimizer

    def build():
        base = nn.Sequential(*(nn.Linear(8192, 8192, bias=False) for _ in range(6))).requires_grad_(False)
        return nn.Sequential(base, nn.Linear(8192, 8))

    return ModelSpec(
        source="tests:frozen-base", build_model=build, example_batch=lambda n: (torch.randn(n, 8192), torch.randint(0, 8, (n,))),
        loss_fn=nn.functional.cross_entropy, build_optimizer=default_optimizer,
    )


def test_a_frozen_base_counts_in_the_weights_over_the_budget_at_nf4_s_size_where_it_may_be_nf4():
    """A frozen base stays on the device with its precision's dtype unless NF4 may hold it: fp32's 1.50 GiB of
    weights are over a peak bf16-master's floor leaves, and are not traced; with --allow-lossy-base the bound counts
    the NF4 codes (half a byte an element), and fp32 is traced."""
    from autofit.planning.context import plan_context
    from autofit.planning.verify.measurements import Measurements

    request = dict(batch_size=4, simulate=True, device="cuda", device_memory="24GiB", cache=False)
    with pytest.raises(InfeasibleBudget) as error:
        planner.make_plan(_frozen_base_spec(), PlanRequest(budget=1000, **request, precisions=("bf16-master",)))
    budget = int(1.1 * error.value.floor_bytes)
    lines = []
    report = planner.plan_with_report(
        _frozen_base_spec(), PlanRequest(budget=budget, **request, precisions=("fp32", "bf16-master")), log=lines.append,
    )
    assert report.plan.config.precision == "bf16-master"
    assert not [line for line in lines if "tracing fp32" in line]
    assert "not traced: its weights alone (1.50 GiB) are more than a peak may be" in report.precision_notes["fp32"]

    context = plan_context(_frozen_base_spec(), PlanRequest(budget=budget, **request, precisions=("fp32", "bf16-master")), log=None)
    head = 8192 * 8 * 4 + 8 * 4
    assert Measurements(context, host_sample_bytes=0).weight_bytes("bf16-master") == 6 * 8192 * 8192 * 2 + 8192 * 8 * 2 + 8 * 2
    assert Measurements(context, host_sample_bytes=0, nf4=True).weight_bytes("fp32") == 6 * 8192 * 8192 // 2 + head


def test_where_every_precision_s_weights_are_over_the_floor_traces_the_least_and_no_precision_that_could_not_lower_it():
    """Even bf16-master's 768 MiB of frozen weights are more than a peak may be: the floor traces bf16-master alone
    (fp32's weights alone need more than its floor) and refuses with the floor bf16-master alone has."""
    request = dict(batch_size=4, simulate=True, device="cuda", device_memory="24GiB", cache=False)
    with pytest.raises(InfeasibleBudget) as alone:
        planner.make_plan(_frozen_base_spec(), PlanRequest(budget="1500MiB", **request, precisions=("bf16-master",)))
    lines = []
    with pytest.raises(InfeasibleBudget) as error:
        planner.make_plan(_frozen_base_spec(), PlanRequest(budget="1500MiB", **request, precisions=("fp32", "bf16-master")), log=lines.append)
    assert error.value.floor_bytes == alone.value.floor_bytes
    assert not [line for line in lines if "tracing fp32" in line]
    assert [line for line in lines if "floor: fp32 not traced for it: its weights alone need a budget of" in line]


def test_the_floor_is_stated_once_when_a_second_check_finds_the_same(monkeypatch):
    """A budget just under the floor: the floor is checked, more precisions traced, checked again; the same floor was
    printed twice ("floor: 203.27 MiB measured" after fp32's trace and again after bf16's). Now once, named as the floor
    without levers."""
    from types import SimpleNamespace

    import autofit.planning.verify.floor as floor_module
    from autofit.config import TrainingConfig
    from autofit.planning.memory.headroom import Headroom
    from autofit.planning.verify.measurements import Measurements

    config = TrainingConfig(global_batch_size=4, micro_batch_size=1)
    monkeypatch.setattr(floor_module, "_options", lambda context, costs: [(100, config)])
    monkeypatch.setattr(floor_module, "floor_phases", lambda costs, config, state_bytes: None)
    monkeypatch.setattr(floor_module, "_predicted_budget", lambda options, measurements: 1100)
    lines = []
    context = SimpleNamespace(log=lines.append, budget_bytes=10**6)
    measurements = Measurements.__new__(Measurements)  # the parts check_floor reads, without a planning context
    measurements.floor_said = None
    headroom = Headroom(device_type="cpu", estimated=False, budget_bytes=10**6)
    monkeypatch.setattr(Measurements, "headroom", property(lambda self: headroom))
    monkeypatch.setattr(Measurements, "model_is_exact", property(lambda self: False))
    monkeypatch.setattr(Measurements, "checked_peak", lambda self, config, fresh=False: (1000, {"parameters": 100}))
    monkeypatch.setattr(Measurements, "has_peak", lambda self, config: True)
    for _ in range(2):
        floor_module.check_floor(context, None, measurements)
    said = [line for line in lines if "floor" in line]
    assert len(said) == 1 and said[0].startswith("floor without levers: ") and said[0].endswith(" measured"), said


def test_a_precision_sharing_anothers_traces_is_not_measured_again_for_the_floor(monkeypatch):
    """#47: fp16 autocast makes bf16's tensors (it shares bf16's traces), so its floor configurations have bf16's
    peaks; they were measured all the same (on the CPU, fp16's steps are many times bf16's)."""
    from autofit.planning.verify.measurements import Measurements

    measured = []
    exact_peak = Measurements.exact_peak

    def counted(self, config):
        measured.append(config.precision)
        return exact_peak(self, config)

    class Checked(Exception):
        """The floor's check is over: the plan goes no further (below it, the memory levers would be tried)."""

    def check_only(context, costs, measurements):
        try:
            return check_floor(context, costs, measurements)
        except InfeasibleBudget as below:
            raise Checked(below) from None

    monkeypatch.setattr(Measurements, "exact_peak", counted)
    monkeypatch.setattr(planner, "check_floor", check_only)
    with pytest.raises(Checked) as checked:
        planner.make_plan(uneven_spec(), PlanRequest(budget=1000, batch_size=4, precisions=("fp16", "bf16"), simulate=True, cache=False))
    assert "bf16" in measured and "fp16" not in measured
    assert checked.value.args[0].floor.config.precision == "bf16"


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_the_floor_does_not_probe_what_the_model_proved_exact_puts_above_the_least_measured(monkeypatch):
    """On the CPU, once the model predicted what was measured within ``exact_slack_share``, an option it predicts
    at or above the least measured is not probed: the same floor, fewer probes. Weights dominate here, so every
    option's peak is the optimizer step's (as the ResNet-18 of #47 at its floor)."""
    from torch import nn

    from autofit.planning.verify.measurements import Measurements
    from autofit.spec import ModelSpec, default_optimizer

    spec = ModelSpec(
        source="tests:weights", build_model=lambda: nn.Sequential(*(nn.Linear(256, 256) for _ in range(3))),
        example_batch=lambda n: (torch.randn(n, 256), torch.randint(0, 256, (n,))),
        loss_fn=nn.functional.cross_entropy, build_optimizer=default_optimizer,
    )
    request = PlanRequest(budget=1000, batch_size=4, precisions=("fp32", "bf16"), device="cpu", cache=False)
    probed, real_peak = [], Measurements.checked_peak

    def counted(self, config, **kwargs):
        if config.key() not in self.peaks:
            probed.append(config.key())
        return real_peak(self, config, **kwargs)

    monkeypatch.setattr(Measurements, "checked_peak", counted)
    fewer = _floor(request, spec)
    skipped = len(probed)
    monkeypatch.setattr("autofit.planning.verify.floor._cannot_measure_less", lambda *args, **kwargs: False)
    probed.clear()
    every = _floor(request, spec)
    assert (fewer.floor_bytes, fewer.floor.config) == (every.floor_bytes, every.floor.config)
    assert 0 < skipped < len(probed), (skipped, probed)


def test_the_slack_a_cpu_plan_probes_within_is_what_its_probes_showed_the_model_off_by():
    """On the CPU the model is exact or optimistic: once probes were compared with it, a point predicted over the
    usable bytes by more than twice their largest difference is not probed (a GPU's model keeps its slack)."""
    from autofit.planning.context import plan_context
    from autofit.planning.policy import POLICY
    from autofit.planning.verify.measurements import Measurements

    context = plan_context(uneven_spec(), PlanRequest(budget="1GB", batch_size=4, device="cpu", cache=False), log=None)
    measurements = Measurements(context, host_sample_bytes=0)
    assert measurements.slack == POLICY.exact_slack_share  # nothing compared yet
    measurements.compared(measured=1_000_004, predicted=1_000_000)
    assert measurements.slack == pytest.approx(2 * 5 / 1_000_000)
    measurements.learn("fp32", measured=1_010_000, predicted=1_000_000)  # off by 1%: the policy's share again
    assert measurements.slack == POLICY.exact_slack_share and measurements.scale("fp32") == pytest.approx(1.01)
    context.trace_pool.close()
