"""How good are the planner's plans? Against an exhaustive grid and the usual hand choices, on the CPU.

For each model and each budget from the floor to the unconstrained peak:

- plan it (``make_plan``, all three precisions) and time the planning;
- re-measure the plan from scratch with ``probe`` at the full global batch:
  a budget violation is measured peak + the plan's headroom > budget;
- compare its samples/s with
  * the best configuration of an exhaustive grid over the same space
    (precision x micro-batch x every checkpoint set): every grid point's
    memory measured (simulated meter, see ``measure_peak``), every point that
    could be best timed as plain training steps, the top three re-timed;
  * "checkpoint every block, largest micro-batch that fits" (fp32);
  * "no checkpointing, largest micro-batch that fits" (fp32).
  The final ratios come from re-timing the contenders side by side, in
  interleaved rounds (best of 3), in the same run.

Grid pruning, both sound under "recomputing more is never faster": for a
(precision, micro-batch), a checkpoint set is not timed when a subset of it
needs no more memory; fp16's points are measured only if its fastest
unconstrained configuration (timed at every micro-batch) beats the best
fitting configuration found without it at some budget.

ResNet-18 at 32x32 (G=256) is planned for the wall-time target; its
8 blocks make 256 checkpoint sets per point, so its grid is restricted to
checkpoint sets {none, all} and to fp32/bf16 (fp16 at G=256 takes about a
minute per point on this CPU), and its "grid" ratio is marked partial.

    python bench/plan_quality.py            # all models (tens of minutes on 2 cores)
    python bench/plan_quality.py --models cnn --budgets 3 --threads 2
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autofit.planning.cost_model import time_configuration  # noqa: E402
from autofit.planning.floor import InfeasibleBudget  # noqa: E402
from autofit.planning.modelling import micro_batch_sizes  # noqa: E402
from autofit.planning.planner import make_plan  # noqa: E402
from autofit.measure.probe import probe  # noqa: E402
from autofit.spec import ModelSpec, default_optimizer, load_spec  # noqa: E402
from autofit.units import format_bytes  # noqa: E402
from strategies import checkpoint_candidates  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# -- models -----------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = nn.Sequential() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


class SmallResNet(nn.Module):
    """A ResNet for 32x32 images with four blocks (16 checkpoint sets)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.blocks = nn.Sequential(
            BasicBlock(32, 32, 1), BasicBlock(32, 64, 2), BasicBlock(64, 64, 1), BasicBlock(64, 128, 2)
        )
        self.head = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)))


class UnevenNet(nn.Module):
    """Five blocks of very different widths at one resolution: uneven bytes and times per block."""

    WIDTHS = (16, 96, 8, 128, 24)

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        channels = [3, *self.WIDTHS]
        self.blocks = nn.Sequential(*[ConvBlock(a, b) for a, b in zip(channels, channels[1:])])
        self.head = nn.Linear(self.WIDTHS[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(dim=(2, 3)))


def image_spec(name: str, build, shape) -> ModelSpec:
    return ModelSpec(
        source=f"bench:{name}",
        build_model=build,
        example_batch=lambda n: (torch.randn(n, *shape), torch.randint(0, 10, (n,))),
        loss_fn=nn.functional.cross_entropy,
        build_optimizer=default_optimizer,
        input_shape=tuple(shape),
    )


@dataclass
class Case:
    name: str
    spec: ModelSpec
    global_batch_size: int
    full_grid: bool = True
    grid_precisions: tuple[str, ...] = ("fp32", "bf16", "fp16")


def cases() -> dict[str, Case]:
    return {
        "cnn": Case("ResNet-style CNN 32x32 (4 blocks)", image_spec("SmallResNet", SmallResNet, (3, 32, 32)), 16),
        "transformer": Case("tiny transformer (4 layers, T=64)", load_spec(str(ROOT / "examples" / "tiny_transformer.py")), 16),
        "uneven": Case("uneven conv blocks 24x24 (5 blocks)", image_spec("UnevenNet", UnevenNet, (3, 24, 24)), 16),
        "resnet18": Case(
            "torchvision resnet18 32x32", load_spec("torchvision:resnet18", input_shape="3x32x32", num_classes=10), 256,
            full_grid=False, grid_precisions=("fp32", "bf16"),
        ),
    }


# -- the grid -----------------------------------------------------------------------------------
def measure_peak(spec, *, precision, micro_batch_size, global_batch_size, checkpoint) -> int:
    """A grid point's peak: the simulated meter (the cpu meter's twin: equal in fp32, within
    0.01% under autocast), one optimizer step of two micro-batches, plus the host copy of
    the samples not traced (later micro-steps repeat the second; the meter counts the host batch)."""
    traced = min(global_batch_size, 2 * micro_batch_size)
    peak = probe(
        spec, micro_batch_size=micro_batch_size, global_batch_size=traced, precision=precision,
        checkpoint=list(checkpoint), simulate=True, steps=1,
    ).peak_bytes
    return peak + (global_batch_size - traced) * host_sample_bytes(spec)


def host_sample_bytes(spec) -> int:
    inputs, targets = spec.example_batch(1)
    return sum(t.untyped_storage().nbytes() for t in (inputs, targets))


def speed(spec, config, global_batch_size, steps: int = 3) -> float:
    precision, m, checkpoint = config
    return time_configuration(
        spec, precision=precision, micro_batch_size=m, global_batch_size=global_batch_size, checkpoint=list(checkpoint),
        device="cpu", steps=steps,
    )


def runnable_sizes(spec, global_batch_size: int) -> list[int]:
    """Micro-batch sizes whose micro-batches, the last (remainder) one included, the model trains with."""
    def runs(m: int) -> bool:
        try:
            probe(spec, micro_batch_size=m, global_batch_size=m, simulate=True, steps=1)
        except Exception:  # e.g. BatchNorm with one value per channel
            return False
        return True

    sizes = []
    for m in micro_batch_sizes(global_batch_size, smallest=1):
        remainder = global_batch_size % m
        if runs(m) and (remainder == 0 or runs(remainder)):
            sizes.append(m)
    return sizes


def fits_for_real(spec, config, global_batch_size: int, budget: int, headroom: int) -> bool:
    """The cpu meter at the full global batch: the last word on whether a contender fits."""
    precision, m, checkpoint = config
    return measure_real_peak(spec, precision=precision, micro_batch_size=m, global_batch_size=global_batch_size, checkpoint=checkpoint) + headroom <= budget


_REAL_PEAKS: dict = {}


def measure_real_peak(spec, *, precision, micro_batch_size, global_batch_size, checkpoint) -> int:
    key = (id(spec), precision, micro_batch_size, global_batch_size, tuple(checkpoint))
    if key not in _REAL_PEAKS:
        _REAL_PEAKS[key] = probe(
            spec, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, precision=precision,
            checkpoint=list(checkpoint), steps=2,
        ).peak_bytes
    return _REAL_PEAKS[key]


def grid(case: Case, log) -> dict:
    """Peaks of every grid point (fp16's only when a budget needs them); speeds later, where needed."""
    spec, G = case.spec, case.global_batch_size
    with torch.device("meta"):
        blocks = checkpoint_candidates(spec.build_model())
    if case.full_grid:
        sets = [tuple(c) for r in range(len(blocks) + 1) for c in itertools.combinations(blocks, r)]
    else:
        sets = [(), tuple(blocks)]
    g = {"peaks": {}, "sizes": runnable_sizes(spec, G), "sets": sets, "blocks": blocks, "speeds": {}, "candidates": []}
    start = time.perf_counter()
    for precision in ("fp32", "bf16"):
        add_precision(case, g, precision)
    log(f"  grid: {len(g['peaks'])} points measured (simulated meter) in {time.perf_counter() - start:.0f} s")
    return g


def add_precision(case: Case, g: dict, precision: str) -> None:
    for m in g["sizes"]:
        for checkpoint in g["sets"]:
            g["peaks"][precision, m, checkpoint] = measure_peak(
                case.spec, precision=precision, micro_batch_size=m, global_batch_size=case.global_batch_size, checkpoint=checkpoint
            )
    g["candidates"] += undominated(g, precision)


def undominated(g: dict, precision: str) -> list[tuple]:
    """Points not beaten by a subset of their checkpoint set at no more memory."""
    keep = []
    for m in g["sizes"]:
        for checkpoint in g["sets"]:
            peak, chosen = g["peaks"][precision, m, checkpoint], set(checkpoint)
            if not any(set(other) < chosen and g["peaks"][precision, m, other] <= peak for other in g["sets"]):
                keep.append((precision, m, checkpoint))
    return keep


def grid_speed(case: Case, g: dict, config) -> float:
    """A screening measurement (one timed step); contenders are re-timed side by side."""
    if config not in g["speeds"]:
        g["speeds"][config] = speed(case.spec, config, case.global_batch_size, steps=2)
    return g["speeds"][config]


def best_of_grid(case: Case, g: dict, budget: int, headroom: int) -> list[tuple]:
    """The grid's fitting points by measured speed, fastest first.

    fp16 enters only where its fastest unconstrained configuration beats the
    best fitting one without it (checkpointing or a smaller budget never make
    it faster).
    """
    fitting = [c for c in g["candidates"] if g["peaks"][c] + headroom <= budget]
    for c in fitting:
        grid_speed(case, g, c)
    best = max((g["speeds"][c] for c in fitting), default=0.0)
    if "fp16" in case.grid_precisions and "fp16" not in {c[0] for c in g["peaks"]}:
        ceiling = max(grid_speed(case, g, ("fp16", m, ())) for m in g["sizes"])
        if ceiling >= best:
            add_precision(case, g, "fp16")
    fitting = [c for c in g["candidates"] if g["peaks"][c] + headroom <= budget]
    for c in fitting:
        grid_speed(case, g, c)
    ranked = sorted(fitting, key=lambda c: -g["speeds"][c])
    # The simulated meter can be a few hundred bytes under the cpu meter under autocast:
    # the leaders are checked with the cpu meter itself.
    confirmed = []
    for c in ranked:
        if fits_for_real(case.spec, c, case.global_batch_size, budget, headroom):
            confirmed.append(c)
        if len(confirmed) == 3:
            break
    return confirmed


def hand_choice(case: Case, g: dict, budget: int, headroom: int, *, checkpoint_all: bool):
    sets = [s for s in g["sets"] if (len(s) == len(g["blocks"]) if checkpoint_all else not s)]
    for m in g["sizes"]:  # largest first
        config = ("fp32", m, sets[0])
        if g["peaks"][config] + headroom <= budget and fits_for_real(case.spec, config, case.global_batch_size, budget, headroom):
            return config
    return None


def side_by_side(case: Case, configs: list[tuple], rounds: int = 3) -> dict:
    """Samples/s of each config: the best of interleaved rounds (other work only ever slows a round down)."""
    speeds = {c: [] for c in configs}
    for _ in range(rounds):
        for c in configs:
            speeds[c].append(speed(case.spec, c, case.global_batch_size))
    return {c: max(v) for c, v in speeds.items()}


# -- the run ----------------------------------------------------------------------------------------
def run_case(key: str, case: Case, *, budgets: int, log) -> list[dict]:
    spec, G = case.spec, case.global_batch_size
    log(f"{case.name}, global batch {G}")
    try:
        make_plan(spec, budget=1, batch_size=G)
    except InfeasibleBudget as error:
        floor = error.floor_bytes
    g = grid(case, log)
    top_peak = max(g["peaks"][p, g["sizes"][0], ()] for p in ("fp32", "bf16"))
    top = math.ceil(top_peak / 0.98) + 1
    log(f"  floor {format_bytes(floor)}, unconstrained peak {format_bytes(top_peak)}; {len(g['candidates'])} undominated grid points")
    rows = []
    for i in range(budgets):
        budget = int(floor + (top - floor) * i / max(budgets - 1, 1))
        start = time.perf_counter()
        plan = make_plan(spec, budget=budget, batch_size=G)
        plan_seconds = time.perf_counter() - start
        headroom = sum(plan.headroom.values())
        again = probe(spec, micro_batch_size=plan.micro_batch_size, global_batch_size=G, precision=plan.precision, checkpoint=plan.checkpoint, steps=2)
        violation = again.peak_bytes + headroom > budget
        mine = (plan.precision, plan.micro_batch_size, tuple(plan.checkpoint))
        ranked = best_of_grid(case, g, budget, headroom)
        all_ckpt = hand_choice(case, g, budget, headroom, checkpoint_all=True)
        no_ckpt = hand_choice(case, g, budget, headroom, checkpoint_all=False)
        contenders = list(dict.fromkeys([mine, *ranked[:3], *(c for c in (all_ckpt, no_ckpt) if c)]))
        measured = side_by_side(case, contenders)
        best_grid = max(measured[c] for c in ranked[:3]) if ranked else float("nan")
        row = {
            "model": key, "budget": budget, "plan": mine, "plan_speed": measured[mine],
            "grid_best": max(ranked[:3], key=lambda c: measured[c]) if ranked else None,
            "vs_grid": measured[mine] / best_grid if ranked else float("nan"),
            "vs_all": measured[mine] / measured[all_ckpt] if all_ckpt else None,
            "vs_none": measured[mine] / measured[no_ckpt] if no_ckpt else None,
            "violation": violation, "plan_seconds": plan_seconds, "partial": not case.full_grid,
        }
        rows.append(row)
        log(f"  {format_bytes(budget):>11}: {describe(mine)} {measured[mine]:.0f} samples/s; grid best {describe(row['grid_best'])}; "
            f"vs grid {row['vs_grid']:.3f}, vs ckpt-all {fmt(row['vs_all'])}, vs no-ckpt {fmt(row['vs_none'])}; "
            f"violation {violation}; planned in {plan_seconds:.1f} s")
    return rows


def describe(config) -> str:
    if config is None:
        return "-"
    precision, m, checkpoint = config
    return f"{precision} m={m} ckpt={len(checkpoint)}"


def fmt(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def table(rows: list[dict], all_cases: dict[str, Case]) -> str:
    lines = [
        "| model | G | budget | plan (precision, m, ckpt blocks) | plan samples/s | / grid best | / ckpt-all hand | / no-ckpt hand | violation | plan s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        case = all_cases[r["model"]]
        grid_ratio = f"{r['vs_grid']:.3f}" + (" (partial)" if r["partial"] else "")
        lines.append(
            f"| {case.name} | {case.global_batch_size} | {format_bytes(r['budget'])} | {describe(r['plan'])} | {r['plan_speed']:.0f} | "
            f"{grid_ratio} | {fmt(r['vs_all'])} | {fmt(r['vs_none'])} | {'YES' if r['violation'] else 'no'} | {r['plan_seconds']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,transformer,uneven,resnet18")
    parser.add_argument("--budgets", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="intra-op threads; 1 keeps timings meaningful when other jobs share the cores (2 threads then stall)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # The plans share a cache across one model's budgets, as a user's would, but never the user's own.
    os.environ.setdefault("AUTOFIT_CACHE_DIR", tempfile.mkdtemp(prefix="plan-quality-cache-"))
    all_cases = cases()
    rows = []
    started = time.perf_counter()
    for key in args.models.split(","):
        rows += run_case(key, all_cases[key], budgets=args.budgets, log=lambda line: print(line, flush=True))
    print()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {time.perf_counter() - started:.0f} s in all")
    print(table(rows, all_cases))
    full = [r for r in rows if not r["partial"]]
    if full:
        ratios = [r["vs_grid"] for r in full]
        print(f"\nfull-grid cases: plan / grid best min {min(ratios):.3f}, median {statistics.median(ratios):.3f}; "
              f"{sum(r >= 0.95 for r in ratios)}/{len(ratios)} at >= 0.95")
    print(f"budget violations: {sum(r['violation'] for r in rows)} of {len(rows)} plans")
    for key in {r["model"] for r in rows}:
        worst = max(r["plan_seconds"] for r in rows if r["model"] == key)
        print(f"{all_cases[key].name}: planning wall time up to {worst:.1f} s")


if __name__ == "__main__":
    main()
