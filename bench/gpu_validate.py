"""CUDA memory predictions against real measurements, side by side in one run.

For each model x precision x checkpointing: the simulated meter's prediction
for a GPU (fake tensors, CPU autocast rules, 512-byte blocks) against the cuda
meter's real peaks (allocated, reserved, and the whole process footprint from
NVML). With --plan BUDGET, also plans with the simulated meter for that budget
and checks the plan on the real card.

    python bench/gpu_validate.py --out results.json          # on a machine with a GPU
    python bench/gpu_validate.py --smoke                      # tiny, on the CPU: checks the script runs
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from autofit.measure.probe import probe  # noqa: E402
from autofit.spec import ModelSpec, load_spec  # noqa: E402
from bench.sized_examples import example_spec  # noqa: E402

GiB = 2**30


def transformer_spec(*, attention: str, d_model: int, n_layers: int, seq_len: int, n_heads: int) -> ModelSpec:
    return example_spec(
        "tiny_transformer.py", build=lambda module: module.TinyTransformer(attention),
        D_MODEL=d_model, N_LAYERS=n_layers, SEQ_LEN=seq_len, N_HEADS=n_heads,
    )


def cases(smoke: bool):
    if smoke:
        return [
            ("resnet18 32x32", load_spec("torchvision:resnet18", input_shape="3x32x32", num_classes=10), 4),
            ("transformer sdpa", transformer_spec(attention="sdpa", d_model=64, n_layers=2, seq_len=16, n_heads=4), 4),
        ]
    return [
        ("resnet50 224", load_spec("torchvision:resnet50"), 64),
        ("vit_b_16 224", load_spec("torchvision:vit_b_16"), 32),
        ("transformer mha d768 L12 T512", transformer_spec(attention="mha", d_model=768, n_layers=12, seq_len=512, n_heads=12), 16),
        ("transformer sdpa d768 L12 T512", transformer_spec(attention="sdpa", d_model=768, n_layers=12, seq_len=512, n_heads=12), 16),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU, to check the script itself")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        print(f"device: {props.name}, {props.total_memory / GiB:.1f} GiB, torch {torch.__version__}")
    rows = []
    header = f"{'case':<32} {'prec':<5} {'ckpt':<4} {'predicted':>9} {'allocated':>9} {'reserved':>9} {'process':>9} {'pred/alloc':>10} {'pred/proc':>9} {'sim s':>6} {'real s':>6}"
    print(header)
    for label, spec, micro_batch_size in cases(args.smoke):
        for precision in ("fp32", "bf16", "fp16"):
            for checkpoint in ("none", "all"):
                settings = dict(micro_batch_size=micro_batch_size, precision=precision, checkpoint=checkpoint, steps=3)
                start = time.perf_counter()
                predicted = probe(spec, device=device, simulate=True, **settings)
                sim_s = time.perf_counter() - start
                start = time.perf_counter()
                real = probe(spec, device=device, **settings)
                real_s = time.perf_counter() - start
                cache = real.breakdown.get("allocator_cache", 0)
                context = real.breakdown.get("context", 0)
                allocated = real.peak_bytes - cache - context
                row = dict(
                    case=label, precision=precision, checkpoint=checkpoint, micro_batch_size=micro_batch_size,
                    predicted_bytes=predicted.peak_bytes, allocated_bytes=allocated, reserved_bytes=allocated + cache,
                    process_bytes=real.peak_bytes, samples_per_s=real.samples_per_s,
                    predicted_breakdown=predicted.breakdown, measured_breakdown=real.breakdown,
                    simulate_seconds=sim_s, real_seconds=real_s,
                )
                rows.append(row)
                print(
                    f"{label:<32} {precision:<5} {checkpoint:<4} {predicted.peak_bytes / GiB:>9.2f} {allocated / GiB:>9.2f} "
                    f"{(allocated + cache) / GiB:>9.2f} {real.peak_bytes / GiB:>9.2f} {predicted.peak_bytes / allocated:>10.3f} "
                    f"{predicted.peak_bytes / real.peak_bytes:>9.3f} {sim_s:>6.1f} {real_s:>6.1f}",
                    flush=True,
                )
    ratios = [r["predicted_bytes"] / r["allocated_bytes"] for r in rows]
    print(f"\npredicted/allocated: min {min(ratios):.3f}, max {max(ratios):.3f}, over {len(rows)} cases (GiB above are 2^30 bytes)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
