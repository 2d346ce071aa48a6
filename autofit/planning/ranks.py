"""Planning for N > 1 processes: one rank's share of the global batch, planned as one process.

The global batch is cut into N rank shares of ceil(G / N) samples. DDP keeps
whole parameters and needs no all-gathers, so it is the faster choice
whenever it fits: the one-process plan of a share with one gradient-size
allowance for DDP's buckets, restated for N processes (``restate_for_ddp``).
When that is below the floor, FSDP2 (``plan_fsdp``): per-rank candidates
ranked by the conservative estimate, the fastest few simulated on a fake
process group. N processes are never run while planning: the plan says what
was measured on one process and what was simulated or allowed for.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from autofit.errors import UserError
from autofit.plan_file import Measured, MultiProcess, Plan, Predicted
from autofit.config import TrainingConfig
from autofit.planning.context import PlanContext
from autofit.planning.bounds import rank_state
from autofit.planning.verify.floor import RANK_HALF_PRECISIONS, InfeasibleBudget, floor_phases, sharded_floor
from autofit.planning.memory.headroom import Headroom, persistent_bytes
from autofit.planning.modelling import HALF_PRECISIONS, Costs, add_recomputations, add_speeds, rank_compute_memory, trace_full, weight_casts
from autofit.planning.policy import POLICY
from autofit.planning.memory.per_rank import estimate_fsdp_peak_bytes, fsdp_layout, simulate_fsdp_peak_bytes
from autofit.planning.memory.levers import LeverChoice, lever_segments
from autofit.planning.memory.segments import Segment, apart_from_step, peak_of
from autofit.planning.search.knapsack import cheapest_checkpoint
from autofit.planning.verify.measurements import Measurements
from autofit.planning.report import PlanReport, batch_norm_notes, plan_basics
from autofit.spec import ModelSpec
from autofit.units import format_bytes
from strategies import micro_batch_count
from strategies.optimizer_state import held_weight_bytes

MULTI_PROCESS_NOTE = (
    "{world_size} processes were not run while planning: memory and speed are one process's, training one rank's "
    "share ({rank_batch_size} samples) of the global batch; communication time is not counted"
)


def check_ranks(*, batch_size: int, world_size: int, nodes: int = 1) -> None:
    """Every rank needs a whole sample at least."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise UserError(f"--batch-size {batch_size!r} must be a whole number of samples, at least 1")
    if batch_size < world_size:
        gpus = f"--gpus {world_size}" if nodes == 1 else f"the {world_size} GPUs (--gpus {world_size // nodes} on --nodes {nodes})"
        raise UserError(
            f"--batch-size {batch_size} is smaller than {gpus}: every GPU needs at least one sample per step; "
            f"raise --batch-size or lower --gpus"
        )


def gradient_bytes(spec: ModelSpec) -> int:
    """Bytes of the model's gradients (fp32 like its parameters): one DDP bucket set."""
    with torch.device("meta"):
        model = spec.build_model()
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def restate_for_ddp(
    report: PlanReport, *, budget_bytes: int, allowance: int, world_size: int, global_batch_size: int, nodes: int = 1,
) -> PlanReport:
    """The one-process plan of a rank's share, restated for ``world_size`` processes (on ``nodes`` machines) under DDP."""
    plan = report.plan
    config = replace(plan.config, global_batch_size=global_batch_size, world_size=world_size, sharding="ddp", nodes=nodes)
    rank_batch_size = config.rank_batch_size
    plan = replace(
        plan, budget_bytes=budget_bytes, config=config,
        # DDP's buckets (gradient_as_bucket_view off) hold one more copy of the gradients: allowed for, not measured.
        headroom={**plan.headroom, "ddp_buckets_allowance": allowance},
        predicted=replace(plan.predicted, per_rank_peak_bytes=int(plan.measured.peak_bytes) + allowance),
        measured=replace(plan.measured, multi_process=MultiProcess(
            world_size=world_size, sharding="ddp", rank_batch_size=rank_batch_size,
            note=MULTI_PROCESS_NOTE.format(world_size=world_size, rank_batch_size=rank_batch_size)
            + f"; DDP's gradient buckets are an allowance ({format_bytes(allowance)}), not measured",
        )),
    )
    return replace(report, plan=plan)


def restate_for_hsdp(report: PlanReport, *, nodes: int, global_batch_size: int) -> PlanReport:
    """An FSDP2 plan over one node's processes (``plan_fsdp``), restated for ``nodes`` such nodes under HSDP: each rank
    holds what it held there (the node's shard, the same share of the batch)."""
    plan = report.plan
    per_node = plan.config.world_size
    world_size = nodes * per_node
    config = replace(plan.config, global_batch_size=global_batch_size, world_size=world_size, sharding="hsdp", nodes=nodes)
    rank_batch_size = config.rank_batch_size
    multi_process = MultiProcess(
        world_size=world_size, sharding="hsdp", rank_batch_size=rank_batch_size,
        note=MULTI_PROCESS_NOTE.format(world_size=world_size, rank_batch_size=rank_batch_size)
        + f"; the per-rank peak is FSDP2 over one node's {per_node} processes run in one process on a fake process group "
        "(simulated, not measured); the all-reduce of each rank's gradient shard across the nodes is not simulated",
    )
    # The notes on batch norm name the global batch: the whole one, not one node's.
    per_node_notes = batch_norm_notes(plan.model, micro_batch_size=config.micro_batch_size, global_batch_size=plan.config.global_batch_size)
    notes = [note for note in plan.notes if note not in per_node_notes]
    notes += batch_norm_notes(plan.model, micro_batch_size=config.micro_batch_size, global_batch_size=global_batch_size)
    plan = replace(plan, config=config, notes=notes, measured=replace(plan.measured, multi_process=multi_process))
    return replace(report, plan=plan)


@dataclass(kw_only=True, slots=True)
class _Candidate:
    """A per-rank configuration under FSDP2, as the conservative estimate sees it."""

    samples_per_s: float
    config: TrainingConfig
    """The whole configuration: the global batch over ``world_size`` FSDP2 ranks."""
    estimate_bytes: float
    """Estimated per-rank peak."""
    fits_estimate: bool


def plan_fsdp(context: PlanContext, costs: Costs, *, world_size: int, global_batch_size: int, nodes: int = 1) -> PlanReport:
    """FSDP2: per-rank candidates ranked by the conservative estimate, the fastest verified by simulation.

    ``context`` is one rank's: its share of the batch, the whole per-GPU budget. ``nodes``: the machines the
    ``world_size`` processes span (the plan's, and its advice's GPUs are per node).
    """
    notes = add_speeds(context, costs)
    for precision in context.precisions:  # every precision is ranked by the FSDP2 estimate: each needs its memory
        trace_full(context, costs, precision)
        add_recomputations(context, costs, precision)  # with every block checkpointed too (a DDP attempt may have left them out)
    measurements = Measurements(context, host_sample_bytes=costs.host_sample_bytes)
    smallest = TrainingConfig(
        global_batch_size=context.global_batch_size, precision=context.precisions[0], micro_batch_size=costs.micro_batch_sizes[-1],
    )
    _, single = measurements.exact_peak(smallest)
    headroom = measurements.headroom
    # A rank's share of the parameters and optimizer state: a lower bound of its persistent bytes at any peak (the
    # simulated breakdown counts FSDP2's gathered parameters as parameters too, which come and go).
    resident = measurements.resident_bytes // world_size
    compute = rank_compute_memory(context, costs)
    candidates = _fsdp_candidates(
        context, costs, single=single, headroom=headroom, resident_bytes=resident, world_size=world_size, global_batch_size=global_batch_size,
        compute=compute,
    )
    context.log(f"FSDP2: {sum(c.fits_estimate for c in candidates)} of {len(candidates)} per-rank configurations fit by the estimate; simulating")
    chosen, simulated, alternatives, rejected = _simulate_fastest(
        context, candidates, headroom=headroom, resident_bytes=resident, memory_scale=costs.model.memory_scale, world_size=world_size
    )
    if chosen is None:
        # The one-process floor's --gpus advice prices the floor configuration (every block checkpointed) with its
        # forward/backward and step apart (the step's temporaries a 1/N share a rank); so does this refusal, or the
        # two name budgets far apart for one question (the step's fp32 copies counted as unsharded activations).
        every = frozenset(range(len(costs.model.blocks)))
        checkpointed = replace(smallest, checkpoint=costs.model.names(every))
        raise _infeasible(
            context, single=single, smallest=smallest, headroom=headroom, world_size=world_size, global_batch_size=global_batch_size,
            nodes=nodes, phases=floor_phases(costs, checkpointed, state_bytes=persistent_bytes(single)),
            half=_half_rank_floor(context, costs, compute, smallest=smallest, every=every),
        )
    candidate, measurement = chosen
    config = candidate.config
    context.log(f"FSDP2: {config.precision}, micro-batch {config.micro_batch_size} x {config.grad_accum_steps} per rank, simulated to fit")
    plan = _fsdp_plan(
        context, costs, candidate=replace(candidate, config=replace(candidate.config, nodes=nodes)), measurement=measurement,
        headroom=headroom, resident_bytes=resident, world_size=world_size, global_batch_size=global_batch_size,
        alternatives=sorted(alternatives, key=lambda a: a["predicted_peak_bytes"]),
    )
    return PlanReport(
        plan=plan, excluded_precisions=context.excluded_precisions, precision_notes=notes,
        sampler="the FSDP2 estimate (all points)", evaluations=len(candidates), simulated_checks=simulated,
        rejected=rejected, costs=costs.model,
    )


def _fsdp_candidates(
    context: PlanContext, costs: Costs, *, single: dict, headroom: Headroom, resident_bytes: int, world_size: int, global_batch_size: int,
    compute=None,
) -> list[_Candidate]:
    """Every (precision, micro-batch) with the cheapest checkpoint set the estimate says fits, and with every block.

    ``compute``: the traces of bf16 autocast over bf16 weights (``modelling.rank_compute_memory``), whose forward
    and backward a half precision's rank holds beside its state; None: the precision's own, less autocast's copies
    of the fp32 weights.

    Estimated to fit first, fastest first; then the rest, least memory first (the estimate is mostly high, 3-38%,
    but not always: simulated ranks of two small CNNs held 21% (8 GPUs) and 41% (64 GPUs) more than it; an 8B Llama
    on 8 GPUs 1.5% high, a 70B one on 64 8.5% high: bench/RESULTS.md).
    """
    shares = _RankShares(
        context, costs, single=single, headroom=headroom, resident_bytes=resident_bytes, world_size=world_size,
        global_batch_size=global_batch_size, compute=compute,
    )
    candidates = [c for precision in context.precisions for size in costs.micro_batch_sizes for c in shares.candidates(precision, size)]
    candidates.sort(key=lambda c: (
        not c.fits_estimate, -round(c.samples_per_s, 6) if c.fits_estimate else c.estimate_bytes,
        c.config.simplicity(),
    ))
    return candidates


class _RankShares:
    """One rank's share of every (precision, micro-batch) point: the FSDP2 estimate of its state and buffers, the
    one-process segments with the state swapped for the rank's, and the cheapest checkpoint set that fits them."""

    def __init__(
        self, context: PlanContext, costs: Costs, *, single: dict, headroom: Headroom, resident_bytes: int, world_size: int,
        global_batch_size: int, compute,
    ) -> None:
        self.context, self.model, self.compute = context, costs.model, compute
        self.world_size, self.global_batch_size = world_size, global_batch_size
        state = {key: single.get(key, 0) for key in ("parameters", "gradients", "optimizer_state")}
        # Whole gradients, whatever the single process's peak held of them: its backward and its step hold them all.
        state["gradients"] = max(state["gradients"], gradient_bytes(context.sim_spec))
        self.state = state
        with torch.device("meta"):
            meta_model = context.sim_spec.build_model()
        self.layout = fsdp_layout(meta_model, world_size=world_size)
        self.compute_weights = held_weight_bytes(meta_model, cast=True) + sum(b.numel() * b.element_size() for b in meta_model.buffers())
        self.usable = headroom.usable_bytes(persistent_bytes=resident_bytes) / self.model.memory_scale
        self._casts_of: dict[bool, tuple[list[int], int]] = {}

    def casts_for(self, precision: str) -> tuple[list[int], int]:
        # Autocast's copies are 2-byte ones under bf16 and fp16 alike (``weight_casts``): one fake forward for both.
        half = precision in HALF_PRECISIONS
        if half not in self._casts_of:
            self._casts_of[half] = casts_by_block(self.model.blocks, weight_casts(self.context, precision))
        return self._casts_of[half]

    def candidates(self, precision: str, size: int) -> list[_Candidate]:
        """The point with its cheapest fitting checkpoint set (when the estimate finds one), and with every block."""
        model, state, world_size = self.model, self.state, self.world_size
        steps = micro_batch_count(self.global_batch_size, world_size=world_size, micro_batch_size=size)
        estimate = estimate_fsdp_peak_bytes(
            parameter_bytes=state["parameters"], gradient_bytes=state["gradients"],
            optimizer_state_bytes=state["optimizer_state"], activation_bytes=0, layout=self.layout,
            world_size=world_size, precision=precision, grad_accum_steps=steps,
        )
        memory = model.precisions[precision].memory
        segments, drops = memory.at(size, global_batch_size=self.context.global_batch_size)
        # The optimizer step runs apart: a rank updates its shards, so the one-process step's temporaries above
        # the whole state (a foreach step's fp32 copy of every parameter) are a 1/N share there, and no block
        # is gathered. Forward and backward keep the one-process segments, with the state swapped: what of it
        # they hold (``_without_state``) for the rank's sharded part and the buffers.
        _, step_peak = apart_from_step(segments)
        backward, drops, held = self.forward_and_backward(precision, size, memory, segments, drops, estimate=estimate)
        swap = estimate.peak_bytes - held
        step_bytes = estimate.state_bytes + max(step_peak * model.memory_scale - sum(state.values()), 0) / world_size
        choice = (
            cheapest_checkpoint(backward, drops, model.recompute_seconds(precision, size), limit_bytes=self.usable - swap)
            if step_bytes <= self.usable else None
        )
        every = frozenset(range(len(model.blocks)))
        options = [(choice.blocks, True)] if choice is not None else []
        if choice is None or choice.blocks != every:
            # Every block too, among those the estimate says do not fit: the estimate is not always high, and
            # where the simulation finds its choice too large, the least memory at this point may still fit.
            options.append((every, False))
        return [
            _Candidate(
                samples_per_s=model.samples_per_s(precision, size, blocks),
                config=TrainingConfig(
                    global_batch_size=self.global_batch_size, micro_batch_size=size, precision=precision,
                    checkpoint=model.names(blocks), world_size=world_size, sharding="fsdp",
                ),
                estimate_bytes=max(peak_of(backward, drops, blocks) * model.memory_scale + swap, step_bytes),
                fits_estimate=fits_estimate,
            )
            for blocks, fits_estimate in options
        ]

    def forward_and_backward(self, precision: str, size: int, memory, segments, drops, *, estimate):
        """(segments, drops, the weights they hold) of the rank's forward and backward, the state taken out."""
        global_batch_size = self.context.global_batch_size
        if self.compute is not None and precision in HALF_PRECISIONS:
            # Their segments hold bf16 weights and no gradient or state (those go to the host as they come).
            lighter = estimate.buffer_bytes - estimate.forward_buffer_bytes
            rank_segments, drops = self.compute.at(size, global_batch_size=global_batch_size)
            rank_segments = _before_backward_lighter(self.compute, rank_segments, size, global_batch_size=global_batch_size, lighter=lighter)
            return apart_from_step(rank_segments)[0], drops, self.compute_weights
        backward, held = _without_state(memory, size, global_batch_size=global_batch_size, segments=segments, state=self.state)
        backward, drops = without_casts(backward, drops, self.casts_for(precision))
        return backward, drops, held


def _before_backward_lighter(memory, segments: list[Segment], size: int, *, global_batch_size: int, lighter: float) -> list[Segment]:
    """``memory.at``'s ``segments`` with those before any block's backward ``lighter`` (the rank's buffers there hold
    gathered parameters only: no unsharded gradient, no reduce-scatter input); as they are without lever records."""
    flags = memory.in_backward(size, global_batch_size=global_batch_size)
    if flags is None:
        return segments
    return [replace(s, peak_bytes=s.peak_bytes - (0 if in_backward else lighter)) for s, in_backward in zip(segments, flags)]


def _without_state(memory, size: int, *, global_batch_size: int, segments: list[Segment], state: dict) -> tuple[list[Segment], int]:
    """Forward and backward's one-process segments with the optimizer state and every gradient taken off where the
    traces' lever records know what each held (``memory.levers.lever_segments``, as for host state), and the state
    they still hold (the parameters); without those records, the plain segments and the whole state.

    A segment holds the gradients accumulated so far, none early in the first micro-step's backward: taking the whole
    state off every segment made a 70B Llama's rank at micro-batch 8 (one micro-step, whose backward peaks before most
    gradients exist) an estimate of a fifth of its simulated peak.
    """
    if memory.has_levers():
        found = lever_segments(memory, size, global_batch_size=global_batch_size, choice=LeverChoice(optimizer_state="host"))
        if found is not None:
            kept = [
                Segment(peak_bytes=s.peak_bytes, dropped=s.dropped, phase=s.phase, recomputes=s.recomputes, selective=s.selective)
                for s in found[0] if s.phase != "optimizer"
            ]
            return kept, state["parameters"]
    return apart_from_step(segments)[0], sum(state.values())


def casts_by_block(blocks: list[str], casts: dict[str, int]) -> tuple[list[int], int]:
    """Autocast's weight copies (``modelling.weight_casts``) per block, and those of the weights outside every block."""
    per_block = [sum(nbytes for name, nbytes in casts.items() if name.startswith(block + ".")) for block in blocks]
    return per_block, sum(casts.values()) - sum(per_block)


def without_casts(segments: list[Segment], drops: list[float], casts: tuple[list[int], int]) -> tuple[list[Segment], list[float]]:
    """The one-process segments without autocast's copies of the weights, which a rank under FSDP2 never makes (it
    gathers the weights in the autocast dtype already, ``mixed_precision_policy``).

    A block's copies are held where its forward has ended and its backward not begun (autograd saved them; the cast
    cache holds them to the forward's end): the segments' ``dropped`` blocks. Those of weights outside the blocks (an
    output layer) are taken off every segment but the optimizer step's. What checkpointing a block frees is taken to
    hold its copies, so it frees that much less here (at least nothing).
    """
    per_block, outside = casts
    if not outside and not any(per_block):
        return segments, drops
    kept = [
        replace(segment, peak_bytes=segment.peak_bytes - (
            0 if segment.phase == "optimizer" else outside + sum(per_block[b] for b in segment.dropped)
        ))
        for segment in segments
    ]
    return kept, [max(drop - per_block[b], 0.0) for b, drop in enumerate(drops)]


def _simulate_fastest(
    context: PlanContext, candidates: list[_Candidate], *, headroom: Headroom, resident_bytes: int, memory_scale: float, world_size: int
) -> tuple[tuple | None, int, list[dict], list[dict]]:
    """Simulate candidates in order until one fits (``POLICY.verify_top_candidates`` + 1 at most).

    Returns:
        (the candidate chosen and its simulated measurement) or None, the simulations run,
        every candidate as an alternative, and the rejected ones with why.
    """
    backend = "gloo" if context.device == "cpu" else "nccl"
    chosen, simulated, alternatives, rejected = None, 0, [], []
    for candidate in candidates:
        config = candidate.config
        entry = {
            "precision": config.precision, "micro_batch_size": config.micro_batch_size,
            "grad_accum_steps": config.grad_accum_steps, "checkpoint": list(config.checkpoint),
            "predicted_peak_bytes": int(candidate.estimate_bytes), "predicted_samples_per_s": candidate.samples_per_s,
            "fits_budget": headroom.fits(candidate.estimate_bytes * memory_scale, persistent_bytes=resident_bytes), "chosen": False,
        }
        alternatives.append(entry)
        if chosen is not None or simulated >= POLICY.verify_top_candidates + 1:
            continue
        measurement = simulate_fsdp_peak_bytes(
            context.sim_spec, world_size=world_size, micro_batch_size=config.micro_batch_size,
            grad_accum_steps=config.grad_accum_steps, precision=config.precision,
            checkpoint=list(config.checkpoint), backend=backend,
        )
        simulated += 1
        entry.update(
            simulated_peak_bytes=measurement.peak_bytes, fits_budget=headroom.fits(measurement.peak_bytes, persistent_bytes=resident_bytes)
        )
        if entry["fits_budget"]:
            chosen, entry["chosen"] = (candidate, measurement), True
        else:
            entry["rejected"] = f"simulated per-rank peak {format_bytes(measurement.peak_bytes)} does not fit"
            rejected.append({"config": config.key(), "why": entry["rejected"]})
    return chosen, simulated, alternatives, rejected


def _fsdp_plan(
    context: PlanContext, costs: Costs, *, candidate: _Candidate, measurement, headroom: Headroom, resident_bytes: int, world_size: int,
    global_batch_size: int, alternatives: list[dict],
) -> Plan:
    config = candidate.config
    rank_batch_size = context.global_batch_size
    basics = plan_basics(context, output_shape=costs.model.output_shape, micro_batch_size=config.micro_batch_size, global_batch_size=global_batch_size)
    return basics.plan(
        config=config,
        estimated=True,
        predicted=Predicted(
            peak_bytes=int(measurement.peak_bytes), per_rank_peak_bytes=int(measurement.peak_bytes),
            samples_per_s=candidate.samples_per_s, estimate_peak_bytes=int(candidate.estimate_bytes),
        ),
        measured=Measured(
            peak_bytes=int(measurement.peak_bytes), samples_per_s=None,
            meter="simulated", breakdown=dict(measurement.breakdown),
            multi_process=MultiProcess(
                world_size=world_size, sharding="fsdp", rank_batch_size=rank_batch_size,
                note=MULTI_PROCESS_NOTE.format(world_size=world_size, rank_batch_size=rank_batch_size)
                + "; the per-rank peak is FSDP2 run in one process on a fake process group (simulated, not measured)",
            ),
        ),
        headroom=headroom.for_peak(measurement.peak_bytes, persistent_bytes=resident_bytes),
        alternatives=alternatives,
    )


def _half_rank_floor(
    context: PlanContext, costs: Costs, compute, *, smallest: TrainingConfig, every: frozenset[int],
) -> tuple[str, dict[str, int], tuple[int, int]] | None:
    """(half precision, breakdown, phases) of the least configuration (``smallest``'s micro-batch, every block
    checkpointed) as the one-process floor's --gpus advice prices a half precision's rank (``floor._gpus_advice``):
    the fp32 state and its step counted from sizes (``bounds.rank_state``), the forward and backward of bf16 autocast
    over bf16 weights (``compute``, bf16-master's traces) above those weights. None without those traces."""
    half = next((p for p in context.precisions if p in RANK_HALF_PRECISIONS), None)
    rank = rank_state(context) if compute is not None and half is not None else None
    if rank is None:
        return None
    try:
        segments, drops = compute.at(smallest.micro_batch_size, global_batch_size=context.global_batch_size)
    except (KeyError, ValueError):
        return None
    meta = context.meta_model
    weights = held_weight_bytes(meta, cast=True) + sum(b.numel() * b.element_size() for b in meta.buffers())
    activations = max(int(peak_of(apart_from_step(segments)[0], drops, every) * costs.model.memory_scale) - weights, 0)
    return half, rank.breakdown, (activations, rank.step_bytes)


def _infeasible(
    context: PlanContext, *, single: dict, smallest: TrainingConfig, headroom: Headroom, world_size: int, global_batch_size: int,
    nodes: int = 1, phases: tuple[int, int] | None = None, half: tuple[str, dict[str, int], tuple[int, int]] | None = None,
) -> InfeasibleBudget:
    """The refusal of a budget no FSDP2 configuration was simulated to fit, with how many GPUs would (``sharded_floor``):
    priced as a half precision's rank where ``half`` says how (the one-process advice's estimate, so that advice and
    refusal name one budget), else from ``single``'s breakdown and ``phases``."""
    precision, breakdown = smallest.precision, single
    if half is not None:
        precision, breakdown, phases = half
    sharded = sharded_floor(
        context.sim_spec, breakdown=breakdown, precision=precision, headroom=headroom,
        micro_batch_size=smallest.micro_batch_size, global_batch_size=global_batch_size, phases=phases,
    )
    if sharded.gpus is not None and sharded.gpus > world_size and nodes > 1:
        advice = f"try --gpus {-(-sharded.gpus // nodes)} on each of the {nodes} nodes (estimated)"
    elif sharded.gpus is not None and sharded.gpus > world_size:
        advice = f"try --gpus {sharded.gpus} (estimated)"
    elif sharded.gpus is not None:
        advice = "try more --gpus"
    else:
        need = f"with --gpus {sharded.best_gpus} each needs {format_bytes(sharded.budget_bytes)} per GPU, estimated"
        if sharded.limit_bytes <= context.budget_bytes:  # the batch, not the bytes, stops more GPUs from fitting
            advice = f"a batch of {global_batch_size} is split between {sharded.best_gpus} GPUs at most ({need}; more samples a step could go to more GPUs)"
        else:
            advice = (
                f"more GPUs would not help (each still holds the activations and FSDP2's gathered blocks: "
                f"{format_bytes(sharded.limit_bytes)} per GPU with any number of GPUs; {need})"
            )
    return InfeasibleBudget(
        f"budget {format_bytes(context.budget_bytes)} per GPU is too small for a batch of {global_batch_size} on {world_size} GPUs"
        f"{f' ({nodes} nodes)' if nodes > 1 else ''}: "
        f"no FSDP2 configuration was simulated to fit (micro-batch down to {smallest.micro_batch_size}, checkpointing "
        f"every block); {advice}, or raise --budget",
        floor_bytes=0, breakdown=single,
    )
