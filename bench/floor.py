"""The floor with and without the memory levers, for a 24 GiB GPU planned here (simulated).

For ResNet-50 at 224x224 (batch 64), ViT-B/16 at 224x224 (batch 32) and a
0.94B-parameter decoder LM (d 2048, 16 layers, vocabulary 32k, 512 tokens,
batch 8; plain PyTorch, built from its sizes on fake tensors: nothing is
downloaded), planned with ``--simulate --device cuda --device-memory 24GiB``,
this prints the floor (the smallest budget anything trains in, headroom
included):

- without the levers: the floor configuration (the smallest micro-batch,
  every block checkpointed or none), as ``check_floor`` measures it;
- with the levers below the floor (``planning/levers.py``: the step in
  backward, activation offload, optimizer state on the host), without lossy
  optimizer state;
- and with 8-bit AdamW state allowed as well (``--allow-lossy-optimizer``),

each as a ratio of the fp32 parameters + gradients + AdamW state (16 bytes per
trainable parameter). The numbers are the planner's: a plan at a budget far
below every floor fails with ``BelowLeverFloor``, which holds the floor and
the least budget each lever candidate was measured to need; then the planner
is asked again at each floor found (it must plan, with those levers, or
without any at the plain floor) and at 0.999 of each lever floor (it must
refuse). Where 8-bit state does not lower the lossless lever floor, the
planner would try the same candidates in the same order, so that floor is not
planned again. Whatever headroom the planner uses (``planning/headroom.py``)
is in the figures.

    python bench/floor.py                        # all three models (about 10 minutes on 2 cores)
    python bench/floor.py --models decoder
    python bench/floor.py --no-checks            # the floors only (about 5 minutes)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autofit.planning.verify.floor import InfeasibleBudget  # noqa: E402
from autofit.planning.verify.below_floor import BelowLeverFloor  # noqa: E402
from autofit.planning.planner import plan_with_report  # noqa: E402
from autofit.planning.request import PlanRequest  # noqa: E402
from autofit.spec import ModelSpec, default_optimizer, load_spec  # noqa: E402
from autofit.units import format_bytes  # noqa: E402

DEVICE_MEMORY = "24GiB"
FAR_BELOW = 2**20
"""A budget below every floor: the planner measures the floor and every lever candidate, and refuses."""
REFUSED_AT = 0.999
"""Each lever floor is checked to be refused at this fraction of it."""

# The decoder's sizes (the "0.94B decoder").
VOCAB, SEQ_LEN, DIM, LAYERS, HEADS = 32_000, 512, 2048, 16, 16


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, C/H)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """A pre-norm GPT-style decoder: learned positions, untied output layer (0.94B parameters at the sizes above)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(1, SEQ_LEN, DIM))
        self.layers = nn.ModuleList(Block(DIM, HEADS) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def decoder_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (n, SEQ_LEN + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def decoder_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # (B, T, V), (B, T)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def decoder_spec() -> ModelSpec:
    return ModelSpec(
        source=str(Path(__file__).resolve()), build_model=Decoder, example_batch=decoder_batch, loss_fn=decoder_loss,
        build_optimizer=default_optimizer,
    )


def torchvision_spec(name: str) -> ModelSpec:
    # Without source_options: on a branch without memory-rest's a50d94a, plan writing gets num_classes twice from them.
    return dataclasses.replace(load_spec(f"torchvision:{name}"), source_options={})


MODELS = {
    "resnet50": ("ResNet-50 224x224", lambda: torchvision_spec("resnet50"), 64),
    "vit_b_16": ("ViT-B/16 224x224", lambda: torchvision_spec("vit_b_16"), 32),
    "decoder": (f"decoder d{DIM} L{LAYERS} V{VOCAB // 1000}k T{SEQ_LEN}", decoder_spec, 8),
}


@dataclass
class Row:
    name: str
    batch: int
    parameters: int
    state_bytes: int
    floor: int
    floor_config: str
    lever_floor: int | None
    levers: str
    lossy_floor: int | None
    lossy_levers: str
    checks: list[str]
    seconds: float


def fp32_state_bytes(spec: ModelSpec) -> tuple[int, int]:
    """Trainable parameters, and their fp32 bytes with gradients and AdamW's two moments (16 bytes each)."""
    with torch.device("meta"):
        count = sum(p.numel() for p in spec.build_model().parameters() if p.requires_grad)
    return count, 16 * count


def plan(spec: ModelSpec, batch: int, budget: int, *, lossy: bool):
    return plan_with_report(
        spec, PlanRequest(budget=budget, batch_size=batch, device="cuda", simulate=True, device_memory=DEVICE_MEMORY, allow_lossy_optimizer=lossy),
    ).plan


def levers_of(plan_) -> str:
    config, parts = plan_.config, []
    if config.optimizer_in_backward:
        parts.append("step in backward")
    if config.offload:
        parts.append(f"offload {len(config.offload)} block(s)")
    if config.optimizer_state != "device":
        parts.append(f"{config.optimizer_state} state")
    if config.precision == "bf16-master":
        parts.append("bf16 weights, fp32 masters and state on the host")
    if config.loss_chunks != 1:
        parts.append(f"loss in {config.loss_chunks} chunks")
    return ", ".join(parts) or "none"


def headroom_of(plan_) -> str:
    return " + ".join(f"{cause.replace('_', ' ')} {format_bytes(nbytes)}" for cause, nbytes in plan_.headroom.items())


def measure_floors(name: str, spec: ModelSpec, batch: int, *, check: bool) -> Row:
    """The floors from one refused plan; with ``check``, each confirmed by the planner (see the module docstring)."""
    started = time.perf_counter()
    parameters, state_bytes = fp32_state_bytes(spec)
    try:
        plan(spec, batch, FAR_BELOW, lossy=True)
    except BelowLeverFloor as error:
        below = error
    else:
        raise SystemExit(f"{name}: a budget of {format_bytes(FAR_BELOW)} was planned; lower FAR_BELOW")
    floor = below.floor
    config = f"m={floor.config.micro_batch_size}, {floor.config.precision}, " + (
        f"{len(floor.config.checkpoint)} blocks checkpointed" if floor.config.checkpoint else "no checkpointing"
    )
    checks = [f"{candidate.name}: needs {format_bytes(budget)}" for candidate, budget in below.lever_budgets]
    if check:
        plain = plan(spec, batch, below.floor_bytes, lossy=False)
        checks.append(
            f"planned at the floor {format_bytes(below.floor_bytes)} with levers: {levers_of(plain)}, device peak "
            f"{format_bytes(plain.measured.peak_bytes)} + headroom {headroom_of(plain)}"
        )
    found = {}
    for lossy in (False, True):
        lever_floor = below.lever_floor_bytes(allow_lossy_optimizer=lossy)
        if lever_floor is None or lever_floor >= below.floor_bytes:
            found[lossy] = (None, "none lower the floor")
            continue
        if lossy and found[False][0] == lever_floor:
            # The same least budget: the planner tries the candidates in the same order, so it plans and refuses alike.
            found[lossy] = found[False]
            continue
        if not check:
            found[lossy] = (lever_floor, next(c.name for c, b in below.lever_budgets if b == lever_floor))
            continue
        chosen = plan(spec, batch, lever_floor, lossy=lossy)
        try:
            plan(spec, batch, int(lever_floor * REFUSED_AT), lossy=lossy)
            refused = "NOT refused"
        except InfeasibleBudget:
            refused = "refused"
        checks.append(
            f"planned at {format_bytes(lever_floor)} ({'8-bit state allowed' if lossy else 'lossless'}) with levers: "
            f"{levers_of(chosen)}, device peak {format_bytes(chosen.measured.peak_bytes)} + headroom {headroom_of(chosen)}; "
            f"at {REFUSED_AT} of it: {refused}"
        )
        found[lossy] = (lever_floor, levers_of(chosen))
    return Row(
        name=name, batch=batch, parameters=parameters, state_bytes=state_bytes, floor=below.floor_bytes, floor_config=config,
        lever_floor=found[False][0], levers=found[False][1], lossy_floor=found[True][0], lossy_levers=found[True][1],
        checks=checks, seconds=time.perf_counter() - started,
    )


def ratio(value: int | None, row: Row) -> str:
    return "-" if value is None else f"{format_bytes(value)} = {value / row.state_bytes:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--no-checks", action="store_true", help="the floors from one refused plan per model, not re-planned")
    args = parser.parse_args()
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"bench/floor.py: unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    # A fresh cache: every figure is measured in this run (the runs of one model share its traces).
    os.environ["AUTOFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="autofit-floor-")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; --simulate --device cuda --device-memory {DEVICE_MEMORY}")
    rows = []
    for name in names:
        title, make_spec, batch = MODELS[name]
        row = measure_floors(title, make_spec(), batch, check=not args.no_checks)
        rows.append(row)
        print(f"\n{title}, batch {batch}: {row.parameters / 1e6:.1f}M parameters; fp32 parameters + gradients + AdamW "
              f"{format_bytes(row.state_bytes)}; floor {format_bytes(row.floor)}, configuration {row.floor_config} ({row.seconds:.0f} s)")
        for check in row.checks:
            print(f"  {check}")
    print()
    print("| model | batch | fp32 params+grads+AdamW | floor, no levers | with the levers (lossless) | levers | with 8-bit state allowed | levers |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row.name} | {row.batch} | {format_bytes(row.state_bytes)} | {ratio(row.floor, row)} | {ratio(row.lever_floor, row)} | "
            f"{row.levers} | {ratio(row.lossy_floor, row)} | {row.lossy_levers} |"
        )


if __name__ == "__main__":
    main()
