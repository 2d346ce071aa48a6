"""autofit's training loop against a minimal hand-written PyTorch loop: samples/s, side by side.

    python bench/loop_overhead.py [--steps 50] [--repeats 10] [--device cpu] [--threads N]

Both train the same model (examples/digits_cnn.py) from the same initial
weights on the same in-memory data (random images, batch 64, fp32, AdamW,
no checkpointing, one micro-batch per step, data loaded in the training
process), one epoch of ``--steps`` steps each. They run alternately,
``--repeats`` times, after one warm-up of each, so drifting load on the
machine hits both alike. Each run is timed from the outside, from the call to
its return: the autofit side includes everything it does per run (applying the
plan, per-step metrics.jsonl, TensorBoard events (at most every 0.2 s), the progress state,
memory readings, saving last.pt and best.pt at the epoch end: about 20 ms a
run for this model on the CPU, under 1% of a 50-step run).

Prints the samples/s of each side per repeat, and the median of the per-pair
ratios (autofit / hand-written; 1.0 means no overhead), by the wall clock and
by this process's CPU time (all its threads, autofit's TensorBoard thread
included). On a machine other jobs share, the CPU-time ratio is the steadier
one: time the scheduler gives to others does not count against either side.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autofit.config import TrainingConfig  # noqa: E402
from autofit.training.data import TrainData, epoch_order  # noqa: E402
from autofit.training.loop import TrainSettings, train  # noqa: E402
from autofit.plan_file import DeviceInfo, ModelInfo, Plan  # noqa: E402
from autofit.spec import load_spec, model_fingerprint  # noqa: E402

BATCH_SIZE = 64


def hand_written(model: nn.Module, dataset, *, device: str, seed: int) -> None:
    """The minimal loop a PyTorch user writes: shuffle, forward, loss, backward, step, log the loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    order = epoch_order(len(dataset), seed=seed, epoch=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH_SIZE, sampler=order)
    model.train()
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()


def autofit_loop(model: nn.Module, dataset, *, device: str, seed: int, log_dir: Path) -> None:
    plan = Plan(
        model=ModelInfo(source="examples/digits_cnn.py", fingerprint=model_fingerprint(model)),
        device=DeviceInfo(type=device), budget_bytes=2**30,
        config=TrainingConfig(global_batch_size=BATCH_SIZE, micro_batch_size=BATCH_SIZE),
    )
    train(
        model, plan=plan, data=TrainData(train=dataset, val=None), loss_fn=nn.functional.cross_entropy,
        build_optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        model_source={"source": "examples/digits_cnn.py", "input_shape": "1x32x32", "num_classes": 10},
        settings=TrainSettings(epochs=1, log_dir=log_dir, seed=seed, verbose=False),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="steps per run (one epoch)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    spec = load_spec(str(ROOT / "examples" / "digits_cnn.py"))
    generator = torch.Generator().manual_seed(0)
    samples = args.steps * BATCH_SIZE
    dataset = torch.utils.data.TensorDataset(
        torch.rand(samples, 1, 32, 32, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )
    torch.manual_seed(0)
    initial = spec.build_model().state_dict()

    def run(side: str, log_root: Path, index: int) -> tuple[float, float]:
        """(samples per wall-clock second, samples per CPU second of this process, all its threads)."""
        model = spec.build_model()
        model.load_state_dict(initial)
        model.to(args.device)
        if args.device == "cuda":
            torch.cuda.synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        if side == "autofit":
            autofit_loop(model, dataset, device=args.device, seed=0, log_dir=log_root / f"run{index}")
        else:
            hand_written(model, dataset, device=args.device, seed=0)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return samples / (time.perf_counter() - start), samples / (time.process_time() - start_cpu)

    print(f"digits_cnn 1x32x32, batch {BATCH_SIZE}, {args.steps} steps per run, fp32, {args.device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        log_root = Path(tmp)
        run("hand", log_root, -2)  # warm-ups: first-call costs (allocator, kernels, imports) hit neither side
        run("autofit", log_root, -1)
        wall_ratios, cpu_ratios = [], []
        for repeat in range(args.repeats):
            first, second = ("hand", "autofit") if repeat % 2 == 0 else ("autofit", "hand")
            speeds = {first: run(first, log_root, repeat), second: run(second, log_root, repeat)}
            wall_ratios.append(speeds["autofit"][0] / speeds["hand"][0])
            cpu_ratios.append(speeds["autofit"][1] / speeds["hand"][1])
            print(
                f"repeat {repeat + 1}: hand-written {speeds['hand'][0]:8.1f} samples/s   autofit {speeds['autofit'][0]:8.1f} samples/s"
                f"   ratio {wall_ratios[-1]:.3f}   (per CPU second: ratio {cpu_ratios[-1]:.3f})"
            )
    for name, ratios in (("wall clock", wall_ratios), ("CPU time", cpu_ratios)):
        print(f"median ratio autofit / hand-written, {name}: {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
