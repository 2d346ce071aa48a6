"""`autofit capacity`: will it fit on my card? One row per card, from one simulated trace set."""
from __future__ import annotations

import time
from pathlib import Path

import typer

from autofit.cli import app
from autofit.commands.common import INPUT_SHAPE, LORA, MODEL_ARG, NUM_CLASSES, SEQ_LEN, TASK, load_model_spec, print_json
from autofit.errors import UserError
from autofit.units import format_bytes, format_rate


@app.command()
def capacity(
    model: str = MODEL_ARG,
    batch_size: int = typer.Option(..., "--batch-size", "-n", help="Global batch: samples per optimizer step."),
    on: str = typer.Option(
        None, "--on",
        help='Cards, separated by commas: names from the GPU table ("RTX 4090", H100), optionally with their memory '
        '("A100 40GB"), or a memory alone ("24GiB"). Default: T4, RTX 4090, A100 40GB, L40S, H100.',
    ),
    precisions: str = typer.Option(
        None, "--precisions", help="Precisions to search, separated by commas (default: fp32, bf16, fp16 and bf16-master).",
    ),
    host_memory: str = typer.Option(
        None, "--host-memory", help='Host memory a card\'s plan may spend (host state, offload), e.g. "128GiB" (default: this machine\'s, assumed).',
    ),
    host_speed: float = typer.Option(
        None, "--host-speed", help="Parameter elements per second the training machine's host updates with the optimizer (default: timed here).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON on stdout (progress goes to stderr)."),
    plot: Path = typer.Option(
        None, "--plot", help="Also draw the predicted peak against the batch in one step, each card's usable memory a line (PNG).",
    ),
    no_cache: bool = typer.Option(False, "--no-cache", help="Neither reuse nor keep costs in the cache ($AUTOFIT_CACHE_DIR, else ~/.cache/autofit)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines."),
    input_shape: str = INPUT_SHAPE,
    num_classes: int | None = NUM_CLASSES,
    task: str | None = TASK,
    seq_len: int | None = SEQ_LEN,
    lora: str | None = LORA,
) -> None:
    """For each card: does the batch train there (lossless), the least memory it needs, the configuration the planner
    would choose and its estimated speed, and the largest batch one step holds, all from one simulated trace set."""
    from autofit.measure.meters import check_model_runs_simulated
    from autofit.planning.capacity import DEFAULT_CARDS, answer_cards, capacity_record, parse_cards
    from autofit.planning.context import plan_context
    from autofit.planning.lever_timings import Levers
    from autofit.planning.request import PlanRequest
    from autofit.progress import as_progress, print_progress

    started = time.perf_counter()
    if plot is not None:
        from autofit.atomic import check_writable

        check_writable(plot, option="--plot")  # before the traces, not after them
    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size} must be at least 1")
    cards = parse_cards(on if on is not None else ",".join(DEFAULT_CARDS))
    wanted = None if precisions is None else tuple(p.strip() for p in precisions.split(",") if p.strip())
    if wanted == ():
        raise UserError(f"--precisions {precisions!r} names no precision; give e.g. --precisions bf16,fp32, or leave it out for all")
    progress = as_progress(None if quiet else print_progress, started_s=started)
    with progress.beating():
        with progress.doing("loading the model"):
            spec = load_model_spec(model, input_shape=input_shape, num_classes=num_classes, task=task, seq_len=seq_len, lora=lora)
        with progress.doing("checking that the model trains (one simulated step)"):
            check_model_runs_simulated(spec)
        largest = max(card.memory_bytes for card in cards)
        # One simulated GPU as large as the largest card: its traces (and the cache's) serve every card.
        request = PlanRequest(
            budget=largest, batch_size=batch_size, device="cuda", simulate=True, device_memory=largest, host_memory=host_memory,
            host_speed=host_speed, precisions=wanted, num_classes=spec.source_options.get("num_classes"), cache=not no_cache,
        )
        context = plan_context(spec, request, log=progress)
        try:
            record = capacity_record(context, levers=Levers())
            with progress.doing("searching every card"):
                least, rows = answer_cards(context, record, cards, global_batch_size=batch_size)
        finally:
            context.trace_pool.close()
    if plot is not None:
        _plot(plot, spec.source, batch_size, record, rows)
    _print_answers(spec, batch_size, least, record, rows, seconds=time.perf_counter() - started, as_json=as_json, plot=plot,
                   host_speed_given=host_speed is not None)


def _print_answers(spec, batch_size: int, least: int | None, record, rows, *, seconds: float, as_json: bool, plot: Path | None,
                   host_speed_given: bool) -> None:
    """The rows as JSON, or as the table with what its speeds rest on and where the plot went."""
    tokens = spec.source_options.get("seq_len") if spec.source_options.get("task", "causal-lm") != "image-classification" else None
    if as_json:
        print_json({
            "model": spec.source, "global_batch_size": batch_size, "seq_len": tokens, "estimated": True,
            "least_budget_bytes": least, "precisions": list(record.allowed.precisions), "left_out": record.left_out,
            "cards": [row.to_dict(tokens_per_sample=tokens) for row in rows], "seconds": seconds,
            "plot": str(plot) if plot is not None else None,
        })
        return
    lines = _table(spec.source, batch_size, tokens, least, record, rows, seconds)
    if not host_speed_given and any(row.chosen and row.chosen.config.updates_on_host for row in rows):
        lines.insert(-1, "  speed: the host's optimizer update (bf16-master's fp32 masters, host state) is assumed at each card's typical "
                     "host's rate (the device table, docs/planner.md), not timed here; --host-speed gives the training machine's")
    if plot is not None:
        lines.append(f"  wrote {plot}: the predicted peak against the batch in one step, each card's usable memory a line")
    print("\n".join(lines))


def _plot(out: Path, source: str, batch_size: int, record, rows) -> None:
    """``--plot``: the peak lines from the batch of 1 to past every card's largest batch in one step."""
    from autofit.planning.capacity import peak_curves
    from autofit.tools.capacity_plot import plot_capacity

    top = max([batch_size, *(row.largest_one_step for row in rows)])
    sizes = sorted({max(1, round(1.25 * top * 2 ** (-i / 2))) for i in range(16)})
    curves = peak_curves(record.model, batch_sizes=sizes, precisions=record.allowed.precisions)
    cards = {
        f"{row.card.name}: what its headroom leaves": min((row.usable_bytes[p] for p in record.allowed.precisions), default=row.card.memory_bytes)
        for row in rows
    }
    plot_capacity(curves, sizes, cards, out, title=f"{source}: peak against the batch in one step")


def _table(source: str, batch_size: int, tokens: int | None, least: int | None, record, rows, seconds: float) -> list[str]:
    """The readable answer: the least budget, then one row per card."""
    from autofit.planning.capacity import config_words
    from autofit.planning.policy import POLICY

    per_sample = f" of {tokens} tokens" if tokens else ""
    lines = [
        f"capacity of {source}: batch {batch_size}{per_sample}, lossless levers only "
        "[estimated: simulated meter, FLOP-based speed]",
        "  least memory " + (
            f"{format_bytes(least)}: the floor with every lossless lever the host allows (checkpointing, offload, host state, "
            "step in backward, chunked loss)"
            if least is not None else "none: no card in the table holds this batch even with every lossless lever"
        ),
    ]
    rate = "tokens/s" if tokens else "samples/s"
    lines.append(f"  {'card':<16} {'memory':>10}  {'fits':<4} {'peak':>10} {rate:>10}  {'one step':>8}  chosen")
    for row in rows:
        chosen = row.chosen
        speed = chosen.samples_per_s * (tokens or 1) if chosen else None
        lines.append(
            f"  {row.card.name:<16} {format_bytes(row.card.memory_bytes):>10}  {'yes' if chosen else 'no':<4} "
            f"{format_bytes(chosen.peak_bytes) if chosen else '-':>10} {format_rate(speed) if chosen else '-':>10}  "
            f"{row.largest_one_step:>8}  {config_words(chosen.config) if chosen else '-'}"
        )
    lines.append(
        "  one step: the largest batch one micro-step holds there (lossless); with accumulation larger global batches "
        "train where one micro-batch fits (a step's memory grows with them by the inputs' copy only)"
    )
    lines.append(f"  peak: predicted, before the card's headroom (context, allocator reserve, fragmentation, {POLICY.safety_margin_share:.0%} margin)")
    for what, why in record.left_out.items():
        lines.append(f"  left out    {what}: {why}")
    lines.append(f"  answered in {seconds:.1f} s (precisions {', '.join(record.allowed.precisions)})")
    return lines
