"""`autofit probe`: measure one configuration, re-measure a plan, or list checkpoint candidates."""
from __future__ import annotations

from pathlib import Path

import typer

from autofit.cli import app
from autofit.commands.common import INPUT_SHAPE, NUM_CLASSES, breakdown_lines, print_json
from autofit.errors import UserError
from autofit.units import format_bytes


@app.command()
def probe(
    model: str | None = typer.Argument(
        None, help="A model file defining build_model() and example_batch(n), or torchvision:NAME (with --plan: the plan's by default)."
    ),
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
    plan: Path | None = typer.Option(None, "--plan", help="Re-measure exactly the configuration this plan.json names."),
) -> None:
    """Run a few real optimizer steps of ONE configuration; report peak bytes and samples/s."""
    from autofit.measure.blocks import profile_blocks
    from autofit.measure.meters import check_device
    from autofit.measure.probe import probe as run_probe
    from autofit.spec import load_spec

    if plan is not None:
        _probe_plan(plan, model=model, steps=steps, as_json=as_json, configured={
            "--micro-batch-size": micro_batch_size != 32, "--grad-accum-steps": grad_accum_steps != 1,
            "--precision": precision != "fp32", "--checkpoint": checkpoint != "none", "--device": device != "cpu",
            "--simulate": simulate, "--list-blocks": list_blocks,
        })
        return
    if model is None:
        raise UserError("probe needs a MODEL (a model file or torchvision:NAME), or --plan plan.json to re-measure a plan")
    check_device(device, precision=precision, simulate=simulate)
    if micro_batch_size < 1:
        raise UserError(f"--micro-batch-size {micro_batch_size} must be at least 1")
    spec = load_spec(model, input_shape=input_shape, num_classes=num_classes)
    if simulate:
        from autofit.planning.memory_model import simulation_spec

        # As the planner does: a model whose build the simulated meter cannot fake (ViT's) is copied from meta.
        spec = simulation_spec(spec)
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
    _print_result(spec.source, result)


def _probe_plan(path: Path, *, model: str | None, steps: int, as_json: bool, configured: dict[str, bool]) -> None:
    """Measure what a plan names, through the same strategy owner as training, and set it beside the plan's figures."""
    from autofit.measure.probe import probe_plan
    from autofit.plan_file import load_plan
    from autofit.spec import spec_for_plan

    given = [flag for flag, set_ in configured.items() if set_]
    if given:
        raise UserError(f"--plan re-measures the plan's own configuration; drop {', '.join(given)} (or drop --plan)")
    the_plan = load_plan(path)
    spec = spec_for_plan(the_plan.model, model_file=model)
    if the_plan.estimated:
        from autofit.planning.memory_model import simulation_spec

        spec = simulation_spec(spec)
    result = probe_plan(spec, the_plan, steps=steps)
    planned = {
        "budget_bytes": the_plan.budget_bytes,
        "measured_peak_bytes": the_plan.measured.peak_bytes if the_plan.measured else None,
        "predicted_peak_bytes": the_plan.predicted.peak_bytes if the_plan.predicted else None,
    }
    if as_json:
        print_json({**result.to_dict(), "plan": planned})
        return
    _print_result(spec.source, result)
    measured_then = planned["measured_peak_bytes"]
    then = f"{format_bytes(measured_then)} when planned" if measured_then else "not measured when planned"
    print(f"  plan   {str(path)}: peak {then}; budget {format_bytes(the_plan.budget_bytes)}")


def _print_result(source: str, result) -> None:
    speed = "n/a (simulated)" if result.samples_per_s is None else f"{result.samples_per_s:.1f} samples/s"
    print(
        f"{source}: micro-batch {result.micro_batch_size} x {result.grad_accum_steps} steps, "
        f"{result.precision}, checkpoint {len(result.checkpoint)} block(s), meter {result.meter}"
    )
    print("\n".join(breakdown_lines(result.breakdown, result.peak_bytes)))
    print(f"  speed  {speed}")
