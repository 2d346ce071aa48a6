"""The one owner of the strategies: nothing else builds them, and a plan re-measures as it was measured."""
import ast
import json
from pathlib import Path

import pytest

import strategies
from strategies.base import Strategy
from tests.helpers import EXAMPLES, ROOT

OWNER = ROOT / "autofit" / "apply.py"
STRATEGY_CLASSES = {
    name for name in dir(strategies)
    if isinstance(getattr(strategies, name), type) and issubclass(getattr(strategies, name), Strategy)
}


def constructions(path: Path) -> list[str]:
    """``Name(...)`` calls of a strategy class in one source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in STRATEGY_CLASSES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}(...)")
    return found


def test_only_the_owner_constructs_strategies():
    assert {"Checkpointing", "Precision", "BatchSplit", "Sharding"} <= STRATEGY_CLASSES
    outside = [hit for path in sorted((ROOT / "autofit").rglob("*.py")) if path != OWNER for hit in constructions(path)]
    assert outside == []
    assert constructions(OWNER)  # the scan finds them where they are


# Small batches: planning costs about the same per precision whatever the batch; bf16 is searched on the CNN only.
@pytest.mark.parametrize(("example", "batch_size", "budget", "precisions"), [
    ("digits_cnn.py", 8, "64MB", "fp32,bf16"), ("tiny_transformer.py", 4, "200MB", "fp32"),
])
@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_probe_of_a_plan_measures_the_planned_peak(run_cli, tmp_path, one_thread, example, batch_size, budget, precisions):
    out = tmp_path / "plan.json"
    code, _, err = run_cli(
        "plan", EXAMPLES / example, "--budget", budget, "--batch-size", batch_size, "--precisions", precisions, "--out", out, "-q",
    )
    assert code == 0, err
    planned = json.loads(out.read_text())
    code, stdout, err = run_cli("probe", "--plan", out, "--json")
    assert code == 0, err
    measured = json.loads(stdout)
    assert measured["peak_bytes"] == planned["measured"]["peak_bytes"]
    assert (measured["precision"], measured["micro_batch_size"], measured["checkpoint"]) == (
        planned["precision"], planned["micro_batch_size"], planned["checkpoint"],
    )
    assert measured["plan"]["budget_bytes"] == planned["budget_bytes"]


def test_probe_of_a_plan_refuses_settings_of_its_own(run_cli, tmp_path):
    code, stdout, err = run_cli("probe", "--plan", tmp_path / "plan.json", "--precision", "bf16")
    assert code == 2 and err.count("\n") == 1 and "drop --precision" in err and "Traceback" not in err
    code, stdout, err = run_cli("probe")
    assert code == 2 and "--plan plan.json" in err and err.count("\n") == 1


def test_a_plan_carries_the_levers_and_probe_re_measures_them(run_cli, tmp_path, one_thread):
    from autofit.config import TrainingConfig
    from autofit.measure.probe import measure
    from autofit.plan_file import DeviceInfo, ModelInfo, Plan, load_plan, save_plan
    from autofit.spec import load_spec, model_fingerprint

    source = str(EXAMPLES / "tiny_transformer.py")
    spec = load_spec(source)
    levers = {"selective_checkpoint": ["layers.0", "layers.1"], "offload": ["layers.2"], "optimizer_in_backward": True}
    plan = Plan(
        model=ModelInfo(source=source, fingerprint=model_fingerprint(spec.build_model())), device=DeviceInfo(type="cpu"),
        budget_bytes=10**9, config=TrainingConfig(global_batch_size=4, micro_batch_size=4, checkpoint=["layers.3"], **levers),
    )
    path = save_plan(plan, tmp_path / "plan.json")
    written = json.loads(path.read_text())
    assert {key: written[key] for key in levers} == levers and "optimizer_state" not in written  # on: written
    assert load_plan(path) == plan
    code, stdout, err = run_cli("probe", "--plan", path, "--json")
    assert code == 0, err
    probed = json.loads(stdout)
    assert (probed["selective_checkpoint"], probed["offload"], probed["optimizer_in_backward"]) == (
        levers["selective_checkpoint"], levers["offload"], True,
    )
    direct = measure(spec, plan.config, device="cpu")
    assert probed["peak_bytes"] == direct.peak_bytes and probed["host_peak_bytes"] == direct.host_peak_bytes > 0


@pytest.mark.parametrize(("change", "field"), [
    ({"micro_batch_size": 2, "optimizer_in_backward": True}, "optimizer_in_backward"),
    ({"offload": ["layers.3"]}, "offload"),
    ({"optimizer_state": "4bit"}, "optimizer_state"),
])
def test_impossible_levers_in_a_plan_file_are_one_line(tmp_path, change, field):
    from autofit.config import TrainingConfig
    from autofit.errors import UserError
    from autofit.plan_file import Plan, load_plan

    data = {**Plan(budget_bytes=10**9, config=TrainingConfig(global_batch_size=4, micro_batch_size=4, checkpoint=["layers.3"])).to_dict(), **change}
    data.pop("grad_accum_steps")
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match=f"field {field} is") as error:
        load_plan(tmp_path / "plan.json")
    assert "\n" not in str(error.value)
