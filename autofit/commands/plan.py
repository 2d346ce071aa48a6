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
from autofit.distributed import NODE0_ADDRESS, torchrun_commands
from autofit.errors import UserError
from autofit.plan_file import DEFAULT_SEGMENTS, EXPANDABLE_SEGMENTS
from autofit.planning.policy import POLICY
from autofit.units import format_bytes, format_rate


@app.command()
def plan(
    model: str = MODEL_ARG,
    budget: str = typer.Option(..., "--budget", "-b", help='Memory budget: "16GB", "16GiB", "512MiB", "90%" of the device, or bytes.'),
    batch_size: str = typer.Option(
        None, "--batch-size", "-n",
        help="Global batch: samples per optimizer step (every plan keeps it); max: the largest the budget trains (one process); "
        "required unless --from-trainer-args.",
    ),
    from_trainer_args: Path = typer.Option(
        None, "--from-trainer-args",
        help="A transformers TrainingArguments JSON or a Lightning config: plan the run it describes (its global batch over "
        "--gpus x --nodes, precision, optimizer, clipping; docs/integrations.md).",
    ),
    device: str = typer.Option("cpu", help=f"{one_of(DeviceChoice)}."),
    simulate: bool = typer.Option(False, help="Plan with the simulated meter and FLOP-based speeds; the plan is marked estimated."),
    device_memory: str = typer.Option(None, "--device-memory", help='Total memory of a device that is not here (with --simulate), e.g. "24GiB".'),
    device_kind: str = typer.Option(
        None, "--device-kind",
        help='The GPU that is not here (with --simulate --device cuda), e.g. "RTX 4090" or H100: its speeds, and its memory unless --device-memory.',
    ),
    host_memory: str = typer.Option(
        None, "--host-memory",
        help='Host memory a GPU plan may spend (host state, bf16 weights\' masters, offload), e.g. "128GiB" (default: '
        "this machine's available memory; simulating, its total, stated as assumed).",
    ),
    out: Path = typer.Option(Path("plan.json"), "--out", "-o", help="Where to write the plan."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON on stdout (progress goes to stderr)."),
    study: str = typer.Option(None, "--study", help="Optuna storage to keep the search and resume it, e.g. sqlite:///plans.db."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Neither reuse nor keep costs in the cache ($AUTOFIT_CACHE_DIR, else ~/.cache/autofit)."),
    threads: int = typer.Option(None, "--threads", help="Intra-op threads to time with (default: PyTorch's, fewer while other work keeps the cores busy)."),
    precisions: str = typer.Option(
        None, "--precisions",
        help="Precisions to search, separated by commas (default: fp32, bf16, fp16, and on a GPU bf16-master).",
    ),
    gpus: int = typer.Option(1, "--gpus", help="GPUs (processes) to train on; BUDGET is then per GPU: DDP if the model fits unsharded, else FSDP2."),
    nodes: int = typer.Option(
        1, "--nodes", help="Machines of --gpus GPUs each: FSDP2 within a node and replicated across nodes (HSDP) where that fits, "
        "else over every GPU; the summary prints each node's torchrun command.",
    ),
    allow_lossy_optimizer: bool = typer.Option(
        False, "--allow-lossy-optimizer",
        help="8-bit AdamW state (torchao) may be chosen, above the floor and below it; it changes the optimizer's arithmetic.",
    ),
    weights_dtype: str = typer.Option(
        "fp32", "--weights-dtype",
        help="fp32: fp32 weights whatever the model's config.json says (the precision sets the arithmetic); config: "
        "its dtype, where bf16 is precision bf16-pure (bf16 weights and AdamW state, lossy stochastic rounding).",
    ),
    expandable_segments: bool = typer.Option(
        True, "--expandable-segments/--no-expandable-segments",
        help="On a GPU: plan for, and train with, the CUDA allocator's expandable segments (less memory kept in its cache).",
    ),
    host_speed: float = typer.Option(
        None, "--host-speed",
        help="Parameter elements per second the training machine's host updates with the optimizer (e.g. 2e9), "
        "for a GPU plan's host levers; default timed on this CPU.",
    ),
    allow_lossy_base: bool = typer.Option(
        False, "--allow-lossy-base",
        help="Frozen linear weights (a --lora base) may be held in 4-bit NF4 (torchao; QLoRA) wherever that is the fastest "
        "configuration that fits (below the floor too); lossy: it rounds them.",
    ),
    max_grad_norm: float | None = typer.Option(
        None, "--max-grad-norm",
        help="Training will clip the gradients' global norm to this (written in the plan); the step in backward, which cannot clip, is not searched.",
    ),
    compile_: bool | None = typer.Option(
        None, "--compile/--no-compile",
        help="Also measure the chosen configuration under torch.compile, kept where it fits and is faster (default: on a GPU yes, on the CPU no).",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines."),
    input_shape: str = INPUT_SHAPE,
    num_classes: int | None = NUM_CLASSES,
    task: str | None = TASK,
    seq_len: str | None = typer.Option(
        None, "--seq-len",
        help="hf: text tasks: tokens per example sequence (default 128, or the context length if shorter); max: the longest "
        "the budget trains at --batch-size (one process).",
    ),
    lora: str | None = LORA,
) -> None:
    """Search precision, micro-batch/accumulation and checkpointing for the fastest plan that fits BUDGET."""
    from autofit.atomic import check_writable
    from autofit.measure.meters import check_fits_this_machine, check_model_runs_simulated
    from autofit.model_checks import check_model_runs
    from autofit.plan_file import save_plan
    from autofit.planning.planner import plan_with_report
    from autofit.planning.request import PlanRequest
    from autofit.progress import as_progress, print_progress
    from autofit.spec import weights_held

    started = time.perf_counter()
    if device not in DEVICES:
        raise UserError(f"--device {device!r} is unknown; use {one_of(DeviceChoice)}")
    run = None
    if batch_size is None and from_trainer_args is None:
        raise UserError("--batch-size is missing: give the global batch (samples per optimizer step), max, or --from-trainer-args FILE")
    asked = batch_size
    batch_size = None if asked is None else _batch_size(asked, gpus=gpus, nodes=nodes)  # None: max (or the trainer's)
    longest = seq_len is not None and seq_len.strip().lower() == "max"
    length = None if seq_len is None or longest else _seq_len(seq_len)
    if from_trainer_args is not None:
        from autofit.integrations.trainer_args import plan_options, read_trainer_args

        if asked is not None and batch_size is None:
            raise UserError("--batch-size max and --from-trainer-args both choose the global batch; give one of them")
        run = read_trainer_args(from_trainer_args, world_size=gpus * nodes)
        given = None if precisions is None else [p.strip() for p in precisions.split(",") if p.strip()]
        options = plan_options(run, batch_size=batch_size, precisions=given, max_grad_norm=max_grad_norm)
        batch_size, precisions, max_grad_norm = options["batch_size"], ",".join(options["precisions"]), options["max_grad_norm"]
        allow_lossy_optimizer = allow_lossy_optimizer or options["allow_lossy_optimizer"]
    if longest and (batch_size is None or gpus * nodes > 1):
        raise UserError(
            "--seq-len max is planned at a given global batch on one process; give --batch-size N"
            + (" (not max) with it" if batch_size is None else "") + (f", and no --gpus {gpus}" if gpus * nodes > 1 else "")
        )
    if device_memory is not None and not simulate and device == "cuda":
        raise UserError("--device-memory describes a GPU that is not here; use it with --simulate")
    wanted = None if precisions is None else [p.strip() for p in precisions.split(",") if p.strip()]
    if wanted == []:  # an empty list used to mean every precision
        raise UserError(f"--precisions {precisions!r} names no precision; give e.g. --precisions bf16,fp32, or leave it out for all")
    check_writable(out, option="--out")  # before the search, not after it
    if study is not None:
        _check_study(study)
    # One heartbeat from here to the plan: loading a large model and checking its first step can be long silences too.
    progress = as_progress(None if quiet else print_progress, started_s=started)
    with progress.beating():
        with progress.doing("loading the model"):
            spec = load_model_spec(model, input_shape=input_shape, num_classes=num_classes, task=task, seq_len=length, lora=lora)
            if run is not None:
                from autofit.integrations.trainer_args import with_optimizer

                spec = with_optimizer(spec, run)
        with progress.doing("checking that the model trains (one step)"):
            if simulate:  # built of fake tensors only: the machine that plans need not hold the model
                check_model_runs_simulated(spec)
            else:
                check_fits_this_machine(spec, device=device)
                check_model_runs(spec)
        request = PlanRequest(
            budget=budget, batch_size=batch_size or 1, device=device, simulate=simulate, device_memory=device_memory, device_kind=device_kind,
            host_memory=host_memory, host_speed=host_speed, study=study, expandable_segments=expandable_segments, weights_dtype=weights_dtype,
            precisions=wanted, num_classes=spec.source_options.get("num_classes"), gpus=gpus, nodes=nodes,
            allow_lossy_optimizer=allow_lossy_optimizer, allow_lossy_base=allow_lossy_base, cache=not no_cache, threads=threads,
            max_grad_norm=max_grad_norm, compile=compile_,
        )
        if batch_size is None:
            from autofit.planning.capacity import largest_batch

            with progress.doing("finding the largest batch the budget trains"):
                largest, note = largest_batch(spec, request, log=progress)
            request = replace(request, batch_size=largest)
        if longest:
            from autofit.planning.capacity import longest_seq_len

            def spec_at(tokens: int | None):
                at = load_model_spec(model, input_shape=input_shape, num_classes=num_classes, task=task, seq_len=tokens, lora=lora)
                if run is not None:
                    from autofit.integrations.trainer_args import with_optimizer

                    at = with_optimizer(at, run)
                return at

            with progress.doing("finding the longest sequence the budget trains"):
                spec, note = longest_seq_len(spec_at, request, log=progress)
        report = plan_with_report(spec, request, log=progress)
        if batch_size is None or longest:
            report.plan = replace(report.plan, notes=[*report.plan.notes, note])
    path = save_plan(report.plan, out)
    if as_json:
        print_json(report.plan.to_dict())
        return
    lines = summary_lines(report, path=path)
    if run is not None:
        lines.insert(1, f"  run         {run.source}")
    before = time.perf_counter() - started - report.seconds
    if before >= 1.0:  # building the model and checking one step of it come before the plan's own clock
        at = next(i for i, line in enumerate(lines) if "planned in" in line) + 1
        what = "loading the model and checking that it trains" + (", finding the largest batch" if batch_size is None else "") + (
            ", finding the longest sequence" if longest else ""
        )
        lines.insert(at, f"    before that, {before:.1f} s {what} ({time.perf_counter() - started:.1f} s in all)")
    from autofit.device import peak_resident_bytes

    at = next(i for i, line in enumerate(lines) if "planned in" in line) + 1
    lines.insert(at, f"    planning held at most {format_bytes(peak_resident_bytes())} of this machine's memory (the process's peak resident set)")
    if spec.weights_note:  # planning used none: weights change no byte
        again = "; --from-config there for random init" if spec.build_pretrained is not None else ""
        held = weights_held(spec, report.plan.config)
        lines.insert(2, f"  weights     {spec.weights_note}, {held} (what `autofit train` starts from{again})")
    print("\n".join(lines))


def _batch_size(text: str, *, gpus: int, nodes: int) -> int | None:
    """``--batch-size``: a whole number of samples, or None for max (the largest the budget trains).

    Raises:
        UserError: neither, below 1, or max for several processes.
    """
    if text.strip().lower() == "max":
        if gpus * nodes > 1:
            raise UserError(f"--batch-size max is planned on one process; for --gpus {gpus} give the global batch")
        return None
    try:
        size = int(text)
    except ValueError:
        raise UserError(f"--batch-size {text!r} is not a whole number of samples; give e.g. 64, or max for the largest the budget trains") from None
    if size < 1:
        raise UserError(f"--batch-size {size} must be at least 1")
    return size


def _seq_len(text: str) -> int:
    """``--seq-len``: a whole number of tokens (max is read before).

    Raises:
        UserError: not a whole number.
    """
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--seq-len {text!r} is not a whole number of tokens; give e.g. 2048, or max for the longest the budget trains") from None


def _check_study(study: str) -> None:
    """Open the --study storage before the search, so that a bad one fails at once rather than after minutes of it."""
    import optuna

    try:
        optuna.storages.get_storage(study)
    except Exception as error:  # SQLAlchemy/Optuna raise many types for an unusable URL
        first = (str(error).strip().splitlines() or [""])[0]
        raise UserError(f"--study {study!r} cannot be opened ({type(error).__name__}: {first}); use e.g. sqlite:///plans.db") from None


def summary_lines(report, *, path: Path | None = None) -> list[str]:
    """The readable summary of a planning run."""
    plan = report.plan
    measured, predicted = plan.measured, plan.predicted
    ranks = measured.multi_process
    if ranks:
        on_nodes = f" on {plan.config.nodes} nodes" if plan.config.nodes > 1 else ""
        where = f"per GPU, {plan.config.world_size} GPUs{on_nodes} ({plan.config.sharding})"
        split = (f"per rank: micro-batch {plan.config.micro_batch_size} x {plan.config.grad_accum_steps} step(s) "
                 f"({plan.config.world_size} ranks x {plan.config.micro_batch_size} x {plan.config.grad_accum_steps} >= {plan.config.global_batch_size})")
        estimated = " [estimated: FSDP2 per-rank peak simulated]" if plan.config.sharding_config().sharded else ""
    else:
        where = f"on {plan.device.name}"
        split = f"micro-batch {plan.config.micro_batch_size} x {plan.config.grad_accum_steps} step(s)"
        estimated = " [estimated: simulated meter, FLOP-based speed]" if plan.estimated else ""
    lines = [
        f"plan for {plan.model.source}: batch {plan.config.global_batch_size}, budget {format_bytes(plan.budget_bytes)} "
        f"({plan.budget_kind}) {where}" + estimated,
        f"  chosen      {plan.config.precision}, {split}, checkpoint {_blocks(plan.config.checkpoint)}" + _levers(plan),
    ]
    if ranks:
        lines.append(f"  note        {ranks.note}")
    lines.append(f"  memory      {'predicted':>12} {f'measured ({measured.meter})':>20}")
    for name, value in measured.breakdown.items():
        lines.append(f"    {name.replace('_', ' '):<18}{'':>12} {format_bytes(value):>20}")
    lines.append(f"    {'peak':<18}{format_bytes(predicted.peak_bytes):>12} {format_bytes(measured.peak_bytes):>20}")
    segments = {EXPANDABLE_SEGMENTS: "  (expandable segments, set by training)", DEFAULT_SEGMENTS: "  (default segments)"}
    for cause, value in plan.headroom.items():
        why = segments.get(plan.device.allocator_settings, "") if cause == "allocator_reserve" else ""
        lines.append(f"    {'+ ' + cause.replace('_', ' '):<18}{'':>12} {format_bytes(value):>20}{why}")
    total = measured.peak_bytes + sum(plan.headroom.values())
    lines.append(
        f"    {'= needed':<18}{'':>12} {format_bytes(total):>20}  of {format_bytes(plan.budget_bytes)} "
        f"({total / plan.budget_bytes:.0%})"
    )
    if plan.host_budget_bytes is not None and measured.host_peak_bytes:
        lines.append(
            f"  host        {format_bytes(measured.host_peak_bytes)} kept in host memory (measured) of "
            f"{format_bytes(plan.host_budget_bytes)} the host may spend"
        )
    speed = measured.samples_per_s
    unconstrained = report.unconstrained
    tokens = plan.model.seq_len  # a language model's speed in tokens too
    text = f"{format_rate(speed)} samples/s measured" if speed else "not measured (simulated)"
    lines.append(
        f"  speed       {text}, {format_rate(predicted.samples_per_s)} predicted"
        + (f" ({format_rate((speed or predicted.samples_per_s) * tokens)} tokens/s at {tokens} tokens a sample)" if tokens else "")
    )
    if unconstrained is not None:
        reference = unconstrained.samples_per_s or unconstrained.predicted_samples_per_s
        mine = speed or predicted.samples_per_s
        kind = "measured" if unconstrained.samples_per_s else "predicted"
        peak = unconstrained.peak_bytes or unconstrained.predicted_peak_bytes
        peak_kind = "" if unconstrained.peak_measured else " predicted"
        lines.append(
            f"              {mine / reference:.2f}x the unconstrained configuration ({unconstrained.precision}, micro-batch "
            f"{unconstrained.micro_batch_size}, no checkpointing: {format_rate(reference)} samples/s {kind}, peak {format_bytes(peak)}{peak_kind})"
        )
    for precision, why in report.excluded_precisions.items():
        lines.append(f"  left out    {precision}: {why}")
    for precision, note in report.precision_notes.items():
        lines.append(f"  note        {precision}: {note}")
    for note in plan.notes:
        lines.append(f"  note        {note}")
    lines.append("  alternatives (Pareto front of memory vs samples/s as predicted; fits: measured where measured; * chosen):")
    lines.append(f"    {'peak':>12} {'measured':>12} {'samples/s':>10}  {'precision':<9} {'micro-batch':>14}  {'fits':<14} checkpoint")
    for alt in plan.alternatives:
        mark = "*" if alt["chosen"] else (" " if alt["fits_budget"] else "!")
        split = f"{alt['micro_batch_size']} x {alt['grad_accum_steps']}"
        measured_peak = alt.get("measured_peak_bytes", alt.get("simulated_peak_bytes"))
        lines.append(
            f"  {mark} {format_bytes(alt['predicted_peak_bytes']):>12} {format_bytes(measured_peak) if measured_peak is not None else '-':>12} "
            f"{format_rate(alt['predicted_samples_per_s']):>10}  {alt['precision']:<9} {split:>14}  {_fits_text(alt):<14} {_blocks(alt['checkpoint'])}"
            + (f"; selective {_blocks(alt['selective_checkpoint'])}" if alt.get("selective_checkpoint") else "")
            + (f"; offload {_blocks(alt['offload'])}" if alt.get("offload") else "")
            + ("; step in backward" if alt.get("optimizer_in_backward") else "")
            + (f"; {alt['optimizer_state']} state" if alt.get("optimizer_state", "device") != "device" else "")
            + (f"; loss in {alt['loss_chunks']} chunks" if alt.get("loss_chunks", 1) != 1 else "")
            + ("; base in NF4" if alt.get("frozen_nf4") else "")
            + ("; torch.compile" if alt.get("compile") else "")
        )
    lines.append(f"    (! = does not fit the budget; measured = by the {measured.meter or 'plan'} meter)")
    if report.rejected:
        lines.append("  rejected    by measurement (the memory model's candidates that did not fit):")
        for rejection in report.rejected:
            lines.append(f"              {_config_text(rejection['config'])}: {rejection['why']}")
    lines += _timing_lines(report)
    if ranks:
        commands = torchrun_commands(plan.config.sharding_config(), args=["train", "--plan", str(path or "plan.json")])
        lines += [f"  start       {command}" for command in commands]
        if len(commands) > 1:
            lines.append(f"              ({NODE0_ADDRESS}: node 0's address, which every node can reach; plan.json and the data on every node)")
    where = f"wrote {path}; " if path else ""
    lines.append(
        f"  {where}planned in {report.seconds:.1f} s: {report.evaluations} points by {report.sampler}, "
        f"{report.simulated_checks} simulated checks, {report.memory_probes} memory probes, {report.real_probes} timed"
        + (" (resumed from the stored study)" if report.resumed else "")
    )
    if report.phases:
        split = ", ".join(f"{name} {seconds:.1f}" for name, seconds in report.phases.items() if seconds >= 0.05)
        lines.append(f"    time by step (s): {split}")
    if report.study and not report.study_problems:
        lines.append(f"    costs and measurements kept in {report.study}")
    for problem in report.study_problems:
        lines.append(f"    note: {problem}")
    return lines


def _fits_text(alternative: dict) -> str:
    """Whether an alternative fits, and by what: "measured", "simulated" (a rank under FSDP2), "predicted", or "rejected"."""
    if "rejected" in alternative:
        return "rejected"
    how = "simulated" if "simulated_peak_bytes" in alternative else "measured" if "measured_peak_bytes" in alternative else "predicted"
    return how if alternative["fits_budget"] else f"no ({how})"


def _levers(plan) -> str:
    """The memory levers a plan uses, as the chosen line names them."""
    levers = []
    if plan.config.selective_checkpoint:
        levers.append(f"selective checkpoint {_blocks(plan.config.selective_checkpoint)}")
    if plan.config.offload:
        levers.append(f"offload {_blocks(plan.config.offload)}")
    if plan.config.optimizer_in_backward:
        levers.append("optimizer step in backward")
    if plan.config.optimizer_state == "host":
        levers.append("optimizer state on the host")
    elif plan.config.optimizer_state == "8bit":
        levers.append("8-bit AdamW state (lossy)")
    if plan.config.loss_chunks != 1:
        levers.append(f"output layer and loss in {plan.config.loss_chunks} chunks")
    if plan.config.frozen_nf4:
        levers.append("frozen weights in NF4 (lossy)")
    if plan.config.compile:
        levers.append("torch.compile")
    return "".join(f", {lever}" for lever in levers)


def _timing_lines(report) -> list[str]:
    """How noisy the timings were, and what that left undecided."""
    lines = []
    timing = report.timing
    if timing:
        source = "stored from an earlier run" if timing.get("reused") else f"{timing['rounds']} interleaved round(s)"
        model_noise = f"the speed model's timings repeated within {report.speed_noise:.1%}" if report.speed_noise else ""
        if timing["rounds"] > 1:
            worst = timing.get("worst_noise", timing["noise"])
            lines.append(
                f"  timing      candidates timed side by side ({source}); the fastest rounds repeated within "
                f"{timing['noise']:.1%}" + (f" (median; {worst:.1%} at worst)" if worst > timing["noise"] else "")
                + (f", {model_noise}" if model_noise else "")
            )
        else:
            lines.append("  timing      one candidate: timed once (nothing to compare it with)" + (f"; {model_noise}" if model_noise else ""))
        if timing.get("tie", POLICY.tie_share) > POLICY.tie_share and timing["rounds"] > 1:
            lines.append(
                f"              the machine was busy: speeds within {timing['tie']:.0%} count as a tie (whole runs under load "
                "rank configurations this close differently)"
            )
        if timing.get("within_noise"):
            # Named as what they are: the others tied with the chosen one (the list used to read as the choice).
            others = "; ".join(_config_text(key) for key in timing["within_noise"])
            lines.append(
                f"              as fast as the chosen {_config_text(report.plan.config.key())} within that noise: {others}; "
                "a tie goes to the simpler configuration, the chosen one"
            )
        # Beyond the tie (at most 5%) but within the noise reported: a quiet machine could rank these first.
        close = {
            key: behind for key, behind in timing.get("behind", {}).items()
            if key not in timing.get("within_noise", []) and 0 < behind <= timing["noise"]
        }
        if close and timing["rounds"] > 1:
            others = "; ".join(f"{_config_text(key)} ({behind:.1%} slower)" for key, behind in sorted(close.items(), key=lambda kv: kv[1]))
            lines.append(f"              slower, but within that noise: {others}")
    if report.threads_note:
        lines.append(f"  threads     {report.threads_note}")
    return lines


def _config_text(key: str) -> str:
    """A configuration's key (``TrainingConfig.key``: precision:micro-batch:checkpoint[:selective[:levers]]) as words."""
    precision, size, checkpoint, *rest = key.split(":")
    text = f"{precision}, micro-batch {size}, checkpoint {_blocks(checkpoint.split(',')) if checkpoint else 'none'}"
    text += f", selective checkpoint {_blocks(rest[0].split(','))}" if rest and rest[0] else ""
    return text + (f", {rest[1].replace(';', ', ').replace('=', ' ')}" if len(rest) > 1 and rest[1] else "")


def _blocks(names: list[str]) -> str:
    if not names:
        return "none"
    if len(names) <= 4:
        return ", ".join(names)
    return f"{len(names)} blocks ({names[0]} .. {names[-1]})"


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
