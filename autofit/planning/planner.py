"""The planner: the fastest configuration that was measured to fit a budget.

One process (``_plan_one_process``), in steps that pass values on:

1. Memory (``modelling``): simulated traces (no arithmetic) give every
   configuration's peak; a stored study's costs (the cache, or ``--study``)
   are reused, and only what is missing is traced.
2. Floor (``floor``): the smallest micro-batch with every block checkpointed
   (or none), so an impossible budget fails in seconds with what would lower
   it; measured unless the budget is well above it. Below it, on one process,
   the floor configuration is tried with the memory levers (``levers``),
   measured; once one fits, the search with the levers (steps 3 to 5) looks
   for a faster configuration, and the faster of the two is the plan. When
   none fits and the floor takes several micro-batches (the ladder then has no
   step in backward), the search still runs where the budget holds the
   parameters and the optimizer state: the whole batch in one micro-batch,
   stepping in backward, may fit.
3. Speed (``modelling``): real timings on the device at a few micro-batch
   sizes per precision, interleaved; with ``simulate``, FLOPs instead.
4. Search (``search``): Optuna over precision x micro-batch; for each point an
   exact knapsack picks the cheapest checkpoint set that fits, with each
   allowed memory lever (``levers.lever_search``: the step in backward; on a
   GPU offload per block and host optimizer state; with
   ``allow_lossy_optimizer`` 8-bit optimizer state). A precision is
   traced in full only when it could reach the verification
   (``modelling.worth_tracing``), fastest first.
5. Verification (``verify``): the best candidates are timed side by side on the
   device, and the chosen one's peak is measured with the device's meter (the
   simulated one when simulating); only a configuration whose measured peak
   plus headroom fits is ever emitted.
6. The plan (``writing``).

N > 1 processes (``_plan_ranks``): DDP when one rank's share plans as one
process with an allowance for DDP's buckets, FSDP2 (``ranks``) otherwise.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import torch

from strategies import MASTER_WEIGHTS, PRECISIONS, PURE_BF16
from autofit.config import TrainingConfig, step_in_backward_refusal
from autofit.errors import UserError
from autofit.plan_file import Plan
from autofit.planning.bounds import check_state_fits
from autofit.planning.context import PlanContext, intra_op_threads, plan_context
from autofit.planning.request import PlanKeywords, PlanRequest, plan_request
from autofit.planning.verify.floor import ONE_PROCESS_PRECISIONS, InfeasibleBudget, check_floor, far_above_budget
from autofit.planning.verify.below_floor import ladder_speed_bound, plan_with_levers, searched_lever_notes, timed_ladder
from autofit.planning.lever_timings import Levers, lever_search
from autofit.planning.coupling import check_rank_share, kept_together
from autofit.planning.modelling import (
    Costs, add_eight_bit_state, add_loss_chunks, add_nf4_state, add_recomputations, add_speeds, best_plain_samples_per_s, compare_halves,
    needs_offload, needs_recomputations, save, stored_or_new, trace_full, trace_low, trace_offload, worth_tracing,
)
from autofit.planning.ranks import check_ranks, gradient_bytes, plan_fsdp, restate_for_ddp, restate_for_hsdp
from autofit.planning.search.space import Evaluation, LeverSearch, score_space
from autofit.planning.verify.measurements import Measurements
from autofit.planning.policy import POLICY
from autofit.planning.verify.candidates import measure_unconstrained, timed_reference, verify
from autofit.planning.speed.timing import tie_cap
from autofit.planning.verify.compiled import with_compile
from autofit.planning.records import Verified
from autofit.planning.report import PlanReport, write_plan
from autofit.spec import ModelSpec, spec_from_model
from autofit.units import format_bytes
from autofit.progress import Progress, as_progress

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11


def plan(
    model: torch.nn.Module,
    example_batch: Callable[[int], tuple],
    request: PlanRequest | None = None,
    *,
    loss_fn: Callable | None = None,
    optimizer: Callable | None = None,
    **keywords: Unpack[PlanKeywords],
) -> Plan:
    """Find the fastest way to train ``model`` inside ``budget``, verified by real probes.

    Args:
        model: the model; it is never modified (probes train copies).
        example_batch: batch_size -> (inputs, targets), e.g. random tensors of the right shapes.
        budget: "16GB", "16GiB", "512MiB", "90%" (of the device) or bytes.
        batch_size: the global batch (samples per optimizer step); every plan keeps it.
        loss_fn: (output, target) -> loss; default cross-entropy.
        optimizer: params -> Optimizer; default AdamW(lr=1e-3).
        request: what to plan for, as one ``autofit.PlanRequest`` (each field documented there).
        keywords: ``PlanRequest``'s fields one by one, over ``request``'s own (or alone: ``budget`` and ``batch_size``
            at least; ``device``, ``simulate``, ``device_memory``, ``precisions``, ``gpus``, ``allow_lossy_optimizer``,
            ``allow_lossy_base``, ``study``, ``cache``, ``threads``, ...).

    Returns:
        The Plan (``autofit.save_plan(plan, "plan.json")`` writes it).

    Raises:
        UserError: a bad or unknown argument, or a budget below the floor (the message gives the floor).

    Example:
        >>> plan = autofit.plan(model, lambda n: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))),
        ...                     budget="2GB", batch_size=256)
        >>> plan.config.micro_batch_size, plan.config.checkpoint, plan.config.precision
    """
    asked = plan_request(request, **keywords)
    spec = spec_from_model(model, example_batch, loss_fn=loss_fn, optimizer=optimizer)
    return make_plan(spec, asked)


def make_plan(spec: ModelSpec, request: PlanRequest, *, log: Callable[[str], None] | None = None) -> Plan:
    """Plan for a ModelSpec: see ``PlanRequest`` for what can be asked; ``log`` receives progress lines."""
    return plan_with_report(spec, request, log=log).plan


def plan_with_report(spec: ModelSpec, request: PlanRequest, *, log: Callable[[str], None] | None = None) -> PlanReport:
    """``make_plan``, also returning how the plan was found (for the CLI's summary).

    With ``gpus`` N > 1 the budget is per GPU and the global batch is cut into
    N rank shares of ceil(G / N) samples, each split into micro-batches. Each
    rank's configuration (precision, checkpointing, micro-batch) is planned as
    one process planning its share. DDP is chosen when that fits with one
    gradient-size allowance for DDP's buckets (DDP keeps whole parameters and
    needs no all-gathers, so it is the faster choice whenever it fits); FSDP2
    otherwise, its per-rank peak simulated (``simulate_fsdp_peak_bytes``).
    N processes are never run while planning: the plan says what was measured
    on one process and what was simulated or allowed for.

    On one process the search adds the memory levers, and below the floor they are tried (``levers``);
    8-bit optimizer state only with ``allow_lossy_optimizer``. They run on one
    process, so N > 1 plans do not use them.

    ``log`` receives the progress lines, stamped with the seconds since this call, and while a step runs, a line
    whenever none went out for ``autofit.progress.INTERVAL_S`` (a ``Progress`` is used as it is: a command's heartbeat).
    """
    gpus, nodes = request.gpus, request.nodes
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise UserError(f"--gpus {gpus!r} must be a whole number of GPUs, at least 1")
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise UserError(f"--nodes {nodes!r} must be a whole number of machines, at least 1")
    # One heartbeat for every context of the run (a command's own where it passes one): no step silent for long.
    progress = as_progress(log, started_s=time.perf_counter())
    with progress.beating():
        if gpus * nodes > 1:
            return _with_clipping(_plan_ranks(spec, request, progress=progress), request.max_grad_norm)
        return _plan_alone(spec, request, progress=progress)


def _plan_alone(spec: ModelSpec, request: PlanRequest, *, progress: Progress) -> PlanReport:
    """One process: ``plan_with_report`` for ``gpus`` 1 on one node."""
    with progress.doing("checking the device and the precisions, and how busy the cores are"):
        context = plan_context(spec, request, log=progress)
    levers = Levers(
        allow_lossy_optimizer=request.allow_lossy_optimizer, allow_lossy_base=request.allow_lossy_base,
        max_grad_norm=request.max_grad_norm,
    )
    try:
        with _threads(context):
            costs = _memory(context, levers=levers)
            coupling = kept_together(context, costs)  # a loss that couples a batch's samples: fewer micro-batch sizes
            report = _plan_one_process(context, costs, levers=levers)
        # The wall time: a report made by the ladder below the floor is followed by the search with the levers.
        report.seconds = time.perf_counter() - context.started
        if coupling is not None:
            model = replace(report.plan.model, min_micro_batch_size=coupling.smallest_micro_batch)
            report.plan = replace(report.plan, model=model, notes=[*report.plan.notes, coupling.why])
        return _with_clipping(_with_trace_notes(report, [context]), request.max_grad_norm)
    finally:
        context.trace_pool.close()


def _with_clipping(report: PlanReport, max_grad_norm: float | None) -> PlanReport:
    """The plan clipping gradients at ``max_grad_norm``, saying that the step in backward was left out for it.

    Clipping changes no byte the planner counts beyond a scalar per gradient (their norms), so it is planned as
    training without it, and only the step in backward, which cannot clip, is not searched.
    """
    if max_grad_norm is None:
        return report
    plan = report.plan
    why = step_in_backward_refusal(
        precision=plan.config.precision, global_batch_size=plan.config.global_batch_size, micro_batch_size=1, world_size=1,
        max_grad_norm=max_grad_norm,
    )
    note = f"gradients are clipped to norm {max_grad_norm:g} before each step; the optimizer step in backward was left out: it {why.split(';')[0]}"
    report.plan = replace(plan, config=replace(plan.config, max_grad_norm=max_grad_norm), notes=[*plan.notes, note])
    return report


def _with_trace_notes(report: PlanReport, contexts: list[PlanContext]) -> PlanReport:
    """The plan saying, once, where its trace workers were stopped (``TracePool.note``: a run past its deadline,
    a worker that died): its traces were then made in this process, the same but slower."""
    notes = dict.fromkeys(c.trace_pool.note for c in contexts if c.trace_pool.note)
    if notes:
        report.plan = replace(report.plan, notes=[*report.plan.notes, *notes])
    return report


@contextmanager
def _threads(context: PlanContext) -> Iterator[None]:
    """Measure with the context's intra-op threads; PyTorch's setting is put back after."""
    if context.threads_note:
        context.log(context.threads_note)
    with intra_op_threads(context.threads):
        yield


def _memory(context: PlanContext, *, levers: Levers | None = None) -> Costs:
    """Step 1: the stored costs, or the smallest micro-batch the model trains with (nothing traced yet).

    Args:
        levers: what the levers may change, where they run (one process): then a model state that neither the
            device nor the host can hold is refused before the first trace (``check_state_fits``).
    """
    context.log(
        f"planning {context.spec.source} for a batch of {context.global_batch_size} within "
        f"{format_bytes(context.budget_bytes)} on {context.device}"
    )
    context.log(context.assumptions)
    if levers is not None:
        check_state_fits(context, allow_lossy_optimizer=levers.allow_lossy_optimizer, allow_lossy_base=levers.allow_lossy_base)
    with context.phase("memory"):
        return stored_or_new(context)


def _plan_one_process(context: PlanContext, costs: Costs, *, levers: Levers | None = None) -> PlanReport:
    """Steps 2 to 6 on the costs of step 1: floor, speed, search, verification, the plan.

    Args:
        levers: below the floor, try the memory levers (None: one rank of several, where they do not run).
    """
    if context.simulate:  # FLOPs cost a fraction of a trace: they say which precision to trace first
        with context.phase("speed"):
            add_speeds(context, costs)
    measurements = Measurements(
        context, host_sample_bytes=0, stored=context.study.load("measurements"), nf4=levers is not None and levers.allow_lossy_base,
    )
    with context.phase("memory"):
        if not costs.memory_for_floor():  # of those whose weights leave a peak room: a 70B's fp32 ones do not
            first = _fastest(context, costs, leaving_out=_weights_over_budget(context, measurements))
            trace_low(context, costs, first, meanwhile=lambda: compare_halves(context, costs))
    measurements.host_sample_bytes = costs.host_sample_bytes  # what a trace says
    try:
        with context.phase("floor"):
            floor = _floor(context, costs, measurements)
    except InfeasibleBudget as below:
        if levers is None:
            raise
        return _below_floor(context, costs, measurements, below, levers=levers)
    with context.phase("speed"):
        add_speeds(context, costs)
        search = lever_search(context, costs, levers) if levers is not None else None
    evaluations, sampler = _search(context, costs, measurements, levers=search)
    save(context, costs)
    with context.phase("verify"):
        reference = timed_reference(context, evaluations)
        chosen = verify(
            context, costs.model, evaluations, floor_config=floor.config, floor_bytes=floor.budget_bytes,
            measurements=measurements, reference=reference, levers=search,
        )
        costs.model = replace(costs.model, memory_scale=chosen.memory_scale)  # what the measurements calibrated
    compile_note = None
    if context.compile and levers is not None:  # one process (several: the configuration refuses compile)
        with context.phase("compile"):
            chosen, compile_note = with_compile(context, chosen, measurements)
    with context.phase("verify"):
        unconstrained = measure_unconstrained(context, evaluations, chosen=chosen, measurements=measurements)
    with context.phase("write"):
        plan = write_plan(
            context, costs.model, chosen=chosen, evaluations=evaluations, unconstrained=unconstrained,
            usable_bytes=measurements.usable_by_precision(), verified=measurements.verified,
        )
        if chosen.config.levers() or chosen.config.precision in (MASTER_WEIGHTS, PURE_BF16):
            plan = replace(plan, notes=[*plan.notes, *searched_lever_notes(costs.model, chosen.config, search)])
        if compile_note:
            plan = replace(plan, notes=[*plan.notes, compile_note])
        context.study.save("measurements", measurements.to_store())
    speed_noise = max((s.noise for p, s in costs.speeds.items() if p in context.precisions), default=0.0)
    report = PlanReport(
        plan=plan, floor_bytes=floor.budget_bytes, floor_breakdown=floor.breakdown,
        excluded_precisions=context.excluded_precisions, precision_notes=_precision_notes(context, costs, evaluations, measurements),
        unconstrained=unconstrained, sampler=sampler, evaluations=len(evaluations), simulated_checks=measurements.simulated_checks,
        memory_probes=measurements.memory_probes, real_probes=measurements.real_probes, resumed=costs.resumed,
        seconds=time.perf_counter() - context.started, rejected=measurements.rejected, costs=costs.model,
        speeds={p: asdict(s) for p, s in costs.speeds.items() if p in context.precisions}, phases=dict(context.phases),
        timing=measurements.timing, speed_noise=0.0 if context.simulate else speed_noise,
        threads_note=context.threads_note, study=context.study.storage or "", study_problems=list(context.study.problems),
    )
    context.log(f"planned in {report.seconds:.1f} s")
    return report


_UNSEARCHED = object()
"""``_searched_below_floor``'s ``verified`` where the search with the levers has not run yet."""


def _below_floor(
    context: PlanContext, costs: Costs, measurements: Measurements, below: InfeasibleBudget, *, levers: Levers,
) -> PlanReport:
    """Below the floor without levers: the floor configuration with the levers (the ladder), then the search with them.

    The ladder adds the levers to the floor configuration only; where that takes several micro-batches the step in
    backward (one micro-batch per step) is tried only with the whole batch and the floor's checkpointing, yet a
    larger micro-batch with it and fewer blocks checkpointed may fit too: where the ladder finds nothing the search
    has the last word, before the levers the flags do not allow are measured for the refusal's advice.

    Where the device runs and the search would run whatever the ladder finds (``_lever_search_may_fit``: a refusal
    stays as fast as before), the search goes first: a configuration it measured faster by ``POLICY.ladder_untimed_share``
    than the fastest the ladder is predicted at (``ladder_speed_bound``) is the plan, and the ladder is not measured
    (a ResNet-18 plan's levers' probe, of a configuration the search beat by 40%). Else the ladder is measured as
    above, and weighed against what the search verified.
    """
    flags = {"allow_lossy_optimizer": levers.allow_lossy_optimizer, "allow_lossy_base": levers.allow_lossy_base}
    verified = _UNSEARCHED  # what the search found, once it has run
    priced: LeverSearch | None = None  # the levers and their timings, made once for the bound and the search
    if not context.simulate and _lever_search_may_fit(context, measurements, below):
        with context.phase("speed"):
            add_speeds(context, costs)
            priced = lever_search(context, costs, levers)
            bound = ladder_speed_bound(context, costs, below.floor, priced, max_grad_norm=levers.max_grad_norm, **flags)
        if bound is not None:
            context.log(
                f"below the floor without levers, {format_bytes(below.floor_bytes)}: the search with the memory levers first, "
                f"against the floor configuration with them (at most {bound:.1f} samples/s predicted)"
            )
            verified = _verified_search(context, costs, measurements, below, below.floor.config, levers=levers, search=priced)
            speed = verified.chosen.measurement.samples_per_s if verified is not None else None
            if speed and speed > bound * (1 + POLICY.ladder_untimed_share):
                how = f"at most {bound:.1f} samples/s predicted"
                context.log(f"below the floor: the search with the memory levers found {speed:.1f} samples/s, the floor configuration {how}")
                return _searched_plan(
                    context, costs, measurements, below, verified,
                    found=f"this configuration faster than the floor configuration with them ({how}), which was not measured",
                )
    searched: PlanReport | None = None

    def search() -> PlanReport | None:
        nonlocal searched
        if verified is not _UNSEARCHED or _lever_search_may_fit(context, measurements, below):
            searched = _searched_below_floor(context, costs, measurements, below, None, levers=levers, verified=verified, search=priced)
        return searched

    with context.phase("levers"):
        ladder = plan_with_levers(
            context, costs, measurements, below, max_grad_norm=levers.max_grad_norm, then=search, **flags,
        )
    if searched is not None:  # the search's plan, where the ladder found none
        return ladder
    found = _searched_below_floor(context, costs, measurements, below, ladder, levers=levers, verified=verified, search=priced)
    return found if found is not None else timed_ladder(context, ladder, measurements)


def _lever_search_may_fit(context: PlanContext, measurements: Measurements, below: InfeasibleBudget) -> bool:
    """Whether, the ladder having failed, the search with the levers could find a configuration that fits: the floor
    takes several micro-batches (so the ladder left the step in backward out) and the budget leaves room for the
    parameters and the optimizer state, which every configuration with the step in backward holds (measured at the
    floor), and on the CPU for the global batch. Else the refusal stays fast: the search needs every precision's speeds and traces."""
    floor = below.floor
    if floor is None or floor.config.grad_accum_steps == 1:
        return False
    resident = below.breakdown.get("parameters", 0) + below.breakdown.get("optimizer_state", 0)
    # On the CPU the global batch waits in the same memory (the host is the device): every configuration holds it.
    batch = 0 if context.device == "cuda" else context.global_batch_size * measurements.host_sample_bytes
    return measurements.usable_bytes() >= resident + batch


@dataclass(frozen=True)
class _Searched:
    """What the search with the memory levers found below the floor, verified: its points, how it scored them, the
    levers it used, and the configuration measured to fit."""

    evaluations: list[Evaluation]
    sampler: str
    levers: LeverSearch
    chosen: Verified


def _verified_search(
    context: PlanContext, costs: Costs, measurements: Measurements, below: InfeasibleBudget, fallback: TrainingConfig, *,
    levers: Levers, search: LeverSearch | None = None,
) -> _Searched | None:
    """The search with the memory levers and its verification, falling back on ``fallback`` (the ladder's plan, or the
    floor configuration, which does not fit); None where nothing it found fits as measured, or the fallback won.
    ``search``: the levers' ``lever_search``, where already made."""
    if search is None:
        with context.phase("speed"):
            add_speeds(context, costs)
            search = lever_search(context, costs, levers)
    evaluations, sampler = _search(context, costs, measurements, levers=search)
    save(context, costs)
    if not any(e.fits for e in evaluations):
        return None
    with context.phase("verify"):
        try:
            chosen = verify(
                context, costs.model, evaluations, floor_config=fallback, floor_bytes=below.floor_bytes,
                measurements=measurements, levers=search,
            )
        except UserError:  # nothing the search found fits as measured: the ladder's plan (or the refusal) stands
            return None
        costs.model = replace(costs.model, memory_scale=chosen.memory_scale)  # what the measurements calibrated
    if chosen.config.key() == fallback.key():
        return None
    return _Searched(evaluations=evaluations, sampler=sampler, levers=search, chosen=chosen)


def _searched_below_floor(
    context: PlanContext, costs: Costs, measurements: Measurements, below: InfeasibleBudget, ladder: PlanReport | None, *,
    levers: Levers, verified=_UNSEARCHED, search: LeverSearch | None = None,
) -> PlanReport | None:
    """Below the floor: the search with the memory levers, for a configuration measured to fit (a larger micro-batch
    with the step in backward or host state, fewer checkpointed blocks). With the floor configuration's levers
    fitting (``ladder``), None when it finds none faster; without (None), None when it finds none that fits.

    The verification falls back on the ladder's plan (measured to fit) or, without one, on the floor
    configuration (which does not fit: the verification then raises, and None is returned). ``verified``: what a
    search made before the ladder was measured found (``_verified_search`` with the floor configuration to fall back
    on: where it found nothing, falling back on the ladder's plan would have chosen that plan). ``search`` as
    ``_verified_search``'s.
    """
    plan = ladder.plan if ladder is not None else None
    if verified is _UNSEARCHED:
        fallback = below.floor.config if plan is None else plan.config
        verified = _verified_search(context, costs, measurements, below, fallback, levers=levers, search=search)
    if verified is None:
        return None
    if plan is not None:
        speed, ladder_speed, how = _weighed_against_ladder(context, verified.chosen, ladder, measurements)
        if not speed or not ladder_speed or speed <= ladder_speed:
            return None
        context.log(f"below the floor: the search with the memory levers found {speed:.1f} samples/s, the floor configuration {ladder_speed:.1f}{how}")
        found = f"this configuration faster than the floor configuration with them ({ladder_speed:.1f} samples/s{how})"
    else:
        context.log("below the floor: the floor configuration with the memory levers does not fit; the search with them found one that does")
        found = ("this configuration, measured to fit, where the floor configuration with them does not (it takes several "
                 "micro-batches a step, and the step in backward needs one)")
    return _searched_plan(context, costs, measurements, below, verified, found=found)


def _searched_plan(
    context: PlanContext, costs: Costs, measurements: Measurements, below: InfeasibleBudget, verified: _Searched, *, found: str,
) -> PlanReport:
    """The plan of the search's configuration below the floor, ``found`` saying what it was found against."""
    chosen, evaluations, search = verified.chosen, verified.evaluations, verified.levers
    with context.phase("write"):
        plan = write_plan(
            context, costs.model, chosen=chosen, evaluations=evaluations, unconstrained=None,
            usable_bytes=measurements.usable_by_precision(), verified=measurements.verified,
        )
        plan = replace(plan, notes=[
            *plan.notes,
            f"below the floor without levers ({format_bytes(below.floor_bytes)}): the search with the memory levers found {found}",
            *(searched_lever_notes(costs.model, chosen.config, search) if chosen.config.levers() else []),
        ])
        context.study.save("measurements", measurements.to_store())
    return PlanReport(
        plan=plan, floor_bytes=below.floor_bytes, floor_breakdown=below.breakdown, excluded_precisions=context.excluded_precisions,
        precision_notes=_precision_notes(context, costs, evaluations, measurements), sampler=verified.sampler, evaluations=len(evaluations),
        simulated_checks=measurements.simulated_checks, memory_probes=measurements.memory_probes,
        real_probes=measurements.real_probes, resumed=costs.resumed, seconds=time.perf_counter() - context.started,
        rejected=measurements.rejected, costs=costs.model, phases=dict(context.phases),
        timing=measurements.timing, study=context.study.storage or "", study_problems=list(context.study.problems),
    )


def _weighed_against_ladder(context: PlanContext, chosen, ladder: PlanReport, measurements: Measurements) -> tuple[float | None, float | None, str]:
    """The search's speed and the ladder's (the floor configuration with the levers), and how the ladder's is known:
    "" timed (or simulated: both predicted), " predicted" where the search's measured speed beats the ladder's
    prediction by ``POLICY.ladder_untimed_share`` (its timing would decide nothing)."""
    if context.simulate:
        return chosen.candidate.predicted_samples_per_s, ladder.plan.predicted.samples_per_s, ""
    speed, predicted = chosen.measurement.samples_per_s, ladder.plan.predicted.samples_per_s
    if speed and predicted and speed > predicted * (1 + POLICY.ladder_untimed_share):
        return speed, predicted, " predicted"
    return speed, timed_ladder(context, ladder, measurements).plan.measured.samples_per_s, ""


def _fastest(context: PlanContext, costs: Costs, *, leaving_out=()) -> str:
    """The precision expected fastest, of those not in ``leaving_out`` (which leaves one at least): by its speeds
    when known, else the first asked for."""
    candidates = [p for p in context.precisions if p not in leaving_out]
    known = [p for p in candidates if p in costs.speeds]
    if not known:
        return candidates[0]
    return max(known, key=lambda p: best_plain_samples_per_s(costs, p))


def _floor(context: PlanContext, costs: Costs, measurements: Measurements):
    """The floor over the precisions traced so far; before a refusal is final, over every precision (measured only
    then, where the memory model already puts it far above the budget).

    Where it is far above, the missing precisions are traced one at a time, the least weights first (the
    likeliest to bring it down: bf16-master's before fp32's), until it no longer is. A precision whose weights alone
    need the floor's budget (``Measurements.weights_budget``) cannot lower it and is not traced for it.
    """
    missing = [p for p in context.precisions if p not in costs.memory_for_floor()]
    missing.sort(key=measurements.weight_bytes)
    while missing and (far := far_above_budget(context, costs, measurements)) is not None:
        missing = _may_lower(context, measurements, missing, far, predicted=True)
        if not missing:
            break
        context.log(f"floor: {format_bytes(far)} predicted, far over the budget: tracing {missing[0]} before measuring it")
        with context.phase("memory"):
            trace_low(context, costs, missing.pop(0))
    try:
        return check_floor(context, costs, measurements)
    except InfeasibleBudget as below:
        missing = _may_lower(context, measurements, missing, below.floor_bytes)
        if not missing:
            save(context, costs)
            raise
    with context.phase("memory"):
        for precision in missing:
            trace_low(context, costs, precision)
    try:
        return check_floor(context, costs, measurements)
    finally:
        save(context, costs)


def _may_lower(
    context: PlanContext, measurements: Measurements, missing: list[str], floor_bytes: int, *, predicted: bool = False,
) -> list[str]:
    """Of the ``missing`` precisions, those whose weights alone need less than the floor's budget; the others said."""
    kept = [p for p in missing if measurements.weights_budget(p) < floor_bytes]
    if len(kept) < len(missing):
        left = [p for p in missing if p not in kept]
        needs = dict.fromkeys(format_bytes(measurements.weights_budget(p)) for p in left)
        context.log(
            f"floor: {', '.join(left)} not traced for it: {'its' if len(left) == 1 else 'their'} weights alone need "
            f"a budget of {' / '.join(needs)}, at least the floor's {format_bytes(floor_bytes)}{' (predicted)' if predicted else ''}"
        )
    return kept


def _search(
    context: PlanContext, costs: Costs, measurements: Measurements, *, levers: LeverSearch | None = None,
) -> tuple[list[Evaluation], str]:
    """Trace precisions in full, fastest first, while one could still reach the verification; score them (with
    the memory levers of ``levers``).

    Where the memory model has the last word (``Measurements.model_is_exact``: simulating, or on the CPU), a
    precision is traced without its recomputations first: checkpointing only slows a point down, so it is worth
    knowing only for points whose speed could still come near the best that fits without it and, where real steps
    are timed, be among the candidates the verification times (``needs_recomputations``). On a GPU the offloading
    runs are traced on the same terms (``needs_offload``: bounded as if the copies back held nothing and cost the
    least they can), after the recomputations, whose speed may leave offload nothing to win.
    A plan that times a real GPU's steps traces them with the plain runs: its verification may ask for a smaller
    checkpoint set where the card's allocator holds more than the model says. On the CPU a model whose forward is
    a Python loop of small ops traces slowly, and its recomputing runs were most of a plan that checkpointed
    nothing (#47, bench/RESULTS.md), so they wait until a candidate could need them; a plan of the same model at
    a tighter budget adds them to the plain runs it finds in the cache.
    """
    order = sorted(context.precisions, key=lambda p: -best_plain_samples_per_s(costs, p))
    over = _weights_over_budget(context, measurements)
    if over:
        context.log(
            f"memory: {', '.join(over)} not traced further: {_weights_words(over, measurements)}"
        )
        order = [p for p in order if p not in over]
    scores = _Scores(context, costs, measurements, levers=levers)
    within = _verify_within(context)
    for index, precision in enumerate(order):
        best = max((e.samples_per_s for e in scores.evaluations if e.fits), default=0.0)
        if precision not in costs.model.precisions and index > 0 and not worth_tracing(costs, precision, best_fitting=best, within=within):
            continue
        with context.phase("memory"):
            trace_full(context, costs, precision, recompute=not measurements.model_is_exact)
        scores.update()
        _trace_what_could_win(context, costs, scores, within=within, levers=levers)
    evaluations, sampler = scores.evaluations, scores.sampler
    if context.study.search_storage is not None or not evaluations:
        with context.phase("search"):
            # The search kept where the user asked (--study): over every precision traced.
            evaluations, sampler = scores.score(study=context.study)
    skipped = [p for p in costs.untraced(context.precisions) if p not in over]
    context.log(
        f"search: {len(evaluations)} (precision, micro-batch) points by {sampler}, {sum(e.fits for e in evaluations)} fit the "
        f"model's budget" + (f"; {', '.join(skipped)} not traced (too slow to matter)" if skipped else "")
    )
    return evaluations, sampler


class _Scores:
    """The search's scores while tracing adds to the costs: scored again only when what they depend on changed."""

    def __init__(self, context: PlanContext, costs: Costs, measurements: Measurements, *, levers: LeverSearch | None) -> None:
        self.context, self.costs, self.measurements, self.levers = context, costs, measurements, levers
        self.usable = measurements.usable_bytes()
        self.usable_for = measurements.usable_by_precision()  # what the search scores each precision by
        self.evaluations: list[Evaluation] = []
        self.sampler = ""
        self._scored_for: list | None = None

    def update(self) -> list[Evaluation]:
        """The levers' records the scores need, then the scores (again where tracing changed what they depend on)."""
        self._add_lever_records()
        key = self._depends_on()
        if key != self._scored_for:
            self._scored_for = key
            with self.context.phase("search"):
                self.evaluations, self.sampler = self.score(study=None)
        return self.evaluations

    def score(self, *, study) -> tuple[list[Evaluation], str]:
        """Every (precision, micro-batch) point of the precisions traced (kept in ``study`` where given)."""
        context, costs = self.context, self.costs
        return score_space(
            costs.model, precisions=_traced(context, costs), micro_batch_sizes=costs.micro_batch_sizes,
            global_batch_size=context.global_batch_size, usable_bytes=self.usable_for, study=study, slack=self.measurements.slack,
            levers=self.levers,
        )

    def _add_lever_records(self) -> None:
        context, costs, levers = self.context, self.costs, self.levers
        if levers is not None and levers.eight_bit is not None:
            with context.phase("memory"):
                add_eight_bit_state(context, costs)
        if levers is not None and levers.loss_chunks > 1:
            with context.phase("memory"):
                add_loss_chunks(context, costs, chunks=levers.loss_chunks, usable_bytes=self.usable)
        if levers is not None and levers.nf4 is not None:
            with context.phase("memory"):
                add_nf4_state(context, costs)

    def _depends_on(self) -> list:
        """What the scores depend on that tracing changes (a precision stored in the cache adds nothing), and the
        slack the probes so far allow."""
        memories = [(p, self.costs.model.precisions[p].memory) for p in _traced(self.context, self.costs)]
        return [self.measurements.slack] + [
            (p, memory.recomputed, memory.has_chunks(), [t.levers.offloaded is not None for t in memory.traces() if t.levers])
            for p, memory in memories
        ]


def _trace_what_could_win(context: PlanContext, costs: Costs, scores: _Scores, *, within: float, levers: LeverSearch | None) -> None:
    """Trace the recomputations, then the offloading runs, of the points whose speed could still reach the
    verification, scoring again after each, until none is left."""
    # Where real steps are timed, a checkpointed point's recomputations matter only if it could be a candidate.
    candidates = None if context.simulate else POLICY.verify_top_candidates
    while True:
        # Recomputations first: the speed they make fit may leave offload nothing to win.
        recomputations = needs_recomputations(
            costs, scores.evaluations, within=within, candidates=candidates, tie=tie_cap(context.tie),
        )
        offloads = []
        if not recomputations and levers and levers.offload:
            offloads = needs_offload(context, costs, scores.evaluations, within=within, usable_bytes=scores.usable)
        if not offloads and not recomputations:
            return
        with context.phase("memory"):
            for name in offloads:
                trace_offload(context, costs, name, usable_bytes=scores.usable)
            for name in recomputations:
                add_recomputations(context, costs, name)
        scores.update()


def _weights_over_budget(context: PlanContext, measurements: Measurements) -> dict[str, int]:
    """The precisions whose weights alone are more than any of their peaks may be
    (``Measurements.weights_over_budget``), with those bytes. Where that is every precision, those with the least
    weights are left out of it: they are searched (and the floor, which no other precision's could be under, says
    how far over the budget it is)."""
    over = {p: b for p in context.precisions if (b := measurements.weights_over_budget(p)) is not None}
    if len(over) == len(context.precisions):
        least = min(over.values())
        over = {p: b for p, b in over.items() if b > least}
    return over


def _weights_words(over: dict[str, int], measurements: Measurements) -> str:
    """"their weights alone (261.00 GiB) are more than a peak may be (170.52 GiB)"."""
    weights = sorted(set(over.values()))
    usable = sorted({int(measurements.usable_bytes(p)) for p in over})
    return (
        f"{'its' if len(over) == 1 else 'their'} weights alone ({' / '.join(format_bytes(b) for b in weights)}) are more "
        f"than a peak may be ({' / '.join(format_bytes(b) for b in usable)})"
    )


def _verify_within(context: PlanContext) -> float:
    """The share of the best predicted speed a candidate needs for the verification to time it; simulating, nothing
    is timed and the fastest predicted wins (one candidate)."""
    return 1.0 if context.simulate else POLICY.verify_within_share


def _traced(context: PlanContext, costs: Costs) -> list[str]:
    return [p for p in context.precisions if p in costs.model.precisions]


def _precision_notes(context: PlanContext, costs: Costs, evaluations: list[Evaluation], measurements: Measurements) -> dict[str, str]:
    """Per precision: its speed note, the traces it shares, or why it was not traced."""
    best = max((e.samples_per_s for e in evaluations if e.fits), default=0.0)
    over = _weights_over_budget(context, measurements)
    notes = {}
    for precision in context.precisions:
        parts = [costs.notes[precision]] if precision in costs.notes else []
        if precision in costs.shared and precision in costs.model.precisions:
            parts.append(f"memory from {costs.shared[precision]}'s traces (autocast checked to make the same tensors)")
        if precision in over and precision not in costs.model.precisions:
            parts.append(f"not traced: {_weights_words({precision: over[precision]}, measurements)}")
        elif precision not in costs.model.precisions:
            within = _verify_within(context)
            parts.append(
                f"not traced: at most {best_plain_samples_per_s(costs, precision):.1f} samples/s with no budget, under "
                + (f"{within:.0%} of " if within < 1 else "") + f"the {best:.1f} found to fit"
            )
        if parts:
            notes[precision] = "; ".join(parts)
    return notes


def _plan_ranks(spec: ModelSpec, request: PlanRequest, *, progress: Progress) -> PlanReport:
    """N > 1 processes: DDP when a rank's share fits as one process with the buckets' allowance, else FSDP2; on several
    nodes, FSDP2 within each node and replicated across them (HSDP) where that fits, else over every process."""
    started = time.perf_counter()
    nodes = request.nodes
    world_size, batch_size = request.gpus * nodes, request.batch_size
    check_ranks(batch_size=batch_size, world_size=world_size, nodes=nodes)
    share = math.ceil(batch_size / world_size)
    check_rank_share(spec, global_batch_size=batch_size, share=share, world_size=world_size)
    # bf16 weights (with their masters on the host, or pure) train on one process only: not a rank's precisions.
    one_process = ONE_PROCESS_PRECISIONS
    if request.weights_dtype == "config" and spec.config_dtype == "bf16":
        raise UserError(
            f"--weights-dtype config keeps config.json's bf16 weights ({PURE_BF16}), which train on one process only; "
            f"for {world_size} GPUs leave it out"
        )
    asked = [p for p in (request.precisions or PRECISIONS) if p not in one_process]
    if not asked:
        raise UserError(f"--precisions {','.join(request.precisions)} train on one process only; for {world_size} GPUs allow bf16 or fp32")
    request = replace(request, precisions=tuple(asked))
    # One rank's share of the batch with the whole per-GPU budget (FSDP2 plans in it).
    rank = plan_context(spec, replace(request, batch_size=share, gpus=1, nodes=1, study=None), log=progress)

    def say_why_left_out(context: PlanContext) -> None:
        for precision in one_process:
            if precision in context.excluded_precisions:
                context.excluded_precisions[precision] = f"trains on one process only, not on {world_size} GPUs"

    say_why_left_out(rank)
    allowance = gradient_bytes(rank.sim_spec)
    rank.log(
        f"{world_size} GPUs: each rank trains {share} of the {batch_size} samples per step; DDP first, keeping "
        f"{format_bytes(allowance)} (one gradient size) for its gradient buckets"
    )
    costs, contexts = None, [rank]
    try:
        if rank.budget_bytes > allowance:
            ddp = plan_context(spec, replace(request, budget=rank.budget_bytes - allowance, batch_size=share, gpus=1, nodes=1), log=progress)
            say_why_left_out(ddp)
            contexts.append(ddp)
            costs = _memory(ddp)
            kept_together(ddp, costs)  # a declared MIN_MICRO_BATCH within a rank's share (check_rank_share)
            try:
                with _threads(ddp):
                    report = _plan_one_process(ddp, costs)
            except InfeasibleBudget:
                # The memory model does not depend on the budget: FSDP2 reuses the one DDP's attempt traced.
                rank.log("DDP does not fit: every rank would hold the whole model's state; sharding it with FSDP2")
            else:
                report = restate_for_ddp(
                    report, budget_bytes=rank.budget_bytes, allowance=allowance, world_size=world_size, global_batch_size=batch_size,
                    nodes=nodes,
                )
                report.seconds = time.perf_counter() - started
                return _with_trace_notes(report, contexts)
        with _threads(rank):
            if costs is None:
                costs = stored_or_new(rank)
                kept_together(rank, costs)
            hsdp = nodes > 1 and request.gpus > 1
            report = _plan_hsdp(rank, costs, per_node=request.gpus, nodes=nodes, batch_size=batch_size) if hsdp else None
            if report is None:
                report = plan_fsdp(rank, costs, world_size=world_size, global_batch_size=batch_size, nodes=nodes)
    finally:
        for context in contexts:
            context.trace_pool.close()
    report.seconds = time.perf_counter() - started
    return _with_trace_notes(report, contexts)


def _plan_hsdp(rank: PlanContext, costs: Costs, *, per_node: int, nodes: int, batch_size: int) -> PlanReport | None:
    """HSDP: a rank's share planned as FSDP2 over the GPUs of one node (a rank holds that sharding's shard and the
    same share of the batch), restated for every node; None where that does not fit."""
    share = rank.global_batch_size
    rank.log(f"{nodes} nodes: FSDP2 within each node's {per_node} GPUs, replicated across the nodes (HSDP)")
    try:
        report = plan_fsdp(rank, costs, world_size=per_node, global_batch_size=share * per_node)
    except InfeasibleBudget:
        rank.log(f"HSDP does not fit: sharded over one node's {per_node} GPUs a rank holds too much; sharding over all {nodes * per_node}")
        return None
    return restate_for_hsdp(report, nodes=nodes, global_batch_size=batch_size)

