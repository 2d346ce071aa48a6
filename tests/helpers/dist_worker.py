"""Training scenarios on 1 or N processes, for tests/training/test_distributed.py.

Under torchrun (``torchrun --standalone --nproc-per-node 2 tests/helpers/dist_worker.py SCENARIOS.json OUT.json``)
every rank runs each scenario in turn on one process group; rank 0 writes the
results. ``run_scenario`` without torchrun is the single-process reference
(plain model, ``BatchSplit``), built from the same model, data and seed.

A scenario is a dict: name, sharding ("none" | "ddp" | "fsdp"),
global_batch_size, micro_batch_size, steps, checkpoint ("none" | "all"),
precision, and optionally max_grad_norm (clipped before each step), save_at + save_to (a DCP save after that step),
resume_from (continue from such a save), track_memory (per-rank peak bytes).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autofit.apply import apply_config  # noqa: E402
from autofit.config import TrainingConfig  # noqa: E402
from autofit.planning.memory.per_rank import ShardAwareTracker  # noqa: E402
from autofit.distributed import cleanup, end_rank, init_distributed, is_rank0, mean_across_ranks  # noqa: E402
from autofit.training.sharded_checkpoints import (  # noqa: E402
    full_model_state_dict,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from autofit.step import train_step  # noqa: E402

IN_FEATURES, WIDTH, HIDDEN, CLASSES, DEPTH = 32, 64, 256, 10, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, WIDTH)
        return x + self.down(F.gelu(self.up(x)))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(IN_FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, IN_FEATURES) -> (B, CLASSES)
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


def global_batch(step: int, *, global_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch on every rank and in the reference run."""
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(global_batch_size, IN_FEATURES, generator=generator)
    targets = torch.randint(0, CLASSES, (global_batch_size,), generator=generator)
    return inputs, targets


def build_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def weights_digest(state: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """A few numbers per tensor: enough for allclose against another run."""
    return {name: [float(t.double().sum()), float(t.double().abs().sum()), float(t.flatten()[0])] for name, t in state.items()}


def run_scenario(scenario: dict, *, env) -> dict:
    sharding = scenario["sharding"]
    precision_name = scenario.get("precision", "fp32")
    config = TrainingConfig(
        global_batch_size=scenario["global_batch_size"], micro_batch_size=scenario["micro_batch_size"],
        precision=precision_name, checkpoint=scenario.get("checkpoint", []),
        sharding=sharding, world_size=env.world_size, max_grad_norm=scenario.get("max_grad_norm"),
    )
    # The one owner: checkpointing, then sharding, precision and the rank's batch split.
    applied = apply_config(build_model(), config, device=env.device, env=env)
    model, precision = applied.model, applied.precision
    optimizer = build_optimizer(model.parameters())
    reductions = _Reductions(model, sharding)
    first_step, losses = 0, []
    if scenario.get("resume_from"):
        extra = load_sharded_checkpoint(scenario["resume_from"], model=model, optimizer=optimizer)
        first_step, losses = extra["step"], extra["losses"]
        precision.scaler.load_state_dict(extra["scaler"])

    def step(index: int):
        inputs, targets = global_batch(index, global_batch_size=scenario["global_batch_size"])
        return train_step(applied, inputs, targets, loss_fn=F.cross_entropy, optimizer=optimizer)

    peaks = []
    for index in range(first_step, scenario["steps"]):
        if scenario.get("track_memory") and index > 0:
            # Like the cpu meter: this rank's shards and optimizer state, then everything made.
            tracker = ShardAwareTracker()
            tracker.track(model.parameters(), "parameters")
            tracker.track([v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)], "optimizer_state")
            with tracker:
                result = step(index)
            peaks.append(tracker.peak_bytes)
            del tracker
        else:
            result = step(index)
        losses.append(float(mean_across_ranks(result.loss)))
        if scenario.get("save_at") == index + 1:
            extra = {"step": index + 1, "losses": list(losses), "scaler": precision.scaler.state_dict()}
            save_sharded_checkpoint(scenario["save_to"], model=model, optimizer=optimizer, extra=extra)
    reductions.close()
    weights = weights_digest(full_model_state_dict(model))
    report = {"losses": losses, "weights": weights, "reductions_per_step": reductions.per_step(len(losses) - first_step)}
    if peaks:
        report["rank_peak_bytes"] = _gather_ints(max(peaks))
    return report


class _Reductions:
    """Counts gradient reductions: DDP through a comm hook, FSDP2 by wrapping its reduce-scatter."""

    def __init__(self, model: nn.Module, sharding: str) -> None:
        self.count = 0
        self._undo = lambda: None
        if sharding == "ddp":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def hook(state, bucket):
                self.count += 1
                return allreduce_hook(dist.group.WORLD, bucket)

            model.register_comm_hook(None, hook)
        elif sharding == "fsdp":
            from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

            original = DefaultReduceScatter.__call__

            def counted(comm, *args, **kwargs):
                self.count += 1
                return original(comm, *args, **kwargs)

            DefaultReduceScatter.__call__ = counted
            self._undo = lambda: setattr(DefaultReduceScatter, "__call__", original)

    def per_step(self, steps: int) -> float:
        return self.count / steps if steps else 0.0

    def close(self) -> None:
        self._undo()


def _gather_ints(value: int) -> list[int]:
    # A tensor, not all_gather_object: with gloo, gathering pickled objects just before
    # exit aborted a rank at interpreter shutdown about one run in eight.
    if not dist.is_initialized():
        return [value]
    values = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([value], dtype=torch.int64))
    return [int(v) for v in values]


def main() -> None:
    scenarios_path, out_path = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    env = init_distributed(device_type="cpu")
    results = {}
    for scenario in json.loads(Path(scenarios_path).read_text()):
        print(f"rank {env.rank}: {scenario['name']}", file=sys.stderr, flush=True)
        results[scenario["name"]] = run_scenario(scenario, env=env)
    if is_rank0():
        Path(out_path).write_text(json.dumps({"world_size": env.world_size, "results": results}))
    cleanup()
    end_rank(0)  # as `autofit train` ends a rank: without the interpreter's teardown, where gloo's ranks sometimes abort


if __name__ == "__main__":
    main()
