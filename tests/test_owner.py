"""The one owner of the strategies: nothing else builds them, and a plan re-measures as it was measured."""
import ast
import json
from pathlib import Path

import pytest

import strategies
from strategies.base import Strategy
from tests.conftest import EXAMPLES, ROOT

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


@pytest.mark.parametrize(("example", "batch_size", "budget"), [("digits_cnn.py", 32, "64MB"), ("tiny_transformer.py", 16, "200MB")])
def test_probe_of_a_plan_measures_the_planned_peak(run_cli, tmp_path, one_thread, example, batch_size, budget):
    out = tmp_path / "plan.json"
    code, _, err = run_cli(
        "plan", EXAMPLES / example, "--budget", budget, "--batch-size", batch_size, "--precisions", "fp32,bf16", "--out", out, "-q",
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
