"""How good are the planner's plans? Against an exhaustive grid and the usual hand choices, on the CPU.

For each model, at budgets from the floor to the unconstrained peak (``--budgets``)
and at fractions of it (``--fractions``, 0.33x and 0.66x by default; the
unconstrained peak is plain fp32 training of the whole global batch, as MONeT
states its budgets):

- plan it (``make_plan``, all three precisions) and time the planning;
- re-measure the plan from scratch with ``probe`` at the full global batch:
  a budget violation is measured peak + the plan's headroom > budget;
- compare its samples/s with
  * the best configuration of an exhaustive grid over the same space
    (precision x micro-batch x a checkpoint mode per block: none, selective
    or full x the optimizer step in backward, off or on where a step is one
    micro-batch and not fp16), every point that could be best timed as plain
    training steps, the top three re-timed;
  * the best block-only point of that grid (no block selective and no step in
    backward: what the planner could do before it searched selective
    checkpointing and the levers), the best point with a selective block and
    the best with the step in backward (what each costs or gains here);
  * the unconstrained configuration (the fastest with no budget: any precision and micro-batch, no
    checkpointing; the three fastest by screening, re-timed);
  * "checkpoint every block, largest micro-batch that fits" (fp32);
  * "no checkpointing, largest micro-batch that fits" (fp32).
  The final ratios come from re-timing the contenders side by side, each
  built once, in 8 interleaved rounds of one step (the fastest counts), in
  the same run; with one thread (the default) by the thread's CPU time, as the
  planner times them. The plan's ratio to the grid's best is then timed as a
  pair, in three fresh builds (the median counts).

The grid's peaks come from the planner's memory model (simulated traces at
the smallest micro-batch and the global batch), which equals the cpu meter in
every cell of tests/planning/memory/test_memory_grid.py (selective modes included); with the
step in backward, from its lever terms (``MemoryCosts.peak_bytes(levers=...)``,
``lever_memory.lever_peak_bytes``, as the planner's search). The grid's
leaders are confirmed with the cpu meter at the full global batch (``probe``
with the same configuration) before they count. Timing is pruned, soundly
under "checkpointing a block never makes a step faster": at a budget, a
(precision, micro-batch, step in backward) point is timed only with mode sets
that fit and have no fitting set that checkpoints a subset of their blocks (a
block none where they have it selective or full); a point with the step in
backward is timed like one without (it is not assumed to cost nothing); fp16's
points only if its fastest unconstrained configuration beats the best fitting
one without it.

Besides the budgets above, a case may name budgets as fractions of its
parameters + gradients + AdamW state (``state_fractions``: 16 bytes a
parameter), where plain training cannot fit and only the step in backward
(which frees each gradient once its parameter has stepped) can: there a
refusal by the planner while the grid holds a fitting point counts as 0.

Modes per block: none / selective / full for models of up to SELECTIVE_GRID_LIMIT
blocks (3^n sets a point); beyond, every block in one mode ({none, all
selective, all full}), and the "grid" ratio is marked partial.

    python bench/plan_quality.py --models chain,lm,cnn --budgets 0   # the selective rows (minutes on 2 cores)
    python bench/plan_quality.py --models lmwide --budgets 0         # the step in backward's rows
    python bench/plan_quality.py            # every model, floor-to-peak sweep too (tens of minutes on 2 cores)
    python bench/plan_quality.py --models cnn --budgets 3 --threads 2
"""
from __future__ import annotations

import argparse
import functools
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

from autofit.config import TrainingConfig  # noqa: E402
from autofit.planning.context import step_clock  # noqa: E402
from autofit.planning.costs import memory_costs  # noqa: E402
from autofit.planning.speed.measured import StepTimer, time_training  # noqa: E402
from autofit.planning.verify.floor import InfeasibleBudget  # noqa: E402
from autofit.planning.memory.levers import LeverChoice  # noqa: E402
from autofit.planning.modelling import micro_batch_sizes  # noqa: E402
from autofit.planning.planner import make_plan  # noqa: E402
from autofit.planning.request import PlanRequest  # noqa: E402
from autofit.measure.probe import probe  # noqa: E402
from autofit.spec import ModelSpec, default_optimizer, load_spec  # noqa: E402
from autofit.units import format_bytes  # noqa: E402
from strategies import checkpoint_candidates  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NONE, SELECTIVE, FULL = "none", "selective", "full"
SELECTIVE_GRID_LIMIT = 5
"""Blocks up to which the grid holds every mode per block (3^5 = 243 sets a point)."""


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


class ChainBlock(nn.Module):
    """Two matmuls around a chain of ReLUs that each keep their (B, T, C) output for backward: selective
    checkpointing keeps the matmul outputs and frees the chain (half of what full checkpointing frees)."""

    def __init__(self, dim: int, chain: int = 4) -> None:
        super().__init__()
        self.up, self.down, self.chain = nn.Linear(dim, dim), nn.Linear(dim, dim), chain

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        h = self.up(x)
        for _ in range(self.chain):
            h = torch.relu(h)
        return x + self.down(h)


class ChainNet(nn.Module):
    """Four ChainBlocks over (B, 2048, 128) inputs: activations far above the parameters' state."""

    def __init__(self, dim: int = 128, num_classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[ChainBlock(dim) for _ in range(4)])
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(dim=1))


class PreNormBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)  # (B, H, T, D)
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.norm2(x))


class PreNormLM(nn.Module):
    """A pre-norm causal LM of 4 layers, SDPA attention (by default width 64, 512 tokens, vocabulary 256)."""

    def __init__(self, *, vocab: int = 256, seq_len: int = 512, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, dim))
        self.layers = nn.ModuleList(PreNormBlock(dim, 4) for _ in range(4))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def lm_batch(n: int, *, vocab: int = 256, seq_len: int = 512):
    tokens = torch.randint(0, vocab, (n, seq_len + 1))  # (B, T + 1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_spec(name: str, *, vocab: int, seq_len: int, dim: int) -> ModelSpec:
    return ModelSpec(
        source=f"bench:{name}", build_model=functools.partial(PreNormLM, vocab=vocab, seq_len=seq_len, dim=dim),
        example_batch=functools.partial(lm_batch, vocab=vocab, seq_len=seq_len), loss_fn=token_loss, build_optimizer=default_optimizer,
    )


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # (B, T, V), (B, T)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


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
    """Every checkpoint mode set (else {none, all selective, all full}, or {none, all} as before selective)."""
    grid_precisions: tuple[str, ...] = ("fp32", "bf16", "fp16")
    state_fractions: tuple[float, ...] = ()
    """Budgets as fractions of the parameters + gradients + AdamW state (16 bytes per fp32 parameter)."""


def cases() -> dict[str, Case]:
    return {
        "cnn": Case("ResNet-style CNN 32x32 (4 blocks)", image_spec("SmallResNet", SmallResNet, (3, 32, 32)), 16),
        "transformer": Case("tiny transformer (4 layers, T=64)", load_spec(str(ROOT / "examples" / "tiny_transformer.py")), 16),
        "uneven": Case("uneven conv blocks 24x24 (5 blocks)", image_spec("UnevenNet", UnevenNet, (3, 24, 24)), 16),
        "resnet18": Case(
            "torchvision resnet18 32x32", load_spec("torchvision:resnet18", input_shape="3x32x32", num_classes=10), 256,
            full_grid=False, grid_precisions=("fp32", "bf16"),
        ),
        # Activations far above the parameters' state, so that 0.33x of the unconstrained peak is feasible.
        "chain": Case("ReLU-chain blocks (4, T=2048, C=128)", image_spec("ChainNet", ChainNet, (2048, 128)), 2),
        "lm": Case("pre-norm LM (4 layers, T=512, C=64)", lm_spec("PreNormLM", vocab=256, seq_len=512, dim=64), 2),
        # Parameters' state far above the activations: at m = G = 2 the optimizer step's peak (parameters,
        # gradients, AdamW state) is the step's, which only the step in backward lowers.
        "lmwide": Case(
            "pre-norm LM (4 layers, T=64, C=256, V=1024)", lm_spec("WideLM", vocab=1024, seq_len=64, dim=256), 2,
            state_fractions=(0.9, 1.0),
        ),
    }


# -- the grid -----------------------------------------------------------------------------------
# A grid point is (precision, micro-batch, modes, in_backward): one mode per block, in block order, and whether
# the optimizer steps in backward.
def checkpoint_lists(blocks: list[str], modes: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(fully, selectively) checkpointed block names."""
    return [b for b, m in zip(blocks, modes) if m == FULL], [b for b, m in zip(blocks, modes) if m == SELECTIVE]


def host_sample_bytes(spec) -> int:
    inputs, targets = spec.example_batch(1)
    return sum(t.untyped_storage().nbytes() for t in (inputs, targets))


def training_config(case: Case, g: dict, config) -> TrainingConfig:
    precision, m, modes, in_backward = config
    full, selective = checkpoint_lists(g["blocks"], modes)
    return TrainingConfig(
        global_batch_size=case.global_batch_size, micro_batch_size=m, precision=precision, checkpoint=full, selective_checkpoint=selective,
        optimizer_in_backward=in_backward,
    )


def speed(case: Case, g: dict, config, steps: int = 3) -> float:
    """Samples/s of plain training steps (``time_training``: the config goes through ``apply_config``)."""
    return time_training(case.spec, training_config(case, g, config), device="cpu", steps=steps)


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


def fits_for_real(case: Case, g: dict, config, budget: int, headroom: int) -> bool:
    """The cpu meter at the full global batch: the last word on whether a contender fits."""
    return measure_real_peak(case, g, config) + headroom <= budget


_REAL_PEAKS: dict = {}


def measure_real_peak(case: Case, g: dict, config) -> int:
    key = (case.name, config)
    if key not in _REAL_PEAKS:
        training = training_config(case, g, config)
        _REAL_PEAKS[key] = probe(
            case.spec, micro_batch_size=training.micro_batch_size, global_batch_size=training.global_batch_size,
            precision=training.precision, checkpoint=training.checkpoint, selective_checkpoint=training.selective_checkpoint,
            optimizer_in_backward=training.optimizer_in_backward, steps=2,
        ).peak_bytes
    return _REAL_PEAKS[key]


def grid(case: Case, log) -> dict:
    """Peaks of every grid point by the memory model (fp16's only when a budget needs them); speeds later, where needed."""
    spec, G = case.spec, case.global_batch_size
    with torch.device("meta"):
        blocks = checkpoint_candidates(spec.build_model())
    if case.full_grid and len(blocks) <= SELECTIVE_GRID_LIMIT:
        sets = list(itertools.product((NONE, SELECTIVE, FULL), repeat=len(blocks)))
    else:
        case.full_grid = False
        sets = [(mode,) * len(blocks) for mode in (NONE, SELECTIVE, FULL)]
    g = {"peaks": {}, "sizes": runnable_sizes(spec, G), "sets": sets, "blocks": blocks, "speeds": {}, "memory": {}}
    start = time.perf_counter()
    for precision in ("fp32", "bf16"):
        add_precision(case, g, precision)
    log(f"  grid: {len(g['peaks'])} points ({len(sets)} mode sets a point) from the memory model in {time.perf_counter() - start:.0f} s")
    return g


def add_precision(case: Case, g: dict, precision: str) -> None:
    """Every point of one precision; with the step in backward where a step is one micro-batch and not fp16
    (as ``search.LeverSearch.choices``), its peak from the memory model's lever terms."""
    G = case.global_batch_size
    memory = memory_costs(case.spec, precision=precision, low=g["sizes"][-1], high=G, device_type="cpu")
    g["memory"][precision] = memory
    for m in g["sizes"]:
        in_backward = (False, True) if m >= G and precision != "fp16" and memory.has_levers() else (False,)
        for modes in g["sets"]:
            full = {b for b, mode in enumerate(modes) if mode == FULL}
            selective = frozenset(b for b, mode in enumerate(modes) if mode == SELECTIVE)
            if selective and memory.selective_drops(m) is None:
                continue  # selective frees nothing anywhere in this model: no such point
            for lever in in_backward:
                g["peaks"][precision, m, modes, lever] = memory.peak_bytes(
                    m, global_batch_size=G, checkpoint=full, selective=selective, levers=LeverChoice(optimizer_in_backward=lever),
                )


def less_recompute(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Whether ``a`` checkpoints a strict subset of ``b``'s blocks, each in ``b``'s mode (so it is never slower)."""
    return a != b and all(x == NONE or x == y for x, y in zip(a, b))


def block_only(config) -> bool:
    """No selective block and no step in backward."""
    return SELECTIVE not in config[2] and not config[3]


def worth_timing(g: dict, budget: int, headroom: int, *, blocks_only: bool = False) -> list[tuple]:
    """Fitting points with no fitting point of the same precision, micro-batch and step in backward that
    recomputes less (block-only points alone with ``blocks_only``)."""
    fitting = [c for c, peak in g["peaks"].items() if peak + headroom <= budget and (not blocks_only or block_only(c))]
    by_point: dict = {}
    for precision, m, modes, in_backward in fitting:
        by_point.setdefault((precision, m, in_backward), []).append(modes)
    return [
        (precision, m, modes, in_backward) for (precision, m, in_backward), sets in by_point.items() for modes in sets
        if not any(less_recompute(other, modes) for other in sets)
    ]


def grid_speed(case: Case, g: dict, config) -> float:
    """A screening measurement (one timed step); contenders are re-timed side by side."""
    if config not in g["speeds"]:
        g["speeds"][config] = speed(case, g, config, steps=2)
    return g["speeds"][config]


def best_of_grid(case: Case, g: dict, budget: int, headroom: int, *, blocks_only: bool = False) -> list[tuple]:
    """The grid's fitting points by measured speed, fastest first (block-only ones with ``blocks_only``).

    fp16 enters only where its fastest unconstrained configuration beats the
    best fitting one without it (checkpointing or a smaller budget never make
    it faster).
    """
    for c in worth_timing(g, budget, headroom, blocks_only=blocks_only):
        grid_speed(case, g, c)
    best = max((g["speeds"][c] for c in worth_timing(g, budget, headroom, blocks_only=blocks_only)), default=0.0)
    none = (NONE,) * len(g["blocks"])
    if "fp16" in case.grid_precisions and "fp16" not in g["memory"]:
        ceiling = max(grid_speed(case, g, ("fp16", m, none, False)) for m in g["sizes"])
        if ceiling >= best:
            add_precision(case, g, "fp16")
    ranked = sorted(worth_timing(g, budget, headroom, blocks_only=blocks_only), key=lambda c: -grid_speed(case, g, c))
    # The leaders are checked with the cpu meter itself.
    confirmed = []
    for c in ranked:
        if fits_for_real(case, g, c, budget, headroom):
            confirmed.append(c)
        if len(confirmed) == 3:
            break
    return confirmed


def unconstrained(case: Case, g: dict) -> list[tuple]:
    """The three fastest configurations with no budget (every precision and micro-batch, no checkpointing and no
    step in backward: plain training), by screening; re-timed beside the plan, the fastest of them is the
    unconstrained speed."""
    none = (NONE,) * len(g["blocks"])
    plain = [(p, m, none, False) for p in ("fp32", "bf16") for m in g["sizes"]]
    return sorted(plain, key=lambda c: -grid_speed(case, g, c))[:3]


def hand_choice(case: Case, g: dict, budget: int, headroom: int, *, checkpoint_all: bool):
    modes = (FULL if checkpoint_all else NONE,) * len(g["blocks"])
    for m in g["sizes"]:  # largest first
        config = ("fp32", m, modes, False)
        if g["peaks"][config] + headroom <= budget and fits_for_real(case, g, config, budget, headroom):
            return config
    return None


def side_by_side(case: Case, g: dict, configs: list[tuple], rounds: int = 8) -> dict:
    """Samples/s of each config: the fastest of ``rounds`` interleaved steps, each config's model built once and
    warmed up first (``StepTimer``), timed as the planner times them (``step_clock``).

    Other work only ever slows a step down, and by CPU time (one thread) hardly at all: rebuilt for each of 3
    wall-clock rounds, two LM configurations that time 1.6% apart alone came out 1.29x apart here.
    """
    clock = step_clock("cpu", torch.get_num_threads())
    timers = {c: StepTimer(case.spec, training_config(case, g, c), device="cpu", clock=clock) for c in configs}
    try:
        seconds = {c: [] for c in configs}
        for _ in range(rounds):
            for c, timer in timers.items():
                seconds[c].append(timer.step_seconds())
        return {c: case.global_batch_size / min(v) for c, v in seconds.items()}
    finally:
        for timer in timers.values():
            timer.close()


def head_to_head(case: Case, g: dict, mine: tuple, other: tuple, *, builds: int = 3, rounds: int = 8) -> list[float]:
    """The plan's speed over another configuration's, once per fresh build of the two (``side_by_side`` of just
    these two, the one timed first in each round alternating between builds).

    Among a dozen contenders, the wide LM's bf16 m=2 --S- bwd came out 1.09x faster than --F- bwd; timed as a pair
    (by CPU time, 8 rounds) it was 1.5-2.5% slower in each of three builds.
    """
    ratios = []
    for build in range(builds):
        pair = [mine, other] if build % 2 == 0 else [other, mine]
        speeds = side_by_side(case, g, pair, rounds=rounds)
        ratios.append(speeds[mine] / speeds[other])
    return ratios


# -- the run ----------------------------------------------------------------------------------------
def run_case(key: str, case: Case, *, budgets: int, fractions: list[float], log) -> tuple[list[dict], dict]:
    spec, G = case.spec, case.global_batch_size
    log(f"{case.name}, global batch {G}")
    try:
        make_plan(spec, PlanRequest(budget=1, batch_size=G))
    except InfeasibleBudget as error:
        floor = error.floor_bytes
    g = grid(case, log)
    none = (NONE,) * len(g["blocks"])
    top_peak = max(g["peaks"][p, g["sizes"][0], none, False] for p in ("fp32", "bf16"))
    top = math.ceil(top_peak / 0.98) + 1
    fastest = unconstrained(case, g)
    plain_peak = measure_real_peak(case, g, ("fp32", G, none, False))
    state_bytes = 16 * sum(p.numel() for p in spec.build_model().parameters() if p.requires_grad)
    log(f"  floor {format_bytes(floor)}, fp32 plain peak {format_bytes(plain_peak)}, parameters + gradients + AdamW state "
        f"{format_bytes(state_bytes)}; the fastest with no budget (screened) {', '.join(describe(g, c) for c in fastest)}")
    wanted = [(int(floor + (top - floor) * i / max(budgets - 1, 1)), None) for i in range(budgets)]
    wanted += [(int(fraction * plain_peak), f"{fraction}x") for fraction in fractions]
    wanted += [(int(fraction * state_bytes), f"{fraction}x state") for fraction in case.state_fractions]
    rows = []
    for budget, label in wanted:
        rows.append({**budget_row(key, case, g, budget, fastest=fastest, log=log, label=label), "label": label})
    return rows, g


def budget_row(key: str, case: Case, g: dict, budget: int, *, fastest: list[tuple], log, label: str | None) -> dict:
    """Plan at one budget, and time the plan beside the grid's best points and the hand choices."""
    spec, G = case.spec, case.global_batch_size
    where = f"{format_bytes(budget):>11}" + (f" ({label})" if label else "")
    start = time.perf_counter()
    try:
        plan = make_plan(spec, PlanRequest(budget=budget, batch_size=G))
    except InfeasibleBudget as error:  # below the floor, the levers included
        plan_seconds = time.perf_counter() - start
        headroom = sum(v for k, v in error.breakdown.items() if k.startswith("headroom"))
        ranked = best_of_grid(case, g, budget, headroom)
        if not ranked:
            log(f"  {where}: refused (floor {format_bytes(error.floor_bytes)}), and no grid point fits")
            return {"model": key, "budget": budget, "below_floor": True, "floor": error.floor_bytes}
        # The planner refused a budget the grid fits: a miss, scored 0.
        with_in_backward = best_fitting(case, g, budget, headroom, lambda c: c[3])
        measured = side_by_side(case, g, list(dict.fromkeys([*ranked[:3], *fastest, *(c for c in (with_in_backward,) if c)])))
        best_grid = max(ranked[:3], key=lambda c: measured[c])
        log(f"  {where}: REFUSED (floor {format_bytes(error.floor_bytes)}) but the grid fits "
            f"{describe(g, best_grid)} at {measured[best_grid]:.1f} samples/s, "
            f"{measured[best_grid] / max(measured[c] for c in fastest):.2f}x unconstrained; planned in {plan_seconds:.1f} s")
        return {
            "model": key, "budget": budget, "below_floor": False, "refused": True, "floor": error.floor_bytes, "plan": None,
            "grid_best": best_grid, "grid_speed": measured[best_grid], "vs_grid": 0.0,
            "grid_vs_unconstrained": measured[best_grid] / max(measured[c] for c in fastest),
            "in_backward_best": with_in_backward, "partial": not case.full_grid, "plan_seconds": plan_seconds, "violation": False,
        }
    plan_seconds = time.perf_counter() - start
    headroom = sum(plan.headroom.values())
    again = probe(
        spec, micro_batch_size=plan.config.micro_batch_size, global_batch_size=G, precision=plan.config.precision, checkpoint=plan.config.checkpoint,
        selective_checkpoint=plan.config.selective_checkpoint, optimizer_in_backward=plan.config.optimizer_in_backward, steps=2,
    )
    violation = again.peak_bytes + headroom > budget
    mine = (plan.config.precision, plan.config.micro_batch_size, tuple(
        FULL if b in plan.config.checkpoint else SELECTIVE if b in plan.config.selective_checkpoint else NONE for b in g["blocks"]
    ), plan.config.optimizer_in_backward)
    ranked = best_of_grid(case, g, budget, headroom)
    blocks = best_of_grid(case, g, budget, headroom, blocks_only=True)
    with_selective = best_fitting(case, g, budget, headroom, lambda c: SELECTIVE in c[2])
    with_in_backward = best_fitting(case, g, budget, headroom, lambda c: c[3])
    all_ckpt = hand_choice(case, g, budget, headroom, checkpoint_all=True)
    no_ckpt = hand_choice(case, g, budget, headroom, checkpoint_all=False)
    contenders = list(dict.fromkeys(
        [mine, *ranked[:3], *blocks[:3], *fastest, *(c for c in (with_selective, with_in_backward, all_ckpt, no_ckpt) if c)]
    ))
    measured = side_by_side(case, g, contenders)
    best_grid = max(ranked[:3], key=lambda c: measured[c]) if ranked else None
    best_blocks = max(blocks[:3], key=lambda c: measured[c]) if blocks else None
    # The ratio the target is about, timed as a pair: among many contenders a few percent either way is noise.
    pair = head_to_head(case, g, mine, best_grid) if best_grid is not None and best_grid != mine else [1.0]

    def over_plan(config) -> float | None:
        return measured[config] / measured[mine] if config else None

    row = {
        "model": key, "budget": budget, "plan": mine, "plan_speed": measured[mine], "refused": False,
        "grid_best": best_grid, "block_best": best_blocks,
        "vs_grid": statistics.median(pair) if best_grid else float("nan"),
        "vs_blocks": measured[mine] / measured[best_blocks] if best_blocks else None,
        "selective_best": with_selective, "selective_vs_plan": over_plan(with_selective),
        "in_backward_best": with_in_backward, "in_backward_vs_plan": over_plan(with_in_backward),
        "vs_unconstrained": measured[mine] / max(measured[c] for c in fastest),
        "vs_all": measured[mine] / measured[all_ckpt] if all_ckpt else None,
        "vs_none": measured[mine] / measured[no_ckpt] if no_ckpt else None,
        "violation": violation, "plan_seconds": plan_seconds, "partial": not case.full_grid, "below_floor": False,
    }
    log(f"  {where}: {describe(g, mine)} {measured[mine]:.1f} samples/s; "
        f"grid best {describe(g, best_grid)}; block-only best {describe(g, best_blocks)}; vs grid {row['vs_grid']:.3f} "
        f"(as a pair, per build: {', '.join(f'{r:.3f}' for r in pair)}; among all: {measured[mine] / measured[best_grid] if best_grid else float('nan'):.3f}), "
        f"vs block-only {fmt(row['vs_blocks'])}, "
        + (f"best with selective {describe(g, with_selective)} at {row['selective_vs_plan']:.2f}x the plan, " if with_selective
           else "no fitting selective point worth timing, ")
        + (f"best with the step in backward {describe(g, with_in_backward)} at {row['in_backward_vs_plan']:.2f}x the plan, "
           if with_in_backward else "no fitting step-in-backward point worth timing, ")
        + f"vs unconstrained {row['vs_unconstrained']:.2f}, vs ckpt-all {fmt(row['vs_all'])}, "
        f"vs no-ckpt {fmt(row['vs_none'])}; violation {violation}; planned in {plan_seconds:.1f} s")
    return row


def best_fitting(case: Case, g: dict, budget: int, headroom: int, wanted) -> tuple | None:
    """The fastest point worth timing that is ``wanted`` and fits by the cpu meter (by the screening's speeds)."""
    return max(
        (c for c in worth_timing(g, budget, headroom) if wanted(c) and fits_for_real(case, g, c, budget, headroom)),
        key=lambda c: grid_speed(case, g, c), default=None,
    )


def describe(g: dict, config) -> str:
    """"bf16 m=4 FS-- bwd": precision, micro-batch, each block's mode in block order (F full, S selective, - none),
    and "bwd" where the optimizer steps in backward."""
    if config is None:
        return "-"
    precision, m, modes, in_backward = config
    letters = "".join({NONE: "-", SELECTIVE: "S", FULL: "F"}[mode] for mode in modes)
    return f"{precision} m={m} {letters}{' bwd' if in_backward else ''}"


def fmt(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def table(rows: list[dict], all_cases: dict[str, Case], grids: dict[str, dict]) -> str:
    lines = [
        "| model | G | budget | plan (precision, m, block modes F/S/-, bwd: step in backward) | plan samples/s | / unconstrained "
        "| / best block-only | / grid best | best with a selective block, / plan | best with the step in backward, / plan "
        "| / ckpt-all hand | / no-ckpt hand | violation | plan s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        case, g = all_cases[r["model"]], grids[r["model"]]
        budget = format_bytes(r["budget"]) + (f" ({r['label']})" if r["label"] else "")
        start = f"| {case.name} | {case.global_batch_size} | {budget} |"
        if r["below_floor"]:
            lines.append(f"{start} refused (floor {format_bytes(r['floor'])}); no grid point fits | | | | | | | | | | |")
            continue
        grid_ratio = f"{r['vs_grid']:.3f}" + (" (partial)" if r["partial"] else "")
        if r["refused"]:
            lines.append(
                f"{start} **refused** (floor {format_bytes(r['floor'])}) | - | - | - | {grid_ratio}: grid best {describe(g, r['grid_best'])} "
                f"{r['grid_speed']:.1f} samples/s, {r['grid_vs_unconstrained']:.2f} of unconstrained | | {describe(g, r['in_backward_best'])} "
                f"| | | | {r['plan_seconds']:.1f} |"
            )
            continue
        lines.append(
            f"{start} {describe(g, r['plan'])} | {r['plan_speed']:.1f} | "
            f"{r['vs_unconstrained']:.2f} | {fmt(r['vs_blocks'])} | {grid_ratio} | "
            f"{describe(g, r['selective_best'])}, {fmt(r['selective_vs_plan'])} | "
            f"{describe(g, r['in_backward_best'])}, {fmt(r['in_backward_vs_plan'])} | {fmt(r['vs_all'])} | {fmt(r['vs_none'])} | "
            f"{'YES' if r['violation'] else 'no'} | {r['plan_seconds']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,transformer,uneven,resnet18")
    parser.add_argument("--budgets", type=int, default=5, help="budgets from the floor to the unconstrained peak (0: none)")
    parser.add_argument("--fractions", default="0.33,0.66", help="budgets as fractions of the fp32 plain peak of the global batch")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="intra-op threads; 1 keeps timings meaningful when other jobs share the cores (2 threads then stall)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # The plans share a cache across one model's budgets, as a user's would, but never the user's own.
    os.environ.setdefault("AUTOFIT_CACHE_DIR", tempfile.mkdtemp(prefix="plan-quality-cache-"))
    all_cases = cases()
    fractions = [float(f) for f in args.fractions.split(",") if f]
    rows, grids = [], {}
    started = time.perf_counter()
    for key in args.models.split(","):
        found, grids[key] = run_case(key, all_cases[key], budgets=args.budgets, fractions=fractions, log=lambda line: print(line, flush=True))
        rows += found
    print()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {time.perf_counter() - started:.0f} s in all")
    print(table(rows, all_cases, grids))
    planned = [r for r in rows if not r["below_floor"]]
    full = [r for r in planned if not r["partial"]]
    if full:
        ratios = [r["vs_grid"] for r in full]
        print(f"\nfull-grid cases: plan / grid best min {min(ratios):.3f}, median {statistics.median(ratios):.3f}; "
              f"{sum(r >= 0.95 for r in ratios)}/{len(ratios)} at >= 0.95")
    planned = [r for r in planned if not r["refused"]]
    refused = [r for r in rows if not r["below_floor"] and r["refused"]]
    print(f"budgets the planner refused where the grid fits: {len(refused)}")
    print(f"plans with selective blocks: {sum(SELECTIVE in r['plan'][2] for r in planned)} of {len(planned)}")
    print(f"plans with the step in backward: {sum(r['plan'][3] for r in planned)} of {len(planned)}")
    print(f"budget violations: {sum(r['violation'] for r in planned)} of {len(planned)} plans")
    for key in dict.fromkeys(r["model"] for r in planned):
        worst = max(r["plan_seconds"] for r in planned if r["model"] == key)
        print(f"{all_cases[key].name}: planning wall time up to {worst:.1f} s")


if __name__ == "__main__":
    main()
