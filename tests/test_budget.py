"""Budgets: what parses, what is refused with one line, and what the planner does at the edges."""
import re

import pytest

from autofit.errors import UserError
from autofit.units import parse_budget

MODEL_FILE = '''
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, c_in, c_out):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(3, 8), Block(8, 16), Block(16, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.blocks(x).mean(dim=(2, 3)))

def build_model():
    return Net()

def example_batch(n):
    return torch.randn(n, 3, 8, 8), torch.randint(0, 4, (n,))
'''


pytestmark = pytest.mark.usefixtures("one_thread")  # planning stays quick while other processes share the cores


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "tiny_cnn.py"
    path.write_text(MODEL_FILE)
    return path


@pytest.mark.parametrize(
    "text, expected",
    [
        ("16GB", 16 * 10**9),
        ("16GiB", 16 * 2**30),
        ("512MB", 512 * 10**6),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", int(1.5 * 2**30)),
        (" 2 kb ", 2000),
        ("123456", 123456),
        (123456, 123456),
    ],
)
def test_good_budgets(text, expected):
    assert parse_budget(text) == expected


def test_percent_of_the_device():
    assert parse_budget("90%", device_total_bytes=10**9) == 9 * 10**8
    assert parse_budget("100%", device_total_bytes=1234) == 1234


@pytest.mark.parametrize(
    "text, message",
    [
        ("abc", "is not a memory size"),
        ("0", "must be more than 0 bytes"),
        ("-1GB", "is not a memory size"),
        ("16 parsecs", "unknown unit 'parsecs'"),
        ("", "is not a memory size"),
        ("0.0001B", "must be more than 0 bytes"),
        ("150%", "percentage in (0, 100]"),
        ("GB", "is not a memory size"),
    ],
)
def test_bad_budgets_name_the_value(text, message):
    with pytest.raises(UserError) as error:
        parse_budget(text, device_total_bytes=10**9)
    assert message in str(error.value)
    assert repr(text) in str(error.value)
    assert "\n" not in str(error.value)


def test_percent_needs_the_device_total():
    with pytest.raises(UserError, match="device's total memory is unknown"):
        parse_budget("90%")


@pytest.mark.parametrize("budget", ["abc", "0", "-1GB", "16 parsecs"])
def test_cli_refuses_bad_budgets_in_one_line(run_cli, model_file, budget):
    code, out, err = run_cli("plan", model_file, "--budget", budget, "--batch-size", "8")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autofit: error: budget") and repr(budget) in lines[0]


def test_cli_refuses_bad_batch_and_device(run_cli, model_file):
    code, _, err = run_cli("plan", model_file, "--budget", "1GB", "--batch-size", "0")
    assert code == 2 and "--batch-size 0" in err
    code, _, err = run_cli("plan", model_file, "--budget", "1GB", "--batch-size", "8", "--device", "tpu")
    assert code == 2 and "--device 'tpu'" in err
    code, _, err = run_cli("plan", model_file, "--budget", "1GB", "--batch-size", "8", "--precisions", "fp8")
    assert code == 2 and "precision 'fp8' is unknown" in err


def test_percent_budget_plans_against_the_machine(model_file, tmp_path):
    from autofit.device import device_info
    from autofit.planning.planner import make_plan
    from autofit.planning.request import PlanRequest
    from autofit.spec import load_spec

    plan = make_plan(load_spec(str(model_file)), PlanRequest(budget="90%", batch_size=4, precisions=["fp32"]))
    assert plan.budget_bytes == int(device_info("cpu").total_bytes * 0.9)
    assert plan.device.total_bytes == device_info("cpu").total_bytes


def test_infeasible_budget_gives_the_floor_and_the_way_out(run_cli, model_file):
    code, out, err = run_cli("plan", model_file, "--budget", "1000", "--batch-size", "8", "--precisions", "fp32", "--quiet")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("autofit: error: budget 1000 B is below the floor")
    assert "parameters" in line and "gradients" in line and "optimizer state" in line and "activations" in line
    assert "micro-batch 1" in line and "checkpoint" in line
    assert "SGD" in line and "more GPUs" in line and "AdamW" in line
    # with progress lines on, the error is still one line, the last
    code, _, err = run_cli("plan", model_file, "--budget", "1000", "--batch-size", "8", "--precisions", "fp32")
    assert code == 2 and err.strip().splitlines()[-1] == line


def test_the_floor_is_a_budget_that_works(model_file):
    """The floor message's number is honest: planning at exactly the floor succeeds and fits."""
    from autofit.planning.verify.floor import InfeasibleBudget
    from autofit.planning.planner import make_plan
    from autofit.planning.request import PlanRequest
    from autofit.measure.probe import probe
    from autofit.spec import load_spec

    spec = load_spec(str(model_file))
    with pytest.raises(InfeasibleBudget) as error:
        make_plan(spec, PlanRequest(budget=1000, batch_size=8, precisions=["fp32"]))
    floor = error.value.floor_bytes
    breakdown = error.value.breakdown
    assert floor > breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer_state"]
    plan = make_plan(spec, PlanRequest(budget=floor, batch_size=8, precisions=["fp32"]))
    again = probe(
        spec, micro_batch_size=plan.config.micro_batch_size, global_batch_size=8, precision=plan.config.precision, checkpoint=plan.config.checkpoint
    )
    assert again.peak_bytes + sum(plan.headroom.values()) <= floor
    with pytest.raises(InfeasibleBudget):
        make_plan(spec, PlanRequest(budget=floor - 1, batch_size=8, precisions=["fp32"]))


def test_the_gpus_advice_is_a_number_of_gpus_that_plans(model_file):
    """--gpus N is named only where N GPUs would fit the floor per rank: planning with it then succeeds."""
    import re

    from autofit.planning.verify.floor import InfeasibleBudget
    from autofit.planning.planner import make_plan
    from autofit.planning.request import PlanRequest
    from autofit.spec import load_spec

    spec = load_spec(str(model_file))
    budget = 50_000
    with pytest.raises(InfeasibleBudget) as error:
        make_plan(spec, PlanRequest(budget=budget, batch_size=8, precisions=["fp32"]))
    found = re.search(r"or --gpus (\d+) \(FSDP2", str(error.value))
    assert found, str(error.value)
    gpus = int(found.group(1))
    assert 2 <= gpus <= 8  # never more GPUs than samples: each needs one
    plan = make_plan(spec, PlanRequest(budget=budget, batch_size=8, precisions=["fp32"], gpus=gpus))
    assert plan.config.world_size == gpus and plan.measured.peak_bytes + sum(plan.headroom.values()) <= budget


def test_more_gpus_would_not_help_a_batch_of_one(run_cli, model_file):
    code, _, err = run_cli("plan", model_file, "--budget", "1000", "--batch-size", "1", "--precisions", "fp32", "--quiet")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "more GPUs would not help: a batch of 1 cannot be split between GPUs" in err and "--gpus" not in err


def test_more_gpus_would_not_help_what_each_gpu_keeps(run_cli, model_file):
    """Sharding divides parameters, gradients and optimizer state, not the activations or the headroom: the way out is a budget."""
    code, _, err = run_cli("plan", model_file, "--budget", "1000", "--batch-size", "8", "--precisions", "fp32", "--quiet")
    assert code == 2
    assert "more GPUs would not help at this budget: each GPU would still hold the activations" in err
    assert re.search(r"--gpus \d would need a budget of [\d.]+ KiB per GPU, estimated", err), err


def test_ranks_that_accumulate_keep_whole_gradients(model_file):
    """With micro-batches of 1 and a batch of 4, 2 or 3 GPUs accumulate (whole gradients until the last); 4 do not."""
    from autofit.planning.verify.floor import sharded_floor
    from autofit.planning.memory.headroom import Headroom
    from autofit.spec import load_spec

    breakdown = {"parameters": 0, "gradients": 1_000_000, "optimizer_state": 0, "activations": 0}
    sharded = sharded_floor(
        load_spec(str(model_file)), breakdown=breakdown, precision="fp32", headroom=Headroom(device_type="cpu", estimated=False, budget_bytes=600_000),
        micro_batch_size=1, global_batch_size=4,
    )
    assert sharded.gpus == 4 and 250_000 <= sharded.state_bytes < 300_000  # a quarter, padded
    # Micro-batches of 2: 2 GPUs take one each, and shard their gradients.
    halves = sharded_floor(
        load_spec(str(model_file)), breakdown=breakdown, precision="fp32", headroom=Headroom(device_type="cpu", estimated=False, budget_bytes=600_000),
        micro_batch_size=2, global_batch_size=4,
    )
    assert halves.gpus == 2 and halves.state_bytes == 500_000


def test_the_optimizer_steps_temporaries_are_sharded_like_its_state(model_file):
    """A foreach AdamW's step briefly holds an fp32 copy of every parameter: at the floor's peak those are its
    'activations', but a rank steps its shards only (#31: 70B was told 64 GPUs would need 327 GiB each)."""
    from autofit.planning.verify.floor import sharded_floor
    from autofit.planning.memory.headroom import Headroom
    from autofit.spec import load_spec

    breakdown = {"parameters": 1_000_000, "gradients": 1_000_000, "optimizer_state": 2_000_000, "activations": 1_000_000}
    options = dict(
        precision="fp32", headroom=Headroom(device_type="cpu", estimated=False, budget_bytes=1_000_000),
        micro_batch_size=1, global_batch_size=8,
    )
    unsplit = sharded_floor(load_spec(str(model_file)), breakdown=breakdown, **options)
    assert unsplit.gpus is None and unsplit.activation_bytes == 1_000_000  # each GPU would hold the whole copy
    split = sharded_floor(load_spec(str(model_file)), breakdown=breakdown, phases=(20_000, 1_000_000), **options)
    assert split.gpus is not None and split.activation_bytes == 20_000


@pytest.mark.slow  # two simulated plans, about 5 s each on a busy 2-core machine
def test_the_gpus_advice_and_the_multi_gpu_refusal_are_one_estimate():
    """#48: a 70B-shaped config refused on one card was told "--gpus 8 would need 38.17 GiB per GPU"; planned so, it
    was refused with "454.58 GiB per GPU at the least": the refusal counted the optimizer step's fp32 copies as
    unsharded activations. Both now price the floor configuration alike: the same budget, within rounding."""
    import torch
    from torch import nn

    from autofit.planning import planner
    from autofit.planning.request import PlanRequest
    from autofit.planning.verify.floor import InfeasibleBudget
    from autofit.spec import spec_from_model

    model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(2)), nn.Linear(256, 4))
    spec = spec_from_model(model, lambda n: (torch.rand(n, 256), torch.randint(0, 4, (n,))))

    def refusal(gpus: int) -> str:
        with pytest.raises(InfeasibleBudget) as refused:
            planner.make_plan(spec, PlanRequest(budget="700KB", batch_size=4, gpus=gpus, simulate=True, cache=False))
        return str(refused.value)

    advice = re.search(r"--gpus 4 would need a budget of ([\d.]+) MiB per GPU", refusal(1))
    least = re.search(r"with --gpus 4 each needs ([\d.]+) MiB per GPU", refusal(4))
    assert advice and least
    assert float(least.group(1)) == pytest.approx(float(advice.group(1)), rel=0.02)
