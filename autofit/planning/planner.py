"""The planner: the fastest configuration that was measured to fit a budget.

One process (``_plan_one_process``), in steps that pass values on:

1. Memory (``modelling``): two simulated traces per precision (no arithmetic)
   give every configuration's peak; a stored study's cost model is reused.
2. Floor (``floor``): the smallest micro-batch with every block checkpointed
   (or none), measured, so an impossible budget fails in seconds with what
   would lower it. Below it, on one process, the floor configuration is tried
   with the memory levers (``levers``), measured; the first that fits is the plan.
3. Speed (``modelling``): real timings on the device at a few micro-batch
   sizes per precision; with ``simulate``, FLOPs instead.
4. Search (``search``): Optuna over precision x micro-batch; for each point an
   exact knapsack picks the cheapest checkpoint set that fits.
5. Verification (``verify``): the best candidates are measured with the
   device's meter (the simulated one when simulating); only a configuration
   whose measured peak plus headroom fits is ever emitted.
6. The plan (``writing``).

N > 1 processes (``_plan_ranks``): DDP when one rank's share plans as one
process with an allowance for DDP's buckets, FSDP2 (``ranks``) otherwise.
"""
from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence

import torch

from autofit.errors import UserError
from autofit.plan_file import Plan
from autofit.planning.context import PlanContext, plan_context
from autofit.planning.floor import InfeasibleBudget, check_floor
from autofit.planning.levers import Levers, plan_with_levers
from autofit.planning.modelling import Costs, add_speeds, stored_or_traced, traced
from autofit.planning.ranks import check_ranks, gradient_bytes, plan_fsdp, restate_for_ddp
from autofit.planning.search import score_space
from autofit.planning.verify import Measurements, measure_unconstrained, verify
from autofit.planning.writing import PlanReport, write_plan
from autofit.spec import ModelSpec, spec_from_model
from autofit.units import format_bytes


def plan(
    model: torch.nn.Module,
    example_batch: Callable[[int], tuple],
    *,
    budget: str | int,
    batch_size: int,
    loss_fn: Callable | None = None,
    optimizer: Callable | None = None,
    device: str = "cpu",
    simulate: bool = False,
    device_memory: str | int | None = None,
    study: str | None = None,
    precisions: Sequence[str] | None = None,
    gpus: int = 1,
    allow_lossy_optimizer: bool = False,
) -> Plan:
    """Find the fastest way to train ``model`` inside ``budget``, verified by real probes.

    Args:
        model: the model; it is never modified (probes train copies).
        example_batch: batch_size -> (inputs, targets), e.g. random tensors of the right shapes.
        budget: "16GB", "16GiB", "512MiB", "90%" (of the device) or bytes.
        batch_size: the global batch (samples per optimizer step); every plan keeps it.
        loss_fn: (output, target) -> loss; default cross-entropy.
        optimizer: params -> Optimizer; default AdamW(lr=1e-3).
        device: "cpu" or "cuda".
        simulate: plan with the simulated meter and FLOP-based speeds (marked estimated).
        device_memory: the device's total memory when simulating a GPU that is not here.
        study: an Optuna storage URL ("sqlite:///plans.db") to keep the search and resume it.
        precisions: restrict the precisions searched (default: all the device runs).
        gpus: processes (GPUs) to train on; ``budget`` is then per GPU, and the plan
            uses DDP when the model fits unsharded, FSDP2 otherwise (see ``plan_with_report``).
        allow_lossy_optimizer: below the floor, 8-bit AdamW state (torchao) may be chosen;
            it changes the optimizer's arithmetic, so it is never chosen without this.

    Returns:
        The Plan (``autofit.save_plan(plan, "plan.json")`` writes it).

    Raises:
        UserError: a bad argument, or a budget below the floor (the message gives the floor).

    Example:
        >>> plan = autofit.plan(model, lambda n: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))),
        ...                     budget="2GB", batch_size=256)
        >>> plan.micro_batch_size, plan.checkpoint, plan.precision
    """
    spec = spec_from_model(model, example_batch, loss_fn=loss_fn, optimizer=optimizer)
    return make_plan(
        spec, budget=budget, batch_size=batch_size, device=device, simulate=simulate,
        device_memory=device_memory, study=study, precisions=precisions, gpus=gpus, allow_lossy_optimizer=allow_lossy_optimizer,
    )


def make_plan(
    spec: ModelSpec,
    *,
    budget: str | int,
    batch_size: int,
    device: str = "cpu",
    simulate: bool = False,
    device_memory: str | int | None = None,
    study: str | None = None,
    precisions: Sequence[str] | None = None,
    num_classes: int | None = None,
    log: Callable[[str], None] | None = None,
    gpus: int = 1,
    allow_lossy_optimizer: bool = False,
) -> Plan:
    """Plan for a ModelSpec: see ``plan`` for the arguments; ``log`` receives progress lines."""
    return plan_with_report(
        spec, budget=budget, batch_size=batch_size, device=device, simulate=simulate, device_memory=device_memory,
        study=study, precisions=precisions, num_classes=num_classes, log=log, gpus=gpus,
        allow_lossy_optimizer=allow_lossy_optimizer,
    ).plan


def plan_with_report(
    spec: ModelSpec,
    *,
    budget: str | int,
    batch_size: int,
    device: str = "cpu",
    simulate: bool = False,
    device_memory: str | int | None = None,
    study: str | None = None,
    precisions: Sequence[str] | None = None,
    num_classes: int | None = None,
    log: Callable[[str], None] | None = None,
    gpus: int = 1,
    allow_lossy_optimizer: bool = False,
) -> PlanReport:
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

    Below the floor on one process, the memory levers are tried (``levers``);
    8-bit optimizer state only with ``allow_lossy_optimizer``. They run on one
    process, so N > 1 plans do not use them.
    """
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise UserError(f"--gpus {gpus!r} must be a whole number of GPUs, at least 1")
    arguments = dict(
        device=device, simulate=simulate, device_memory=device_memory, precisions=precisions, num_classes=num_classes, log=log,
    )
    if gpus > 1:
        return _plan_ranks(spec, world_size=gpus, budget=budget, batch_size=batch_size, study=study, **arguments)
    context = plan_context(spec, budget=budget, batch_size=batch_size, study=study, **arguments)
    return _plan_one_process(context, _memory(context), levers=Levers(allow_lossy_optimizer=allow_lossy_optimizer))


def _memory(context: PlanContext) -> Costs:
    """Step 1: the memory model (with the speeds too when a stored study holds them)."""
    context.log(
        f"planning {context.spec.source} for a batch of {context.global_batch_size} within "
        f"{format_bytes(context.budget_bytes)} on {context.device}"
    )
    return stored_or_traced(context)


def _plan_one_process(context: PlanContext, costs: Costs, *, levers: Levers | None = None) -> PlanReport:
    """Steps 2 to 6 on the memory model of step 1: floor, speed, search, verification, the plan.

    Args:
        levers: below the floor, try the memory levers (None: one rank of several, where they do not run).
    """
    G, model = context.global_batch_size, costs.model
    measurements = Measurements(context, host_sample_bytes=costs.host_sample_bytes, verified=context.study.load("verified") or {})
    try:
        floor = check_floor(context, costs, measurements)
    except InfeasibleBudget as below:
        if levers is None:
            raise
        return plan_with_levers(context, costs, measurements, below, allow_lossy_optimizer=levers.allow_lossy_optimizer)
    precision_notes = {} if costs.resumed else add_speeds(context, costs)
    evaluations, sampler = score_space(
        model, precisions=context.precisions, micro_batch_sizes=costs.micro_batch_sizes, global_batch_size=G,
        usable_bytes=measurements.headroom.usable_bytes(), study=context.study,
    )
    context.log(f"search: {len(evaluations)} (precision, micro-batch) points by {sampler}, {sum(e.fits for e in evaluations)} fit the model's budget")
    chosen = verify(context, model, evaluations, floor_config=floor.config, floor_bytes=floor.budget_bytes, measurements=measurements)
    unconstrained = measure_unconstrained(context, evaluations, chosen=chosen, measurements=measurements)
    plan = write_plan(
        context, model, chosen=chosen, evaluations=evaluations, unconstrained=unconstrained,
        headroom=measurements.headroom, verified=measurements.verified,
    )
    report = PlanReport(
        plan=plan, floor_bytes=floor.budget_bytes, floor_breakdown=floor.breakdown,
        excluded_precisions=context.excluded_precisions, precision_notes=precision_notes, unconstrained=unconstrained,
        sampler=sampler, evaluations=len(evaluations), simulated_checks=measurements.simulated_checks,
        memory_probes=measurements.memory_probes, real_probes=measurements.real_probes, resumed=costs.resumed,
        seconds=time.perf_counter() - context.started, rejected=measurements.rejected, cost_model=model.to_dict(),
    )
    context.study.save("verified", measurements.verified)
    context.log(f"planned in {report.seconds:.1f} s")
    return report


def _plan_ranks(spec: ModelSpec, *, world_size: int, budget: str | int, batch_size: int, study: str | None, **arguments) -> PlanReport:
    """N > 1 processes: DDP when a rank's share fits as one process with the buckets' allowance, else FSDP2."""
    started = time.perf_counter()
    check_ranks(batch_size=batch_size, world_size=world_size)
    share = math.ceil(batch_size / world_size)
    # One rank's share of the batch with the whole per-GPU budget (FSDP2 plans in it).
    rank = plan_context(spec, budget=budget, batch_size=share, study=None, **arguments)
    allowance = gradient_bytes(rank.sim_spec)
    rank.log(
        f"{world_size} GPUs: each rank trains {share} of the {batch_size} samples per step; DDP first, keeping "
        f"{format_bytes(allowance)} (one gradient size) for its gradient buckets"
    )
    costs = None
    if rank.budget_bytes > allowance:
        ddp = plan_context(spec, budget=rank.budget_bytes - allowance, batch_size=share, study=study, **arguments)
        costs = _memory(ddp)
        try:
            report = _plan_one_process(ddp, costs)
        except InfeasibleBudget:
            # The memory model does not depend on the budget: FSDP2 reuses the one DDP's attempt traced.
            rank.log("DDP does not fit: every rank would hold the whole model's state; sharding it with FSDP2")
        else:
            report = restate_for_ddp(
                report, budget_bytes=rank.budget_bytes, allowance=allowance, world_size=world_size, global_batch_size=batch_size
            )
            report.seconds = time.perf_counter() - started
            return report
    report = plan_fsdp(rank, costs or traced(rank), world_size=world_size, global_batch_size=batch_size)
    report.seconds = time.perf_counter() - started
    return report


def print_progress(line: str) -> None:
    """A log function for the CLI: progress on stderr, so --json keeps stdout clean."""
    print(f"  {line}", file=sys.stderr, flush=True)
