"""bench/gpu_truth.py's dry run: every check it makes on a card runs here on the CPU, with tiny models, and passes."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from bench import gpu_truth
from tests.helpers import ROOT

MiB, GiB = 2**20, 2**30


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_the_dry_run_makes_every_section_and_no_row_fails(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu_truth.py"), "--dry-run", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=400, env=env, cwd=ROOT,  # 134 s alone on a slow 2-core machine
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_truth.json").read_text())
    assert report["device"] == "cpu" and report["dry_run"] and report["failed"] == 0
    sections = report["sections"]
    assert list(sections) == ["meters", "floor", "levers", "plans", "faults", "host link"]
    assert sections["floor"][0]["values"]["simulated_bytes"] == sections["floor"][0]["values"]["measured_bytes"]
    rows = [row for section in sections.values() for row in section]
    assert not [row for row in rows if row["status"] == "FAILED"]
    # Every check ran but the CUDA-only ones, which say so; none was cut by the time limit.
    skipped = [(row["section"], row["result"]) for row in rows if row["status"] == "skipped"]
    assert len(skipped) == 2 and all("skipped on cpu" in result for _, result in skipped), skipped
    assert len(sections["meters"]) >= 8 and len(sections["plans"]) == 8
    # Plain PyTorch against itself comes first: on the CPU it has no run-to-run difference, so nothing is loosened.
    assert sections["levers"][0]["check"] == "plain PyTorch against itself"
    assert sections["levers"][0]["values"]["run_to_run_floor"] == 0.0
    levers = {row["check"]: row["values"] for row in sections["levers"]}
    assert all(levers[name]["allowed_difference"] == 0.0 for name in ("none", "full recompute", "host optimizer state"))
    assert {"none", "selective recompute", "activation offload", "step in backward", "host optimizer state"} <= set(levers)
    assert all(levers[name]["weights_equal"] for name in ("none", "selective recompute", "activation offload", "step in backward"))
    assert levers["activation offload"]["host_peak_bytes"] > 0 and levers["activation offload"]["peak_vs_none"] < 1
    plans = [row["values"] for row in sections["plans"] if "budget_bytes" in row["values"]]
    assert len(plans) == 6 and all(plan["fits"] for plan in plans)
    assert len(list((tmp_path / "plans").glob("*.json"))) == 6  # each plan as plan.json holds it, measured from the file
    faults = {row["check"]: row for row in sections["faults"]}
    for where in ("forward", "backward", "optimizer.step"):
        assert faults[f"out of memory in {where}"]["values"]["weights_equal"], where
        assert faults[f"out of memory in {where}"]["values"]["allowed_difference"] == 0.0, where
    # The same table it printed, written as Markdown.
    table = (tmp_path / "gpu_truth.md").read_text()
    assert table.count("\n| ") == len(rows) + 1 and "| section | check | status | result | s |" in done.stdout


def judge_on_card(monkeypatch, *, simulated_bytes: int, allocated_bytes: int, cache_bytes: int):
    """check_meter's judgment on a card, with the meters' results made up (no card here)."""
    simulated = SimpleNamespace(meter="simulated", peak_bytes=simulated_bytes, samples_per_s=None,
                                breakdown={"parameters": 50 * MiB, "gradients": 50 * MiB, "optimizer_state": 100 * MiB})
    context_bytes = 760 * MiB
    real = SimpleNamespace(meter="cuda", peak_bytes=allocated_bytes + cache_bytes + context_bytes, samples_per_s=1.0,
                           breakdown={"allocator_cache": cache_bytes, "context": context_bytes})
    monkeypatch.setattr(gpu_truth, "measure", lambda *_, simulate=False, **__: simulated if simulate else real)
    truth = gpu_truth.Truth(device="cuda", time_limit_s=60, out=ROOT)
    return gpu_truth.check_meter(truth, lambda: None, micro_batch_size=16, precision="bf16", checkpoint="all")


def test_on_a_card_an_under_count_the_headroom_covers_passes_and_an_over_count_fails(monkeypatch):
    # The H200's tiny decoder, bf16, checkpointed: simulated 556 MiB of 682 MiB allocated (x0.815), covered.
    line, values = judge_on_card(monkeypatch, simulated_bytes=556 * MiB, allocated_bytes=682 * MiB, cache_bytes=300 * MiB)
    assert "x0.815" in line and "covered by" in line and values["covered_by_bytes"] > 0
    assert "safety_margin" not in values["headroom"] and values["headroom_bytes"] == sum(values["headroom"].values())
    # The same prediction, but the allocator's cache outgrew the headroom: a plan at it would not fit.
    with pytest.raises(gpu_truth.Failed, match="short by .* would not fit"):
        judge_on_card(monkeypatch, simulated_bytes=556 * MiB, allocated_bytes=682 * MiB, cache_bytes=3 * GiB)
    # The H200's HF GPT-2, fp32: simulated 3.32 GiB of 2.23 GiB allocated (x1.49) wastes budget.
    with pytest.raises(gpu_truth.Failed, match="over-counts by more than 15%"):
        judge_on_card(monkeypatch, simulated_bytes=int(3.32 * GiB), allocated_bytes=int(2.23 * GiB), cache_bytes=300 * MiB)


def test_deterministic_comparisons_put_the_previous_setting_back():
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    with gpu_truth.comparing("cuda"):
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) == before
    assert gpu_truth.lossless_allowance("cuda", 3.1e-5) == (3.1e-5, "3.1e-05, plain PyTorch's own run-to-run difference")
    assert gpu_truth.lossless_allowance("cuda", None) == (1e-6, "1e-06") == gpu_truth.lossless_allowance("cuda", 0.0)
