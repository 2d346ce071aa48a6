"""The summary of a planning run as ``autofit plan`` prints it: the plan (``report.write_plan``) and how it was found.

One section per question a reader asks, in the order printed: what was chosen and where, the memory it needs
against the budget, its speed, the alternatives, how sure the timings are, and how the planning went.
"""
from __future__ import annotations

from pathlib import Path

from autofit.config import TrainingConfig
from autofit.distributed import NODE0_ADDRESS, torchrun_commands
from autofit.plan_file import DEFAULT_SEGMENTS, EXPANDABLE_SEGMENTS, Plan
from autofit.planning.policy import POLICY
from autofit.planning.report import PlanReport
from autofit.units import format_bytes, format_rate
from strategies import MASTER_WEIGHTS


def summary_lines(report: PlanReport, *, path: Path | None = None) -> list[str]:
    """The readable summary of a planning run (``path``: where the plan was written)."""
    return [
        *_chosen_lines(report.plan),
        *_memory_lines(report.plan),
        *_speed_lines(report),
        *_note_lines(report),
        *_alternative_lines(report),
        *timing_lines(report),
        *_start_lines(report.plan, path=path),
        *_planning_lines(report, path=path),
    ]


def _chosen_lines(plan: Plan) -> list[str]:
    """Where the plan trains (one device, or each rank's share) and what it chose."""
    measured = plan.measured
    ranks = measured.multi_process
    config = plan.config
    if ranks:
        on_nodes = f" on {config.nodes} nodes" if config.nodes > 1 else ""
        where = f"per GPU, {config.world_size} GPUs{on_nodes} ({config.sharding})"
        split = (f"per rank: micro-batch {config.micro_batch_size} x {config.grad_accum_steps} step(s) "
                 f"({config.world_size} ranks x {config.micro_batch_size} x {config.grad_accum_steps} >= {config.global_batch_size})")
        estimated = " [estimated: FSDP2 per-rank peak simulated]" if config.sharding_config().sharded else ""
    else:
        where = f"on {plan.device.name}"
        split = f"micro-batch {config.micro_batch_size} x {config.grad_accum_steps} step(s)"
        estimated = " [estimated: simulated meter, FLOP-based speed]" if plan.estimated else ""
    lines = [
        f"plan for {plan.model.source}: batch {config.global_batch_size}, budget {format_bytes(plan.budget_bytes)} "
        f"({plan.budget_kind}) {where}" + estimated,
        f"  chosen      {config.precision}, {split}, checkpoint {_blocks(config.checkpoint)}" + _levers(plan),
    ]
    if ranks:
        lines.append(f"  note        {ranks.note}")
    return lines


def _none_because(kind: str, config: TrainingConfig) -> str:
    """Why a kind of the peak's breakdown holds 0 B (it is taken at the peak): "gradients 0 B" in a full fine-tune
    reads as a mistake without it."""
    if kind == "optimizer_state" and (config.optimizer_state == "host" or config.precision == MASTER_WEIGHTS):
        return "on the host"
    if kind == "gradients" and config.optimizer_in_backward:
        return "each freed as its parameter steps in backward"
    if kind == "gradients" and config.precision == MASTER_WEIGHTS:
        return "moved to the host after each micro-batch"
    return "none alive at the peak"


def _memory_lines(plan: Plan) -> list[str]:
    """The peak, predicted and measured with its breakdown, the headroom by cause, and the total against the budget."""
    measured, predicted = plan.measured, plan.predicted
    lines = [f"  memory      {'predicted':>12} {f'measured ({measured.meter})':>20}"]
    for name, value in measured.breakdown.items():
        why = f"  ({_none_because(name, plan.config)})" if value == 0 else ""
        lines.append(f"    {name.replace('_', ' '):<18}{'':>12} {format_bytes(value):>20}{why}")
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
    return lines


def _speed_lines(report: PlanReport) -> list[str]:
    """Samples/s measured and predicted (tokens/s for a language model), and against the unconstrained configuration."""
    plan = report.plan
    measured, predicted = plan.measured, plan.predicted
    speed = measured.samples_per_s
    unconstrained = report.unconstrained
    tokens = plan.model.seq_len  # a language model's speed in tokens too
    text = f"{format_rate(speed)} samples/s measured" if speed else "not measured (simulated)"
    lines = [
        f"  speed       {text}, {format_rate(predicted.samples_per_s)} predicted"
        + (f" ({format_rate((speed or predicted.samples_per_s) * tokens)} tokens/s at {tokens} tokens a sample)" if tokens else "")
    ]
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
    return lines


def _note_lines(report: PlanReport) -> list[str]:
    """Precisions left out and why, what was noted of others, and the plan's own notes."""
    return [
        *(f"  left out    {precision}: {why}" for precision, why in report.excluded_precisions.items()),
        *(f"  note        {precision}: {note}" for precision, note in report.precision_notes.items()),
        *(f"  note        {note}" for note in report.plan.notes),
    ]


def _alternative_lines(report: PlanReport) -> list[str]:
    """The Pareto front the search scored, each marked as fitting by measurement or prediction, and the rejected."""
    lines = [
        "  alternatives (Pareto front of memory vs samples/s as predicted; fits: measured where measured; * chosen):",
        f"    {'peak':>12} {'measured':>12} {'samples/s':>10}  {'precision':<9} {'micro-batch':>14}  {'fits':<14} checkpoint",
    ]
    for alt in report.plan.alternatives:
        mark = "*" if alt["chosen"] else (" " if alt["fits_budget"] else "!")
        split = f"{alt['micro_batch_size']} x {alt['grad_accum_steps']}"
        measured_peak = alt.get("measured_peak_bytes", alt.get("simulated_peak_bytes"))
        lines.append(
            f"  {mark} {format_bytes(alt['predicted_peak_bytes']):>12} {format_bytes(measured_peak) if measured_peak is not None else '-':>12} "
            f"{format_rate(alt['predicted_samples_per_s']):>10}  {alt['precision']:<9} {split:>14}  {_fits_text(alt):<14} {_blocks(alt['checkpoint'])}"
            + _alternative_levers(alt)
        )
    lines.append(f"    (! = does not fit the budget; measured = by the {report.plan.measured.meter or 'plan'} meter)")
    if report.rejected:
        lines.append("  rejected    by measurement (the memory model's candidates that did not fit):")
        for rejection in report.rejected:
            lines.append(f"              {config_text(rejection['config'])}: {rejection['why']}")
    return lines


def _alternative_levers(alt: dict) -> str:
    """An alternative's levers beyond full checkpointing, as its row's tail."""
    return (
        (f"; selective {_blocks(alt['selective_checkpoint'])}" if alt.get("selective_checkpoint") else "")
        + (f"; offload {_blocks(alt['offload'])}" if alt.get("offload") else "")
        + ("; step in backward" if alt.get("optimizer_in_backward") else "")
        + (f"; {alt['optimizer_state']} state" if alt.get("optimizer_state", "device") != "device" else "")
        + (f"; loss in {alt['loss_chunks']} chunks" if alt.get("loss_chunks", 1) != 1 else "")
        + ("; base in NF4" if alt.get("frozen_nf4") else "")
        + ("; torch.compile" if alt.get("compile") else "")
    )


def _start_lines(plan: Plan, *, path: Path | None) -> list[str]:
    """Several processes: the torchrun command(s) that train the plan."""
    if not plan.measured.multi_process:
        return []
    commands = torchrun_commands(plan.config.sharding_config(), args=["train", "--plan", str(path or "plan.json")])
    lines = [f"  start       {command}" for command in commands]
    if len(commands) > 1:
        lines.append(f"              ({NODE0_ADDRESS}: node 0's address, which every node can reach; plan.json and the data on every node)")
    return lines


def _planning_lines(report: PlanReport, *, path: Path | None) -> list[str]:
    """Where the plan went, what planning took (in all and by step), and where its study is kept."""
    where = f"wrote {path}; " if path else ""
    lines = [
        f"  {where}planned in {report.seconds:.1f} s: {report.evaluations} points by {report.sampler}, "
        f"{report.simulated_checks} simulated checks, {report.memory_probes} memory probes, {report.real_probes} timed"
        + (" (resumed from the stored study)" if report.resumed else "")
    ]
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


def _levers(plan: Plan) -> str:
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


def timing_lines(report: PlanReport) -> list[str]:
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
            others = "; ".join(config_text(key) for key in timing["within_noise"])
            lines.append(
                f"              as fast as the chosen {config_text(report.plan.config.key())} within that noise: {others}; "
                "a tie goes to the simpler configuration, the chosen one"
            )
        # Beyond the tie (at most 5%) but within the noise reported: a quiet machine could rank these first.
        close = {
            key: behind for key, behind in timing.get("behind", {}).items()
            if key not in timing.get("within_noise", []) and 0 < behind <= timing["noise"]
        }
        if close and timing["rounds"] > 1:
            others = "; ".join(f"{config_text(key)} ({behind:.1%} slower)" for key, behind in sorted(close.items(), key=lambda kv: kv[1]))
            lines.append(f"              slower, but within that noise: {others}")
    if report.threads_note:
        lines.append(f"  threads     {report.threads_note}")
    return lines


def config_text(key: str) -> str:
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
