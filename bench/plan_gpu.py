"""Plans on a real GPU, re-measured: do they fit the card budget, and how fast are they?

For one model, plan with a generous budget, then with budgets at fractions of
that plan's needs (and one below the floor); re-measure each plan from scratch
with the cuda meter (allocator reserve + context) and report measured +
headroom against the budget, the choice, speed and planning time. Also plans
the same model with ``--simulate`` (the estimate for a GPU that is not there)
and measures that plan for real.

    python bench/plan_gpu.py                       # needs a CUDA device
    python bench/plan_gpu.py --model torchvision:resnet50 --shape 3x224x224 --batch 64

Run on an H200 on 2026-11-29: results in bench/RESULTS.md ("Planner on a GPU").
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from autofit.planning.verify.floor import InfeasibleBudget  # noqa: E402
from autofit.planning.planner import plan_with_report  # noqa: E402
from autofit.planning.request import PlanRequest  # noqa: E402
from autofit.measure.probe import probe  # noqa: E402
from autofit.spec import load_spec  # noqa: E402
from autofit.units import format_bytes  # noqa: E402


def remeasure(spec, plan) -> tuple[int, float]:
    result = probe(
        spec, micro_batch_size=plan.config.micro_batch_size, global_batch_size=plan.config.global_batch_size, precision=plan.config.precision,
        checkpoint=plan.config.checkpoint, device="cuda", steps=3,
    )
    return result.peak_bytes, result.samples_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="torchvision:resnet18")
    parser.add_argument("--shape", default="3x224x224")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--fractions", default="0.6,0.4")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/plan_gpu.py needs a CUDA device")
    spec = load_spec(args.model, input_shape=args.shape, num_classes=10)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {format_bytes(props.total_memory)}, torch {torch.__version__}, bf16 {torch.cuda.is_bf16_supported()}")
    print(f"model {args.model} {args.shape}, global batch {args.batch}")
    rows = []

    def plan_and_check(budget, label):
        start = time.perf_counter()
        try:
            report = plan_with_report(spec, PlanRequest(budget=budget, batch_size=args.batch, device="cuda"))
        except InfeasibleBudget as error:
            print(f"{label}: refused in {time.perf_counter() - start:.1f} s: {error}")
            return None
        except Exception:  # noqa: BLE001 - a bench: report and go on with the next case
            print(f"{label}: FAILED after {time.perf_counter() - start:.1f} s")
            traceback.print_exc()
            return None
        seconds = time.perf_counter() - start
        plan = report.plan
        peak, speed = remeasure(spec, plan)
        # The cuda meter's peak includes the context; the plan keeps the context under headroom.
        others = sum(v for k, v in plan.headroom.items() if k != "context")
        needed = peak + others
        rows.append((label, plan, peak, needed, speed, seconds, report))
        print(
            f"{label}: budget {format_bytes(plan.budget_bytes)} -> {plan.config.precision} m={plan.config.micro_batch_size}x{plan.config.grad_accum_steps} "
            f"ckpt={len(plan.config.checkpoint)}; re-measured process peak {format_bytes(peak)} + margins {format_bytes(others)} = "
            f"{format_bytes(needed)} ({needed / plan.budget_bytes:.1%} of budget, fits={needed <= plan.budget_bytes}); "
            f"{speed:.0f} samples/s (plan said {plan.measured.samples_per_s:.0f}); "
            f"{plan.measured.relative_to_unconstrained or float('nan'):.2f}x unconstrained; "
            f"headroom {({k: format_bytes(v) for k, v in plan.headroom.items()})}; planned in {seconds:.1f} s"
        )
        return plan

    generous = plan_and_check("90%", "90% of the card")
    if generous is None:
        sys.exit("the generous plan failed; nothing to scale the other budgets from")
    needed = generous.measured.peak_bytes + sum(generous.headroom.values())
    for fraction in [float(f) for f in args.fractions.split(",")]:
        plan_and_check(int(needed * fraction), f"{fraction:.0%} of the plain plan's needs")
    plan_and_check(int(needed * 0.05), "5% (below the floor)")

    start = time.perf_counter()
    estimate = plan_with_report(
        spec, PlanRequest(budget=int(needed * 0.6), batch_size=args.batch, device="cuda", simulate=True, device_memory=str(props.total_memory)),
    ).plan
    seconds = time.perf_counter() - start
    peak, speed = remeasure(spec, estimate)
    # The estimate's allocator reserve and fragmentation stand in for the cache the real
    # process peak already holds: only the safety margin is kept beyond it.
    margin = estimate.headroom["safety_margin"]
    planned_total = estimate.measured.peak_bytes + sum(estimate.headroom.values())
    print(
        f"simulated plan at 60%: {estimate.config.precision} m={estimate.config.micro_batch_size}x{estimate.config.grad_accum_steps} "
        f"ckpt={len(estimate.config.checkpoint)}, predicted peak {format_bytes(estimate.measured.peak_bytes)} + headroom "
        f"{format_bytes(sum(estimate.headroom.values()))} = {format_bytes(planned_total)}; real process peak "
        f"{format_bytes(peak)} + safety margin {format_bytes(margin)} = {(peak + margin) / estimate.budget_bytes:.1%} of "
        f"budget (fits={peak + margin <= estimate.budget_bytes}; real/planned {peak / planned_total:.2f}); "
        f"{speed:.0f} samples/s (estimated {estimate.predicted.samples_per_s:.0f}); planned in {seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
