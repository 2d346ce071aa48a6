"""bench/gpu_truth.py's dry run: every check it makes on a card runs here on the CPU, with tiny models, and passes."""
import json
import os
import subprocess
import sys

from tests.conftest import ROOT


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
    assert list(sections) == ["meters", "levers", "plans", "faults", "host link"]
    rows = [row for section in sections.values() for row in section]
    assert not [row for row in rows if row["status"] == "FAILED"]
    # Every check ran but the CUDA-only ones, which say so; none was cut by the time limit.
    skipped = [(row["section"], row["result"]) for row in rows if row["status"] == "skipped"]
    assert len(skipped) == 2 and all("skipped on cpu" in result for _, result in skipped), skipped
    assert len(sections["meters"]) >= 8 and len(sections["plans"]) == 8
    levers = {row["check"]: row["values"] for row in sections["levers"]}
    assert {"none", "selective recompute", "activation offload", "step in backward", "host optimizer state"} <= set(levers)
    assert all(levers[name]["weights_equal"] for name in ("none", "selective recompute", "activation offload", "step in backward"))
    assert levers["activation offload"]["host_peak_bytes"] > 0 and levers["activation offload"]["peak_vs_none"] < 1
    plans = [row["values"] for row in sections["plans"] if "budget_bytes" in row["values"]]
    assert len(plans) == 6 and all(plan["fits"] for plan in plans)
    assert len(list((tmp_path / "plans").glob("*.json"))) == 6  # each plan as plan.json holds it, measured from the file
    faults = {row["check"]: row for row in sections["faults"]}
    for where in ("forward", "backward", "optimizer.step"):
        assert faults[f"out of memory in {where}"]["values"]["weights_equal"], where
    # The same table it printed, written as Markdown.
    table = (tmp_path / "gpu_truth.md").read_text()
    assert table.count("\n| ") == len(rows) + 1 and "| section | check | status | result | s |" in done.stdout
