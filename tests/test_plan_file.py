"""plan.json: typed parts, schema 1 kept, and one line naming the field for every bad value."""
import copy
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.plan_file import (
    DeviceInfo, Measured, ModelInfo, MultiProcess, Plan, Predicted, load_plan, plan_from_dict, save_plan,
)
from strategies import micro_batch_count
from tests.helpers import ROOT

OLD_PLANS = Path(__file__).parent / "plan_files"
"""plan.json files written by autofit 0.1.0 before the plan was typed (alternatives cut to two)."""

README_KEYS = [
    "schema_version", "created_by", "model", "device", "budget_bytes", "budget_kind", "global_batch_size",
    "micro_batch_size", "grad_accum_steps", "precision", "checkpoint", "world_size", "sharding", "estimated",
    "predicted", "measured", "headroom", "alternatives", "history", "notes",
]


def valid_plan() -> Plan:
    """A one-process plan with every part filled in, as the planner writes it."""
    return Plan(
        created_by={"autofit": "0.1.0", "torch": "2.4.0"},
        model=ModelInfo(source="examples/digits_cnn.py", fingerprint="e3249da8c66da91f", batch_norm=False,
                        parameter_count=117834, input_shape=[1, 32, 32], num_classes=10),
        device=DeviceInfo(type="cpu", name="cpu", total_bytes=16 * 2**30),
        budget_bytes=64 * 10**6, config=TrainingConfig(global_batch_size=8, micro_batch_size=4, precision="bf16", checkpoint=["blocks.0"]),
        predicted=Predicted(peak_bytes=30_000_000, samples_per_s=120.5),
        measured=Measured(
            peak_bytes=29_000_000, samples_per_s=118.0, meter="cpu",
            breakdown={"parameters": 471336, "gradients": 471336, "optimizer_state": 942824, "activations": 27_000_000},
            unconstrained={"precision": "fp32", "micro_batch_size": 8, "grad_accum_steps": 1, "peak_bytes": 70_000_000,
                           "samples_per_s": 130.0},
            relative_to_unconstrained=118.0 / 130.0,
        ),
        headroom={"safety_margin": 1_280_000},
        alternatives=[{"precision": "bf16", "micro_batch_size": 4, "grad_accum_steps": 2, "checkpoint": ["blocks.0"],
                       "predicted_peak_bytes": 30_000_000, "predicted_samples_per_s": 120.5, "fits_budget": True, "chosen": True}],
        history=[{"micro_batch_size": 4, "previous_micro_batch_size": 8, "epoch": 0, "step": 3}],
        notes=["a note"],
    )


def sharded_plan() -> Plan:
    plan = valid_plan()
    return replace(
        plan, config=replace(plan.config, world_size=2, sharding="fsdp", micro_batch_size=2),
        predicted=replace(plan.predicted, per_rank_peak_bytes=30_000_000, estimate_peak_bytes=30_000_000),
        measured=replace(
            plan.measured, multi_process=MultiProcess(world_size=2, sharding="fsdp", rank_batch_size=4, note="not run while planning"),
        ),
    )


MULTI_PROCESS = {"world_size": 2, "sharding": "ddp", "rank_batch_size": 4, "note": "not run while planning"}
MISSING = object()
NAN, INF = float("nan"), float("inf")

# (field named in the error, {dotted path: value}); the valid plan has G=8, m=4, world_size 1, so grad_accum_steps 2.
BAD = [
    *[("schema_version", {"schema_version": v}) for v in (MISSING, None, "1", 1.0, True, 2, 0)],
    *[("created_by", {"created_by": v}) for v in (None, [], "autofit 0.1.0", {"autofit": 1}, {"torch": None})],
    *[("model", {"model": v}) for v in (None, [], "examples/digits_cnn.py", 3)],
    *[("model.source", {"model.source": v}) for v in (5, "", ["a.py"], True)],
    *[("model.fingerprint", {"model.fingerprint": v}) for v in (123, "", ["e3249da8"], True, {"hash": "x"})],
    *[("model.batch_norm", {"model.batch_norm": v}) for v in (1, 0, "yes")],
    *[("model.parameter_count", {"model.parameter_count": v}) for v in (-1, 1.5, "117834", True, 2**64)],
    *[("model.input_shape", {"model.input_shape": v}) for v in ("1x32x32", [], [1, 0, 32], [1.0, 32, 32], [True, 32], 32)],
    *[("model.num_classes", {"model.num_classes": v}) for v in (0, -3, "10", False, 2.5)],
    *[("device", {"device": v}) for v in (None, "cpu", ["cpu"])],
    *[("device.type", {"device.type": v}) for v in ("gpu", "CUDA", 1, None)],
    *[("device.name", {"device.name": v}) for v in (5, "", ["cpu"])],
    *[("device.total_bytes", {"device.total_bytes": v}) for v in (0, -1, "16GB", 1e9, True)],
    *[("budget_bytes", {"budget_bytes": v}) for v in (MISSING, None, 0, -1, "16GB", 1.5, 64e6, True, 2**64)],
    *[("budget_kind", {"budget_kind": v}) for v in ("gpu", "", 1, None)],
    *[("global_batch_size", {"global_batch_size": v}) for v in (MISSING, None, 0, -8, 8.0, "8", True, 2**31 + 1, [8])],
    *[("micro_batch_size", {"micro_batch_size": v}) for v in (MISSING, None, 0, -4, "x", 4.0, False, True, 2**40, [4])],
    *[("grad_accum_steps", {"grad_accum_steps": v}) for v in (0, -2, "2", True, 2.0, None, 2**40, 1, 3)],
    *[("precision", {"precision": v}) for v in ("fp8", "FP32", "", None, 32, ["bf16"])],
    *[("checkpoint", {"checkpoint": v}) for v in ("blocks.0", None, [1], ["blocks.0", "blocks.0"], [""], [None], {"blocks.0": True})],
    *[("world_size", {"world_size": v}) for v in (0, -1, "2", True, 1.5, None, 2**40)],
    *[("sharding", {"sharding": v}) for v in ("zero", "", None, 1, "FSDP")],
    *[("estimated", {"estimated": v}) for v in (1, 0, "false", None)],
    *[("predicted", {"predicted": v}) for v in (None, [], "x", 3)],
    ("predicted.peak_bytes", {"predicted": {"samples_per_s": 1.0}}),
    *[("predicted.peak_bytes", {"predicted.peak_bytes": v}) for v in (-1, "1", 1.5, None, True)],
    *[("predicted.samples_per_s", {"predicted.samples_per_s": v}) for v in (MISSING, 0, -1.0, "fast", NAN, INF, None, True)],
    *[("predicted.per_rank_peak_bytes", {"predicted.per_rank_peak_bytes": v}) for v in ("x", -5, 2.5)],
    *[("predicted.estimate_peak_bytes", {"predicted.estimate_peak_bytes": v}) for v in ("x", -5)],
    *[("measured", {"measured": v}) for v in (None, [], 3)],
    *[("measured.peak_bytes", {"measured.peak_bytes": v}) for v in (MISSING, -1, 1.5, None, "29MB")],
    *[("measured.samples_per_s", {"measured.samples_per_s": v}) for v in (0, -3, "1", True, NAN)],
    *[("measured.meter", {"measured.meter": v}) for v in (MISSING, "gpu", None, 1)],
    *[("measured.breakdown", {"measured.breakdown": v}) for v in (None, [], {"parameters": "1"}, {"parameters": True}, {"x": INF})],
    *[("measured.unconstrained", {"measured.unconstrained": v}) for v in ([], "x", 1)],
    *[("measured.relative_to_unconstrained", {"measured.relative_to_unconstrained": v}) for v in (0, "1", -1, True)],
    *[("measured.multi_process", {"measured.multi_process": v}) for v in ([], "x", True)],
    *[(f"measured.multi_process.{key}", {"measured.multi_process": MULTI_PROCESS, f"measured.multi_process.{key}": v})
      for key, values in {"world_size": (1, "2", MISSING), "sharding": ("none", None), "rank_batch_size": (0, 1.5),
                          "note": (5, "", MISSING)}.items() for v in values],
    *[("headroom", {"headroom": v}) for v in (None, [], {"safety_margin": -1}, {"safety_margin": 1.5},
                                              {"safety_margin": "1"}, {"safety_margin": True}, {"safety_margin": None})],
    *[("alternatives", {"alternatives": v}) for v in (None, {}, [1], "x", [["fp32"]])],
    *[("history", {"history": v}) for v in (None, {}, ["x"])],
    *[("notes", {"notes": v}) for v in (None, "a note", [1], [None])],
    # Each fine alone, impossible together.
    ("sharding", {"world_size": 1, "sharding": "ddp"}),
    ("sharding", {"world_size": 1, "sharding": "fsdp"}),
    ("sharding", {"world_size": 2, "sharding": "none"}),
    ("world_size", {"world_size": 16, "sharding": "ddp"}),
    ("micro_batch_size", {"micro_batch_size": 16, "grad_accum_steps": MISSING}),
    ("micro_batch_size", {"world_size": 2, "sharding": "ddp", "micro_batch_size": 5, "grad_accum_steps": MISSING}),
    ("grad_accum_steps", {"world_size": 2, "sharding": "fsdp", "micro_batch_size": 2, "grad_accum_steps": 4}),
    *[("nodes", {"nodes": v}) for v in (0, "2", True, 1.5, None)],
    ("nodes", {"world_size": 4, "sharding": "fsdp", "micro_batch_size": 2, "grad_accum_steps": MISSING, "nodes": 3}),
    ("sharding", {"world_size": 4, "sharding": "hsdp", "micro_batch_size": 2, "grad_accum_steps": MISSING}),
    ("sharding", {"world_size": 4, "sharding": "hsdp", "micro_batch_size": 2, "grad_accum_steps": MISSING, "nodes": 4}),
]


def changed(data: dict, changes: dict) -> dict:
    data = copy.deepcopy(data)
    for path, value in changes.items():
        *parents, key = path.split(".")
        target = data
        for parent in parents:
            target = target[parent]
        if value is MISSING:
            del target[key]
        else:
            target[key] = copy.deepcopy(value)
    return data


def case_id(case) -> str:
    name, changes = case
    return f"{name}=" + ",".join("missing" if v is MISSING else json.dumps(v)[:20] for v in changes.values())


def write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


# -- good plans ----------------------------------------------------------------------------------


def test_to_dict_has_readme_keys_and_the_derived_grad_accum_steps():
    data = valid_plan().to_dict()
    assert list(data) == README_KEYS and data["grad_accum_steps"] == 2
    assert list(data["model"]) == ["source", "fingerprint", "batch_norm", "parameter_count", "input_shape", "num_classes"]
    assert list(data["device"]) == ["type", "name", "total_bytes"]
    assert list(data["predicted"]) == ["peak_bytes", "samples_per_s"]
    assert list(data["measured"]) == ["peak_bytes", "samples_per_s", "meter", "breakdown", "unconstrained", "relative_to_unconstrained"]
    sharded = sharded_plan().to_dict()
    assert sharded["grad_accum_steps"] == 2 and sharded["measured"]["multi_process"]["sharding"] == "fsdp"


@pytest.mark.parametrize("make", [valid_plan, sharded_plan, lambda: Plan(budget_bytes=1, config=TrainingConfig(global_batch_size=4, micro_batch_size=3))])
def test_a_plan_survives_the_file(tmp_path, make):
    plan = make()
    again = load_plan(save_plan(plan, tmp_path / "plan.json"))
    assert again == plan and again.to_dict() == plan.to_dict()


def test_a_hand_written_plan_has_empty_parts():
    data = Plan(budget_bytes=1, config=TrainingConfig(global_batch_size=4, micro_batch_size=3)).to_dict()
    assert data["predicted"] == {} and data["measured"] == {} and data["device"]["type"] == "cpu"
    plan = plan_from_dict({"schema_version": 1, "budget_bytes": 1, "global_batch_size": 4, "micro_batch_size": 3})
    assert plan.predicted is None and plan.measured is None and plan.model == ModelInfo() and plan.config.grad_accum_steps == 2


@pytest.mark.parametrize("name", sorted(p.name for p in OLD_PLANS.glob("*.json")))
def test_files_written_before_load_and_write_the_same_object(name):
    text = (OLD_PLANS / name).read_text()
    plan = load_plan(OLD_PLANS / name)
    assert plan.to_dict() == json.loads(text)
    assert isinstance(plan.model, ModelInfo) and isinstance(plan.measured, Measured) and isinstance(plan.predicted, Predicted)


def test_unknown_keys_are_ignored_at_every_level():
    data = changed(sharded_plan().to_dict(), {
        "from_the_future": 1, "model.layers": 12, "device.uuid": "GPU-1", "predicted.flops": 3,
        "measured.energy_j": 2.0, "measured.multi_process.hosts": ["a"],
    })
    assert plan_from_dict(data) == sharded_plan()


@pytest.mark.parametrize("G,N,m", [(8, 1, 3), (8, 2, 3), (9, 2, 5), (64, 8, 1), (7, 7, 1), (10, 3, 4)])
def test_grad_accum_steps_is_derived_like_the_ranks_split(G, N, m):
    plan = Plan(budget_bytes=1, config=TrainingConfig(global_batch_size=G, micro_batch_size=m, world_size=N, sharding="ddp" if N > 1 else "none"))
    assert plan.config.grad_accum_steps == micro_batch_count(G, world_size=N, micro_batch_size=m) == math.ceil(math.ceil(G / N) / m)
    data = plan.to_dict()
    assert plan_from_dict(data) == plan and plan_from_dict(changed(data, {"grad_accum_steps": MISSING})) == plan


# -- bad plans -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", BAD, ids=[case_id(c) for c in BAD])
def test_a_bad_field_is_one_line_naming_it(tmp_path, case):
    name, changes = case
    path = write(tmp_path / "p.json", changed(valid_plan().to_dict(), changes))
    with pytest.raises(UserError) as error:
        load_plan(path)
    message = str(error.value)
    assert "\n" not in message and message.startswith("plan file ")
    assert f"field {name} " in message, message
    assert "autofit plan" in message, message
    value = changes.get(name, MISSING)
    if name in changes and value is not MISSING and len(json.dumps(value)) < 40:
        assert f" is {json.dumps(value)}" in message, message


def test_the_message_says_what_was_expected_and_how_to_go_on(tmp_path):
    path = write(tmp_path / "p.json", changed(valid_plan().to_dict(), {"micro_batch_size": "x"}))
    with pytest.raises(UserError, match=r'^plan file .*p\.json\': field micro_batch_size is "x", expected a whole number of '
                                        r'samples from 1 to 2147483648; re-create it with `autofit plan`$'):
        load_plan(path)
    path = write(tmp_path / "p.json", changed(valid_plan().to_dict(), {"grad_accum_steps": 3}))
    expected = r"field grad_accum_steps is 3, expected 2 \(ceil\(8 / 4\): micro-batches of 4 in global_batch_size 8\); drop it"
    with pytest.raises(UserError, match=expected):
        load_plan(path)


def test_a_saved_checkpoints_plan_names_where_it_came_from():
    with pytest.raises(UserError, match=r"^the plan saved in runs/x/last.pt: field precision is \"fp8\""):
        plan_from_dict(changed(valid_plan().to_dict(), {"precision": "fp8"}), where="the plan saved in runs/x/last.pt")


@pytest.mark.parametrize("case", BAD, ids=[case_id(c) for c in BAD])
def test_autofit_train_refuses_a_bad_plan_with_one_line(tmp_path, run_cli, case):
    """In this process, through the CLI's own error handling: exit 2 and one line on stderr."""
    name, changes = case
    path = write(tmp_path / "bad.json", changed(valid_plan().to_dict(), changes))
    code, out, err = run_cli("train", "--plan", path, "--data", tmp_path / "images")
    assert code == 2 and out == ""
    assert err.startswith("autofit: error: plan file ") and err.count("\n") == 1 and "Traceback" not in err, err


CLI_CASES = [
    ("micro_batch_size", {"micro_batch_size": "x"}),
    ("grad_accum_steps", {"grad_accum_steps": 3}),
]
"""A field of the wrong type and one that contradicts the others: every case of BAD runs through the CLI in this
process above; a real process only adds the interpreter's own output, the same for any field."""


@pytest.mark.parametrize("case", CLI_CASES, ids=[case_id(c) for c in CLI_CASES])
def test_python_m_autofit_train_refuses_a_bad_plan_without_a_traceback(tmp_path, case):
    """A real process (`python -m autofit`), as a user runs it: two, each costs a torch import."""
    name, changes = case
    path = write(tmp_path / "bad.json", changed(valid_plan().to_dict(), changes))
    done = subprocess.run(
        [sys.executable, "-m", "autofit", "train", "--plan", str(path), "--data", str(tmp_path / "images")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("autofit: error: plan file ") and f"field {name} " in done.stderr
