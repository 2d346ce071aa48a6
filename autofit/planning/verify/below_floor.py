"""Below the floor: the floor configuration again, with the memory levers, measured.

Above the floor the search scores the levers itself (``search.LeverSearch``, its time terms from
``lever_timings.lever_search``); this module is what runs when even the floor does not fit, and the notes a
plan with levers carries.

When the budget is below the floor (``check_floor``), the floor configuration
(the smallest micro-batch, the floor's checkpointing and precision) is tried
with the levers, cheapest first and each adding to the last:

1. the optimizer step in backward (no change to the arithmetic; not with fp16): where the floor has one
   micro-batch per step, added to it; where it has several, the whole batch in one micro-batch with it, on its
   own (``LeverCandidate.apart``: the levers after it keep the floor's micro-batch),
2. on a GPU (simulated too: the simulated meter counts host tensors apart):
   activation offload of every block not checkpointed and the optimizer
   state on the host, whose gradients also leave the device in backward
   (same arithmetic; costs transfers),
3. with ``allow_lossy_base`` only, for a model with frozen linear weights (a
   LoRA base): those weights in 4-bit NF4 (QLoRA; ``strategies.frozen_nf4``),
4. with ``allow_lossy_optimizer`` only: torchao's 8-bit AdamW state (it
   changes the optimizer's arithmetic: a declared choice, never a silent one).

Each candidate's peak is measured by the plan's meter (the device's, or the
simulated one when simulating) under the same headroom; the first that fits is
the plan, timed with plain training steps where the device runs. Its
predicted samples/s is the speed model's for the floor configuration plus
the levers' costs (``speed.levers``: transfers over the host link, measured on
a GPU here or assumed, and the update on the host), which the notes state; its
predicted peak is the memory model's with the levers where the floor's trace
models them.
When none fits, the floor's one-line error names each lever with what it
saved, measured.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from autofit.config import TrainingConfig, step_in_backward_refusal
from autofit.errors import UserError
from autofit.measure.meters import release_device_memory
from autofit.measure.probe import measure
from autofit.planning.context import PlanContext
from autofit.planning.costs import PrecisionCosts
from autofit.planning.lever_timings import lever_time_for, loss_chunking
from autofit.planning.speed.measured import time_training
from autofit.planning.verify.floor import Floor, InfeasibleBudget, below_floor
from autofit.planning.memory.headroom import persistent_bytes
from autofit.planning.memory.levers import LeverChoice
from autofit.planning.modelling import Costs, add_eight_bit_state, add_loss_chunks, add_nf4_state, add_speeds
from autofit.planning.search.space import LeverSearch
from autofit.planning.verify.measurements import Measurements
from autofit.planning.records import Candidate, Measurement, Verified
from autofit.planning.report import PlanReport, write_plan
from autofit.units import format_bytes
from strategies import MASTER_WEIGHTS, PURE_BF16, nf4_weights

LOSSY_FLAG = "--allow-lossy-optimizer"
LOSSY_BASE_FLAG = "--allow-lossy-base"
NF4_NOTE = (
    f"the frozen weights are held in 4-bit NF4 (torchao, QLoRA's base; allowed by {LOSSY_BASE_FLAG}): each is rounded to "
    "one of 16 levels of its block, so the model the adapters train over differs from the dense one by that rounding; "
    "the updates are plain training's"
)
LOSSY_NOTE = (
    f"8-bit AdamW state (torchao, allowed by {LOSSY_FLAG}) changes the optimizer's arithmetic: its moments are "
    "quantized block-wise, so training follows plain AdamW closely but not exactly"
)


PURE_NOTE = (
    f"precision {PURE_BF16} (allowed by {LOSSY_FLAG}) keeps the weights and AdamW's state in bf16 and rounds each update "
    "stochastically (torchao): it changes the optimizer's arithmetic, close to fp32's on average but not exactly"
)
MASTER_NOTE = (
    f"precision {MASTER_WEIGHTS} is a declared choice: bf16 autocast over the weights rounded to bf16 on the device, "
    "each updated in fp32 on the host by the model's own optimizer (the arithmetic of a bf16 run with fp32 master weights)"
)


@dataclass(frozen=True, kw_only=True)
class LeverCandidate:
    """The floor configuration with some levers on."""

    name: str
    """What the levers are, as the summary and the error say them."""
    added: str
    """The lever(s) this candidate adds to the one before it."""
    config: TrainingConfig
    lossy: bool = False
    """It changes the optimizer's arithmetic (8-bit state)."""
    lossy_base: bool = False
    """It rounds the frozen weights (NF4)."""
    apart: bool = False
    """Measured on its own: the candidates after it keep the floor's micro-batch and do not add to it (the step in
    backward with the whole batch in one micro-batch, where the floor takes several)."""

    def allowed(self, *, allow_lossy_optimizer: bool, allow_lossy_base: bool) -> bool:
        """Whether the user's flags let the plan use it."""
        return (allow_lossy_optimizer or not self.lossy) and (allow_lossy_base or not self.lossy_base)

    @property
    def flag(self) -> str:
        """The flag that allows it ("" for a lossless candidate)."""
        return LOSSY_FLAG if self.lossy else LOSSY_BASE_FLAG if self.lossy_base else ""


class BelowLeverFloor(InfeasibleBudget):
    """Below the floor even with the levers: also says the least budget each lever candidate was measured to need."""

    def __init__(self, message: str, *, below: InfeasibleBudget, lever_budgets: list[tuple[LeverCandidate, int]]) -> None:
        super().__init__(message, floor_bytes=below.floor_bytes, breakdown=below.breakdown, floor=below.floor)
        self.lever_budgets = lever_budgets
        """(candidate, the least budget whose headroom leaves room for its measured peak), for each candidate measured."""

    def lever_floor_bytes(self, *, allow_lossy_optimizer: bool, allow_lossy_base: bool = False) -> int | None:
        """The least budget a plan with the levers needs (None: no candidate was measured)."""
        budgets = [
            budget for candidate, budget in self.lever_budgets
            if candidate.allowed(allow_lossy_optimizer=allow_lossy_optimizer, allow_lossy_base=allow_lossy_base)
        ]
        return min(budgets, default=None)


@dataclass(kw_only=True)
class _Measured:
    candidate: LeverCandidate
    peak_bytes: int | None
    """None: the device ran out of memory, or the lever cannot run here (``why``)."""
    breakdown: dict
    host_peak_bytes: int = 0
    why: str = ""


def lever_candidates(
    context: PlanContext, floor: Floor, *, blocks: list[str], allow_lossy_optimizer: bool, max_grad_norm: float | None = None,
    allow_lossy_base: bool = False,
) -> tuple[list[LeverCandidate], list[str]]:
    """The floor configuration with the levers, cheapest in speed first, and why any lever was left out.

    The lossy candidates (frozen weights in NF4, then 8-bit state, then bf16-pure) are last and marked lossy; they are
    listed without their flags too, so that the error can say what they would save.
    """
    config, G = floor.config, context.global_batch_size
    base = TrainingConfig(
        global_batch_size=G, micro_batch_size=config.micro_batch_size, precision=config.precision, checkpoint=config.checkpoint,
    )
    candidates, skipped, names = [], [], []
    base = _add_step_in_backward(candidates, skipped, names, base=base, max_grad_norm=max_grad_norm)
    chunks, _ = loss_chunking(context)
    if chunks > 1:  # the same loss, a little recompute: before the levers that move bytes over the host link
        base = replace(base, loss_chunks=chunks)
        names.append(f"output layer and loss in {chunks} chunks")
        candidates.append(LeverCandidate(name=", ".join(names), added=names[-1], config=base))
    if context.device == "cuda" and config.precision == MASTER_WEIGHTS:
        # Its masters and state are on the host already: offload is what is left to move.
        others = [name for name in blocks if name not in config.checkpoint]
        if others:
            base = replace(base, offload=others)
            names.append(f"activation offload of {len(others)} block(s)")
            candidates.append(LeverCandidate(name=", ".join(names), added=names[-1], config=base))
        _add_nf4(context, candidates, skipped, base=base, allow_lossy_base=allow_lossy_base)
        return candidates, skipped
    if context.device == "cuda":
        base = _add_host_levers(context, candidates, skipped, names, base=base, blocks=blocks)
    else:
        skipped.append("activation offload and host optimizer state: GPU levers (--device cuda); on the CPU the host is the device")
    _add_nf4(context, candidates, skipped, base=candidates[-1].config if candidates else base, allow_lossy_base=allow_lossy_base)
    # Last: 8-bit state on the device (on a GPU host state already keeps none there; this one is faster).
    candidates.append(
        LeverCandidate(
            name=", ".join([*names, "8-bit AdamW state"]), added="8-bit AdamW state", config=replace(base, optimizer_state="8bit"), lossy=True,
        )
    )
    # Then bf16 weights and state on the device, rounded stochastically (lossy too; no 8-bit state beside it).
    pure = replace(base, precision=PURE_BF16, optimizer_state="device", optimizer_in_backward=False)
    candidates.append(LeverCandidate(
        name=", ".join([*[n for n in names if n != "optimizer step in backward"], "bf16 weights and AdamW state (stochastic rounding)"]),
        added="bf16 weights and AdamW state (stochastic rounding)", config=pure, lossy=True,
    ))
    if not allow_lossy_optimizer:
        skipped.append(f"8-bit AdamW state: it changes the optimizer's arithmetic; allow it with {LOSSY_FLAG}")
    return candidates, skipped


def _add_step_in_backward(
    candidates: list[LeverCandidate], skipped: list[str], names: list[str], *, base: TrainingConfig, max_grad_norm: float | None,
) -> TrainingConfig:
    """The step in backward's rung: on the floor's micro-steps where it can run there, else (a refusal for the
    micro-steps only) with the whole batch in one micro-batch, apart from the ladder; the ladder's base after it."""
    G = base.global_batch_size
    refusal = step_in_backward_refusal(
        precision=base.precision, global_batch_size=G, micro_batch_size=base.micro_batch_size, world_size=1,
        max_grad_norm=max_grad_norm,
    )
    whole = step_in_backward_refusal(
        precision=base.precision, global_batch_size=G, micro_batch_size=G, world_size=1, max_grad_norm=max_grad_norm,
    )
    if refusal:
        skipped.append(f"optimizer step in backward: it {refusal.split(';')[0]}")
    if refusal and not whole:
        # The floor's micro-steps rule it out, not the step: the whole batch in one micro-batch, every block as the
        # floor checkpoints it, may need less than the floor (no gradient is ever whole), so the refusal's floor is the
        # least the search can reach only with it measured too.
        name = f"optimizer step in backward with the whole batch of {G} in one micro-batch"
        candidates.append(LeverCandidate(
            name=name, added=name, config=replace(base, micro_batch_size=G, optimizer_in_backward=True), apart=True,
        ))
    elif not refusal:
        base = replace(base, optimizer_in_backward=True)
        names.append("optimizer step in backward")
        candidates.append(LeverCandidate(name=", ".join(names), added=names[-1], config=base))
    return base


def _add_host_levers(
    context: PlanContext, candidates: list[LeverCandidate], skipped: list[str], names: list[str], *, base: TrainingConfig,
    blocks: list[str],
) -> TrainingConfig:
    """A GPU's rungs: offload of the blocks not checkpointed with the state on the host, then bf16 weights with fp32
    masters on the host; the ladder's base after them (with the offload, its state on the device)."""
    # The checkpointed blocks keep only their inputs: offload is for the others.
    others = [name for name in blocks if name not in base.checkpoint]
    added = []
    if others:
        base = replace(base, offload=others)
        added.append(f"activation offload of {len(others)} block(s)")
    # Simulated too: the simulated meter counts the host optimizer's tensors as host bytes (``host_allocation``).
    added.append("optimizer state on the host")
    candidates.append(LeverCandidate(name=", ".join([*names, *added]), added=" and ".join(added), config=replace(base, optimizer_state="host")))
    # Then the weights on the device in bf16 too, their fp32 masters beside the state on the host (no step in
    # backward: the masters step after it); not where --precisions leaves bf16-master out (its arithmetic is bf16).
    master = replace(base, precision=MASTER_WEIGHTS, optimizer_in_backward=False)
    if MASTER_WEIGHTS not in context.precisions:
        skipped.append(f"bf16 weights with fp32 masters on the host: --precisions leaves {MASTER_WEIGHTS} out")
    else:
        candidates.append(LeverCandidate(
            name=", ".join([
                *[n for n in names if n != "optimizer step in backward"], *added[:-1],
                "bf16 weights with fp32 masters and optimizer state on the host",
            ]),
            added="bf16 weights with fp32 masters on the host", config=master,
        ))
    names.extend(added[:1] if others else [])  # the 8-bit candidate keeps the offload, with its state on the device
    return base


def _add_nf4(context: PlanContext, candidates: list[LeverCandidate], skipped: list[str], *, base: TrainingConfig,
             allow_lossy_base: bool) -> None:
    """The candidate with the frozen linear weights in NF4 too (after the lossless ones it adds to), for a model that
    has such weights (a LoRA base)."""
    frozen = nf4_weights(context.meta_model)
    if not frozen:
        return
    added = f"frozen weights in NF4 ({len(frozen)} linear layer(s))"
    name = ", ".join(filter(None, [candidates[-1].name if candidates and candidates[-1].config == base else "", added]))
    candidates.append(LeverCandidate(name=name, added=added, config=replace(base, frozen_nf4=True), lossy_base=True))
    if not allow_lossy_base:
        skipped.append(f"frozen weights in NF4: it rounds the frozen weights to 4 bits; allow it with {LOSSY_BASE_FLAG}")


def plan_with_levers(
    context: PlanContext, costs: Costs, measurements: Measurements, below: InfeasibleBudget, *, allow_lossy_optimizer: bool,
    max_grad_norm: float | None = None, allow_lossy_base: bool = False, then: Callable[[], PlanReport | None] | None = None,
) -> PlanReport:
    """The first lever candidate measured to fit, as the plan; the floor's error with the levers' savings otherwise.

    The candidates the flags do not allow are measured last, only for the error's advice: where none allowed fits,
    ``then`` (the search with the levers) runs first, and its plan, if it finds one, needs no advice.

    Raises:
        BelowLeverFloor: no candidate fits; the message names each lever and what it saved, measured, and the
            error holds the least budget each candidate needs.
    """
    floor = below.floor
    floor_peak, _ = measurements.checked_peak(floor.config)
    candidates, skipped = lever_candidates(
        context, floor, blocks=list(costs.model.blocks), allow_lossy_optimizer=allow_lossy_optimizer, max_grad_norm=max_grad_norm,
        allow_lossy_base=allow_lossy_base,
    )
    flags = {"allow_lossy_optimizer": allow_lossy_optimizer, "allow_lossy_base": allow_lossy_base}
    context.log(f"below the floor without levers, {format_bytes(floor.budget_bytes)}: the floor configuration with the memory levers")
    for why in skipped:
        context.log(f"  left out: {why}")
    tried: list[_Measured] = []
    resident = below.breakdown.get("parameters", 0) + below.breakdown.get("optimizer_state", 0)
    allowed = [c for c in candidates if c.allowed(**flags)]
    for candidate in [*allowed, None, *(c for c in candidates if not c.allowed(**flags))]:
        if candidate is None:
            found = then() if then is not None else None
            if found is not None:
                return found
            continue
        inputs = candidate.config.micro_batch_size * measurements.host_sample_bytes
        if candidate.apart and resident + inputs >= floor_peak:
            # The whole batch's inputs beside the weights and state already reach the floor: it cannot lower it, and a
            # large batch would take long to measure (a batch of 10^9 would not end).
            context.log(
                f"  {candidate.name}: not measured: its inputs ({format_bytes(inputs)}) with the parameters and optimizer "
                f"state ({format_bytes(resident)}) reach the floor's peak"
            )
            continue
        measured = _measure(context, measurements, candidate)
        tried.append(measured)
        if measured.peak_bytes is None:
            context.log(f"  {candidate.name}: {measured.why}")
            continue
        excess = measurements.host_excess(measured.host_peak_bytes)
        fits = measurements.fits_peak(measured.peak_bytes, measured.breakdown) and excess is None
        context.log(
            f"  {candidate.name}: peak {format_bytes(measured.peak_bytes)} measured ({against_floor(measured.peak_bytes, floor_peak)}); "
            + ("fits" if fits else excess or "does not fit")
            + ("" if candidate.allowed(**flags) else f" (not allowed without {candidate.flag})")
        )
        if fits and candidate.allowed(**flags):
            return _report(context, costs, measurements, measured, floor=floor, floor_peak=floor_peak, tried=len(tried))
        measurements.reject(floor.config, f"with {candidate.name}: {measurements.over_budget(measured.peak_bytes, measured.breakdown)}"
                            if not fits else f"with {candidate.name}: fits, but needs {candidate.flag}")
    lever_budgets = [
        (m.candidate, measurements.headroom.smallest_budget(m.peak_bytes, persistent_bytes=persistent_bytes(m.breakdown)))
        for m in tried if m.peak_bytes is not None and measurements.fits_host(m.host_peak_bytes)
    ]
    # The floor the error names is the least the levers the user allows reach, measured, where that is below the floor's.
    least = min(((budget, c.name) for c, budget in lever_budgets if c.allowed(**flags)), default=None)
    raise BelowLeverFloor(
        below_floor(
            context, floor, measurements, levers=_savings(tried, floor_peak=floor_peak, flags=flags, fits=measurements.fits_peak,
                                                          host_fits=measurements.fits_host),
            lever_floor=least if least is not None and least[0] < floor.budget_bytes else None,
        ),
        below=below, lever_budgets=lever_budgets,
    )


def against_floor(peak: int, floor_peak: int) -> str:
    """"1.5 MiB less than the floor's", "89.66 MiB more than the floor's" or "the floor's": a lever's peak against it."""
    if peak == floor_peak:
        return "the floor's"
    return f"{format_bytes(abs(floor_peak - peak))} {'less' if peak < floor_peak else 'more'} than the floor's"


def _savings(tried: list[_Measured], *, floor_peak: int, flags: dict[str, bool], fits, host_fits=None) -> str:
    """"optimizer step in backward (-3.09 MiB, measured; not enough), ": each measured lever with what it saves.

    The candidates add to each other, so from the second on a part says what its lever changed from the part before
    and the saving in all: the parts add up to their total ("-20.16 MiB", then "+2.93 MiB, -17.23 MiB in all"; a lever
    can cost a little where it is added to the others).
    """
    parts = []
    before = None
    """The peak of the part before (None: this is the first)."""
    for measured in tried:
        if measured.peak_bytes is None or measured.peak_bytes >= floor_peak:
            continue  # not measured, or it lowers nothing here (8-bit state of tiny tensors can cost more)
        candidate = measured.candidate
        if before is None:
            saving = f"-{format_bytes(floor_peak - measured.peak_bytes)}, measured"
        else:
            step = measured.peak_bytes - before
            saving = f"{'+' if step > 0 else '-'}{format_bytes(abs(step))}, -{format_bytes(floor_peak - measured.peak_bytes)} in all, measured"
        before = None if candidate.apart else measured.peak_bytes  # the next part adds to the floor configuration, not to it
        if candidate.lossy or candidate.lossy_base:
            flag = "" if candidate.allowed(**flags) else f"{candidate.flag} for "
            would = "; it would fit" if fits(measured.peak_bytes, measured.breakdown) else "; not enough"
            change = "it changes the optimizer's arithmetic" if candidate.lossy else "it rounds the frozen weights"
            parts.append(f"{flag}{candidate.added} ({saving}{would}; {change})")
        elif host_fits is not None and fits(measured.peak_bytes, measured.breakdown) and not host_fits(measured.host_peak_bytes):
            parts.append(
                f"{candidate.added} ({saving}; it fits the device but keeps {format_bytes(measured.host_peak_bytes)} in host "
                "memory, more than the host has: give --host-memory for the machine that trains)"
            )
        else:
            parts.append(f"{candidate.added} ({saving}; not enough)")
    return "".join(f"{'then ' if index else ''}{part}, " for index, part in enumerate(parts))


def _measure(context: PlanContext, measurements: Measurements, candidate: LeverCandidate) -> _Measured:
    """A candidate's peak by the meter that has the last word, counted as ``Measurements`` counts its own.

    Two micro-batches stand for all of them (later micro-steps repeat the
    second); the samples not traced are added as the host's copy of the global
    batch where the meter counts it.
    """
    G, m = context.global_batch_size, candidate.config.micro_batch_size
    traced = min(G, 2 * m)
    spec = context.sim_spec if context.simulate else context.spec
    try:
        with context.progress.doing(f"measuring the floor configuration with {candidate.name}"):
            result = measure(
                spec, replace(candidate.config, global_batch_size=traced), device=context.device, simulate=context.simulate, steps=2,
                progress=context.progress,
            )
    except torch.OutOfMemoryError:
        release_device_memory(context.device)
        return _Measured(candidate=candidate, peak_bytes=None, breakdown={}, why="out of memory on the device")
    except UserError as error:  # 8-bit state needs AdamW or Adam, and torchao
        return _Measured(candidate=candidate, peak_bytes=None, breakdown={}, why=f"cannot run here: {error}")
    on_gpu = context.device == "cuda" and not context.simulate
    if context.simulate:
        measurements.simulated_checks += 1
    else:
        measurements.memory_probes += 1
    breakdown = dict(result.breakdown)
    context_bytes = breakdown.pop("context", 0) if on_gpu else 0
    host = 0 if on_gpu else (G - traced) * measurements.host_sample_bytes
    breakdown["activations"] = breakdown.get("activations", 0) + host
    return _Measured(
        candidate=candidate, peak_bytes=result.peak_bytes - context_bytes + host, breakdown=breakdown, host_peak_bytes=result.host_peak_bytes,
    )


def _report(
    context: PlanContext, costs: Costs, measurements: Measurements, chosen: _Measured, *, floor: Floor, floor_peak: int, tried: int
) -> PlanReport:
    """The plan of the chosen lever candidate: measured to fit, timed where the device runs, its levers named."""
    config, model = chosen.candidate.config, costs.model
    precision_notes = add_speeds(context, costs)  # only what the costs do not hold yet
    if config.optimizer_state == "8bit":
        add_eight_bit_state(context, costs)  # the memory model's term for it
    if config.loss_chunks > 1:
        add_loss_chunks(context, costs, chunks=config.loss_chunks, usable_bytes=measurements.usable_bytes())
    if config.frozen_nf4:
        add_nf4_state(context, costs)
    model = _predicting(costs, config)
    blocks = model.indices(floor.config.checkpoint)
    levers_time = lever_time_for(context, costs, model, config)
    modelled = _modelled_peak(model, config, blocks)
    result = Verified(
        candidate=Candidate(
            config=config,
            # The memory model's lever terms where it has them: else the floor configuration's.
            predicted_peak_bytes=modelled if modelled is not None else model.peak_bytes(config.precision, config.micro_batch_size, blocks),
            predicted_samples_per_s=_predicted_samples_per_s(context, model, config, floor=floor, levers_seconds=levers_time.seconds),
        ),
        measurement=Measurement(  # its speed timed once it is needed (``timed_ladder``)
            peak_bytes=chosen.peak_bytes, samples_per_s=None, host_peak_bytes=chosen.host_peak_bytes,
            meter="simulated" if context.simulate else context.device, breakdown=chosen.breakdown,
            headroom=measurements.headroom.for_peak(chosen.peak_bytes, persistent_bytes=persistent_bytes(chosen.breakdown)),
        ),
    )
    plan = write_plan(context, model, chosen=result, evaluations=[], unconstrained=None, usable_bytes=measurements.usable_bytes(), verified={})
    plan = replace(
        plan, notes=[
            *plan.notes,
            *lever_notes(
                chosen.candidate, floor_peak=floor_peak, peak_bytes=chosen.peak_bytes, host_peak_bytes=chosen.host_peak_bytes,
                modelled=modelled is not None,
            ),
            *levers_time.notes,
        ],
    )
    return PlanReport(
        plan=plan, floor_bytes=floor.budget_bytes, floor_breakdown=floor.breakdown, excluded_precisions=context.excluded_precisions,
        precision_notes=precision_notes, sampler="adding the memory levers to the floor configuration", evaluations=tried,
        simulated_checks=measurements.simulated_checks, memory_probes=measurements.memory_probes, real_probes=measurements.real_probes,
        resumed=costs.resumed, seconds=time.perf_counter() - context.started, rejected=measurements.rejected, costs=model,
    )


def _predicting(costs: Costs, config: TrainingConfig):
    """The cost model that predicts a lever candidate: the run's, with the floor's trace for its precision where the
    traces so far do not reach its micro-batch (only the floor's trace, at the smallest micro-batch, was needed)."""
    model = costs.model
    known = model.precisions.get(config.precision)
    if known is None or known.memory.with_checkpointing(config.micro_batch_size) is None:
        memory = costs.memory_for_floor()[config.precision]
        speed = costs.speeds[config.precision]
        model = replace(model, precisions={**model.precisions, config.precision: PrecisionCosts(precision=config.precision, memory=memory, speed=speed)})
    return model


def _predicted_samples_per_s(context: PlanContext, model, config: TrainingConfig, *, floor: Floor, levers_seconds: float) -> float:
    """The speed model's step of the floor configuration at the candidate's micro-batch, plus what its levers cost
    (``speed.levers``)."""
    step_s = model.step_seconds(config.precision, config.micro_batch_size, model.indices(floor.config.checkpoint))
    return context.global_batch_size / (step_s + levers_seconds)


def ladder_speed_bound(
    context: PlanContext, costs: Costs, floor: Floor, search: LeverSearch, *, allow_lossy_optimizer: bool,
    max_grad_norm: float | None = None, allow_lossy_base: bool = False,
) -> float | None:
    """The most samples/s the floor configuration with the levers (``plan_with_levers``) could be predicted at: the
    fastest lever candidate the flags allow, whichever of them fits (None: the flags allow none, or one of a precision
    not timed). A configuration of the search measured faster than it by ``POLICY.ladder_untimed_share`` is the plan
    whatever the ladder measures, so the ladder need not be measured first (``planner._below_floor``).

    The levers are priced by ``search`` (``lever_timings.lever_search``: the search's own, each lever timed once),
    over the speeds ``add_speeds`` made."""
    candidates, _ = lever_candidates(
        context, floor, blocks=list(costs.model.blocks), allow_lossy_optimizer=allow_lossy_optimizer, max_grad_norm=max_grad_norm,
        allow_lossy_base=allow_lossy_base,
    )
    allowed = [c for c in candidates if c.allowed(allow_lossy_optimizer=allow_lossy_optimizer, allow_lossy_base=allow_lossy_base)]
    if not allowed:
        return None
    if any(c.config.precision not in costs.speeds for c in allowed):  # bf16-pure's: not timed unless it is the plan
        return None
    speeds = []
    for candidate in allowed:
        model = _predicting(costs, candidate.config)
        seconds = search.lever_time(model, candidate.config).seconds
        speeds.append(_predicted_samples_per_s(context, model, candidate.config, floor=floor, levers_seconds=seconds))
    return max(speeds)


def timed_ladder(context: PlanContext, ladder: PlanReport, measurements: Measurements) -> PlanReport:
    """The floor configuration with the levers (``plan_with_levers``' plan), its speed timed where the device runs:
    timed only once it is the plan, or the search's configuration is to be weighed against it (``_report`` leaves
    it untimed: the search's plan is mostly the faster by far, and timing it took a ResNet-18 plan a second)."""
    plan = ladder.plan
    if context.simulate or plan.measured is None or plan.measured.samples_per_s is not None:
        return ladder
    if measurements.ladder_samples_per_s is None:  # timed once in a run, whoever asks first
        measurements.ladder_samples_per_s = time_training(context.spec, plan.config, device=context.device)
        measurements.real_probes += 1
        context.log(f"  timed: {measurements.ladder_samples_per_s:.1f} samples/s with the floor configuration and its levers")
    measured = replace(plan.measured, samples_per_s=measurements.ladder_samples_per_s)
    return replace(ladder, plan=replace(plan, measured=measured), real_probes=measurements.real_probes)


def lever_notes(
    candidate: LeverCandidate, *, floor_peak: int, peak_bytes: int, host_peak_bytes: int, modelled: bool = False,
) -> list[str]:
    """The plan's notes on its levers: what they are, what they saved (measured), and any change of arithmetic.

    Args:
        modelled: the predicted peak is the memory model's with the levers (else the floor configuration's).
    """
    predicted = (
        "the predicted peak is the memory model's with them (planning/memory/levers.py)" if modelled else
        "the memory model does not model these levers (traces without the offload trace), so the "
        "predicted peak is the floor configuration's without them"
    )
    notes = [
        f"below the floor without levers: {candidate.name} lowers the floor configuration's peak from "
        f"{format_bytes(floor_peak)} to {format_bytes(peak_bytes)} (measured); {predicted}; the predicted speed adds "
        "the levers' costs (planning/speed/levers.py)"
    ]
    if host_peak_bytes:
        notes.append(f"the levers keep {format_bytes(host_peak_bytes)} in host memory (measured)")
    if candidate.lossy_base:
        notes.append(NF4_NOTE)
    elif candidate.lossy:
        notes.append(PURE_NOTE if candidate.config.precision == PURE_BF16 else LOSSY_NOTE)
    elif candidate.config.precision == MASTER_WEIGHTS:
        notes.append(MASTER_NOTE)
    else:
        notes.append("the levers do not change the arithmetic: the updates are plain training's")
    return notes


def _modelled_peak(model, config: TrainingConfig, blocks: frozenset[int]) -> float | None:
    """The memory model's peak of a lever candidate, where its traces model its levers."""
    if config.selective_checkpoint:
        return None
    choice = LeverChoice(
        offload=frozenset(model.blocks.index(name) for name in config.offload), optimizer_in_backward=config.optimizer_in_backward,
        optimizer_state=config.optimizer_state, loss_chunks=config.loss_chunks, frozen_nf4=config.frozen_nf4,
    )
    try:
        return model.peak_bytes(config.precision, config.micro_batch_size, blocks, levers=choice)
    except ValueError:  # traces without a lever record, or without the offload trace
        return None


def searched_lever_notes(model, config: TrainingConfig, search: LeverSearch) -> list[str]:
    """The notes of a plan whose search chose memory levers: which, what they cost in time, and whether they change
    the arithmetic (8-bit state and NF4 weights do: declared choices)."""
    chosen = config.levers() or f"precision {config.precision}"
    arithmetic = [NF4_NOTE] if config.frozen_nf4 else []
    if config.optimizer_state == "8bit":
        arithmetic.append(LOSSY_NOTE)
    elif config.precision in (MASTER_WEIGHTS, PURE_BF16):
        arithmetic.append(MASTER_NOTE if config.precision == MASTER_WEIGHTS else PURE_NOTE)
    elif not arithmetic:
        arithmetic.append("the levers do not change the arithmetic: the updates are plain training's")
    return [
        f"memory levers chosen by the search ({chosen}): the memory model predicts their peak "
        "(planning/memory/levers.py) and the chosen configuration was measured with them",
        *search.lever_time(model, config).notes,
        *arithmetic,
    ]
