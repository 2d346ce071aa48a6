"""The memory levers in the search above the floor: the step in backward where one micro-batch per step allows
it, offload per block and host optimizer state on a GPU, 8-bit optimizer state with --allow-lossy-optimizer, each
plan re-measured by ``probe_plan``."""
import pytest
import torch

from autofit.config import TrainingConfig
from autofit.measure.probe import probe, probe_plan
from autofit.planning.summary import summary_lines
from autofit.measure.optimizer_speed import UpdateCost
from autofit.planning import lever_timings as levers
from autofit.planning.speed.levers import UpdateTime
from autofit.planning.planner import plan_with_report
from autofit.planning.request import PlanRequest
from autofit.planning.search.space import LeverSearch, score_space
from autofit.planning.memory.levers import LeverChoice
from tests.helpers.models import conv_then_wide_spec, layout_specs
from tests.helpers.planning import STEP_BUDGET, grid_spec

@pytest.fixture(autouse=True)
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_step_in_backward_lets_the_whole_batch_fit_above_the_floor(monkeypatch):
    """Its wide head's gradients appear beside every convolution's activations; stepped in backward they never
    coexist, so micro-batch 8 fits without recomputation: faster than checkpointing or accumulating where each
    parameter's own step costs little (priced at 1 us here: its measured price, this CPU's overhead per Python
    call against FLOP-estimated steps of a few milliseconds, decides it either way by the load of the moment;
    tests/planning/speed/test_lever_costs.py prices it high and sees checkpointing chosen)."""
    from autofit.measure.optimizer_speed import UpdateCost
    from autofit.planning import lever_timings as levers

    monkeypatch.setattr(levers, "time_step_in_backward", lambda build, device: UpdateCost(per_tensor_seconds=1e-6, per_element_seconds=0.0))
    spec = conv_then_wide_spec()
    report = plan_with_report(spec, PlanRequest(budget=STEP_BUDGET, batch_size=8, device="cpu", simulate=True, cache=False, precisions=["fp32"]))
    plan = report.plan
    assert report.floor_bytes < STEP_BUDGET
    assert plan.config.optimizer_in_backward and plan.config.micro_batch_size == 8 and not plan.config.checkpoint and not plan.config.selective_checkpoint
    assert plan.measured.peak_bytes <= STEP_BUDGET
    assert abs(plan.predicted.peak_bytes - plan.measured.peak_bytes) <= 0.001 * plan.measured.peak_bytes
    assert any("optimizer step in backward" in note for note in plan.notes)
    # Without it the same configuration does not fit, and whatever fits instead is predicted slower.
    plain = probe(spec, micro_batch_size=8, global_batch_size=8, simulate=True, steps=1)
    assert plain.peak_bytes > STEP_BUDGET
    others = [a for a in plan.alternatives if a["fits_budget"] and not a.get("optimizer_in_backward")]
    assert others and all(a["predicted_samples_per_s"] < plan.predicted.samples_per_s for a in others)
    remeasured = probe_plan(spec, plan, steps=2)
    assert remeasured.optimizer_in_backward and remeasured.peak_bytes <= STEP_BUDGET


def test_step_in_backward_is_searched_only_where_a_point_allows_it():
    """One micro-batch per step, and not fp16 (its GradScaler must see every gradient before any step); host state
    and offload only when the search allows them (a GPU)."""
    search = LeverSearch(step_in_backward=True)
    assert LeverChoice(optimizer_in_backward=True) in search.choices("fp32", 8, 8)
    assert search.choices("fp32", 4, 8) == [LeverChoice()]
    assert search.choices("fp16", 8, 8) == [LeverChoice()]
    gpu = LeverSearch(step_in_backward=True, host_state=True, offload=True)
    assert LeverChoice(optimizer_state="host") in gpu.choices("fp16", 4, 8)
    assert all(c.optimizer_state != "8bit" for c in gpu.choices("fp32", 8, 8))


def test_eight_bit_state_is_searched_only_when_allowed():
    """8-bit state changes the arithmetic: a choice only with --allow-lossy-optimizer (``LeverSearch.eight_bit``), alone
    or with the step in backward where a point allows that."""
    allowed = LeverSearch(step_in_backward=True, eight_bit=UpdateTime(seconds=0.0, source="test"))
    assert allowed.choices("fp32", 8, 8) == [
        LeverChoice(), LeverChoice(optimizer_in_backward=True), LeverChoice(optimizer_state="8bit"),
        LeverChoice(optimizer_in_backward=True, optimizer_state="8bit"),
    ]
    assert allowed.choices("fp32", 4, 8) == [LeverChoice(), LeverChoice(optimizer_state="8bit")]
    assert all(c.optimizer_state != "8bit" for c in LeverSearch(step_in_backward=True).choices("fp32", 8, 8))


def test_nf4_weights_are_searched_only_when_allowed_and_add_to_every_other_choice():
    """Frozen weights in NF4 round them: a choice only with --allow-lossy-base (``LeverSearch.nf4``), beside each of the
    other levers, at every precision (bf16-master's too)."""
    timed = UpdateTime(seconds=0.0, source="test")
    allowed = LeverSearch(step_in_backward=True, nf4={"fp32": timed, "bf16-master": timed})
    assert allowed.choices("fp32", 8, 8) == [
        LeverChoice(), LeverChoice(optimizer_in_backward=True), LeverChoice(frozen_nf4=True),
        LeverChoice(optimizer_in_backward=True, frozen_nf4=True),
    ]
    assert allowed.choices("bf16-master", 4, 8) == [LeverChoice(), LeverChoice(frozen_nf4=True)]
    assert not any(c.frozen_nf4 for c in LeverSearch(step_in_backward=True).choices("fp32", 8, 8))


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_simulated_gpu_plan_offloads_a_block_where_that_is_fastest():
    """The LM at micro-batch 8 on a simulated GPU, at a budget where dropping its blocks' activations is needed (with
    the default segments' allocator reserve, which the budget was sized for):
    offloading a block costs its copies over the assumed host link, less than recomputing it or splitting the batch,
    and the plan names it; ``autofit probe --plan`` re-measures it within the budget."""
    spec = layout_specs()["lm"]
    report = plan_with_report(
        spec, PlanRequest(
            budget="2.042GiB", batch_size=8, device="cuda", simulate=True, device_memory="24GiB", cache=False, precisions=["fp32"],
            expandable_segments=False,
        ),
    )
    plan = report.plan
    assert plan.config.offload and plan.config.micro_batch_size == 8
    assert not set(plan.config.offload) & set(plan.config.checkpoint + plan.config.selective_checkpoint)
    assert abs(plan.predicted.peak_bytes - plan.measured.peak_bytes) <= 0.002 * plan.measured.peak_bytes
    assert any("activation offload moves" in note and "assumed" in note for note in plan.notes)
    remeasured = probe_plan(spec, plan, steps=2)
    assert remeasured.offload == list(plan.config.offload) and remeasured.host_peak_bytes > 0
    assert remeasured.peak_bytes == plan.measured.peak_bytes
    assert remeasured.peak_bytes + sum(plan.headroom.values()) <= plan.budget_bytes


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_cpu_plans_never_offload():
    """On the CPU the host is the device: the search offers neither offload nor host state, even where dropping
    activations is needed (the LM at 1.25 MB checkpoints instead)."""
    spec = layout_specs()["lm"]
    report = plan_with_report(spec, PlanRequest(budget=1_250_000, batch_size=8, device="cpu", simulate=True, cache=False, precisions=["fp32"]))
    plan = report.plan
    assert not plan.config.offload and plan.config.optimizer_state == "device"
    assert plan.config.checkpoint or plan.config.selective_checkpoint or plan.config.micro_batch_size < 8


def test_configuration_keys_name_the_levers_and_keep_the_old_ones():
    """Stored measurements are keyed by configuration: one without levers keeps the key it always had."""
    plain = TrainingConfig(global_batch_size=8, precision="fp32", micro_batch_size=4, checkpoint=("a",))
    assert plain.key() == "fp32:4:a"
    levers = TrainingConfig(global_batch_size=8, precision="fp32", micro_batch_size=4, checkpoint="a", offload=["b"], optimizer_state="host")
    assert levers.key() == "fp32:4:a::offload=b;state=host"
    stepping = TrainingConfig(global_batch_size=8, precision="bf16", micro_batch_size=8, optimizer_in_backward=True)
    assert stepping.key() == "bf16:8:::step-in-backward"
    assert len({plain.key(), levers.key(), stepping.key()}) == 3
    assert plain.simplicity() < levers.simplicity()
    assert levers.offload == ("b",) and levers.checkpoint == ("a",) and levers.optimizer_state == "host"


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_a_point_that_fits_as_plain_training_tries_no_lever(monkeypatch):
    """Levers only add time (the step in backward none): at a budget every point fits without checkpointing,
    the search never models one (the lever search costs most of a tight plan's search)."""
    import autofit.planning.search.space as search

    def refuse(*args, **kwargs):
        raise AssertionError("a lever was tried at a point that fits as plain training")

    monkeypatch.setattr(search, "lever_segments", refuse)
    report = plan_with_report(
        layout_specs()["lm"], PlanRequest(budget="4GiB", batch_size=8, device="cuda", simulate=True, device_memory="24GiB", cache=False),
    )
    plan = report.plan
    assert not plan.config.optimizer_in_backward and plan.config.offload == () and plan.config.optimizer_state == "device" and not plan.config.checkpoint


def test_offload_is_traced_only_where_a_point_could_win_with_it(monkeypatch):
    """Offload only adds time: a precision's offloading runs are traced only when one of its points that does
    not fit as plain training is, as plain training, faster than the best that fits (``needs_offload``), or
    where the search bounded its speed with offload (``bound_samples_per_s``), by that bound."""
    import autofit.planning.modelling as modelling
    from autofit.planning.search.space import Evaluation

    monkeypatch.setattr(modelling, "offload_untraced", lambda context, costs, precision, *, usable_bytes: True)

    def point(precision, m, *, fits, speed, plain, bound=None):
        return Evaluation(
            config=TrainingConfig(global_batch_size=8, precision=precision, micro_batch_size=m), fits=fits, samples_per_s=speed,
            plain_samples_per_s=plain, bound_samples_per_s=bound,
        )

    fitting = point("bf16", 4, fits=True, speed=100.0, plain=100.0)
    slower = point("fp32", 8, fits=False, speed=0.0, plain=90.0)
    faster = point("fp32", 8, fits=False, speed=0.0, plain=120.0)
    checkpointed = point("bf16", 8, fits=True, speed=95.0, plain=130.0)  # fits only checkpointed: offload might beat it
    assert modelling.needs_offload(None, None, [fitting, slower], within=1.0, usable_bytes=0) == []
    assert modelling.needs_offload(None, None, [fitting, faster], within=1.0, usable_bytes=0) == ["fp32"]
    assert modelling.needs_offload(None, None, [fitting, slower], within=0.8, usable_bytes=0) == ["fp32"]
    assert modelling.needs_offload(None, None, [fitting, checkpointed], within=1.0, usable_bytes=0) == ["bf16"]
    bounded = point("fp32", 8, fits=False, speed=0.0, plain=120.0, bound=99.0)  # faster as plain training, not with offload
    assert modelling.needs_offload(None, None, [fitting, bounded], within=1.0, usable_bytes=0) == []
    bounded.bound_samples_per_s = 101.0
    assert modelling.needs_offload(None, None, [fitting, bounded], within=1.0, usable_bytes=0) == ["fp32"]


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_the_bound_before_offload_is_traced_holds(monkeypatch):
    """Before the offloading runs are traced, the search bounds each point's speed with offload (its copies back
    at the least they cost, ``offload_floor_seconds``); every point the search then offloads is no faster than its
    bound was, and the plan of ``test_simulated_gpu_plan_offloads_a_block_where_that_is_fastest`` still offloads."""
    import autofit.planning.planner as planner

    scorings = []

    def spy(*args, **kwargs):
        found, sampler = score_space(*args, **kwargs)
        scorings.append({(e.config.precision, e.config.micro_batch_size): e for e in found})
        return found, sampler

    monkeypatch.setattr(planner, "score_space", spy)
    report = plan_with_report(
        layout_specs()["lm"], PlanRequest(
            budget="2.042GiB", batch_size=8, device="cuda", simulate=True, device_memory="24GiB", cache=False, precisions=["fp32"],
            expandable_segments=False,
        ),
    )
    assert report.plan.config.offload
    before = next(i for i, scored in enumerate(scorings) if any(e.config.offload for e in scored.values()))
    offloading = [key for key, e in scorings[before].items() if e.config.offload]
    assert offloading and before > 0
    for key in offloading:
        bound = scorings[before - 1][key].bound_samples_per_s
        assert bound is not None and scorings[before][key].samples_per_s <= bound * (1 + 1e-9)


EIGHT_BIT_BUDGET = 900_000
"""Bytes: the LM of tests/test_memory_grid (foreach AdamW) for a batch of 4 on the CPU, above its floor (880 KB with
headroom) and below its plain peak at micro-batch 4 (997 KB; 997 KB with the step in backward too: the foreach step's
temporaries peak after backward). With 8-bit state micro-batch 4 peaks at 862 KB, without checkpointing; without it
the first block is checkpointed (876 KB)."""


def eight_bit_plan(monkeypatch, *, per_element_seconds: float, allow_lossy_optimizer: bool, budget=EIGHT_BIT_BUDGET):
    """A simulated CPU plan of the LM with the 8-bit update's time per element set (its timing has its own test);
    without the flag it is never timed."""
    def timed(build, device):
        assert allow_lossy_optimizer, "8-bit state was timed without --allow-lossy-optimizer"
        return UpdateCost(per_tensor_seconds=0.0, per_element_seconds=per_element_seconds)

    monkeypatch.setattr(levers, "time_eight_bit_update", timed)
    return plan_with_report(
        grid_spec("lm"),
        PlanRequest(budget=budget, batch_size=4, device="cpu", simulate=True, cache=False, precisions=["fp32"], allow_lossy_optimizer=allow_lossy_optimizer),
    )


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_eight_bit_state_lets_the_whole_batch_fit_without_recomputation(monkeypatch):
    """Allowed, and its update cheaper than recomputing a block, 8-bit state is the plan: micro-batch 4 without
    checkpointing, predicted within 0.01% of the simulated meter, named lossy in the notes and the summary, and
    re-measured by ``autofit probe --plan`` within the budget. Not allowed, the same budget checkpoints instead."""
    report = eight_bit_plan(monkeypatch, per_element_seconds=1e-12, allow_lossy_optimizer=True)
    plan = report.plan
    assert report.floor_bytes < EIGHT_BIT_BUDGET
    assert plan.config.optimizer_state == "8bit" and plan.config.micro_batch_size == 4 and not plan.config.checkpoint and not plan.config.selective_checkpoint
    assert plan.measured.peak_bytes + sum(plan.headroom.values()) <= EIGHT_BIT_BUDGET
    assert abs(plan.predicted.peak_bytes - plan.measured.peak_bytes) <= 0.0001 * plan.measured.peak_bytes
    assert any("changes the optimizer's arithmetic" in note for note in plan.notes)
    assert any("8-bit optimizer state:" in note and "timed against the model's optimizer" in note for note in plan.notes)
    assert any("8-bit AdamW state (lossy)" in line for line in summary_lines(report))
    # Without it the same micro-batch does not fit, with or without the step in backward.
    for in_backward in (False, True):
        plain = probe(grid_spec("lm"), micro_batch_size=4, global_batch_size=4, simulate=True, steps=1, optimizer_in_backward=in_backward)
        assert plain.peak_bytes > EIGHT_BIT_BUDGET
    remeasured = probe_plan(grid_spec("lm"), plan, steps=2)
    assert remeasured.optimizer_state == "8bit" and remeasured.peak_bytes + sum(plan.headroom.values()) <= EIGHT_BIT_BUDGET

    refused = eight_bit_plan(monkeypatch, per_element_seconds=1e-12, allow_lossy_optimizer=False).plan
    assert refused.config.optimizer_state == "device" and refused.config.checkpoint


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_eight_bit_state_is_chosen_only_where_it_is_fastest(monkeypatch):
    """Its measured time counts: an update slower than recomputing the first block loses to checkpointing, even allowed."""
    plan = eight_bit_plan(monkeypatch, per_element_seconds=1e-6, allow_lossy_optimizer=True).plan
    assert plan.config.optimizer_state == "device" and plan.config.checkpoint


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_eight_bit_state_is_not_tried_where_plain_training_fits(monkeypatch):
    """At a budget where every point fits as plain training, the search models no lever, 8-bit state included."""
    import autofit.planning.search.space as search

    def refuse(*args, **kwargs):
        raise AssertionError("a lever was tried at a point that fits as plain training")

    monkeypatch.setattr(search, "lever_segments", refuse)
    plan = eight_bit_plan(monkeypatch, per_element_seconds=1e-12, allow_lossy_optimizer=True, budget="4MiB").plan
    assert plan.config.optimizer_state == "device" and not plan.config.checkpoint and not plan.config.optimizer_in_backward
