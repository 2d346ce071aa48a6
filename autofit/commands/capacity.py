"""`autofit capacity`: will it fit on my card? One row per card, from one simulated trace set."""
from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import typer

from autofit.cli import app
from autofit.commands.common import INPUT_SHAPE, LORA, MODEL_ARG, NUM_CLASSES, SEQ_LEN, TASK, load_model_spec, print_json
from autofit.errors import UserError
from autofit.units import format_bytes, format_rate


# The options whose help runs over a line, named here so that the command's signature reads as its list of flags.
LONGEST_OPTION = typer.Option(
    False, "--longest",
    help="Also the longest sequence the batch trains on each card (text models): traces at two more lengths, and a "
    "search of minutes for a large model (docs/capacity.md).",
)
ALLOW_LOSSY_OPTIMIZER_OPTION = typer.Option(
    False, "--allow-lossy-optimizer",
    help="Also answer with 8-bit AdamW state and bf16-pure (lossy: they change the optimizer's arithmetic), in columns of their own.",
)
ALLOW_LOSSY_BASE_OPTION = typer.Option(
    False, "--allow-lossy-base",
    help="Also answer with the frozen linear weights of a --lora base in 4-bit NF4 (lossy: QLoRA), in columns of their own.",
)


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
        None, "--plot", help="Also draw each card's chosen configuration's predicted peak against the batch in one step (with --longest, and "
        "against the sequence length), each card's usable memory a line (PNG).",
    ),
    longest: bool = LONGEST_OPTION,
    allow_lossy_optimizer: bool = ALLOW_LOSSY_OPTIMIZER_OPTION,
    allow_lossy_base: bool = ALLOW_LOSSY_BASE_OPTION,
    no_cache: bool = typer.Option(False, "--no-cache", help="Neither reuse nor keep costs in the cache ($AUTOFIT_CACHE_DIR, else ~/.cache/autofit)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines."),
    input_shape: str = INPUT_SHAPE,
    num_classes: int | None = NUM_CLASSES,
    task: str | None = TASK,
    seq_len: int | None = SEQ_LEN,
    lora: str | None = LORA,
) -> None:
    """For each card: does the batch train there (lossless), the least memory it needs, the planner's configuration and
    its estimated speed, the largest batch in one step (--longest: the longest sequence), from one simulated trace set."""
    from autofit.measure.meters import check_model_runs_simulated
    from autofit.planning.capacity import DEFAULT_CARDS, parse_cards
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
    wanted = _precisions(precisions)
    progress = as_progress(None if quiet else print_progress, started_s=started)
    with progress.beating():
        spec_at = partial(load_model_spec, model, input_shape=input_shape, num_classes=num_classes, task=task, lora=lora)
        with progress.doing("loading the model"):
            spec = spec_at(seq_len=seq_len)
        with progress.doing("checking that the model trains (one simulated step)"):
            check_model_runs_simulated(spec)
        largest = max(card.memory_bytes for card in cards)
        # One simulated GPU as large as the largest card: its traces (and the cache's) serve every card.
        # Traced at 2 samples at least: traces at one size draw no line in the batch for the largest batch to follow.
        request = PlanRequest(
            budget=largest, batch_size=max(batch_size, 2), device="cuda", simulate=True, device_memory=largest, host_memory=host_memory, host_speed=host_speed,
            precisions=wanted, num_classes=spec.source_options.get("num_classes"), cache=not no_cache, allow_lossy_optimizer=allow_lossy_optimizer,
            allow_lossy_base=allow_lossy_base,
        )
        if longest and spec.source_options.get("seq_len") is None:
            raise UserError(f"--longest: {model} takes no sequence (a text model's --task does); leave --longest out")
        levers = Levers(allow_lossy_optimizer=allow_lossy_optimizer, allow_lossy_base=allow_lossy_base)
        record, lengths, answers = _answers(
            spec, spec_at, request, levers, cards, global_batch_size=batch_size, longest=longest, configs=as_json, progress=progress,
        )
    plotted = _plot(plot, spec.source, batch_size, record, answers.rows, lengths) if plot is not None else None
    _print_answers(spec, batch_size, answers, record, lengths, seconds=time.perf_counter() - started, as_json=as_json, plot=plot,
                   plotted=plotted, host_speed_given=host_speed is not None)


def _answers(spec, spec_at, request, levers, cards, *, global_batch_size: int, longest: bool, configs: bool, progress):
    """The record at the user's length, with ``longest`` the records at the lengths the fit goes through, and every
    card's answers from them (``configs``: the longest sequence's configuration too, for --json)."""
    from autofit.planning.capacity import answer_cards, capacity_record
    from autofit.planning.context import plan_context
    from autofit.planning.length_workers import LengthWorkers
    from autofit.planning.lengths import traced_lengths

    given = spec.source_options.get("seq_len")
    context = plan_context(spec, request, log=progress)
    # --longest: the other lengths traced beside this one where the cores are free, started before this process's
    # own trace workers are counted (they see these as other work); not where the cache holds the user's length's
    # costs (the others' are likely there too: loading them here is quicker than starting a process for each).
    traced_aside = longest and context.study.load("costs") is None
    others = [length for length in traced_lengths(given, context_length=spec.context_length) if length != given] if traced_aside else []
    aside = LengthWorkers(spec_at, others, request, levers, progress=progress)
    try:
        own_started = time.perf_counter()
        record = capacity_record(context, levers=levers)
        lengths = _traced_lengths(
            record, spec, request, levers=levers, progress=progress, spec_at=spec_at, aside=aside, own_s=time.perf_counter() - own_started,
        ) if longest else None
        with progress.doing("searching every card"):
            answers = answer_cards(context, record, cards, global_batch_size=global_batch_size, lengths=lengths, longest_configs=configs)
    finally:
        aside.close()
        context.trace_pool.close()
    return record, lengths, answers


def _precisions(text: str | None) -> tuple[str, ...] | None:
    """``--precisions``: the names separated by commas (None: every precision).

    Raises:
        UserError: it names none.
    """
    wanted = None if text is None else tuple(p.strip() for p in text.split(",") if p.strip())
    if wanted == ():
        raise UserError(f"--precisions {text!r} names no precision; give e.g. --precisions bf16,fp32, or leave it out for all")
    return wanted


def _traced_lengths(record, spec, request, *, levers, progress, spec_at, aside, own_s: float):
    """``--longest``: the records at the given length (``record``, traced in ``own_s``) and the others the fit goes
    through, each traced as the given one was (``spec_at(seq_len=...)``: the spec at a length), by its process in
    ``aside`` (``length_workers.LengthWorkers``) where it has one, else here."""
    from autofit.planning.capacity import length_records, traced_record

    def trace(length: int):
        found = aside.record(length, own_s=own_s)
        if found is not None:
            return found
        progress(f"--longest: the costs at {length} tokens a sequence")
        return traced_record(spec_at(seq_len=length), request, levers=levers, log=progress)[0]

    return length_records(record, given=spec.source_options["seq_len"], context_length=spec.context_length, trace=trace)


def _print_answers(spec, batch_size: int, answers, record, lengths, *, seconds: float, as_json: bool, plot: Path | None,
                   plotted: str | None, host_speed_given: bool) -> None:
    """The rows as JSON, or as the table with what its speeds rest on and where the plot went (``answers``:
    ``capacity.answer_cards``'; ``lengths``: the traced lengths where --longest asked for them)."""
    from autofit.planning.capacity import is_lossy, lossless

    tokens = spec.source_options.get("seq_len") if spec.source_options.get("task", "causal-lm") != "image-classification" else None
    lossy = is_lossy(record.allowed)
    if as_json:
        print_json({
            "model": spec.source, "global_batch_size": batch_size, "seq_len": tokens, "estimated": True,
            "least_budget_bytes": answers.least_bytes, "precisions": list(lossless(record.allowed).precisions), "left_out": record.left_out,
            "lossy": _lossy_choices(record.allowed) if lossy else None, "least_budget_bytes_lossy": answers.least_lossy_bytes,
            "traced_seq_lens": lengths.lengths if lengths else None, "context_length": spec.context_length if lengths else None,
            "longest_note": answers.lengths_note or None,
            "cards": [row.to_dict(tokens_per_sample=tokens) for row in answers.rows], "seconds": seconds,
            "plot": str(plot) if plot is not None else None,
        })
        return
    lines = _table(spec.source, batch_size, tokens, answers.least_bytes, record, answers.rows, seconds, lengths=lengths)
    if answers.lengths_note:
        lines.insert(-1, f"  longest     {answers.lengths_note}")
    if lossy:
        lines[-1:-1] = _lossy_table(_lossy_choices(record.allowed), answers.least_lossy_bytes, answers.rows, longest=lengths is not None)
    if not host_speed_given and any(row.chosen and row.chosen.config.updates_on_host for row in answers.rows):
        lines.insert(-1, "  speed: the host's optimizer update (bf16-master's fp32 masters, host state) is assumed at each card's typical "
                     "host's rate (the device table, docs/planner.md), not timed here; --host-speed gives the training machine's")
    if plotted is not None:
        lines.append(plotted)
    print("\n".join(lines))


def _plot(out: Path, source: str, batch_size: int, record, rows, lengths) -> str:
    """``--plot``: each card's chosen configuration's peak from the batch of 1 to past every card's largest batch in
    one step (where no card has one: each precision with no block and with every block checkpointed), and with
    ``lengths`` (--longest) against the sequence length too; the line that says what it drew."""
    from autofit.planning.capacity import batch_curves, chosen_configs, length_curves, peak_curves, plotted_lengths
    from autofit.planning.lengths import LengthsDiffer
    from autofit.tools.capacity_plot import Panel, plot_capacity

    top = max([batch_size, *(row.largest_one_step for row in rows)])
    sizes = sorted({max(1, round(1.25 * top * 2 ** (-i / 2))) for i in range(16)})
    configs = chosen_configs(rows)
    try:
        curves = batch_curves(record.model, configs, batch_sizes=sizes) if configs else None
    except ValueError:  # a configuration the cost model cannot price at another batch: the precisions' lines instead
        configs, curves = {}, None
    if curves is None:
        curves = peak_curves(record.model, batch_sizes=sizes, precisions=record.allowed.precisions)
    drawn = "each card's chosen configuration" if configs else "each precision with no block and with every block checkpointed"
    panels = [Panel(xs=sizes, curves=curves, xlabel="batch in one micro-step (samples)", title=f"{source}: peak against the batch in one step")]
    against = "the batch in one step"
    if lengths is not None and configs:
        seq_lens = plotted_lengths(lengths)
        try:
            by_length = length_curves(lengths, configs, seq_lens=seq_lens)
        except (LengthsDiffer, ValueError):  # said under the table already, or not priced there: the batch's panel stands
            by_length = None
        if by_length is not None:
            marks = {}
            for row in rows:  # cards of one memory share the answer: one line, named after them all
                if row.longest is not None and row.longest.seq_len:
                    marks.setdefault(row.longest.seq_len, []).append(row.card.name)
            panels.append(Panel(
                xs=seq_lens, curves=by_length, xlabel="sequence length (tokens)",
                title=f"{source}: peak against the sequence length, batch {batch_size}",
                marks={f"{', '.join(names)}: longest {length} (with the levers it needs there)": length for length, names in marks.items()},
            ))
            against += " and the sequence length"
    cards = {
        f"{row.card.name}: what its headroom leaves": min((row.usable_bytes[p] for p in record.allowed.precisions), default=row.card.memory_bytes)
        for row in rows
    }
    plot_capacity(panels, cards, out)
    return f"  wrote {out}: the predicted peak of {drawn} against {against}, each card's usable memory a line"


def _table(source: str, batch_size: int, tokens: int | None, least: int | None, record, rows, seconds: float, *, lengths) -> list[str]:
    """The readable answer: the least budget, then one row per card (``lengths``: with the longest sequence)."""
    from autofit.planning.capacity import config_words, lossless
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
    longest = f"  {'longest':>20}" if lengths is not None else ""
    lines.append(f"  {'card':<16} {'memory':>10}  {'fits':<4} {'peak':>10} {rate:>10}  {'one step':>8}{longest}  chosen")
    for row in rows:
        chosen = row.chosen
        speed = chosen.samples_per_s * (tokens or 1) if chosen else None
        longest = f"  {row.longest.words() if row.longest is not None else '-':>20}" if lengths is not None else ""
        lines.append(
            f"  {row.card.name:<16} {format_bytes(row.card.memory_bytes):>10}  {'yes' if chosen else 'no':<4} "
            f"{format_bytes(chosen.peak_bytes) if chosen else '-':>10} {format_rate(speed) if chosen else '-':>10}  "
            f"{row.largest_one_step:>8}{longest}  {config_words(chosen.config) if chosen else '-'}"
        )
    lines.append(
        "  one step: the largest batch one micro-step holds there (lossless); with accumulation larger global batches "
        "train where one micro-batch fits (a step's memory grows with them by the inputs' copy only)"
    )
    if lengths is not None:
        lines.append(_longest_line(batch_size, lengths))
    lines.append(f"  peak: predicted, before the card's headroom (context, allocator reserve, fragmentation, {POLICY.safety_margin_share:.0%} margin)")
    for what, why in record.left_out.items():
        lines.append(f"  left out    {what}: {why}")
    lines.append(f"  answered in {seconds:.1f} s (precisions {', '.join(lossless(record.allowed).precisions)})")
    return lines


def _longest_line(batch_size: int, lengths) -> str:
    """What the longest column means, and the lengths its answers are fitted through."""
    from autofit.planning.lengths import SEQ_LEN_STEP

    top = f", at most the model's context length {lengths.context_length}" if lengths.context_length else ""
    return (
        f"  longest: the longest sequence (a multiple of {SEQ_LEN_STEP} tokens{top}) a batch of {batch_size} trains there "
        f"(lossless), each term fitted through traces at {', '.join(map(str, lengths.lengths))} tokens (quadratic in the "
        "length); in brackets how far it lies from the nearest traced length"
    )


def _lossy_choices(allowed) -> list[str]:
    """The declared lossy choices ``allowed`` holds (what ``capacity.lossless`` takes away), in words."""
    from strategies import PURE_BF16

    choices = []
    if allowed.levers is not None and allowed.levers.eight_bit is not None:
        choices.append("8-bit optimizer state")
    if PURE_BF16 in allowed.precisions:
        choices.append("bf16-pure")
    if allowed.levers is not None and allowed.levers.nf4 is not None:
        choices.append("frozen weights in NF4")
    return choices


def _lossy_table(choices: list[str], least: int | None, rows, *, longest: bool) -> list[str]:
    """The answers with the declared lossy choices allowed: a table of their own under the lossless one."""
    from autofit.planning.capacity import Longest

    lines = [
        f"  with the lossy choices allowed ({', '.join(choices)}), apart from the lossless answers above:",
        "  least memory " + (format_bytes(least) if least is not None else "none: no card in the table holds this batch"),
        f"  {'card':<16} {'fits':<4}  {'one step':>8}" + (f"  {'longest':>20}" if longest else ""),
    ]
    for row in rows:
        answer = row.lossy
        words = ""
        if longest and answer.longest_seq_len is not None:
            words = f"  {Longest(seq_len=answer.longest_seq_len, nearest_traced=answer.longest_seq_len_nearest_traced or 0).words():>20}"
        lines.append(f"  {row.card.name:<16} {'yes' if answer.fits else 'no':<4}  {answer.largest_one_step:>8}" + words)
    return lines
