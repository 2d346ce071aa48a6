"""Simulated meter against the cpu-tracked meter, side by side in one run.

For each model: peak bytes simulated / cpu-tracked (target 1.00 within 1%),
and the simulated probe's wall time / the real probe's wall time.

    python bench/meters.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autofit.measure.probe import probe  # noqa: E402
from autofit.spec import load_spec  # noqa: E402
from autofit.units import format_bytes  # noqa: E402

CASES = [
    # (label, source, input shape, micro-batch, precision, checkpoint)
    ("resnet18 64x64", "torchvision:resnet18", "3x64x64", 16, "fp32", "none"),
    ("resnet18 64x64 bf16+ckpt", "torchvision:resnet18", "3x64x64", 16, "bf16", "all"),
    ("resnet50 64x64", "torchvision:resnet50", "3x64x64", 8, "fp32", "none"),
    ("mobilenet_v3_small 64x64", "torchvision:mobilenet_v3_small", "3x64x64", 16, "fp32", "none"),
    ("tiny transformer (MHA)", str(ROOT / "examples/tiny_transformer.py"), None, 16, "fp32", "none"),
    ("tiny transformer (MHA) bf16+ckpt", str(ROOT / "examples/tiny_transformer.py"), None, 16, "bf16", "all"),
    ("resnet50 224x224", "torchvision:resnet50", "3x224x224", 16, "fp32", "none"),
]


def timed(**kwargs):
    start = time.perf_counter()
    result = probe(**kwargs)
    return result, time.perf_counter() - start


def main() -> None:
    # One throwaway probe of each meter first: one-time start-up costs stay out of the table.
    warm = load_spec("torchvision:resnet18", input_shape="3x32x32", num_classes=10)
    timed(spec=warm, micro_batch_size=2, steps=1)
    timed(spec=warm, micro_batch_size=2, steps=1, simulate=True)
    print(f"{'case':<34} {'cpu-tracked':>12} {'simulated':>12} {'bytes ratio':>11} {'real s':>7} {'sim s':>7} {'time ratio':>10}")
    for label, source, shape, micro_batch_size, precision, checkpoint in CASES:
        spec = load_spec(source, input_shape=shape or "3x224x224", num_classes=10)
        settings = dict(spec=spec, micro_batch_size=micro_batch_size, precision=precision, checkpoint=checkpoint, steps=3)
        real, real_s = timed(**settings)
        simulated, sim_s = timed(simulate=True, **settings)
        print(
            f"{label:<34} {format_bytes(real.peak_bytes):>12} {format_bytes(simulated.peak_bytes):>12} "
            f"{simulated.peak_bytes / real.peak_bytes:>11.4f} {real_s:>7.2f} {sim_s:>7.2f} {sim_s / real_s:>10.2f}"
        )
    big = load_spec("torchvision:resnet50")
    _, sim_s = timed(spec=big, micro_batch_size=64, simulate=True, steps=3)
    print(f"\nresnet50 224x224 micro-batch 64, simulated (3 steps): {sim_s:.1f} s")


if __name__ == "__main__":
    main()
