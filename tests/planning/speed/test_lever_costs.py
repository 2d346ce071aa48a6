"""The levers' time terms (planning/lever_costs.py) and what feeds them: the host link (measured on a GPU,
assumed without one), the optimizer's update on the host, and what 8-bit state adds to the update."""
import dataclasses

import pytest
import torch

from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.measure.host_speed import HostLink, measure_host_link, time_host_update
from autofit.measure.optimizer_speed import time_eight_bit_update, time_step_in_backward
from autofit.measure.probe import measure
from autofit.planning.speed import levers as lever_costs
from autofit.planning import lever_timings as levers
from autofit.planning.costs import CostModel
from autofit.planning.memory.headroom import Headroom, persistent_bytes
from autofit.planning.speed.levers import (
    ASSUMED_LINK_BYTES_PER_S, UpdateTime, host_link, host_state_seconds, lever_time, offload_seconds,
)
from autofit.planning.planner import plan_with_report
from autofit.planning.request import PlanRequest
from autofit.spec import load_spec
from tests.helpers.planning import LM_BLOCKS, LM_MODEL_FILE, STEP_BUDGET

GB = 1e9


def link(down: float, up: float) -> HostLink:
    return HostLink(to_host_bytes_per_s=down, to_device_bytes_per_s=up, measured=False, source="test")


def test_offload_copies_down_hide_behind_the_forward_and_copies_back_do_not():
    assert offload_seconds(offloaded_bytes=1 * GB, forward_seconds=0.5, link=link(10 * GB, 20 * GB)) == pytest.approx(0.05)
    # Copies down longer than the forward: the rest shows.
    assert offload_seconds(offloaded_bytes=1 * GB, forward_seconds=0.04, link=link(10 * GB, 20 * GB)) == pytest.approx(0.06 + 0.05)


def test_host_state_moves_gradients_down_and_parameters_up_and_replaces_the_device_step():
    seconds = host_state_seconds(
        gradient_bytes=2 * GB, parameter_bytes=2 * GB, update_seconds=1.5, device_optimizer_seconds=0.25, link=link(10 * GB, 20 * GB),
    )
    assert seconds == pytest.approx(0.2 + 1.5 + 0.1 - 0.25)


def test_without_a_gpu_the_link_is_assumed_and_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assumed = host_link("cuda")
    assert not assumed.measured and assumed.to_host_bytes_per_s == assumed.to_device_bytes_per_s == ASSUMED_LINK_BYTES_PER_S
    assert "assumed" in assumed.source and "12 GB/s" in assumed.source


def test_with_a_gpu_the_link_is_measured(monkeypatch):
    """The measuring itself needs CUDA (test_the_link_is_measured_on_a_gpu); here: that the planner asks for it."""
    measured = HostLink(to_host_bytes_per_s=25 * GB, to_device_bytes_per_s=26 * GB, measured=True, source="measured on this GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(lever_costs, "measure_host_link", lambda device: measured)
    assert host_link("cuda") is measured
    monkeypatch.setattr(lever_costs, "measure_host_link", lambda device: pytest.fail("no link on the CPU"))
    assert not host_link("cpu").measured


def test_measuring_the_link_without_a_gpu_is_refused():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        measure_host_link("cuda")


@pytest.mark.gpu
def test_the_link_is_measured_on_a_gpu():
    measured = measure_host_link("cuda", nbytes=16 * 2**20)
    assert measured.measured and "measured on this" in measured.source
    for rate in (measured.to_host_bytes_per_s, measured.to_device_bytes_per_s):
        assert 1 * GB < rate < 1000 * GB


def test_the_host_update_is_timed_per_parameter(one_thread):
    per_element = time_host_update(lambda params: torch.optim.AdamW(params, lr=1e-3), elements=2**16)
    assert 0 < per_element < 1e-6  # well under a microsecond per element on any CPU
    # A builder that needs more than a list of parameters: AdamW is timed instead.
    assert time_host_update(lambda params: torch.optim.AdamW(params.parameters()), elements=2**16) > 0


def test_the_eight_bit_update_is_timed_against_the_models_optimizer(one_thread):
    """torchao's compiled 8-bit step against the model's AdamW, over one large tensor and several small ones: on this
    CPU it dequantizes and quantizes both moments, so it costs more per element than plain AdamW (well under a
    microsecond), and one compiled call per tensor costs more than AdamW's for-loop pays per tensor (measured:
    +29 ns per element, +320 us per tensor; the LM of tests/test_memory_grid, 42 tensors of 42,848 elements, then
    takes 14.7 ms more a step, and ``time_training`` measured 15 to 20 ms more)."""
    cost = time_eight_bit_update(lambda params: torch.optim.AdamW(params, lr=1e-3), device="cpu")
    assert 0 < cost.per_element_seconds < 1e-6
    assert 0 < cost.per_tensor_seconds < 0.1
    assert cost.seconds(tensors=2, elements=10) == pytest.approx(2 * cost.per_tensor_seconds + 10 * cost.per_element_seconds)
    with pytest.raises(UserError, match="replaces AdamW or Adam"):
        time_eight_bit_update(lambda params: torch.optim.SGD(params, lr=0.1), device="cpu", elements=2**16)


@pytest.fixture(scope="module")
def lm_costs(tmp_path_factory):
    """A small decoder LM's cost model, simulated for a GPU (no budget: nothing below the floor)."""
    path = tmp_path_factory.mktemp("lm") / "lm.py"
    path.write_text(LM_MODEL_FILE)
    spec = load_spec(str(path))
    report = plan_with_report(spec, PlanRequest(budget="3GiB", batch_size=2, precisions=["fp32"], device="cuda", simulate=True, device_memory="4GiB"))
    return spec, CostModel.from_dict(report.cost_model)


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_lever_time_adds_each_lever_by_its_formula(lm_costs):
    _, model = lm_costs
    costs = model.precisions["fp32"]
    config = TrainingConfig(global_batch_size=2, micro_batch_size=2, checkpoint=["layers.0"], offload=["layers.1", "layers.2"])
    slow = link(1e6, 2e6)  # slow enough that the copies down outlast the forward
    _, drops = costs.memory.at(2, global_batch_size=2)
    moved = drops[1] + drops[2]
    assert moved > 0
    time = lever_time(config, model=model, link=slow, trainable_bytes=0, host_update_seconds=0.0)
    assert time.offload_seconds == pytest.approx(moved / 1e6 - costs.speed.forward_seconds_at(2) + moved / 2e6)
    assert time.host_state_seconds == 0 and "activation offload moves" in time.notes[0] and "test" in time.notes[0]
    host = lever_time(
        TrainingConfig(global_batch_size=2, micro_batch_size=2, optimizer_state="host", optimizer_in_backward=True),
        model=model, link=slow, trainable_bytes=4000, host_update_seconds=0.5,
    )
    assert host.offload_seconds == 0
    assert host.seconds == pytest.approx(4000 / 1e6 + 0.5 + 4000 / 2e6 - costs.speed.optimizer_seconds)
    assert "instead of the device's" in host.notes[0]
    accumulating = lever_time(
        TrainingConfig(global_batch_size=2, micro_batch_size=1, optimizer_state="host"),
        model=model, link=slow, trainable_bytes=4000, host_update_seconds=0.5,
    )
    assert accumulating.seconds == pytest.approx(2 * 4000 / 1e6 + 0.5 + 4000 / 2e6 - costs.speed.optimizer_seconds)
    assert "after each of 2 micro-batches" in accumulating.notes[0]
    in_backward = lever_time(TrainingConfig(global_batch_size=2, micro_batch_size=2, optimizer_in_backward=True), model=model,
                             link=None, trainable_bytes=4000, host_update_seconds=0.0)
    assert in_backward.seconds == 0 and "no time" in in_backward.notes[0]


def test_lever_time_adds_the_eight_bit_update_it_is_given(lm_costs):
    _, model = lm_costs
    config = TrainingConfig(global_batch_size=2, micro_batch_size=2, optimizer_state="8bit")
    eight_bit = UpdateTime(seconds=0.25, source="timed in a test")
    time = lever_time(config, model=model, link=None, trainable_bytes=4000, host_update_seconds=0.0, eight_bit=eight_bit)
    assert time.seconds == time.eight_bit_seconds == 0.25 and "timed in a test" in time.notes[0]
    with pytest.raises(ValueError, match="8-bit"):
        lever_time(config, model=model, link=None, trainable_bytes=4000, host_update_seconds=0.0)


def test_lever_time_adds_the_step_in_backward_it_is_given(lm_costs):
    _, model = lm_costs
    config = TrainingConfig(global_batch_size=2, micro_batch_size=2, optimizer_in_backward=True)
    stepping = UpdateTime(seconds=0.125, source="timed in a test")
    time = lever_time(config, model=model, link=None, trainable_bytes=4000, host_update_seconds=0.0, step_in_backward=stepping)
    assert time.seconds == time.step_in_backward_seconds == 0.125 and "timed in a test" in time.notes[0]
    # With host state the update is the host's: its term counts it.
    host = lever_time(
        TrainingConfig(global_batch_size=2, micro_batch_size=2, optimizer_in_backward=True, optimizer_state="host"), model=model,
        link=link(1e6, 2e6), trainable_bytes=4000, host_update_seconds=0.5, step_in_backward=stepping,
    )
    assert host.step_in_backward_seconds == 0


def test_the_step_in_backward_is_timed_per_parameter_against_the_models_optimizer(one_thread):
    """One optimizer per parameter against one for all, over the same small tensors: what each parameter's own
    step adds (a call and its hooks here; on a GPU the launches a foreach step shares). Nothing per element: the
    updates are the same."""
    cost = time_step_in_backward(lambda params: torch.optim.AdamW(params, lr=1e-3), device="cpu")
    assert cost.per_element_seconds == 0 and abs(cost.per_tensor_seconds) < 0.01
    assert cost.seconds(tensors=3, elements=10**9) == pytest.approx(3 * cost.per_tensor_seconds)


def test_a_step_in_backward_that_costs_more_than_recomputing_is_not_chosen(monkeypatch):
    """ConvThenWide at the budget where the step in backward lets micro-batch 8 fit unchecked
    (tests/planning/test_plan_search_levers.py): priced at a second per parameter, it loses to recomputation or accumulation."""
    from autofit.measure.optimizer_speed import UpdateCost
    from tests.helpers.models import conv_then_wide_spec

    monkeypatch.setattr(levers, "time_step_in_backward", lambda build, device: UpdateCost(per_tensor_seconds=1.0, per_element_seconds=0.0))
    plan = plan_with_report(
        conv_then_wide_spec(), PlanRequest(budget=STEP_BUDGET, batch_size=8, device="cpu", simulate=True, cache=False, precisions=["fp32"]),
    ).plan
    assert not plan.config.optimizer_in_backward and plan.measured.peak_bytes <= STEP_BUDGET


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_a_simulated_gpu_lever_plan_predicts_the_floor_speed_plus_the_levers(lm_costs, monkeypatch):
    """--simulate --device cuda with host state: predicted samples/s is G / (the chosen configuration's step + the host
    state's term), with the assumed link in the notes (below the floor: the floor configuration with the levers,
    or what the search with them finds faster)."""
    spec, _ = lm_costs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def simulated_cuda(**chosen):
        config = TrainingConfig(global_batch_size=1, micro_batch_size=1, checkpoint=LM_BLOCKS, optimizer_in_backward=True, **chosen)
        return measure(spec, config, device="cuda", simulate=True, steps=2)

    in_backward, host = simulated_cuda(), simulated_cuda(optimizer_state="host")
    headroom = Headroom.estimated_cuda(1, expandable_segments=True)
    def least(measured) -> int:
        return headroom.smallest_budget(measured.peak_bytes, persistent_bytes=persistent_bytes(measured.breakdown))

    budget = (least(host) + least(in_backward)) // 2
    # The host that trains: 1e6 elements/s, 1e-6 s per element (a GPU that is not here is never timed on this CPU).
    request = PlanRequest(budget=budget, batch_size=1, precisions=["fp32"], device="cuda", simulate=True, device_memory="4GiB", host_speed=1e6)
    report = plan_with_report(spec, request)
    plan, model = report.plan, CostModel.from_dict(report.cost_model)
    assert plan.config.optimizer_state == "host"
    with torch.device("meta"):
        params = list(spec.build_model().parameters())
    elements, nbytes = sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)
    checkpointed = frozenset(model.blocks.index(b) for b in plan.config.checkpoint)
    floor_step = model.step_seconds("fp32", 1, checkpointed, frozenset(model.blocks.index(b) for b in plan.config.selective_checkpoint))
    speed = model.precisions["fp32"].speed
    expected = 1 / (floor_step + nbytes / ASSUMED_LINK_BYTES_PER_S + 1e-6 * elements + nbytes / ASSUMED_LINK_BYTES_PER_S - speed.optimizer_seconds)
    assert plan.predicted.samples_per_s == pytest.approx(expected)
    assert any("assumed (no GPU here to measure it" in note for note in plan.notes)


def test_below_the_floor_bf16_master_is_priced_with_its_host_update_and_link(lm_costs):
    """The ladder's configurations with bf16-master are priced as the search's are (it raised for want of the link)."""
    from autofit.planning.context import plan_context
    from autofit.planning.lever_timings import lever_time_for

    spec, model = lm_costs
    context = plan_context(spec, PlanRequest(budget="3GiB", batch_size=2, device="cuda", simulate=True, device_memory="4GiB"))
    model = dataclasses.replace(model, precisions={**model.precisions, "bf16-master": model.precisions["fp32"]})
    time = lever_time_for(context, None, model, TrainingConfig(global_batch_size=2, micro_batch_size=2, precision="bf16-master"))
    assert time.host_state_seconds > 0 and any("fp32 masters" in note for note in time.notes), time.notes
