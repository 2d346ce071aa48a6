"""Per-rank peak bytes of FSDP2 on 2 CPU processes (gloo): measured, simulated, and the formula.

For each case, side by side in one run:
- measured: a real rank's peak (``ShardAwareTracker`` over real tensors, torchrun, gloo),
  the highest of 3 steps after the first, for rank 0 and rank 1;
- simulated: ``simulate_fsdp_peak_bytes(backend="gloo")`` (FSDP2 run in one process on a
  fake process group over fake tensors, plus gloo's reduce-scatter copy of one unit) and
  measured / simulated;
- formula: ``estimate_fsdp_peak_bytes`` from a one-process probe, and measured / formula.

    python bench/distributed_memory.py          # launches torchrun --nproc-per-node 2 itself
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from autofit.apply import apply_config  # noqa: E402
from autofit.config import TrainingConfig  # noqa: E402
from autofit.measure.probe import probe  # noqa: E402
from autofit.planning.memory.per_rank import (  # noqa: E402
    ShardAwareTracker,
    estimate_fsdp_peak_bytes,
    fsdp_layout,
    simulate_fsdp_peak_bytes,
)
from autofit.spec import load_spec  # noqa: E402
from autofit.distributed import cleanup, init_distributed  # noqa: E402
from autofit.step import train_step  # noqa: E402

WORLD_SIZE = 2
TRANSFORMER = str(ROOT / "examples" / "tiny_transformer.py")
CASES = [
    # (label, model source, per-rank micro-batch, accumulation steps, precision, checkpoint)
    ("tiny transformer", TRANSFORMER, 8, 1, "fp32", "none"),
    ("tiny transformer, checkpointed", TRANSFORMER, 8, 1, "fp32", "all"),
    ("tiny transformer, 2 micro-batches", TRANSFORMER, 4, 2, "fp32", "none"),
    ("tiny transformer, bf16", TRANSFORMER, 8, 1, "bf16", "none"),
    ("tiny transformer, small batch", TRANSFORMER, 1, 1, "fp32", "none"),
]


def measure_rank(case) -> int:
    """This rank's highest peak over 3 steps after the first (a collective: both ranks run it)."""
    _, source, micro_batch_size, grad_accum_steps, precision, checkpoint = case
    env = init_distributed(device_type="cpu")
    spec = load_spec(source)
    torch.manual_seed(0)
    global_batch_size = micro_batch_size * grad_accum_steps * env.world_size
    config = TrainingConfig(
        global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, precision=precision,
        checkpoint=checkpoint, sharding="fsdp", world_size=env.world_size,
    )
    applied = apply_config(spec.build_model(), config, device=env.device, env=env)
    model = applied.model
    optimizer = spec.build_optimizer(model.parameters())
    torch.manual_seed(1)
    inputs, targets = spec.example_batch(global_batch_size)

    def step() -> None:
        train_step(applied, inputs, targets, loss_fn=spec.loss_fn, optimizer=optimizer)

    step()
    peaks = []
    for _ in range(3):
        tracker = ShardAwareTracker()
        tracker.track(model.parameters(), "parameters")
        tracker.track(model.buffers(), "parameters")
        tracker.track([v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)], "optimizer_state")
        with tracker:
            step()
        peaks.append(tracker.peak_bytes)
    return max(peaks)


def worker(out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    env = init_distributed(device_type="cpu")
    rows = []
    for case in CASES:
        peak = measure_rank(case)
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(env.world_size)]
        dist.all_gather(gathered, torch.tensor([peak], dtype=torch.int64))
        rows.append([int(t) for t in gathered])
    if env.rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    cleanup()


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        out_path = Path(folder) / "measured.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}", __file__, "--worker", str(out_path)]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        measured = json.loads(out_path.read_text())
    print(f"{'case':36} {'measured rank0/rank1':>22} {'simulated':>10} {'meas/sim':>9} {'formula':>10} {'meas/formula':>13}")
    for case, ranks in zip(CASES, measured):
        label, source, micro_batch_size, grad_accum_steps, precision, checkpoint = case
        spec = load_spec(source)
        simulated = simulate_fsdp_peak_bytes(
            spec, world_size=WORLD_SIZE, micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps,
            precision=precision, checkpoint=[] if checkpoint == "none" else _all_blocks(spec), backend="gloo",
        ).peak_bytes
        one = probe(spec, micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps, precision=precision, checkpoint=checkpoint, simulate=True)
        model = spec.build_model()
        parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        b = one.breakdown
        formula = estimate_fsdp_peak_bytes(
            parameter_bytes=parameter_bytes, gradient_bytes=parameter_bytes, optimizer_state_bytes=b["optimizer_state"],
            activation_bytes=one.peak_bytes - b["parameters"] - b["gradients"] - b["optimizer_state"],
            layout=fsdp_layout(model, world_size=WORLD_SIZE), world_size=WORLD_SIZE, precision=precision,
            grad_accum_steps=grad_accum_steps,
        ).peak_bytes
        ratios = "/".join(f"{r / simulated:.3f}" for r in ranks)
        formula_ratios = "/".join(f"{r / formula:.3f}" for r in ranks)
        print(f"{label:36} {ranks[0]:>10} {ranks[1]:>11} {simulated:>10} {ratios:>9} {formula:>10} {formula_ratios:>13}")


def _all_blocks(spec) -> list[str]:
    from strategies import checkpoint_candidates

    return checkpoint_candidates(spec.build_model())


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
