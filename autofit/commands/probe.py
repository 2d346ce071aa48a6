"""`autofit probe`: measure one configuration, re-measure a plan, or list checkpoint candidates."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import typer

from autofit.cli import app
from autofit.commands.common import INPUT_SHAPE, LORA, NUM_CLASSES, SEQ_LEN, TASK, load_model_spec, breakdown_lines, one_of, print_json
from autofit.config import DeviceChoice, OptimizerStateChoice, PrecisionChoice
from autofit.errors import UserError
from autofit.progress import Progress, as_progress, print_progress
from autofit.units import format_bytes


# The options whose help runs over a line, named here so that the command's signature reads as its list of flags.
PROBE_MODEL_ARG = typer.Argument(
    None, help="A model file defining build_model() and example_batch(n), torchvision:NAME, timm:NAME or hf:DIR (a transformers "
    "config); with --plan: the plan's by default."
)
PRECISION_OPTION = typer.Option(
    "fp32", help=f"{one_of(PrecisionChoice)}: autocast (bf16, fp16), or the weights in bf16 with an fp32 master on the "
    "host (bf16-master) or none (bf16-pure, lossy).",
)
SELECTIVE_CHECKPOINT_OPTION = typer.Option(
    "none", "--selective-checkpoint", help="Blocks that keep matmul/conv/attention outputs and recompute the rest: all, none, or names."
)
OPTIMIZER_IN_BACKWARD_OPTION = typer.Option(
    False, "--optimizer-in-backward", help="Step each parameter as soon as its gradient is ready (needs -k 1, not fp16)."
)
OPTIMIZER_STATE_OPTION = typer.Option(
    "device", "--optimizer-state", help=f"{one_of(OptimizerStateChoice)} (host: a GPU lever; 8bit: torchao, lossy).",
)
LOSS_CHUNKS_OPTION = typer.Option(
    1, "--loss-chunks", help="A causal LM's output layer and loss in this many chunks, recomputed in backward (1: whole)."
)
NF4_BASE_OPTION = typer.Option(
    False, "--nf4-base", help="Frozen linear weights (a --lora base) in 4-bit NF4 (torchao; QLoRA; lossy, what plan's --allow-lossy-base may choose).",
)
DEVICE_KIND_OPTION = typer.Option(
    None, "--device-kind",
    help='The GPU that is not here (with --simulate --device cuda), e.g. "RTX 4090": whether the peak with the headroom a plan keeps fits its memory.',
)
DEVICE_MEMORY_OPTION = typer.Option(
    None, "--device-memory", help='That GPU\'s memory (with --simulate --device cuda), e.g. "24GiB" (default: --device-kind\'s).',
)


@app.command()
def probe(
    model: str | None = PROBE_MODEL_ARG,
    micro_batch_size: int = typer.Option(32, "--micro-batch-size", "-m", help="Samples per forward/backward."),
    grad_accum_steps: int = typer.Option(1, "--grad-accum-steps", "-k", help="Micro-batches per optimizer step."),
    precision: str = PRECISION_OPTION,
    checkpoint: str = typer.Option("none", help="all, none, or block names separated by commas."),
    selective_checkpoint: str = SELECTIVE_CHECKPOINT_OPTION,
    offload: str = typer.Option("none", "--offload", help="Blocks whose saved activations wait in host memory: all, none, or names."),
    optimizer_in_backward: bool = OPTIMIZER_IN_BACKWARD_OPTION,
    optimizer_state: str = OPTIMIZER_STATE_OPTION,
    loss_chunks: int = LOSS_CHUNKS_OPTION,
    nf4_base: bool = NF4_BASE_OPTION,
    compile_: bool = typer.Option(False, "--compile", help="torch.compile the model (measured on the device; not with --simulate)."),
    max_grad_norm: float | None = typer.Option(None, "--max-grad-norm", help="Clip the gradients' global norm to this, as training will."),
    device: str = typer.Option("cpu", help=f"{one_of(DeviceChoice)}."),
    simulate: bool = typer.Option(False, help="Measure over fake tensors: no arithmetic, no speed."),
    device_kind: str | None = DEVICE_KIND_OPTION,
    device_memory: str | None = DEVICE_MEMORY_OPTION,
    steps: int = typer.Option(3, help="Optimizer steps; the first is a warm-up."),
    list_blocks: bool = typer.Option(False, "--list-blocks", help="List checkpoint candidates with their costs."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines (on stderr: a line when a step runs for 10 s)."),
    input_shape: str = INPUT_SHAPE,
    num_classes: int | None = NUM_CLASSES,
    task: str | None = TASK,
    seq_len: int | None = SEQ_LEN,
    lora: str | None = LORA,
    plan: Path | None = typer.Option(None, "--plan", help="Re-measure exactly the configuration this plan.json names."),
) -> None:
    """Run a few real optimizer steps of ONE configuration; report peak bytes and samples/s."""
    from autofit.measure.blocks import profile_blocks
    from autofit.device import check_device
    from autofit.measure.probe import probe as run_probe

    # A simulated probe of a large model can run for minutes: a line whenever none came for a while.
    progress = as_progress(None if quiet else print_progress, started_s=time.perf_counter())
    if plan is not None:
        # Flags that name a configuration, which the plan names instead: each given one is refused.
        configured = {
            "--micro-batch-size": micro_batch_size != 32, "--grad-accum-steps": grad_accum_steps != 1,
            "--precision": precision != "fp32", "--checkpoint": checkpoint != "none", "--device": device != "cpu",
            "--selective-checkpoint": selective_checkpoint != "none", "--offload": offload != "none",
            "--optimizer-in-backward": optimizer_in_backward, "--optimizer-state": optimizer_state != "device",
            "--loss-chunks": loss_chunks != 1, "--simulate": simulate, "--list-blocks": list_blocks,
            "--lora": lora is not None, "--nf4-base": nf4_base, "--compile": compile_, "--max-grad-norm": max_grad_norm is not None,
            "--device-kind": device_kind is not None, "--device-memory": device_memory is not None,
        }
        with progress.beating():
            _probe_plan(plan, model=model, steps=steps, as_json=as_json, progress=progress, configured=configured)
        return
    if model is None:
        raise UserError("probe needs a MODEL (a model file, torchvision:NAME, timm:NAME or hf:DIR), or --plan plan.json to re-measure a plan")
    check_device(device, precision=precision, simulate=simulate)
    if micro_batch_size < 1:
        raise UserError(f"--micro-batch-size {micro_batch_size} must be at least 1")
    card = simulated_card(device_kind, device_memory, device=device, simulate=simulate)
    if nf4_base and lora is None and not model.endswith(".py"):  # a model file may freeze its own weights
        raise UserError(f"--nf4-base holds a frozen base in NF4, and {model} trains every weight; add --lora r=8 (or drop --nf4-base)")
    with progress.beating():
        with progress.doing("loading the model"):
            spec = load_model_spec(model, input_shape=input_shape, num_classes=num_classes, task=task, seq_len=seq_len, lora=lora)
        with progress.doing("checking that the model trains (one step)"):
            spec = _checked(spec, micro_batch_size=micro_batch_size, device=device, simulate=simulate)
        if list_blocks:
            with progress.doing("profiling each block"):
                blocks = profile_blocks(spec, micro_batch_size=micro_batch_size, precision=precision, device=device, simulate=simulate)
            _print_blocks(blocks, simulate=simulate, as_json=as_json)
            return
        measuring = progress.doing(f"probing {precision} at micro-batch {micro_batch_size} x {grad_accum_steps}")
        with measuring, _out_of_memory_as_one_line(f"-m {micro_batch_size}", device=device):
            result = run_probe(
                spec, micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps, precision=precision, checkpoint=checkpoint,
                selective_checkpoint=selective_checkpoint, offload=offload, optimizer_in_backward=optimizer_in_backward,
                optimizer_state=optimizer_state, loss_chunks=loss_chunks, frozen_nf4=nf4_base, compile=compile_,
                max_grad_norm=max_grad_norm, device=device, simulate=simulate, steps=steps, progress=progress,
            )
    _print_probe(spec.source, result, card=card, as_json=as_json)


def _print_blocks(blocks: list, *, simulate: bool, as_json: bool) -> None:
    """``--list-blocks``: each checkpoint candidate's saved activations, input and share of the forward."""
    if as_json:
        print_json([b.to_dict() for b in blocks])
        return
    share = "FLOP share" if simulate else "time share"
    width = max([24, *(len(b.name) for b in blocks)])  # a shared layer's calls: "albert.encoder.albert_layer_groups.0#3"
    print(f"{'block':<{width}} {'saved activations':>18} {'input':>12} {share:>11}")
    for b in blocks:
        print(f"{b.name:<{width}} {format_bytes(b.saved_bytes):>18} {format_bytes(b.input_bytes):>12} {b.forward_share:>10.1%}")


def _print_probe(source: str, result, *, card: SimulatedCard | None, as_json: bool) -> None:
    """One configuration's measurement, and with ``--device-kind`` whether it fits that card."""
    fit = card.fit(result) if card is not None else None
    if as_json:
        print_json({**result.to_dict(), **({"card": fit} if fit else {})})
        return
    _print_result(source, result)
    if fit:
        print(card_line(fit))


@dataclass(frozen=True, kw_only=True, slots=True)
class SimulatedCard:
    """A GPU that is not here (``--device-kind``, ``--device-memory``): its memory, and the headroom a plan for it keeps."""

    name: str
    total_bytes: int

    def fit(self, result) -> dict:
        """Whether ``result``'s simulated peak, with the headroom a plan for this card keeps beyond it (context, allocator
        reserve with expandable segments as a GPU plan's default, fragmentation, safety margin: ``Headroom``), fits
        the card's memory."""
        from autofit.planning.memory.headroom import Headroom, persistent_bytes

        headroom = Headroom.estimated_cuda(self.total_bytes, expandable_segments=True)
        causes = headroom.for_peak(result.peak_bytes, persistent_bytes=persistent_bytes(result.breakdown))
        needed = result.peak_bytes + sum(causes.values())
        return {"name": self.name, "total_bytes": self.total_bytes, "headroom": causes, "needed_bytes": needed, "fits": needed <= self.total_bytes}


def simulated_card(kind: str | None, memory: str | None, *, device: str, simulate: bool) -> SimulatedCard | None:
    """``--device-kind`` / ``--device-memory``'s GPU, as ``plan`` reads them; None when neither is given.

    Raises:
        UserError: given without ``--simulate --device cuda``, a GPU the table does not hold, or a bad memory size.
    """
    if kind is None and memory is None:
        return None
    flag = "--device-kind" if kind is not None else "--device-memory"
    if device != "cuda" or not simulate:
        raise UserError(f"{flag} describes a GPU that is not here: use it with --simulate --device cuda (a device here is measured as it is)")
    from autofit.planning.speed.estimated import GPU_PEAKS, gpu_kind
    from autofit.units import parse_budget

    name = gpu_kind(kind) if kind is not None else None
    if memory is None:
        return SimulatedCard(name=f"simulated {name}", total_bytes=GPU_PEAKS[name].memory_gib * 2**30)
    try:
        total = parse_budget(memory)
    except UserError as error:
        raise UserError(f"--device-memory: {error}") from None
    return SimulatedCard(name=f"simulated {name or 'GPU'}", total_bytes=total)


def card_line(fit: dict) -> str:
    """The card's line under a probe's breakdown: the peak with a plan's headroom against its memory."""
    causes = ", ".join(f"{cause.replace('_', ' ')} {format_bytes(value)}" for cause, value in fit["headroom"].items())
    spare = fit["total_bytes"] - fit["needed_bytes"]
    verdict = f"fits, {format_bytes(spare)} spare" if fit["fits"] else f"does not fit, {format_bytes(-spare)} short"
    return (
        f"  card   {fit['name']}, {format_bytes(fit['total_bytes'])}: with a plan's headroom ({causes}) it needs "
        f"{format_bytes(fit['needed_bytes'])}: {verdict}"
    )


def _checked(spec, *, micro_batch_size: int, device: str, simulate: bool):
    """``spec`` checked to train once, as the probe will measure it (simulated: over fake tensors, the machine need
    not hold it; else on the device, with a micro-batch whose inputs fit it)."""
    from autofit.model_checks import check_model_runs

    if simulate:
        from autofit.measure.meters import check_model_runs_simulated
        from autofit.planning.memory.traces import simulation_spec

        check_model_runs_simulated(spec)
        # As the planner does: a model whose build the simulated meter cannot fake (ViT's) is copied from meta.
        return simulation_spec(spec)
    from autofit.measure.meters import check_fits_this_machine

    check_fits_this_machine(spec, device=device)
    check_model_runs(spec)
    _check_fits_machine(spec, micro_batch_size=micro_batch_size, device=device)
    return spec


def _probe_plan(
    path: Path, *, model: str | None, steps: int, as_json: bool, configured: dict[str, bool], progress: Progress,
) -> None:
    """Measure what a plan names, through the same strategy owner as training, and set it beside the plan's figures."""
    from autofit.measure.probe import probe_plan
    from autofit.model_checks import check_model_runs
    from autofit.plan_file import load_plan
    from autofit.spec import spec_for_plan

    given = [flag for flag, set_ in configured.items() if set_]
    if given:
        raise UserError(f"--plan re-measures the plan's own configuration; drop {', '.join(given)} (or drop --plan)")
    the_plan = load_plan(path)
    spec = spec_for_plan(the_plan.model, model_file=model)
    if the_plan.estimated:
        from autofit.measure.meters import check_model_runs_simulated
        from autofit.planning.memory.traces import simulation_spec

        check_model_runs_simulated(spec)
        spec = simulation_spec(spec)
    else:
        check_model_runs(spec)
    measuring = progress.doing(f"probing the plan's configuration at micro-batch {the_plan.config.micro_batch_size}")
    with measuring, _out_of_memory_as_one_line(f"the plan's micro-batch {the_plan.config.micro_batch_size}", device=the_plan.device.type):
        result = probe_plan(spec, the_plan, steps=steps, progress=progress)
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


def _check_fits_machine(spec, *, micro_batch_size: int, device: str) -> None:
    """Refuse a micro-batch whose inputs alone exceed the device's memory, before allocating any of it."""
    from autofit.device import device_info
    from autofit.model_checks import batch_bytes

    sample_bytes = batch_bytes(spec.example_batch(1))
    total_bytes = device_info(device).total_bytes
    if total_bytes and sample_bytes * micro_batch_size > total_bytes:
        raise UserError(
            f"-m {micro_batch_size} does not fit this machine: its inputs and targets alone take "
            f"{format_bytes(sample_bytes * micro_batch_size)}, more than the {format_bytes(total_bytes)} of the {device}; "
            "try a smaller -m"
        )


@contextmanager
def _out_of_memory_as_one_line(what: str, *, device: str):
    """An allocation that fails while probing is the configuration's fault: one line saying what to lower."""
    from autofit.errors import is_out_of_memory

    try:
        yield
    except RuntimeError as error:
        if not is_out_of_memory(error):
            raise
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise UserError(f"{what} runs out of memory on the {device} ({first}); try a smaller -m, --checkpoint all or --precision bf16") from None


def _print_result(source: str, result) -> None:
    speed = "n/a (simulated)" if result.samples_per_s is None else f"{result.samples_per_s:.1f} samples/s"
    levers = [f"checkpoint {len(result.checkpoint)} block(s)"]
    levers += [f"selective checkpoint {len(result.selective_checkpoint)} block(s)"] if result.selective_checkpoint else []
    levers += [f"offload {len(result.offload)} block(s)"] if result.offload else []
    levers += ["optimizer step in backward"] if result.optimizer_in_backward else []
    levers += [f"optimizer state {result.optimizer_state}"] if result.optimizer_state != "device" else []
    levers += [f"output layer and loss in {result.loss_chunks} chunks"] if result.loss_chunks != 1 else []
    levers += ["frozen weights in NF4 (lossy)"] if result.frozen_nf4 else []
    levers += [f"gradients clipped to norm {result.max_grad_norm:g}"] if result.max_grad_norm is not None else []
    if result.compiled_change_bytes is not None:
        change = result.compiled_change_bytes
        levers += [f"torch.compile (the eager count {'+' if change >= 0 else '-'} {format_bytes(abs(change))}, the CPU allocator's difference)"]
    elif result.compile:
        levers += ["torch.compile"]
    print(
        f"{source}: micro-batch {result.micro_batch_size} x {result.grad_accum_steps} steps, "
        f"{result.precision}, {', '.join(levers)}, meter {result.meter}"
    )
    print("\n".join(breakdown_lines(result.breakdown, result.peak_bytes)))
    if result.host_peak_bytes:
        print(f"  host   {format_bytes(result.host_peak_bytes)} at most, not in the peak (offloaded to host memory)")
    print(f"  speed  {speed}")
