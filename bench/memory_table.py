"""The memory model's prediction against the cpu meter, for the plan each model gets under a tight budget.

For each model (the bundled examples, and the four layouts of tests/helpers/models.py:
a CNN with BatchNorm, a pre-norm causal LM, a ViT-style model, a U-Net with
skips) the planner plans on the CPU with real probes under two budgets, 35%
and 15% of what the model needs with no budget (the plain fp32 step of the
whole batch, measured first; 5% above the floor where that is below it), so
that micro-batches and checkpointing are chosen. Printed for the chosen plan: the cost model's predicted peak, the
peak the planner measured before choosing it, the same configuration measured
again by ``probe_plan`` (``autofit probe --plan``), and predicted/measured.

    python bench/memory_table.py              # every case, about 12 minutes on 2 busy cores
    python bench/memory_table.py --only cnn   # the cases whose label contains "cnn"
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autofit.measure.probe import probe, probe_plan  # noqa: E402
from autofit.planning.verify.floor import InfeasibleBudget  # noqa: E402
from autofit.planning.planner import plan_with_report  # noqa: E402
from autofit.planning.request import PlanRequest  # noqa: E402
from autofit.spec import load_spec  # noqa: E402
from autofit.units import format_bytes  # noqa: E402

CASES = [
    # (label, source: a model file or a tests/helpers/models.py layout, global batch)
    ("digits CNN (examples)", "examples/digits_cnn.py", 64),
    ("tiny transformer (examples)", "examples/tiny_transformer.py", 64),
    ("GPT-2, transformers (examples)", "examples/hf_causal_lm.py", 64),
    ("ConvNeXt, timm (examples)", "examples/timm_classifier.py", 64),
    ("CNN with BatchNorm", "layout:cnn", 64),
    ("pre-norm LM", "layout:lm", 64),
    ("ViT-style", "layout:vit", 64),
    ("U-Net with skips", "layout:unet", 64),
]
SHARES = (0.35, 0.15)
"""Budgets, as shares of the plain fp32 peak (5% above the floor where that is below it)."""


def load(source: str):
    if source.startswith("layout:"):
        from tests.helpers.models import layout_specs

        return layout_specs()[source.split(":", 1)[1]]
    return load_spec(str(ROOT / source))


def plan_under(spec, *, batch_size: int, budget: int):
    """The plan for ``budget``, or for 5% above the floor when the budget is below it (and which budget it was)."""
    try:
        return plan_with_report(spec, PlanRequest(budget=budget, batch_size=batch_size, cache=False)), budget
    except InfeasibleBudget as below:
        budget = int(below.floor_bytes * 1.05)
        return plan_with_report(spec, PlanRequest(budget=budget, batch_size=batch_size, cache=False)), budget


def describe(plan) -> str:
    checkpoint = f"{len(plan.config.checkpoint)} block(s)" if plan.config.checkpoint else "no ckpt"
    return f"{plan.config.precision} {plan.config.micro_batch_size}x{plan.config.grad_accum_steps} {checkpoint}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="run only the cases whose label contains this (case-insensitive)")
    args = parser.parse_args()
    header = (
        f"{'case':<31} {'batch':>5} {'plain fp32':>11} {'budget':>11} {'chosen':<22} {'predicted':>11} {'measured':>11} "
        f"{'again':>11} {'pred/meas':>9} {'s':>5}"
    )
    print(header)
    ratios = []
    for label, source, batch_size in CASES:
        if args.only.lower() not in label.lower():
            continue
        spec = load(source)
        plain = probe(spec, micro_batch_size=batch_size, global_batch_size=batch_size, steps=2).peak_bytes
        for share in SHARES:
            start = time.perf_counter()
            report, budget = plan_under(spec, batch_size=batch_size, budget=int(share * plain))
            plan = report.plan
            again = probe_plan(spec, plan, steps=2).peak_bytes
            predicted, measured = plan.predicted.peak_bytes, plan.measured.peak_bytes
            ratios.append(predicted / measured)
            print(
                f"{label:<31} {batch_size:>5} {format_bytes(plain):>11} {format_bytes(budget):>11} {describe(plan):<22} "
                f"{format_bytes(predicted):>11} {format_bytes(measured):>11} {format_bytes(again):>11} {predicted / measured:>9.4f} "
                f"{time.perf_counter() - start:>5.0f}",
                flush=True,
            )
    if ratios:
        print(f"\npredicted/measured: {min(ratios):.4f} to {max(ratios):.4f} over {len(ratios)} plans (cpu meter; 'again' is probe --plan)")


if __name__ == "__main__":
    main()
