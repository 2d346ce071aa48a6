"""The floor: the smallest budget anything can train in, checked before the search.

The floor configuration is the smallest micro-batch the model trains with,
every block checkpointed or none, whichever the memory model says is smaller,
in the precision that makes it smallest. It is measured by the meter that has
the last word, so a budget below it fails in seconds, with the floor's
breakdown and what would lower it (an optimizer with less state, more GPUs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from autofit.errors import UserError
from autofit.measure.meters import frozen_note
from autofit.config import TrainingConfig
from autofit.planning.bounds import rank_state
from autofit.planning.context import PlanContext
from autofit.planning.memory.headroom import PERSISTENT, Headroom, persistent_bytes
from autofit.planning.memory.segments import apart_from_step, peak_of
from autofit.planning.modelling import Costs
from autofit.planning.memory.per_rank import ShardedMemoryEstimate, estimate_fsdp_peak_bytes, fsdp_layout
from autofit.planning.policy import POLICY
from autofit.planning.verify.measurements import Measurements
from autofit.spec import ModelSpec
from autofit.units import format_bytes
from strategies import MASTER_WEIGHTS, PRECISIONS, PURE_BF16, micro_batch_count

ONE_PROCESS_PRECISIONS = (MASTER_WEIGHTS, PURE_BF16)
"""bf16 weights (their masters on the host, or none): they train on one process only, not on several GPUs."""
RANK_HALF_PRECISIONS = ("bf16", "fp16")
"""The half precisions a rank of several trains in (autocast over its gathered weights in that dtype)."""


class InfeasibleBudget(UserError):
    """The budget is below the floor: nothing can train in it."""

    def __init__(self, message: str, *, floor_bytes: int, breakdown: dict[str, int], floor: Floor | None = None) -> None:
        super().__init__(message)
        self.floor_bytes = floor_bytes
        self.breakdown = breakdown
        self.floor = floor
        """The floor configuration and its measured budget (what the levers start from)."""


@dataclass(frozen=True, kw_only=True)
class Floor:
    config: TrainingConfig
    budget_bytes: int
    """The least budget whose headroom leaves room for the floor configuration's peak (measured, or predicted)."""
    breakdown: dict[str, int] = field(default_factory=dict)
    """Its measured peak and headroom, by cause (empty when predicted)."""
    measured: bool = True
    phases: tuple[int, int] | None = None
    """(activations in forward and backward, the optimizer step's temporaries), each above the whole state, by the
    memory model: what ranks would hold of each (a rank steps its shards only). None: not known."""


def check_floor(context: PlanContext, costs: Costs, measurements: Measurements) -> Floor:
    """The floor, measured unless the budget is well above what the memory model predicts for it.

    It is the least of every precision traced so far (``Costs.memory_for_floor``):
    the caller traces the others before taking a refusal as final. Measured, it
    is the least measured budget among the configurations it measures: the one
    predicted least, every other predicted within
    ``POLICY.floor_measured_margin_share`` above the least measured peak, and
    any measured before (by an earlier call, before more precisions were
    traced), so a misprediction between two configurations never states the
    larger as the floor.

    Raises:
        InfeasibleBudget: the budget is below it (the message says what would lower it).
    """
    options = _options(context, costs)
    predicted_budget = _predicted_budget(options, measurements)
    config = options[0][1]
    if measurements.model_is_exact and context.budget_bytes >= predicted_budget * (1 + POLICY.floor_decided_margin_share):
        context.log(f"floor: {format_bytes(predicted_budget)} predicted, well under the budget: not measured")
        return Floor(config=config, budget_bytes=predicted_budget, measured=False)
    peaks = {}  # config key -> (config, peak, breakdown), of every option measured
    # Those measured by an earlier check first: the least measured is known before any other is probed.
    for predicted, config in sorted(options, key=lambda option: not measurements.has_peak(option[1])):
        least = min((peak for _, peak, _ in peaks.values()), default=None)
        if least is not None and not measurements.has_peak(config) and _cannot_measure_less(context, predicted, least, measurements=measurements):
            continue
        if least is None or predicted <= least * (1 + POLICY.floor_measured_margin_share) or measurements.has_peak(config):
            peaks[config.key()] = (config, *measurements.checked_peak(config))
            if measurements.model_is_exact:
                measurements.compared(measured=peaks[config.key()][1], predicted=predicted)
    headroom = measurements.headroom  # after the probes: on a GPU it holds the context just measured
    budgets = {key: headroom.smallest_budget(peak, persistent_bytes=persistent_bytes(breakdown)) for key, (_, peak, breakdown) in peaks.items()}
    config, peak, breakdown = peaks[min(budgets, key=budgets.get)]
    causes = headroom.for_peak(peak, persistent_bytes=persistent_bytes(breakdown))
    floor = Floor(
        config=config, budget_bytes=budgets[config.key()],
        breakdown={**breakdown, **{f"headroom ({k.replace('_', ' ')})": v for k, v in causes.items()}},
        phases=floor_phases(costs, config, state_bytes=persistent_bytes(breakdown)),
    )
    if measurements.floor_said != floor.budget_bytes:  # stated once: a second check finding the same floor says nothing
        context.log(f"floor without levers: {format_bytes(floor.budget_bytes)} measured")
        measurements.floor_said = floor.budget_bytes
    if context.budget_bytes < floor.budget_bytes:
        raise InfeasibleBudget(below_floor(context, floor, measurements), floor_bytes=floor.budget_bytes, breakdown=floor.breakdown, floor=floor)
    return floor


def _cannot_measure_less(context: PlanContext, predicted: float, least_measured: float, *, measurements: Measurements) -> bool:
    """Whether an option predicted at ``predicted`` cannot measure below ``least_measured`` (within
    ``POLICY.exact_slack_share``): on the CPU, where the budget a peak needs grows with the peak alone (no
    allocator), and the memory model, the meter's twin, predicted every probe so far within that share
    (``Measurements.model_error``). Else the model may order them wrongly, and the margin rule measures. The
    ResNet-18 of #47 measured fp32's and bf16's floors alike, each with every block checkpointed and without (the
    model 4 and 24 bytes under the meter): four probes, one of them enough."""
    error = measurements.model_error
    return (
        context.device == "cpu" and error is not None and error <= POLICY.exact_slack_share
        and predicted >= least_measured * (1 - POLICY.exact_slack_share)
    )


def far_above_budget(context: PlanContext, costs: Costs, measurements: Measurements) -> int | None:
    """The floor the memory model predicts over the precisions traced so far, where it is the meter's twin and puts
    that well above the budget (then a refusal waits for the other precisions, and measures nothing before them);
    else None."""
    options = _options(context, costs)
    if not options or not measurements.model_is_exact:
        return None
    budget = _predicted_budget(options, measurements)
    return budget if budget > context.budget_bytes * (1 + POLICY.floor_decided_margin_share) else None


def _options(context: PlanContext, costs: Costs) -> list[tuple[float, TrainingConfig]]:
    """The floor's candidate configurations with their predicted peaks, least first.

    Two precisions that share their traces (``Costs.shared``: fp16's and bf16's autocast make the same tensors)
    have the same peaks: the simpler one (first in ``PRECISIONS``) stands for both, since measuring the other would
    only repeat the same bytes (fp16 autocast's steps on a CPU are many times bf16's, #47)."""
    model, smallest, G = costs.model, costs.smallest, context.global_batch_size
    blocks = frozenset(range(len(model.blocks)))
    options: list[tuple[float, TrainingConfig]] = []
    traced = costs.memory_for_floor()
    for precision, memory in traced.items():
        if _stood_for(costs, precision, traced):
            continue
        for checkpoint in (blocks, frozenset()):
            peak = memory.peak_bytes(smallest, global_batch_size=G, checkpoint=checkpoint) * model.memory_scale
            config = TrainingConfig(global_batch_size=G, micro_batch_size=smallest, precision=precision, checkpoint=model.names(checkpoint))
            options.append((peak, config))
    options.sort(key=lambda option: option[0])
    return options


def _stood_for(costs: Costs, precision: str, traced: dict) -> bool:
    """Whether a ``traced`` precision that shares this one's traces comes before it in ``PRECISIONS``."""
    partners = {b for a, b in costs.shared.items() if a == precision} | {a for a, b in costs.shared.items() if b == precision}
    return any(p in traced and PRECISIONS.index(p) < PRECISIONS.index(precision) for p in partners)


def _predicted_budget(options: list[tuple[float, TrainingConfig]], measurements: Measurements) -> int:
    # Predicted, its persistent bytes are at least the parameters and optimizer state (``resident_bytes``).
    return measurements.headroom.smallest_budget(options[0][0], persistent_bytes=measurements.resident_bytes)


def floor_phases(costs: Costs, config: TrainingConfig, *, state_bytes: int) -> tuple[int, int] | None:
    """(forward and backward's peak, the optimizer step's peak), each less ``state_bytes``, of ``config`` by the memory
    model; None where its traces do not say."""
    model = costs.model
    memory = costs.memory_for_floor().get(config.precision)
    if not hasattr(memory, "at"):  # no traces of this precision (or a memory model without segments)
        return None
    try:
        segments, drops = memory.at(config.micro_batch_size, global_batch_size=model.global_batch_size)
    except (KeyError, ValueError):
        return None
    backward, step = apart_from_step(segments)
    if not step:
        return None
    peak = peak_of(backward, drops, model.indices(config.checkpoint))
    return (max(int(peak * model.memory_scale) - state_bytes, 0), max(int(step * model.memory_scale) - state_bytes, 0))


def below_floor(
    context: PlanContext, floor: Floor, measurements: Measurements, *, levers: str = "", lever_floor: tuple[int, str] | None = None,
) -> str:
    """The one-line error: the floor, its breakdown, and what would lower it.

    Args:
        levers: what the memory levers would save, measured ("optimizer step in
            backward (-3.1 MiB, measured), "), put first among the ways out.
        lever_floor: the least budget the memory levers the user allows reach, measured, and which levers, where it
            is below the floor configuration's: then it is the floor the line names (the least anything trains in),
            the configuration without levers after it.
    """
    peak, breakdown = measurements.checked_peak(floor.config)  # measured by check_floor: reused
    headroom = measurements.headroom
    config = floor.config
    frozen = frozen_note(context.sim_spec)  # LoRA, a frozen backbone: parameters without gradients or state
    parts = " + ".join(f"{k.replace('_', ' ')} {format_bytes(v)}{frozen if k == 'parameters' else ''}" for k, v in breakdown.items() if v)
    headroom_bytes = sum(headroom.for_peak(peak, persistent_bytes=persistent_bytes(breakdown)).values())
    state = breakdown.get("optimizer_state", 0)
    what = f"micro-batch {config.micro_batch_size}, {config.precision}, " + ("every block checkpointed" if config.checkpoint else "no checkpointing")
    gpus = _gpus_advice(context, floor, breakdown=breakdown, headroom=headroom)
    without = f"{what}: {parts} + headroom {format_bytes(headroom_bytes)}"
    if lever_floor is not None:
        least, how = lever_floor
        stated = (
            f"{format_bytes(least)} for a batch of {context.global_batch_size} with {how}, measured (without levers "
            f"{format_bytes(floor.budget_bytes)}: {without})"
        )
    else:
        stated = f"{format_bytes(floor.budget_bytes)} for a batch of {context.global_batch_size} ({without})"
    return (
        f"budget {format_bytes(context.budget_bytes)} is below the floor {stated}; "
        f"to lower it: {_ways_out(levers + less_state(context, state), gpus)}"
    )


def _ways_out(first: str, gpus: str) -> str:
    """The ways out in order; the GPUs' advice ("or --gpus 4 (...)") loses its "or" when nothing comes before it."""
    if not first.strip() and gpus.startswith("or "):
        return gpus[len("or "):]
    return f"{first}{gpus}"


def less_state(context: PlanContext, state: int) -> str:
    """The way out through the optimizer: one with less state, unless it keeps none already."""
    if state <= 0:
        return ""
    return (f"use an optimizer with less state than {_optimizer_name(context)} ({format_bytes(state)} here; e.g. SGD without "
            "momentum keeps none) ")


def _gpus_advice(context: PlanContext, floor: Floor, *, breakdown: dict[str, int], headroom: Headroom) -> str:
    """--gpus N where N GPUs would fit the floor configuration per rank (the conservative estimate), else why not and what would.

    A floor in bf16-master or bf16-pure (bf16 weights: one process only) is priced as the ranks the multi-GPU planner
    would make: fp32 weights, gradients and optimizer state sharded (``bounds.rank_state``), computing in bf16 over
    bf16 gathered weights as this floor's forward and backward do (``plan_fsdp`` prices a half precision's rank from
    the same traces); priced with its own bytes, the advice left out the state the ranks hold, and followed, was
    refused (bench/RESULTS.md, "#48: the --gpus advice of a bf16-master floor, followed").
    """
    G = context.global_batch_size
    if G < 2:
        return "(more GPUs would not help: a batch of 1 cannot be split between GPUs)"
    general = "or more GPUs (--gpus N: FSDP2 shards parameters, gradients and optimizer state)"
    precision, phases = floor.config.precision, floor.phases
    if precision in ONE_PROCESS_PRECISIONS:
        half = next((p for p in context.precisions if p in RANK_HALF_PRECISIONS), None)
        rank = rank_state(context) if half is not None else None
        if rank is None:  # no precision ranks train in that the floor's traces price, or no count of the state
            return general
        activations = phases[0] if phases is not None else sum(v for k, v in breakdown.items() if k not in PERSISTENT)
        precision, breakdown, phases = half, rank.breakdown, (activations, rank.step_bytes)
    try:
        sharded = sharded_floor(
            context.sim_spec, breakdown=breakdown, precision=precision, headroom=headroom,
            micro_batch_size=floor.config.micro_batch_size, global_batch_size=G, phases=phases,
        )
    except Exception:  # a model that cannot be built on meta: no count, the advice stays general
        return general
    if sharded.gpus is not None:
        return f"or --gpus {sharded.gpus} (FSDP2 shards parameters, gradients and optimizer state; estimated)"
    holds = (
        f"each GPU would still hold the activations, {format_bytes(sharded.activation_bytes)}, and FSDP2's gathered blocks, "
        f"{format_bytes(sharded.buffer_bytes)}: {format_bytes(sharded.limit_bytes)} per GPU with any number of GPUs, estimated"
    )
    need = f"--gpus {sharded.best_gpus} would need a budget of {format_bytes(sharded.budget_bytes)} per GPU, estimated"
    if sharded.limit_bytes <= context.budget_bytes:  # the batch, not the bytes, stops more GPUs from fitting
        return f"(more samples a step could be split between more GPUs; at a batch of {G}, {need})"
    if sharded.budget_bytes < floor.budget_bytes:
        return f"(more GPUs would not help at this budget: {holds}; {need})"
    return f"(more GPUs would not help: {holds}; the floor is the least budget)"


def _optimizer_name(context: PlanContext) -> str:
    try:
        return type(context.spec.build_optimizer(context.meta_model.parameters())).__name__
    except Exception:  # an optimizer that refuses meta parameters: the name is cosmetic
        return "the optimizer"


@dataclass(frozen=True, kw_only=True)
class ShardedFloor:
    """A configuration under FSDP2 over more GPUs, per GPU, by the conservative estimate (``estimate_fsdp_peak_bytes``)."""

    gpus: int | None
    """The fewest GPUs whose per-GPU peak and headroom fit the budget; None when no number up to the batch does."""
    best_gpus: int
    """The number of GPUs that needs the least per-GPU budget."""
    budget_bytes: int
    """That least per-GPU budget."""
    activation_bytes: int
    buffer_bytes: int
    """FSDP2's gathered parameters and unsharded gradients of one block, and the reduce-scatter input, at ``best_gpus``."""
    state_bytes: int
    """Parameters, gradients and optimizer state one GPU holds at ``best_gpus``."""
    limit_bytes: int
    """The least per-GPU budget with any number of GPUs: the activations and gathered blocks, their headroom, no state
    (the estimate's limit as the state's share goes to nothing). A budget under it: more GPUs would not help."""


def sharded_floor(
    spec: ModelSpec, *, breakdown: dict[str, int], precision: str, headroom: Headroom, micro_batch_size: int, global_batch_size: int,
    phases: tuple[int, int] | None = None,
) -> ShardedFloor:
    """What 2 to ``global_batch_size`` GPUs (at most ``POLICY.floor_advice_max_gpus``) would make of a configuration
    whose one-process peak breaks down as ``breakdown``.

    Each GPU trains ceil(G / N) samples in micro-batches of ``micro_batch_size``;
    FSDP2 divides the parameters, gradients and optimizer state (each
    parameter's first dimension padded to N: a layer with fewer rows than GPUs
    is not divided further), but not the activations, the gathered blocks or
    the headroom, and a rank that accumulates micro-batches keeps its whole
    gradients until the last one (``RankSplit``). Conservative: fewer GPUs may do.

    With ``phases`` (forward and backward's activations, the optimizer step's temporaries), the activations are
    forward and backward's, and the step a moment of its own: a rank steps its shards, so it holds a 1/N share of the
    one-process step's temporaries (a foreach AdamW's fp32 copy of every parameter), and no gathered block.
    """
    state = {key: breakdown.get(key, 0) for key in PERSISTENT}
    activations = sum(value for key, value in breakdown.items() if key not in state)
    step_bytes = 0
    if phases is not None:
        activations, step_bytes = phases
    with torch.device("meta"):
        model = spec.build_model()
    numel = sum(p.numel() for p in model.parameters()) or 1
    best: tuple[int, int, ShardedMemoryEstimate] | None = None
    for world_size in range(2, min(global_batch_size, POLICY.floor_advice_max_gpus) + 1):
        layout = fsdp_layout(model, world_size=world_size)
        padded = (layout.root_numel + sum(layout.unit_numels.values())) / numel  # shards are of the padded parameters
        steps = micro_batch_count(global_batch_size, world_size=world_size, micro_batch_size=micro_batch_size)
        estimate = estimate_fsdp_peak_bytes(
            parameter_bytes=math.ceil(state["parameters"] * padded), gradient_bytes=math.ceil(state["gradients"] * padded),
            optimizer_state_bytes=math.ceil(state["optimizer_state"] * padded), activation_bytes=activations, layout=layout,
            world_size=world_size, precision=precision, grad_accum_steps=steps,
        )
        peak = max(estimate.peak_bytes, estimate.state_bytes + math.ceil(step_bytes / world_size))
        budget = headroom.smallest_budget(peak, persistent_bytes=estimate.state_bytes)
        fits = headroom.fits(peak, persistent_bytes=estimate.state_bytes)
        if fits or best is None or budget < best[1]:
            best = (world_size, budget, estimate)
        if fits:
            break
    if best is None:
        raise ValueError(f"a batch of {global_batch_size} cannot be split between GPUs")
    world_size, budget, estimate = best
    unsharded = estimate.activation_bytes + estimate.buffer_bytes
    return ShardedFloor(
        gpus=world_size if fits else None, best_gpus=world_size, budget_bytes=budget,
        activation_bytes=estimate.activation_bytes, buffer_bytes=estimate.buffer_bytes, state_bytes=estimate.state_bytes,
        limit_bytes=headroom.smallest_budget(unsharded, persistent_bytes=0),
    )
