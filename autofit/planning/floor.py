"""The floor: the smallest budget anything can train in, checked before the search.

The floor configuration is the smallest micro-batch the model trains with,
every block checkpointed or none, whichever the memory model says is smaller,
in the precision that makes it smallest. It is measured by the meter that has
the last word, so a budget below it fails in seconds, with the floor's
breakdown and what would lower it (an optimizer with less state, more GPUs).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autofit.errors import UserError
from autofit.measure.meters import frozen_note
from autofit.planning.context import Config, PlanContext
from autofit.planning.headroom import persistent_bytes
from autofit.planning.modelling import Costs
from autofit.planning.per_rank import fsdp_layout, smallest_world_size
from autofit.planning.verify import Measurements
from autofit.spec import ModelSpec
from autofit.units import format_bytes


class InfeasibleBudget(UserError):
    """The budget is below the floor: nothing can train in it."""

    def __init__(self, message: str, *, floor_bytes: int, breakdown: dict[str, int], floor: Floor | None = None) -> None:
        super().__init__(message)
        self.floor_bytes = floor_bytes
        self.breakdown = breakdown
        self.floor = floor
        """The floor configuration and its measured budget (what the levers start from)."""


FLOOR_DECIDED_MARGIN = 0.05
"""Where the memory model is the meter's twin (the CPU, the simulated meter), a budget this far above the
floor it predicts needs no probe to be known possible (a candidate that misses falls back to it, measured)."""


@dataclass(frozen=True, kw_only=True)
class Floor:
    config: Config
    budget_bytes: int
    """The least budget whose headroom leaves room for the floor configuration's peak (measured, or predicted)."""
    breakdown: dict[str, int] = field(default_factory=dict)
    """Its measured peak and headroom, by cause (empty when predicted)."""
    measured: bool = True


def check_floor(context: PlanContext, costs: Costs, measurements: Measurements) -> Floor:
    """The floor, measured unless the budget is well above what the memory model predicts for it.

    It is the least of every precision traced so far (``Costs.memory_for_floor``):
    the caller traces the others before taking a refusal as final.

    Raises:
        InfeasibleBudget: the budget is below it (the message says what would lower it).
    """
    model, smallest, G = costs.model, costs.smallest, context.global_batch_size
    blocks = frozenset(range(len(model.blocks)))
    options = []
    for precision, memory in costs.memory_for_floor().items():
        for checkpoint in (blocks, frozenset()):
            peak = memory.peak_bytes(smallest, global_batch_size=G, checkpoint=checkpoint) * model.memory_scale
            options.append((peak, precision, checkpoint))
    predicted, precision, checkpoint = min(options, key=lambda option: option[0])
    config = Config(precision=precision, micro_batch_size=smallest, checkpoint=tuple(model.blocks[b] for b in sorted(checkpoint)))
    # Predicted, its persistent bytes are at least the parameters and optimizer state (``resident_bytes``).
    predicted_budget = measurements.headroom.smallest_budget(predicted, persistent_bytes=measurements.resident_bytes)
    if measurements.model_is_exact and context.budget_bytes >= predicted_budget * (1 + FLOOR_DECIDED_MARGIN):
        context.log(f"floor: {format_bytes(predicted_budget)} predicted, well under the budget: not measured")
        return Floor(config=config, budget_bytes=predicted_budget, measured=False)
    peak, breakdown = measurements.checked_peak(config)
    headroom = measurements.headroom  # after the probe: on a GPU it holds the context just measured
    persistent = persistent_bytes(breakdown)
    causes = headroom.for_peak(peak, persistent_bytes=persistent)
    floor = Floor(
        config=config, budget_bytes=headroom.smallest_budget(peak, persistent_bytes=persistent),
        breakdown={**breakdown, **{f"headroom ({k.replace('_', ' ')})": v for k, v in causes.items()}},
    )
    context.log(f"floor: {format_bytes(floor.budget_bytes)} measured")
    if context.budget_bytes < floor.budget_bytes:
        raise InfeasibleBudget(below_floor(context, floor, measurements), floor_bytes=floor.budget_bytes, breakdown=floor.breakdown, floor=floor)
    return floor


def below_floor(context: PlanContext, floor: Floor, measurements: Measurements, *, levers: str = "") -> str:
    """The one-line error: the floor, its breakdown, and what would lower it.

    Args:
        levers: what the memory levers would save, measured ("optimizer step in
            backward (-3.1 MiB, measured), "), put first among the ways out.
    """
    peak, breakdown = measurements.checked_peak(floor.config)  # measured by check_floor: reused
    headroom = measurements.headroom
    return _below_floor(
        context, floor, breakdown=breakdown, headroom_bytes=sum(headroom.for_peak(peak, persistent_bytes=persistent_bytes(breakdown)).values()),
        usable_bytes=measurements.usable_bytes(), levers=levers,
    )


def _below_floor(
    context: PlanContext, floor: Floor, *, breakdown: dict[str, int], headroom_bytes: int, usable_bytes: float, levers: str
) -> str:
    config = floor.config
    frozen = frozen_note(context.sim_spec)  # LoRA, a frozen backbone: parameters without gradients or state
    parts = " + ".join(f"{k.replace('_', ' ')} {format_bytes(v)}{frozen if k == 'parameters' else ''}" for k, v in breakdown.items() if v)
    state = breakdown.get("optimizer_state", 0)
    what = f"micro-batch {config.micro_batch_size}, {config.precision}, " + ("every block checkpointed" if config.checkpoint else "no checkpointing")
    gpus = _gpus_advice(context.sim_spec, breakdown=breakdown, precision=config.precision, usable_bytes=usable_bytes)
    return (
        f"budget {format_bytes(context.budget_bytes)} is below the floor {format_bytes(floor.budget_bytes)} for a batch of "
        f"{context.global_batch_size} ({what}: {parts} + headroom {format_bytes(headroom_bytes)}); "
        f"to lower it: {levers}use an optimizer with less state than {_optimizer_name(context)} ({format_bytes(state)} here; e.g. SGD "
        f"without momentum keeps none) {gpus}"
    )


def _gpus_advice(sim_spec: ModelSpec, *, breakdown: dict[str, int], precision: str, usable_bytes: float) -> str:
    """How many GPUs FSDP2 would need for the floor configuration, by the conservative estimate."""
    try:
        gpus = gpus_for(sim_spec, breakdown=breakdown, precision=precision, usable_bytes=usable_bytes)
    except Exception:  # a model that cannot be built on meta: no count, the advice stays general
        return "or more GPUs (--gpus N: FSDP2 shards parameters, gradients and optimizer state)"
    if gpus is None:
        return "(more GPUs would not help: the activations and gathered blocks alone exceed it)"
    return f"or --gpus {gpus} (FSDP2 shards parameters, gradients and optimizer state; estimated)"


def _optimizer_name(context: PlanContext) -> str:
    with torch.device("meta"):
        try:
            model = context.sim_spec.build_model()
            return type(context.spec.build_optimizer(model.parameters())).__name__
        except Exception:  # a model that cannot be built on meta: the name is cosmetic
            return "the optimizer"


def gpus_for(spec: ModelSpec, *, breakdown: dict[str, int], precision: str, usable_bytes: float) -> int | None:
    """The fewest GPUs FSDP2 would need for a configuration whose one-process peak breaks down as ``breakdown``.

    By ``smallest_world_size`` (a conservative estimate: fewer may do); None when
    no number of GPUs fits.
    """
    state = {key: breakdown.get(key, 0) for key in ("parameters", "gradients", "optimizer_state")}
    activations = sum(value for key, value in breakdown.items() if key not in state)
    with torch.device("meta"):
        layout = fsdp_layout(spec.build_model(), world_size=2)
    return smallest_world_size(
        budget_bytes=int(usable_bytes), parameter_bytes=state["parameters"], gradient_bytes=state["gradients"],
        optimizer_state_bytes=state["optimizer_state"], activation_bytes=activations, layout=layout, precision=precision,
    )
