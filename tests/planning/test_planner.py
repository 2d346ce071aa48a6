"""The planner: plans are measured to fit, generous budgets stay plain, tight ones trade, the search is exact."""
import itertools
import json
import math
import random

import pytest
import torch
from torch import nn

from autofit.errors import UserError
from autofit.planning.memory.segments import Segment
from autofit.plan_file import DeviceInfo, load_plan, save_plan
from autofit.planning.context import usable_precisions
from autofit.planning.verify.floor import InfeasibleBudget
from autofit.planning.policy import POLICY
from autofit.planning.modelling import micro_batch_sizes
from autofit.planning.planner import make_plan, plan_with_report
from autofit.planning.request import PlanRequest
from autofit.measure.probe import probe
from autofit.planning.search.knapsack import FULL, SELECTIVE, cheapest_checkpoint, peak_of
from autofit.spec import ModelSpec, default_optimizer
from tests.helpers.planning import CNN_MODEL_FILE, UnevenNet, uneven_spec
from tests.helpers.models import transformer_module


def small_transformer_spec() -> ModelSpec:
    """examples/tiny_transformer.py, made smaller still (3 layers, 16 tokens, width 64)."""
    module = transformer_module("mha")
    module.SEQ_LEN, module.D_MODEL = 16, 64
    return ModelSpec(
        source="tiny_transformer[small]",
        build_model=lambda: module.TinyTransformer("mha"),
        example_batch=module.example_batch,
        loss_fn=nn.functional.cross_entropy,
        build_optimizer=default_optimizer,
    )


SPECS = {"uneven": uneven_spec, "transformer": small_transformer_spec}
BATCH = {"uneven": 16, "transformer": 8}
POSITIONS = (0.0, 0.35, 0.7)
"""Budgets between each model's floor (0) and its plain full-batch peak (1)."""


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: timings stay meaningful while other processes share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def remeasure(spec, plan, device="cpu"):
    """The plan's settings, probed again from scratch (as `autofit probe` does)."""
    return probe(
        spec, micro_batch_size=plan.config.micro_batch_size, global_batch_size=plan.config.global_batch_size,
        precision=plan.config.precision, checkpoint=plan.config.checkpoint, selective_checkpoint=plan.config.selective_checkpoint,
        offload=plan.config.offload, optimizer_in_backward=plan.config.optimizer_in_backward, optimizer_state=plan.config.optimizer_state,
        device=device,
    )


@pytest.fixture(scope="module")
def floors(one_thread):
    """Each model's floor (from the planner's refusal) and its plain full-batch peak."""
    found = {}
    for name, make in SPECS.items():
        with pytest.raises(InfeasibleBudget) as error:
            make_plan(make(), PlanRequest(budget=1000, batch_size=BATCH[name], precisions=["fp32"]))
        plain = probe(make(), micro_batch_size=BATCH[name], global_batch_size=BATCH[name])
        found[name] = (error.value.floor_bytes, plain.peak_bytes)
    return found


@pytest.fixture(scope="module")
def planned(floors):
    """Plans for each model at budgets from the floor towards the plain peak."""
    plans = {}
    for name in SPECS:
        floor, plain_peak = floors[name]
        for position in POSITIONS:
            budget = int(floor + position * (plain_peak - floor))
            plans[name, position] = make_plan(SPECS[name](), PlanRequest(budget=budget, batch_size=BATCH[name], precisions=["fp32"]))
    return plans


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("position", POSITIONS)
def test_plans_fit_when_measured_again(name, position, planned):
    plan = planned[name, position]
    again = remeasure(SPECS[name](), plan)
    assert again.peak_bytes + sum(plan.headroom.values()) <= plan.budget_bytes
    assert again.peak_bytes == plan.measured.peak_bytes  # the cpu meter is deterministic
    assert plan.config.global_batch_size == BATCH[name]
    assert plan.config.micro_batch_size * plan.config.grad_accum_steps >= plan.config.global_batch_size
    assert plan.config.micro_batch_size * (plan.config.grad_accum_steps - 1) < plan.config.global_batch_size


@pytest.mark.parametrize("name", sorted(SPECS))
def test_tight_budget_trades_memory(name, planned, floors):
    _, plain_peak = floors[name]
    plan = planned[name, 0.35]
    assert plan.config.checkpoint or plan.config.micro_batch_size < BATCH[name]
    assert plan.measured.peak_bytes < plain_peak


def test_generous_budget_is_plain_training():
    spec = uneven_spec()
    plan = make_plan(spec, PlanRequest(budget="1GB", batch_size=16, precisions=["fp32"]))
    assert plan.config.checkpoint == ()
    assert plan.config.grad_accum_steps == 1 and plan.config.micro_batch_size == 16
    assert plan.measured.relative_to_unconstrained == pytest.approx(1.0)


def test_cli_writes_every_field_and_probe_agrees(run_cli, tmp_path):
    out = tmp_path / "plan.json"
    model = str(tmp_path / "model.py")
    (tmp_path / "model.py").write_text(CNN_MODEL_FILE)
    code, stdout, err = run_cli("plan", model, "--budget", "3MB", "--batch-size", "16", "--precisions", "fp32,bf16", "--out", out, "--json", "-q")
    assert code == 0, err
    printed = json.loads(stdout)
    plan = load_plan(out)
    assert printed == plan.to_dict()
    assert plan.schema_version == 1
    assert set(plan.created_by) == {"autofit", "torch"}
    assert plan.model.source == model and len(plan.model.fingerprint) == 16
    assert plan.model.parameter_count > 0 and plan.model.input_shape == [3, 12, 12] and plan.model.num_classes == 10
    assert plan.device.type == "cpu" and plan.device.total_bytes > 0 and plan.device.name
    assert plan.budget_bytes == 3 * 10**6 and plan.budget_kind == "cpu-tracked" and plan.estimated is False
    assert plan.config.precision in ("fp32", "bf16")
    assert set(printed["predicted"]) >= {"peak_bytes", "samples_per_s"} and set(printed["measured"]) >= {"peak_bytes", "samples_per_s", "meter"}
    assert plan.measured.meter == "cpu" and plan.measured.samples_per_s > 0
    # what training needs to run at that speed: the threads it was timed with, and how well it repeated
    assert 1 <= plan.measured.threads <= torch.get_num_threads() and (plan.measured.noise is None or plan.measured.noise >= 0)
    assert plan.headroom["safety_margin"] > 0
    assert sum(a["chosen"] for a in plan.alternatives) == 1
    front = [a for a in plan.alternatives if not a["chosen"]]
    peaks = [a["predicted_peak_bytes"] for a in front]
    speeds = [a["predicted_samples_per_s"] for a in front]
    # a Pareto front (of the precisions traced: one too slow to reach the verification is not)
    assert len(front) >= 1 and peaks == sorted(peaks) and speeds == sorted(speeds)
    # `autofit probe` with the plan's settings measures the same peak (16 = m x k here or the check is skipped)
    if plan.config.micro_batch_size * plan.config.grad_accum_steps == 16:
        code, stdout, err = run_cli(
            "probe", model, "-m", plan.config.micro_batch_size, "-k", plan.config.grad_accum_steps, "--precision", plan.config.precision,
            "--checkpoint", ",".join(plan.config.checkpoint) or "none", "--json",
        )
        assert code == 0, err
        assert json.loads(stdout)["peak_bytes"] + sum(plan.headroom.values()) <= plan.budget_bytes


def test_cli_summary(run_cli, tmp_path):
    (tmp_path / "model.py").write_text(CNN_MODEL_FILE)
    code, stdout, err = run_cli("plan", tmp_path / "model.py", "--budget", "3MB", "--batch-size", "16", "--precisions", "fp32", "--out", tmp_path / "p.json")
    assert code == 0, err
    for text in ("chosen", "peak", "safety margin", "of 2.86 MiB", "samples/s measured", "unconstrained configuration", "Pareto front", "memory probes"):
        assert text in stdout, text
    assert "planning" in err  # progress goes to stderr


def test_simulated_plan_is_marked_estimated(tmp_path):
    plan = make_plan(uneven_spec(), PlanRequest(budget="3MB", batch_size=16, simulate=True))
    assert plan.estimated is True
    assert plan.measured.meter == "simulated" and plan.measured.samples_per_s is None
    assert plan.predicted.samples_per_s > 0
    # on the CPU the simulated meter matches the cpu meter (to a few hundred bytes under autocast): it fits for real too
    again = remeasure(uneven_spec(), plan)
    assert again.peak_bytes + sum(plan.headroom.values()) <= plan.budget_bytes
    assert abs(again.peak_bytes - plan.measured.peak_bytes) <= 0.001 * again.peak_bytes


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_a_simulated_gpu_of_a_named_kind_has_its_memory_and_its_speeds():
    report = plan_with_report(uneven_spec(), PlanRequest(budget="50%", batch_size=16, device="cuda", simulate=True, device_kind="rtx-4090"))
    plan = report.plan
    assert plan.device == DeviceInfo(type="cuda", name="simulated RTX 4090", total_bytes=24 * 2**30, allocator_settings="expandable_segments:True")
    assert report.precision_notes["fp32"].startswith("estimated from FLOPs for the RTX 4090"), report.precision_notes
    a100 = make_plan(uneven_spec(), PlanRequest(budget="50%", batch_size=16, device="cuda", simulate=True, device_memory="24GiB"))
    assert plan.predicted.samples_per_s != a100.predicted.samples_per_s  # another card's rates
    with pytest.raises(UserError, match="--device-kind 'B200' is not a GPU autofit knows; give one of H200"):
        make_plan(uneven_spec(), PlanRequest(budget="50%", batch_size=16, device="cuda", simulate=True, device_kind="B200"))
    with pytest.raises(UserError, match="use it with --simulate --device cuda"):
        make_plan(uneven_spec(), PlanRequest(budget="50%", batch_size=16, device="cpu", device_kind="H100"))


@pytest.mark.parametrize("expandable", [True, False], ids=["expandable segments", "default segments"])
def test_simulated_gpu_plan_without_a_gpu(expandable, tmp_path):
    request = PlanRequest(budget="90%", batch_size=16, device="cuda", simulate=True, device_memory="4GiB", expandable_segments=expandable)
    plan = make_plan(uneven_spec(), request)
    settings = "expandable_segments:True" if expandable else "expandable_segments:False"
    assert plan.device == DeviceInfo(type="cuda", name="simulated cuda", total_bytes=4 * 2**30, allocator_settings=settings)
    assert load_plan(save_plan(plan, tmp_path / "plan.json")).device.allocator_settings == settings
    assert plan.budget_bytes == int(0.9 * 4 * 2**30) and plan.budget_kind == "cuda-process" and plan.estimated
    assert set(plan.headroom) == {"context", "allocator_reserve", "fragmentation", "safety_margin"}
    # the allocator's reserve measured on an H200 with the segments the plan names (bench/RESULTS.md)
    assert plan.headroom["context"] == 768 * 2**20 and plan.headroom["allocator_reserve"] == (2**29 if expandable else 5 * 2**28)
    # fragmentation: a share of the peak less its parameters, gradients and optimizer state (tests/planning/memory/test_headroom.py)
    breakdown = plan.measured.breakdown
    non_persistent = plan.measured.peak_bytes - breakdown["parameters"] - breakdown["gradients"] - breakdown["optimizer_state"]
    assert plan.headroom["fragmentation"] == math.ceil(POLICY.estimated_cuda_fragmentation_share * non_persistent)
    assert plan.measured.peak_bytes + sum(plan.headroom.values()) <= plan.budget_bytes


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_all_precisions_are_measured_not_assumed():
    """fp16 on a CPU is slow; the planner finds out by timing it, and never picks it here."""
    report = plan_with_report(uneven_spec(), PlanRequest(budget="1GB", batch_size=16))
    assert report.plan.config.precision in ("fp32", "bf16")
    assert set(report.speeds) == {"fp32", "bf16", "fp16"}  # timed, each of them, traced or not
    assert all(s["step_seconds"][0] > 0 for s in report.speeds.values())
    assert set(report_model(report).precisions) <= {"fp32", "bf16", "fp16"}


def report_model(report):
    from autofit.planning.costs import CostModel

    return CostModel.from_dict(report.cost_model)


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_study_resumes(tmp_path):
    storage = f"sqlite:///{tmp_path / 'plans.db'}"
    first = plan_with_report(uneven_spec(), PlanRequest(budget="3MB", batch_size=16, precisions=["fp32"], study=storage))
    second = plan_with_report(uneven_spec(), PlanRequest(budget="3MB", batch_size=16, precisions=["fp32"], study=storage))
    assert not first.resumed and second.resumed
    assert second.real_probes == 0  # measurements come from the study
    assert second.plan.config.micro_batch_size == first.plan.config.micro_batch_size and second.plan.config.checkpoint == first.plan.config.checkpoint
    other_budget = plan_with_report(uneven_spec(), PlanRequest(budget="2MB", batch_size=16, precisions=["fp32"], study=storage))
    assert other_budget.resumed  # the cost model is shared across budgets
    import optuna

    names = [s.study_name for s in optuna.get_all_study_summaries(storage=storage)]
    assert len(names) == 3  # one search per budget, and the costs and measurements they share
    assert sum(name.endswith(":costs") for name in names) == 1


def test_bad_study_url_is_one_line():
    with pytest.raises(UserError, match="--study 'nope://x' cannot be opened"):
        make_plan(uneven_spec(), PlanRequest(budget="1GB", batch_size=4, precisions=["fp32"], study="nope://x"))


def test_python_api_leaves_the_model_alone():
    import autofit

    model = UnevenNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = autofit.plan(
        model, lambda n: (torch.randn(n, 3, 12, 12), torch.randint(0, 10, (n,))), budget="1GB", batch_size=8,
        precisions=["fp32"],
    )
    assert plan.config.global_batch_size == 8 and plan.model.source == "python:UnevenNet"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bf16_left_out_on_a_gpu_without_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (7, 5))
    kept, excluded = usable_precisions("cuda", simulate=False, wanted=None)
    assert kept == ["fp32", "fp16"]
    assert "compute capability 7.5" in excluded["bf16"]


def test_micro_batch_sizes_cover_each_step_count_once():
    sizes = micro_batch_sizes(256, smallest=2)
    assert sizes[0] == 256 and sizes[-1] == 2 and sizes == sorted(set(sizes), reverse=True)
    assert {128, 86, 64, 43, 32} <= set(sizes)
    assert micro_batch_sizes(1, smallest=1) == [1]
    assert 3 not in sizes  # 256 = 85 x 3 + 1: a last micro-batch of one sample
    assert 3 in micro_batch_sizes(256, smallest=1)


def random_problem(rng: random.Random, n: int, shaped: bool, *, selective: bool = False):
    """Segments and per-block costs; with ``selective``, a third mode that frees less (sometimes less than nothing) for less time."""
    drops = [rng.randint(0, 100) for _ in range(n)]
    seconds = [rng.uniform(0.1, 2.0) for _ in range(n)]
    selective_drops = [rng.randint(-20, d) for d in drops] if selective else None
    selective_seconds = [s * rng.uniform(0.05, 1.0) for s in seconds] if selective else None
    segments = []
    for j in range(n + 1):
        for _ in range(2):
            dropped = list(range(j)) if shaped else sorted(rng.sample(range(n), rng.randint(0, n)))
            segments.append(Segment(peak_bytes=rng.randint(200, 600), dropped=dropped, phase="first"))
    for b in range(n):
        for mode in ([False, True] if selective else [False]):
            dropped = list(range(b)) if shaped else sorted(rng.sample(range(n), rng.randint(0, n)))
            segments.append(Segment(peak_bytes=rng.randint(200, 600), dropped=dropped, phase="first", recomputes=b, selective=mode))
    return segments, drops, seconds, selective_drops, selective_seconds


def brute_force(segments, drops, seconds, limit, selective_drops=None, selective_seconds=None):
    """The least recompute seconds over every mode per block (none, full, and selective when given)."""
    modes = [None, FULL] + ([SELECTIVE] if selective_drops is not None else [])
    best = None
    for choice in itertools.product(modes, repeat=len(drops)):
        full = frozenset(b for b, mode in enumerate(choice) if mode == FULL)
        selective = frozenset(b for b, mode in enumerate(choice) if mode == SELECTIVE)
        if peak_of(segments, drops, full, selective_drops=selective_drops, selective=selective) <= limit:
            cost = sum(seconds[b] for b in full) + sum(selective_seconds[b] for b in selective)
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("selective", [False, True], ids=["two modes", "three modes"])
@pytest.mark.parametrize("shaped", [True, False])
def test_checkpoint_knapsack_is_exact(shaped, selective):
    rng = random.Random(7)
    for _ in range(60):
        n = rng.randint(1, 6 if selective else 7)
        segments, drops, seconds, selective_drops, selective_seconds = random_problem(rng, n, shaped, selective=selective)
        limit = rng.randint(150, 600)
        expected = brute_force(segments, drops, seconds, limit, selective_drops, selective_seconds)
        choice = cheapest_checkpoint(
            segments, drops, seconds, limit_bytes=limit, selective_drops=selective_drops, selective_seconds=selective_seconds,
        )
        if expected is None:
            assert choice is None
        else:
            assert choice is not None and choice.peak_bytes <= limit
            assert choice.recompute_seconds == pytest.approx(expected)
            assert choice.peak_bytes == peak_of(segments, drops, choice.blocks, selective_drops=selective_drops, selective=choice.selective)
            assert not choice.blocks & choice.selective


def test_greedy_fits_and_never_beats_the_exact_answer(monkeypatch):
    """Many blocks of unusual shape fall to the greedy search (here every problem not prefix-shaped: the exact
    enumeration is allowed one choice): what it returns fits, at no less than the optimum."""
    from dataclasses import replace

    from autofit.planning.search import knapsack

    monkeypatch.setattr(knapsack, "POLICY", replace(knapsack.POLICY, enumerate_max_choices_log2=0))
    rng = random.Random(11)
    for _ in range(40):
        n = rng.randint(1, 6)
        segments, drops, seconds, selective_drops, selective_seconds = random_problem(rng, n, False, selective=True)
        limit = rng.randint(150, 600)
        choice = cheapest_checkpoint(
            segments, drops, seconds, limit_bytes=limit, selective_drops=selective_drops, selective_seconds=selective_seconds,
        )
        if choice is not None:
            assert choice.peak_bytes <= limit
            assert choice.peak_bytes == peak_of(segments, drops, choice.blocks, selective_drops=selective_drops, selective=choice.selective)
            expected = brute_force(segments, drops, seconds, limit, selective_drops, selective_seconds)
            assert choice.recompute_seconds >= expected - 1e-9


def test_selective_is_chosen_where_it_is_the_cheaper_way_to_fit():
    """Three blocks each dropping 100 bytes fully (1 s) or 60 selectively (0.1 s): 180 bytes to drop is three
    selective blocks (0.3 s), not two full ones (2 s); 250 needs full blocks, and mixes them with selective ones."""
    segments = [Segment(peak_bytes=1000, dropped=[], phase="first"), Segment(peak_bytes=1180, dropped=[0, 1, 2], phase="first")]
    costs = dict(selective_drops=[60.0] * 3, selective_seconds=[0.1] * 3)
    choice = cheapest_checkpoint(segments, [100.0] * 3, [1.0] * 3, limit_bytes=1000, **costs)
    assert choice.selective == {0, 1, 2} and not choice.blocks and choice.recompute_seconds == pytest.approx(0.3)
    choice = cheapest_checkpoint(segments[:1] + [Segment(peak_bytes=1250, dropped=[0, 1, 2], phase="first")], [100.0] * 3, [1.0] * 3,
                                 limit_bytes=1000, **costs)
    assert len(choice.blocks) == 2 and len(choice.selective) == 1
    # Without selective costs (an old store, or nothing to drop) the search is the two-mode one.
    assert cheapest_checkpoint(segments, [100.0] * 3, [1.0] * 3, limit_bytes=1000).selective == frozenset()


def test_prefix_knapsack_scales_to_many_blocks():
    rng = random.Random(3)
    for selective in (False, True):
        segments, drops, seconds, selective_drops, selective_seconds = random_problem(rng, 48, True, selective=selective)
        choice = cheapest_checkpoint(
            segments, drops, seconds, limit_bytes=400, selective_drops=selective_drops, selective_seconds=selective_seconds,
        )
        assert choice is None or choice.peak_bytes <= 400


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
@pytest.mark.parametrize("name", sorted(SPECS))
def test_memory_model_matches_the_meter(name):
    """The trace model against the exact simulated meter on random configurations."""
    from autofit.planning.costs import CostModel, PrecisionCosts, SpeedCosts, memory_costs

    spec = SPECS[name]()
    G = BATCH[name]
    memory = memory_costs(spec, precision="fp32", low=1, high=G, device_type="cpu")
    blocks = memory.low.blocks
    speed = SpeedCosts(sizes=[1], step_seconds=[1.0], forward_seconds=[1.0], block_seconds=[[]], optimizer_seconds=0.0)
    model = CostModel(
        blocks=blocks, global_batch_size=G, device_type="cpu", estimated=False,
        precisions={"fp32": PrecisionCosts(precision="fp32", memory=memory, speed=speed)},
    )
    rng = random.Random(0)
    for m in (1, G // 4, G // 2, G):
        chosen = {b for b in range(len(blocks)) if rng.random() < 0.5}
        exact = probe(spec, micro_batch_size=m, global_batch_size=G, checkpoint=[blocks[b] for b in sorted(chosen)], simulate=True, steps=2)
        predicted = model.peak_bytes("fp32", m, chosen)
        assert abs(predicted - exact.peak_bytes) <= 0.001 * exact.peak_bytes, (m, chosen)


CHAIN_MODEL_FILE = '''
import torch
from torch import nn

SEQ_LEN, DIM, CHAIN = 256, 256, 4


class ChainBlock(nn.Module):
    """Two wide matmuls around a chain of ReLUs, each keeping its (B, T, C) output for backward."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, DIM)
        self.down = nn.Linear(DIM, DIM)

    def forward(self, x):  # (B, T, C)
        h = self.up(x)
        for _ in range(CHAIN):
            h = torch.relu(h)
        return x + self.down(h)


class ChainNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[ChainBlock() for _ in range(4)])
        self.head = nn.Linear(DIM, 10)

    def forward(self, x):  # (B, T, C) -> (B, classes)
        return self.head(self.blocks(x).mean(dim=1))


def build_model():
    return ChainNet()


def example_batch(n):
    return torch.randn(n, SEQ_LEN, DIM), torch.randint(0, 10, (n,))
'''


@pytest.fixture(scope="module")
def chain_model(tmp_path_factory):
    """A model whose blocks' ReLU chains selective checkpointing frees for a fraction of full recompute's time,
    and a budget that the peak with every block selective fits but plain training does not (batch 1: no
    micro-batch to shrink)."""
    from autofit.planning.memory.headroom import Headroom
    from autofit.spec import load_spec
    from strategies import checkpoint_candidates

    path = tmp_path_factory.mktemp("chain") / "chain.py"
    path.write_text(CHAIN_MODEL_FILE)
    spec = load_spec(str(path))
    blocks = checkpoint_candidates(spec.build_model())
    peaks = {
        mode: probe(spec, micro_batch_size=1, global_batch_size=1, simulate=True, steps=1, **levers).peak_bytes
        for mode, levers in {"none": {}, "selective": {"selective_checkpoint": blocks}, "full": {"checkpoint": blocks}}.items()
    }
    assert peaks["full"] < peaks["selective"] < peaks["none"]
    budget = Headroom(device_type="cpu", estimated=False, budget_bytes=1).smallest_budget(peaks["selective"], persistent_bytes=0)
    return path, spec, blocks, budget


def test_planner_chooses_selective_where_it_is_cheaper_and_probe_agrees(chain_model, run_cli, tmp_path):
    """Estimated from FLOPs, selective recomputes about half of a block's forward for two thirds of full
    checkpointing's bytes: at this budget selective blocks are the cheapest way to fit, and `autofit probe
    --plan` re-measures the plan within the budget."""
    path, spec, blocks, budget = chain_model
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli(
        "plan", path, "--budget", budget, "--batch-size", "1", "--precisions", "fp32", "--simulate", "--no-cache", "--out", out,
    )
    assert code == 0, err
    plan = load_plan(out)
    assert plan.config.selective_checkpoint and not plan.config.checkpoint, (plan.config.checkpoint, plan.config.selective_checkpoint)
    assert set(plan.config.selective_checkpoint) <= set(blocks)
    assert "selective checkpoint" in stdout  # the chosen line names the selective blocks
    code, stdout, err = run_cli("probe", "--plan", out, "--json")
    assert code == 0, err
    again = json.loads(stdout)
    assert again["selective_checkpoint"] == list(plan.config.selective_checkpoint) and again["checkpoint"] == []
    assert again["peak_bytes"] + sum(plan.headroom.values()) <= plan.budget_bytes
    # The simulated meter is the cpu meter's twin: the plan fits for real too.
    real = probe(spec, micro_batch_size=1, global_batch_size=1, selective_checkpoint=plan.config.selective_checkpoint, steps=2)
    assert real.peak_bytes + sum(plan.headroom.values()) <= plan.budget_bytes


def test_measured_plan_with_selective_candidates_fits(chain_model, run_cli, tmp_path):
    """The same budget with real timings: selective and full recompute are timed on this CPU (which is cheaper
    here is the machine's to say), the candidates are timed with their modes, and the plan fits when probed."""
    path, spec, blocks, budget = chain_model
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli("plan", path, "--budget", budget, "--batch-size", "1", "--precisions", "fp32", "--no-cache", "--out", out)
    assert code == 0, err
    plan = load_plan(out)
    assert plan.config.checkpoint or plan.config.selective_checkpoint
    code, stdout, err = run_cli("probe", "--plan", out, "--json")
    assert code == 0, err
    again = json.loads(stdout)
    assert (again["checkpoint"], again["selective_checkpoint"]) == (list(plan.config.checkpoint), list(plan.config.selective_checkpoint))
    assert again["peak_bytes"] + sum(plan.headroom.values()) <= plan.budget_bytes
    assert again["peak_bytes"] == plan.measured.peak_bytes


def test_selective_blocks_are_in_the_configuration_key_and_the_timed_steps():
    from autofit.planning.summary import config_text
    from autofit.config import TrainingConfig

    plain = TrainingConfig(global_batch_size=8, precision="bf16", micro_batch_size=4, checkpoint=["layers.0"])
    mixed = TrainingConfig(
        global_batch_size=8, precision="bf16", micro_batch_size=4, checkpoint=["layers.0"], selective_checkpoint="layers.1,layers.2",
    )
    assert plain.key() == "bf16:4:layers.0"  # stored measurements keep their keys
    assert mixed.key() == "bf16:4:layers.0:layers.1,layers.2"
    assert config_text(plain.key()) == "bf16, micro-batch 4, checkpoint layers.0"
    assert config_text(mixed.key()) == "bf16, micro-batch 4, checkpoint layers.0, selective checkpoint layers.1, layers.2"
    assert config_text("fp32:2:") == "fp32, micro-batch 2, checkpoint none"
    assert mixed.checkpoint == ("layers.0",) and mixed.selective_checkpoint == ("layers.1", "layers.2")


@pytest.mark.gpu
def test_cuda_plans_fit_the_card_when_measured_again():
    """On a real GPU: plain needs, then a budget below them; each plan re-probed on the card fits."""
    from tests.helpers.models import resnet_spec

    spec = resnet_spec()
    generous = make_plan(spec, PlanRequest(budget="90%", batch_size=256, device="cuda"))
    assert generous.budget_kind == "cuda-process" and generous.measured.meter == "cuda"
    assert generous.config.checkpoint == () and generous.config.grad_accum_steps == 1
    needs = generous.measured.peak_bytes + sum(generous.headroom.values())
    budget = int(needs - 0.4 * generous.measured.peak_bytes)  # the measured peak leaves the context out
    tight = make_plan(spec, PlanRequest(budget=budget, batch_size=256, device="cuda"))
    assert tight.config.checkpoint or tight.config.micro_batch_size < 256 or tight.config.precision != generous.config.precision
    for plan in (generous, tight):
        again = remeasure(spec, plan, device="cuda")
        margins = sum(v for k, v in plan.headroom.items() if k != "context")  # the probe's peak holds the context
        assert again.peak_bytes + margins <= plan.budget_bytes


def test_a_selective_candidate_races_its_point_without_selective_blocks(chain_model, monkeypatch):
    """Selective recomputation's price comes from an estimated share and a factor that load skews: a candidate
    with selective blocks is timed side by side with its point's cheapest set without them (here the speed model
    is told selective costs next to nothing, so the search's candidate is selective)."""
    import autofit.planning.planner as planner
    from autofit.planning.planner import plan_with_report

    add_speeds = planner.add_speeds

    def selective_nearly_free(context, costs):
        add_speeds(context, costs)
        for speed in costs.speeds.values():
            speed.selective_factor = 0.01

    monkeypatch.setattr(planner, "add_speeds", selective_nearly_free)
    path, spec, blocks, budget = chain_model
    report = plan_with_report(spec, PlanRequest(budget=budget, batch_size=1, precisions=["fp32"], cache=False))
    plan = report.plan
    raced = [plan.config.key(), *report.timing["behind"]]  # every contender: the chosen one and those behind it
    selective_sets = [k.split(":")[3] for k in raced if len(k.split(":")) > 3]
    block_only = [k for k in raced if len(k.split(":")) == 3 and k.split(":")[2]]
    assert any(selective_sets) and block_only, raced
    assert report.plan.measured.peak_bytes + sum(report.plan.headroom.values()) <= budget
