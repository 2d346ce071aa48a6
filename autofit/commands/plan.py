"""`autofit plan`: the fastest configuration measured to fit a budget, written to plan.json."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import typer

from autofit.cli import app
from autofit.config import DeviceChoice
from autofit.commands.common import (
    DEVICES, INPUT_SHAPE, LORA, MODEL_ARG, NUM_CLASSES, TASK, in_panels, load_model_spec, one_of, print_json,
)
from autofit.errors import UserError
from autofit.units import format_bytes


# The options whose help runs over a line, named here so that the command's signature reads as its list of flags.
BATCH_SIZE_OPTION = typer.Option(
    None, "--batch-size", "-n",
    help="Global batch: samples per optimizer step (every plan keeps it); max: the largest the budget trains (one process); "
    "required unless --from-trainer-args.",
)
FROM_TRAINER_ARGS_OPTION = typer.Option(
    None, "--from-trainer-args",
    help="A transformers TrainingArguments JSON or a Lightning config: plan the run it describes (its global batch over "
    "--gpus x --nodes, precision, optimizer, clipping; docs/integrations.md).",
)
DEVICE_KIND_OPTION = typer.Option(
    None, "--device-kind",
    help='The GPU that is not here (with --simulate --device cuda), e.g. "RTX 4090" or H100: its speeds, and its memory unless --device-memory.',
)
HOST_MEMORY_OPTION = typer.Option(
    None, "--host-memory",
    help='Host memory a GPU plan may spend (host state, bf16 weights\' masters, offload), e.g. "128GiB" (default: '
    "this machine's available memory; simulating, its total, stated as assumed).",
)
PRECISIONS_OPTION = typer.Option(
    None, "--precisions",
    help="Precisions to search, separated by commas (default: fp32, bf16, fp16, and on a GPU bf16-master).",
)
NODES_OPTION = typer.Option(
    1, "--nodes", help="Machines of --gpus GPUs each: FSDP2 within a node and replicated across nodes (HSDP) where that fits, "
    "else over every GPU; the summary prints each node's torchrun command.",
)
ALLOW_LOSSY_OPTIMIZER_OPTION = typer.Option(
    False, "--allow-lossy-optimizer",
    help="8-bit AdamW state (torchao) may be chosen, above the floor and below it; it changes the optimizer's arithmetic.",
)
WEIGHTS_DTYPE_OPTION = typer.Option(
    "fp32", "--weights-dtype",
    help="fp32: fp32 weights whatever the model's config.json says (the precision sets the arithmetic); config: "
    "its dtype, where bf16 is precision bf16-pure (bf16 weights and AdamW state, lossy stochastic rounding).",
)
EXPANDABLE_SEGMENTS_OPTION = typer.Option(
    True, "--expandable-segments/--no-expandable-segments",
    help="On a GPU: plan for, and train with, the CUDA allocator's expandable segments (less memory kept in its cache).",
)
HOST_SPEED_OPTION = typer.Option(
    None, "--host-speed",
    help="Parameter elements per second the training machine's host updates with the optimizer (e.g. 2e9), "
    "for a GPU plan's host levers; default: timed on this CPU for a GPU here, a typical host of the kind for one that is not (docs/planner.md).",
)
ALLOW_LOSSY_BASE_OPTION = typer.Option(
    False, "--allow-lossy-base",
    help="Frozen linear weights (a --lora base) may be held in 4-bit NF4 (torchao; QLoRA) wherever that is the fastest "
    "configuration that fits (below the floor too); lossy: it rounds them.",
)
MAX_GRAD_NORM_OPTION = typer.Option(
    None, "--max-grad-norm",
    help="Training will clip the gradients' global norm to this (written in the plan); the step in backward, which cannot clip, is not searched.",
)
SEQ_LEN_OPTION = typer.Option(
    None, "--seq-len",
    help="hf: text tasks: tokens per example sequence (default 128, or the context length if shorter); max: the longest "
    "the budget trains at --batch-size (one process).",
)
COMPILE_OPTION = typer.Option(
    None, "--compile/--no-compile",
    help="Also measure the chosen configuration under torch.compile, kept where it fits and is faster (default: on a GPU yes, on the CPU no).",
)


@app.command()
def plan(
    model: str = MODEL_ARG,
    budget: str = typer.Option(..., "--budget", "-b", help='Memory budget: "16GB", "16GiB", "512MiB", "90%" of the device, or bytes.'),
    batch_size: str = BATCH_SIZE_OPTION,
    from_trainer_args: Path = FROM_TRAINER_ARGS_OPTION,
    device: str = typer.Option("cpu", help=f"{one_of(DeviceChoice)}."),
    simulate: bool = typer.Option(False, help="Plan with the simulated meter and FLOP-based speeds; the plan is marked estimated."),
    device_memory: str = typer.Option(None, "--device-memory", help='Total memory of a device that is not here (with --simulate), e.g. "24GiB".'),
    device_kind: str = DEVICE_KIND_OPTION,
    host_memory: str = HOST_MEMORY_OPTION,
    out: Path = typer.Option(Path("plan.json"), "--out", "-o", help="Where to write the plan."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON on stdout (progress goes to stderr)."),
    study: str = typer.Option(None, "--study", help="Optuna storage to keep the search and resume it, e.g. sqlite:///plans.db."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Neither reuse nor keep costs in the cache ($AUTOFIT_CACHE_DIR, else ~/.cache/autofit)."),
    threads: int = typer.Option(None, "--threads", help="Intra-op threads to time with (default: PyTorch's, fewer while other work keeps the cores busy)."),
    precisions: str = PRECISIONS_OPTION,
    gpus: int = typer.Option(1, "--gpus", help="GPUs (processes) to train on; BUDGET is then per GPU: DDP if the model fits unsharded, else FSDP2."),
    nodes: int = NODES_OPTION,
    allow_lossy_optimizer: bool = ALLOW_LOSSY_OPTIMIZER_OPTION,
    weights_dtype: str = WEIGHTS_DTYPE_OPTION,
    expandable_segments: bool = EXPANDABLE_SEGMENTS_OPTION,
    host_speed: float = HOST_SPEED_OPTION,
    allow_lossy_base: bool = ALLOW_LOSSY_BASE_OPTION,
    max_grad_norm: float | None = MAX_GRAD_NORM_OPTION,
    compile_: bool | None = COMPILE_OPTION,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines."),
    input_shape: str = INPUT_SHAPE,
    num_classes: int | None = NUM_CLASSES,
    task: str | None = TASK,
    seq_len: str | None = SEQ_LEN_OPTION,
    lora: str | None = LORA,
) -> None:
    """Search precision, micro-batch/accumulation and checkpointing for the fastest plan that fits BUDGET."""
    from autofit.atomic import check_writable
    from autofit.plan_file import save_plan
    from autofit.planning.request import PlanRequest
    from autofit.planning.summary import summary_lines
    from autofit.progress import as_progress, print_progress

    started = time.perf_counter()
    if device not in DEVICES:
        raise UserError(f"--device {device!r} is unknown; use {one_of(DeviceChoice)}")
    batch_size = _batch_size(batch_size, gpus=gpus, nodes=nodes, from_trainer_args=from_trainer_args is not None)
    run = None
    if from_trainer_args is not None:
        run, batch_size, precisions, max_grad_norm, allow_lossy_optimizer = _with_trainer_args(
            from_trainer_args, world_size=gpus * nodes, batch_size=batch_size, precisions=precisions, max_grad_norm=max_grad_norm,
            allow_lossy_optimizer=allow_lossy_optimizer,
        )
    longest, length = _seq_len(seq_len, batch_size=batch_size, gpus=gpus * nodes)
    if device_memory is not None and not simulate and device == "cuda":
        raise UserError("--device-memory describes a GPU that is not here; use it with --simulate")
    wanted = _precisions(precisions)
    check_writable(out, option="--out")  # before the search, not after it
    if study is not None:
        _check_study(study)
    # One heartbeat from here to the plan: loading a large model and checking its first step can be long silences too.
    progress = as_progress(None if quiet else print_progress, started_s=started)
    with progress.beating():
        spec_at = _spec_loader(model, input_shape=input_shape, num_classes=num_classes, task=task, lora=lora, run=run)
        with progress.doing("loading the model"):
            spec = spec_at(length)
        with progress.doing("checking that the model trains (one step)"):
            _check_model(spec, device=device, simulate=simulate)
        request = PlanRequest(
            budget=budget, batch_size=batch_size or 1, device=device, simulate=simulate, device_memory=device_memory, device_kind=device_kind,
            host_memory=host_memory, host_speed=host_speed, study=study, expandable_segments=expandable_segments, weights_dtype=weights_dtype,
            precisions=wanted, num_classes=spec.source_options.get("num_classes"), gpus=gpus, nodes=nodes,
            allow_lossy_optimizer=allow_lossy_optimizer, allow_lossy_base=allow_lossy_base, cache=not no_cache, threads=threads,
            max_grad_norm=max_grad_norm, compile=compile_,
        )
        report = _planned(spec, request, largest=batch_size is None, spec_at=spec_at if longest else None, progress=progress)
    path = save_plan(report.plan, out)
    if as_json:
        print_json(report.plan.to_dict())
        return
    searched = ", finding the largest batch" if batch_size is None else ", finding the longest sequence" if longest else ""
    print("\n".join(_with_this_run(summary_lines(report, path=path), report, spec=spec, run=run, started=started, searched=searched)))


def _spec_loader(model: str, *, input_shape: str, num_classes: int | None, task: str | None, lora: str | None, run):
    """The model's spec at a sequence length (None: its default), with the trainer's optimizer where ``run`` names one:
    what the plan is made for, and what ``--seq-len max`` traces at other lengths."""
    def spec_at(tokens: int | None):
        spec = load_model_spec(model, input_shape=input_shape, num_classes=num_classes, task=task, seq_len=tokens, lora=lora)
        if run is not None:
            from autofit.integrations.trainer_args import with_optimizer

            spec = with_optimizer(spec, run)
        return spec

    return spec_at


def _with_trainer_args(path: Path, *, world_size: int, batch_size: int | None, precisions: str | None, max_grad_norm: float | None,
                       allow_lossy_optimizer: bool):
    """``--from-trainer-args``: the run it describes, and the batch, precisions, clipping and 8-bit state it sets."""
    from autofit.integrations.trainer_args import plan_options, read_trainer_args

    run = read_trainer_args(path, world_size=world_size)
    given = None if precisions is None else [p.strip() for p in precisions.split(",") if p.strip()]
    options = plan_options(run, batch_size=batch_size, precisions=given, max_grad_norm=max_grad_norm)
    return (
        run, options["batch_size"], ",".join(options["precisions"]), options["max_grad_norm"],
        allow_lossy_optimizer or options["allow_lossy_optimizer"],
    )


def _check_model(spec, *, device: str, simulate: bool) -> None:
    """One step of the model before minutes of planning: over fake tensors when simulated (the machine that plans
    need not hold the model), else for real, after checking this machine can hold it."""
    from autofit.measure.meters import check_fits_this_machine, check_model_runs_simulated
    from autofit.model_checks import check_model_runs

    if simulate:
        check_model_runs_simulated(spec)
    else:
        check_fits_this_machine(spec, device=device)
        check_model_runs(spec)


def _planned(spec, request, *, largest: bool, spec_at=None, progress):
    """The plan's report; with ``largest`` (``--batch-size max``), at the largest batch the budget trains, and with
    ``spec_at`` (``--seq-len max``: the spec at a sequence length, None its default) at the longest sequence; either
    said in a note."""
    from autofit.planning.capacity import largest_batch, longest_seq_len
    from autofit.planning.planner import plan_with_report

    if largest:
        with progress.doing("finding the largest batch the budget trains"):
            batch, note = largest_batch(spec, request, log=progress)
        request = replace(request, batch_size=batch)
    elif spec_at is not None:
        with progress.doing("finding the longest sequence the budget trains"):
            spec, note = longest_seq_len(spec_at, request, log=progress)
    else:
        return plan_with_report(spec, request, log=progress)
    report = plan_with_report(spec, request, log=progress)
    report.plan = replace(report.plan, notes=[*report.plan.notes, note])
    return report


def _with_this_run(lines: list[str], report, *, spec, run, started: float, searched: str = "") -> list[str]:
    """The summary with what only this command knows: the trainer's run it planned, the time before the plan's own
    clock (``searched``: what else it went to, ", finding the largest batch"), the memory planning held, and where the
    weights come from."""
    from autofit.device import peak_resident_bytes
    from autofit.spec import weights_held

    lines = list(lines)
    if run is not None:
        lines.insert(1, f"  run         {run.source}")
    before = time.perf_counter() - started - report.seconds
    if before >= 1.0:  # building the model and checking one step of it come before the plan's own clock
        at = next(i for i, line in enumerate(lines) if "planned in" in line) + 1
        total = time.perf_counter() - started
        lines.insert(at, f"    before that, {before:.1f} s loading the model and checking that it trains{searched} ({total:.1f} s in all)")
    at = next(i for i, line in enumerate(lines) if "planned in" in line) + 1
    lines.insert(at, f"    planning held at most {format_bytes(peak_resident_bytes())} of this machine's memory (the process's peak resident set)")
    if spec.weights_note:  # planning used none: weights change no byte
        again = "; --from-config there for random init" if spec.build_pretrained is not None else ""
        held = weights_held(spec, report.plan.config)
        lines.insert(2, f"  weights     {spec.weights_note}, {held} (what `autofit train` starts from{again})")
    return lines


def _batch_size(text: str | None, *, gpus: int, nodes: int, from_trainer_args: bool) -> int | None:
    """``--batch-size``: a whole number of samples, or None for max (the largest the budget trains) or the trainer's.

    Raises:
        UserError: missing without --from-trainer-args, neither, below 1, or max for several processes or beside
            --from-trainer-args.
    """
    if text is None:
        if not from_trainer_args:
            raise UserError("--batch-size is missing: give the global batch (samples per optimizer step), max, or --from-trainer-args FILE")
        return None
    if text.strip().lower() == "max":
        if gpus * nodes > 1:
            raise UserError(f"--batch-size max is planned on one process; for --gpus {gpus} give the global batch")
        if from_trainer_args:
            raise UserError("--batch-size max and --from-trainer-args both choose the global batch; give one of them")
        return None
    try:
        size = int(text)
    except ValueError:
        raise UserError(f"--batch-size {text!r} is not a whole number of samples; give e.g. 64, or max for the largest the budget trains") from None
    if size < 1:
        raise UserError(f"--batch-size {size} must be at least 1")
    return size


def _seq_len(text: str | None, *, batch_size: int | None, gpus: int) -> tuple[bool, int | None]:
    """``--seq-len``: whether it is max (the longest the budget trains), else the tokens it names (None: not given).

    Raises:
        UserError: not a whole number; max without a global batch (``batch_size`` None: max or missing) or for
            several processes (``gpus``: all of them).
    """
    if text is None:
        return False, None
    if text.strip().lower() != "max":
        try:
            return False, int(text)
        except ValueError:
            raise UserError(f"--seq-len {text!r} is not a whole number of tokens; give e.g. 2048, or max for the longest the budget trains") from None
    if batch_size is None or gpus > 1:
        raise UserError(
            "--seq-len max is planned at a given global batch on one process; give --batch-size N"
            + (" (not max) with it" if batch_size is None else "") + (f", and no --gpus {gpus}" if gpus > 1 else "")
        )
    return True, None


def _precisions(text: str | None) -> list[str] | None:
    """``--precisions``: the names separated by commas (None: every precision).

    Raises:
        UserError: it names none (an empty list used to mean every precision).
    """
    wanted = None if text is None else [p.strip() for p in text.split(",") if p.strip()]
    if wanted == []:
        raise UserError(f"--precisions {text!r} names no precision; give e.g. --precisions bf16,fp32, or leave it out for all")
    return wanted


def _check_study(study: str) -> None:
    """Open the --study storage before the search, so that a bad one fails at once rather than after minutes of it."""
    import optuna

    try:
        optuna.storages.get_storage(study)
    except Exception as error:  # SQLAlchemy/Optuna raise many types for an unusable URL
        first = (str(error).strip().splitlines() or [""])[0]
        raise UserError(f"--study {study!r} cannot be opened ({type(error).__name__}: {first}); use e.g. sqlite:///plans.db") from None


in_panels(plan, {
    "Arguments": ("model",),
    "Model": ("input_shape", "num_classes", "task", "seq_len"),
    "Budget and batch": ("budget", "batch_size", "from_trainer_args", "device", "gpus", "nodes", "host_memory"),
    "Search": (
        "precisions", "allow_lossy_optimizer", "weights_dtype", "max_grad_norm", "compile_", "expandable_segments", "threads",
        "study", "no_cache",
    ),
    "A device that is not here": ("simulate", "device_memory", "device_kind", "host_speed"),
    "Fine-tuning": ("lora", "allow_lossy_base"),
    "Output": ("out", "as_json", "quiet"),
})
