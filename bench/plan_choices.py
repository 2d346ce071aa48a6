"""The configuration ``plan`` chooses for small models at budgets that force levers: one row per plan.

A refactor of the planner must leave every row the same (issue #51's contract): run it before and after,
and diff the two outputs. Simulated (no timing noise) and without the cache, so a row depends on the code alone.

    AUTOFIT_TIMING=short python bench/plan_choices.py > before.txt
    AUTOFIT_TIMING=short python bench/plan_choices.py layout_unet 0.35   # one model, one budget share

On the CPU a simulated plan's speeds rest on a matmul rate measured as it runs (``speed.estimated.roofline_rates``),
so a point within a few percent of another can swap with the machine's load: rerun a row that differs.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autofit.errors import UserError  # noqa: E402
from autofit.planning.planner import plan_with_report  # noqa: E402
from autofit.planning.request import PlanRequest  # noqa: E402
from autofit.spec import load_spec  # noqa: E402
from tests.helpers.models import layout_specs, relu_chain_spec  # noqa: E402
from tests.helpers.planning import uneven_spec  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# (name, spec builder, global batch, budget shares of the model's unconstrained peak, extra request fields)
CASES = [
    ("digits_cnn", lambda: load_spec(str(EXAMPLES / "digits_cnn.py")), 64, (0.6, 0.35, 0.2), {}),
    ("tiny_transformer", lambda: load_spec(str(EXAMPLES / "tiny_transformer.py")), 16, (0.6, 0.35, 0.2), {}),
    ("own_loop", lambda: load_spec(str(EXAMPLES / "own_loop.py")), 64, (0.6, 0.3), {}),
    ("layout_cnn", lambda: layout_specs()["cnn"], 32, (0.6, 0.35, 0.2), {}),
    ("layout_lm", lambda: layout_specs()["lm"], 16, (0.6, 0.35, 0.2), {"allow_lossy_optimizer": True}),
    ("layout_vit", lambda: layout_specs()["vit"], 32, (0.6, 0.35, 0.2), {}),
    ("layout_unet", lambda: layout_specs()["unet"], 16, (0.6, 0.35, 0.2), {}),
    ("relu_chain", relu_chain_spec, 64, (0.6, 0.35), {}),
    ("uneven", uneven_spec, 32, (0.6, 0.35, 0.2), {}),
    ("layout_lm_cuda", lambda: layout_specs()["lm"], 16, (0.6, 0.3), {"device": "cuda", "device_kind": "H100"}),
]


def describe(config) -> str:
    """One configuration as the fields a plan chooses."""
    parts = [
        config.precision, f"m={config.micro_batch_size}x{config.grad_accum_steps}",
        f"ckpt={','.join(config.checkpoint) or '-'}", f"sel={','.join(config.selective_checkpoint) or '-'}",
    ]
    if config.offload:
        parts.append(f"offload={','.join(config.offload)}")
    if config.optimizer_in_backward:
        parts.append("step-in-backward")
    if config.optimizer_state != "device":
        parts.append(f"state={config.optimizer_state}")
    if config.loss_chunks > 1:
        parts.append(f"loss_chunks={config.loss_chunks}")
    if config.frozen_nf4:
        parts.append("nf4")
    return " ".join(parts)


def main(names: list[str], only_share: float | None) -> None:
    for name, build, batch, shares, extra in CASES:
        if names and name not in names:
            continue
        spec = build()
        request = dict(batch_size=batch, simulate=True, cache=False, **extra)
        if extra.get("device") == "cuda":
            request["device_memory"] = "80GiB"
            request["host_memory"] = "64GiB"
        free = plan_with_report(spec, PlanRequest(budget="8GiB", **request))
        peak = free.plan.measured.peak_bytes
        print(f"{name:18s} free      {describe(free.plan.config)} peak={peak}", flush=True)
        for share in shares:
            if only_share is not None and share != only_share:
                continue
            budget = int(peak * share)
            try:
                config = describe(plan_with_report(spec, PlanRequest(budget=budget, **request)).plan.config)
            except UserError as refused:
                config = "refused: " + str(refused)[:90]
            print(f"{name:18s} {share:4.2f}x    {config}", flush=True)


if __name__ == "__main__":
    shares = [float(a) for a in sys.argv[1:] if a.replace(".", "", 1).isdigit()]
    main([a for a in sys.argv[1:] if not a.replace(".", "", 1).isdigit()], shares[0] if shares else None)
