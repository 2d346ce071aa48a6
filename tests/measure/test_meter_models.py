"""Meters on models that are not plain: frozen parameters, and a model fake tensors cannot run."""
import pytest
import torch
from torch import nn

from autofit.measure.meters import checked_for_simulation, frozen_parameter_bytes
from autofit.measure.probe import probe
from autofit.model_io import Loss
from autofit.planning.costs import memory_costs
from autofit.planning.planner import InfeasibleBudget, make_plan
from autofit.planning.request import PlanRequest
from autofit.spec import ModelSpec, default_optimizer
from tests.helpers.models import GroupedExperts


class Stack(nn.Module):
    """Four same-typed blocks (checkpoint candidates); ``freeze`` of them do not train."""

    def __init__(self, *, freeze: int = 0, branch_on_values: bool = False) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(4)))
        self.head = nn.Linear(32, 5)
        self.branch_on_values = branch_on_values
        for block in list(self.blocks)[:freeze]:
            block.requires_grad_(False)

    def forward(self, x):  # (B, 32) -> (B, 5)
        h = self.blocks(x)
        if self.branch_on_values and h.sum() > 0:  # reads a value: fake tensors have none
            h = h * 2
        return self.head(h)


def stack_spec(**options) -> ModelSpec:
    return ModelSpec(
        source=f"stack{options}", build_model=lambda: Stack(**options),
        example_batch=lambda n: (torch.randn(n, 32), torch.randint(0, 5, (n,))),
        loss_fn=Loss(nn.functional.cross_entropy), build_optimizer=default_optimizer,
    )


def test_frozen_parameters_have_no_gradients_or_optimizer_state_in_every_meter(one_thread):
    spec = stack_spec(freeze=2)
    model = spec.build_model()
    all_bytes = sum(p.numel() * 4 for p in model.parameters())
    frozen = frozen_parameter_bytes(model)
    trainable = all_bytes - frozen
    assert 0 < frozen < all_bytes
    trainable_tensors = sum(1 for p in model.parameters() if p.requires_grad)
    for simulate in (False, True):
        result = probe(spec, micro_batch_size=4, global_batch_size=8, simulate=simulate, steps=2)
        breakdown = result.breakdown
        assert breakdown["parameters"] == all_bytes
        assert breakdown["gradients"] <= trainable
        # AdamW: two moments per trainable parameter and a 4-byte step count per tensor; nothing for frozen ones.
        assert breakdown["optimizer_state"] == 2 * trainable + 4 * trainable_tensors
    cpu = probe(spec, micro_batch_size=8, steps=2)
    simulated = probe(spec, micro_batch_size=8, simulate=True, steps=2)
    assert simulated.peak_bytes == cpu.peak_bytes


def test_the_memory_model_predicts_a_partly_frozen_model(one_thread):
    spec = stack_spec(freeze=3)
    costs = memory_costs(spec, precision="fp32", low=2, high=8, device_type="cpu")
    for size in (2, 4, 8):
        predicted = costs.peak_bytes(size, global_batch_size=8, checkpoint=set())
        measured = probe(spec, micro_batch_size=size, global_batch_size=8, simulate=True, steps=2).peak_bytes
        assert predicted == pytest.approx(measured, rel=1e-4)


def test_the_floor_message_says_which_parameters_are_frozen(one_thread):
    with pytest.raises(InfeasibleBudget, match=r"frozen: no gradients or optimizer state") as raised:
        make_plan(stack_spec(freeze=2), PlanRequest(budget="20KB", batch_size=8, device="cpu"))
    breakdown = raised.value.breakdown
    model = Stack(freeze=2)
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert breakdown["parameters"] == sum(p.numel() * 4 for p in model.parameters())
    assert breakdown["gradients"] <= trainable and breakdown["optimizer_state"] < 2 * sum(p.numel() * 4 for p in model.parameters())


def test_a_model_fake_tensors_cannot_run_falls_back_to_the_cpu_meter_with_one_line(one_thread, capsys):
    spec = stack_spec(branch_on_values=True)
    result = probe(spec, micro_batch_size=4, simulate=True, steps=2)
    err = capsys.readouterr().err
    assert result.meter == "cpu"
    assert err.count("\n") == 1 and "simulated meter cannot run" in err and "DataDependentOutputException" in err
    assert "cpu meter" in err and "Traceback" not in err
    assert result.peak_bytes == probe(spec, micro_batch_size=4, steps=2).peak_bytes
    checked = checked_for_simulation(spec)
    assert checked.simulation_fallback.startswith("DataDependentOutputException")
    assert checked_for_simulation(stack_spec()).simulation_fallback == ""


def test_a_plan_for_a_model_fake_tensors_cannot_run(one_thread, capsys):
    lines = []
    plan = make_plan(stack_spec(branch_on_values=True), PlanRequest(budget="2MB", batch_size=8, device="cpu", simulate=True), log=lines.append)
    err = capsys.readouterr().err
    assert plan.measured.peak_bytes > 0
    assert (err + "\n".join(lines)).count("simulated meter cannot run") == 1
    traces = [line for line in lines if "memory: tracing" in line]
    assert traces and all("(cpu meter: fake tensors cannot run this model)" in line for line in traces), traces


def test_an_example_batch_of_views_is_counted_as_the_cpu_meter_counts_it(one_thread):
    """example_batch runs on real tensors and is made again of fake ones (``made_of_real_tensors``); inputs and
    targets that are views of one tensor (nanoGPT's ``tokens[:, :-1], tokens[:, 1:]``) stay views of one storage."""
    from autofit.planning.memory.traces import simulation_spec

    def example_batch(n):
        tokens = torch.randint(0, 50, (n, 33))
        return tokens[:, :-1], tokens[:, 1:]

    spec = ModelSpec(
        source="views", build_model=lambda: nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50)), example_batch=example_batch,
        loss_fn=Loss(None), build_optimizer=default_optimizer,
    )
    real = probe(spec, micro_batch_size=2, global_batch_size=8, steps=1).peak_bytes
    assert probe(simulation_spec(spec), micro_batch_size=2, global_batch_size=8, steps=1, simulate=True).peak_bytes == real


def experts_spec() -> ModelSpec:
    return ModelSpec(
        source="experts", build_model=GroupedExperts, example_batch=lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,))),
        loss_fn=Loss(nn.functional.cross_entropy), build_optimizer=default_optimizer,
    )


def test_an_op_only_its_fake_kernel_refuses_falls_back_to_the_cpu_meter_quietly(one_thread, capfd):
    result = probe(experts_spec(), micro_batch_size=4, simulate=True, steps=1)
    err = capfd.readouterr().err
    assert result.meter == "cpu" and result.peak_bytes == probe(experts_spec(), micro_batch_size=4, steps=1).peak_bytes
    assert err.count("\n") == 1 and "aten._grouped_mm" in err and "cpu meter" in err, err
    assert "Traceback" not in err  # torch's fake-tensor log, one traceback per call, stays off the screen


def test_an_op_only_its_fake_kernel_refuses_is_one_line_for_a_card_that_is_not_here(capfd):
    from autofit.errors import UserError

    with pytest.raises(UserError, match=r"cannot run aten\._grouped_mm\.default .*\(without --simulate\)"):
        checked_for_simulation(experts_spec(), for_device="cuda")
    assert "Traceback" not in capfd.readouterr().err


def test_a_model_file_only_fake_tensors_cannot_check_is_checked_for_real(tmp_path, run_cli):
    path = tmp_path / "experts.py"
    path.write_text(
        "import torch\nfrom tests.helpers.models import GroupedExperts as build_model\n\n\n"
        "def example_batch(n):\n    return torch.randn(n, 16), torch.randint(0, 4, (n,))\n"
    )
    code, out, err = run_cli("probe", path, "--simulate", "--micro-batch-size", "4", "--steps", "1")
    assert code == 0 and "meter cpu" in out and err.count("simulated meter cannot run") == 1, err


def test_a_plan_for_a_card_names_the_op_its_fake_kernel_refuses(capfd):
    from autofit.errors import UserError

    request = PlanRequest(budget="10MB", batch_size=8, device="cuda", simulate=True, device_memory="24GiB", cache=False)
    with pytest.raises(UserError, match=r"^the simulated meter cannot run aten\._grouped_mm\.default"):
        make_plan(experts_spec(), request)
    assert "Traceback" not in capfd.readouterr().err


def test_every_fake_mode_autofit_makes_keeps_torch_s_fake_kernel_log_quiet_and_names_the_op(caplog):
    from autofit._torch_private import failed_fake_kernel, new_fake_mode

    with new_fake_mode(), pytest.raises(RuntimeError) as raised:  # FLOP counts and block discovery use such modes too
        nn.functional.grouped_mm(torch.randn(4, 16), torch.randn(2, 16, 16), offs=torch.tensor([2, 4], dtype=torch.int32))
    assert failed_fake_kernel(raised.value) == "aten._grouped_mm.default"
    assert not [record for record in caplog.records if "attempting to run meta" in record.getMessage()]


def test_a_trace_on_real_tensors_equals_the_one_over_fake_tensors(one_thread):
    """On the CPU a traced run may be made on real tensors with the cpu meter (``real_sizes``): the same trace,
    checkpointed and selective runs included, as over fake tensors."""
    from autofit.planning.memory.traces import simulation_spec, trace_memory_sizes

    spec = simulation_spec(stack_spec(freeze=1))
    fake = trace_memory_sizes(spec, sizes=[8, 2], precision="bf16")
    real = trace_memory_sizes(spec, sizes=[8, 2], precision="bf16", real_sizes={8, 2})
    assert real == fake
    assert all(t.fake_cpu_seconds > 0 for t in fake) and all(t.fake_cpu_seconds == 0 for t in real)


def test_a_plan_for_this_cpu_traces_on_real_tensors_where_a_step_costs_less(one_thread):
    """Where a step is cheap beside a run over fake tensors, the plan's traces are made on real tensors and say so:
    the floor's by the FLOPs and seconds of the simulated step that found the smallest micro-batch (no step timed
    yet), the later ones by the speed model's steps. What it predicts is what the cpu meter measures."""
    said = []
    plan = make_plan(stack_spec(), PlanRequest(budget="400KB", batch_size=16, device="cpu"), log=said.append)
    lines = [line.split("] ", 1)[-1] for line in said]  # less the time stamp
    real = "(cpu meter: a real step here costs less than a run over fake tensors)"
    timed = next(i for i, line in enumerate(lines) if line.startswith("speed: timing"))
    traces = [(i, line) for i, line in enumerate(lines) if line.startswith("memory: tracing")]
    assert traces[0][0] < timed and traces[0][1] == f"memory: tracing fp32 at micro-batch 1 {real}", traces
    assert any(line.endswith(real) for i, line in traces if i > timed), traces
    assert plan.measured.peak_bytes == plan.predicted.peak_bytes


def test_a_small_model_released_on_the_cpu_is_left_to_pythons_collections(monkeypatch):
    """A full collection per probe cost a ResNet-18 plan 0.7 s (#47): a model whose training state is a small share
    of the free memory is left to Python's own collections on the CPU; a large one, or a GPU's, is collected now."""
    import gc

    from autofit.measure.meters import release_device_memory, state_bytes

    collected = []
    monkeypatch.setattr(gc, "collect", lambda *args: collected.append(args) or 0)
    model = Stack()
    assert state_bytes(model) == 4 * sum(p.numel() * 4 for p in model.parameters())
    release_device_memory("cpu", held_bytes=state_bytes(model))
    assert collected == []
    release_device_memory("cpu", held_bytes=2**50)
    release_device_memory("cpu")
    release_device_memory("cuda", held_bytes=state_bytes(model))
    assert len(collected) == 3
