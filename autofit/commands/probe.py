"""`autofit probe`: measure one configuration (or list checkpoint candidates)."""
from __future__ import annotations

import typer

from autofit.cli import app
from autofit.commands.common import INPUT_SHAPE, MODEL_ARG, NUM_CLASSES, breakdown_lines, print_json
from autofit.errors import UserError
from autofit.units import format_bytes


@app.command()
def probe(
    model: str = MODEL_ARG,
    micro_batch_size: int = typer.Option(32, "--micro-batch-size", "-m", help="Samples per forward/backward."),
    grad_accum_steps: int = typer.Option(1, "--grad-accum-steps", "-k", help="Micro-batches per optimizer step."),
    precision: str = typer.Option("fp32", help="fp32, bf16 or fp16."),
    checkpoint: str = typer.Option("none", help="all, none, or block names separated by commas."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    simulate: bool = typer.Option(False, help="Measure over fake tensors: no arithmetic, no speed."),
    steps: int = typer.Option(3, help="Optimizer steps; the first is a warm-up."),
    list_blocks: bool = typer.Option(False, "--list-blocks", help="List checkpoint candidates with their costs."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    input_shape: str = INPUT_SHAPE,
    num_classes: int = NUM_CLASSES,
) -> None:
    """Run a few real optimizer steps of ONE configuration; report peak bytes and samples/s."""
    from autofit.measure.blocks import profile_blocks
    from autofit.measure.meters import device_info
    from autofit.measure.probe import probe as run_probe
    from autofit.spec import load_spec

    if device not in ("cpu", "cuda"):
        raise UserError(f"--device {device!r} is unknown; use cpu or cuda")
    if micro_batch_size < 1:
        raise UserError(f"--micro-batch-size {micro_batch_size} must be at least 1")
    if device == "cuda" and not simulate:
        device_info("cuda")  # fails with a one-line message when no GPU is visible
    spec = load_spec(model, input_shape=input_shape, num_classes=num_classes)
    if list_blocks:
        blocks = profile_blocks(spec, micro_batch_size=micro_batch_size, precision=precision, device=device, simulate=simulate)
        if as_json:
            print_json([b.to_dict() for b in blocks])
            return
        share = "FLOP share" if simulate else "time share"
        print(f"{'block':<24} {'saved activations':>18} {'input':>12} {share:>11}")
        for b in blocks:
            print(f"{b.name:<24} {format_bytes(b.saved_bytes):>18} {format_bytes(b.input_bytes):>12} {b.forward_share:>10.1%}")
        return
    result = run_probe(
        spec,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=grad_accum_steps,
        precision=precision,
        checkpoint=checkpoint,
        device=device,
        simulate=simulate,
        steps=steps,
    )
    if as_json:
        print_json(result.to_dict())
        return
    speed = "n/a (simulated)" if result.samples_per_s is None else f"{result.samples_per_s:.1f} samples/s"
    print(
        f"{spec.source}: micro-batch {result.micro_batch_size} x {result.grad_accum_steps} steps, "
        f"{result.precision}, checkpoint {len(result.checkpoint)} block(s), meter {result.meter}"
    )
    print("\n".join(breakdown_lines(result.breakdown, result.peak_bytes)))
    print(f"  speed  {speed}")
