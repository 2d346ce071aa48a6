"""The planner: the fastest configuration that was measured to fit a budget.

1. Memory: two simulated traces per precision (no arithmetic) give every
   configuration's peak (``memory_model``); the floor (micro-batch as small as
   the model runs, every block checkpointed) is checked first, so an
   impossible budget fails in seconds with what would lower it.
2. Speed: real timings on the device at a few micro-batch sizes per precision
   (``cost_model``); with ``simulate``, FLOPs instead.
3. Search: Optuna over precision x micro-batch (``search``); for each point an
   exact knapsack picks the cheapest checkpoint set that fits.
4. Verification: the best candidates are re-measured exactly with the
   simulated meter (equal to the CPU meter) and then with real probes; only a
   configuration whose measured peak plus headroom fits is ever emitted.
"""
from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from autofit.errors import UserError
from autofit.measure.meters import check_device, checked_for_simulation, frozen_note, release_device_memory
from autofit.planning.memory_model import simulation_spec
from autofit.plan_file import Plan
from autofit.spec import ModelSpec
from autofit.units import format_bytes, parse_budget
from strategies import PRECISIONS

SAFETY_MARGIN = 0.02
"""Share of the budget kept free on every device: the meters are exact, the data may not be."""
CUDA_FRAGMENTATION = 0.05
"""Share of the allocator's peak kept for fragmentation growth over a long run on a GPU."""
# Planning for a GPU that is not here (--simulate --device cuda): bench/gpu_validate.py on an
# H200 (bench/RESULTS.md) found the simulated peak 1-9% under the allocator's allocated peak,
# the allocator's cache 0.35-1.25 GiB above that, and 0.75 GiB outside the allocator in every
# case. These three cover all 24 measured cases.
ESTIMATED_CUDA_FRAGMENTATION = 0.20
"""Share of the simulated peak kept for the meter's under-count and the allocator's cache growing with it."""
ESTIMATED_CUDA_ALLOCATOR_RESERVE = 2**30
"""Fixed part of the allocator's cache (reserved - allocated) when estimated."""
ESTIMATED_CUDA_CONTEXT = 768 * 2**20
"""CUDA context and library workspaces assumed when planning for a GPU that is not here."""
MODEL_SLACK = 0.01
"""The memory model may be this pessimistic; candidates within it are checked exactly rather than dropped."""
VERIFY_TOP = 3
"""Candidates verified with real probes."""
VERIFY_WITHIN = 0.75
"""Only candidates predicted at least this fraction of the best candidate's speed are worth a real probe."""
NOISE = 0.03
"""Measured speeds this close are a tie (timing noise); the simpler configuration wins a tie."""
VERIFY_ATTEMPTS = 5
"""Checkpoint sets measured per (precision, micro-batch) before it is given up."""
TIMING_ROUNDS = 2
"""Each verified candidate is timed this many times, in interleaved rounds; its fastest round counts."""


class InfeasibleBudget(UserError):
    """The budget is below the floor: nothing can train in it."""

    def __init__(self, message: str, *, floor_bytes: int, breakdown: dict[str, int]) -> None:
        super().__init__(message)
        self.floor_bytes = floor_bytes
        self.breakdown = breakdown


@dataclass(kw_only=True, slots=True)
class Headroom:
    """Bytes kept free beyond a measured peak, by cause (see README "plan.json")."""

    device_type: str
    estimated: bool
    budget_bytes: int
    context_bytes: int = 0
    """On a GPU: what the process holds outside the allocator (measured, or assumed when estimated)."""

    def _fragmentation_share(self) -> float:
        if self.device_type != "cuda":
            return 0.0
        return ESTIMATED_CUDA_FRAGMENTATION if self.estimated else CUDA_FRAGMENTATION

    def _fixed_causes(self) -> dict[str, int]:
        """Causes that do not grow with the peak (the safety margin is added by the caller)."""
        if self.device_type != "cuda":
            return {}
        causes = {"context": self.context_bytes}
        if self.estimated:
            causes["allocator_reserve"] = ESTIMATED_CUDA_ALLOCATOR_RESERVE
        return causes

    def for_peak(self, peak_bytes: float) -> dict[str, int]:
        causes = dict(self._fixed_causes())
        if self.device_type == "cuda":
            causes["fragmentation"] = math.ceil(self._fragmentation_share() * peak_bytes)
        causes["safety_margin"] = math.ceil(SAFETY_MARGIN * self.budget_bytes)
        return causes

    def usable_bytes(self) -> float:
        """The largest peak whose headroom still fits the budget."""
        fixed = math.ceil(SAFETY_MARGIN * self.budget_bytes) + sum(self._fixed_causes().values())
        # fragmentation is rounded up per peak: keep one byte spare for it
        return (self.budget_bytes - fixed - 1) / (1 + self._fragmentation_share())

    def smallest_budget(self, peak_bytes: float) -> int:
        """The least budget whose headroom leaves room for this peak."""
        need = peak_bytes + math.ceil(self._fragmentation_share() * peak_bytes) + sum(self._fixed_causes().values())
        budget = math.ceil(need / (1 - SAFETY_MARGIN))
        probe = Headroom(device_type=self.device_type, estimated=self.estimated, budget_bytes=budget, context_bytes=self.context_bytes)
        while not probe.fits(peak_bytes):
            budget += 1 + budget // 10**6
            probe.budget_bytes = budget
        return budget

    def fits(self, peak_bytes: float) -> bool:
        return peak_bytes + sum(self.for_peak(peak_bytes).values()) <= self.budget_bytes


@dataclass(kw_only=True, slots=True)
class Config:
    precision: str
    micro_batch_size: int
    checkpoint: tuple[str, ...] = ()

    def key(self) -> str:
        return f"{self.precision}:{self.micro_batch_size}:{','.join(self.checkpoint)}"


@dataclass(kw_only=True)
class PlanReport:
    """What the summary shows beyond plan.json: how the plan was found."""

    plan: Plan
    floor_bytes: int = 0
    floor_breakdown: dict[str, int] = field(default_factory=dict)
    excluded_precisions: dict[str, str] = field(default_factory=dict)
    """Precision -> why it was left out."""
    precision_notes: dict[str, str] = field(default_factory=dict)
    unconstrained: dict = field(default_factory=dict)
    """The fastest configuration with no budget, and its measured speed."""
    sampler: str = ""
    evaluations: int = 0
    simulated_checks: int = 0
    memory_probes: int = 0
    """Real probes of a configuration's peak (on its meter)."""
    real_probes: int = 0
    """Configurations timed for real."""
    resumed: bool = False
    seconds: float = 0.0
    rejected: list[dict] = field(default_factory=list)
    """Candidates that failed verification, with why."""
    cost_model: dict = field(default_factory=dict)
    """The cost model the search used (``CostModel.from_dict`` reads it)."""


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

    Returns:
        The Plan (``autofit.save_plan(plan, "plan.json")`` writes it).

    Raises:
        UserError: a bad argument, or a budget below the floor (the message gives the floor).

    Example:
        >>> plan = autofit.plan(model, lambda n: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))),
        ...                     budget="2GB", batch_size=256)
        >>> plan.micro_batch_size, plan.checkpoint, plan.precision
    """
    from autofit.spec import spec_from_model

    spec = spec_from_model(model, example_batch, loss_fn=loss_fn, optimizer=optimizer)
    return make_plan(
        spec, budget=budget, batch_size=batch_size, device=device, simulate=simulate,
        device_memory=device_memory, study=study, precisions=precisions, gpus=gpus,
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
) -> Plan:
    """Plan for a ModelSpec: see ``plan`` for the arguments; ``log`` receives progress lines."""
    return plan_with_report(
        spec, budget=budget, batch_size=batch_size, device=device, simulate=simulate, device_memory=device_memory,
        study=study, precisions=precisions, num_classes=num_classes, log=log, gpus=gpus,
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
    """
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise UserError(f"--gpus {gpus!r} must be a whole number of GPUs, at least 1")
    arguments = dict(
        budget=budget, batch_size=batch_size, device=device, simulate=simulate,
        device_memory=device_memory, study=study, precisions=precisions, num_classes=num_classes, log=log,
    )
    if gpus == 1:
        return _Planner(spec, **arguments).run()
    return _RanksPlanner(spec, gpus=gpus, **arguments).run()


class _Planner:
    """One planning run; its steps read top to bottom in ``run``."""

    def __init__(
        self, spec: ModelSpec, *, budget, batch_size, device, simulate, device_memory, study, precisions, num_classes, log
    ) -> None:
        from autofit.measure.meters import device_info

        check_device(device, simulate=simulate)
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise UserError(f"--batch-size {batch_size!r} must be a whole number of samples, at least 1")
        total = parse_budget(device_memory) if device_memory is not None else None
        self.info = device_info(device, total_bytes=total)
        self.spec = spec
        self.sim_spec = checked_for_simulation(simulation_spec(spec))  # or the cpu meter, with one line saying why
        self.budget_bytes = parse_budget(budget, device_total_bytes=self.info.total_bytes)
        self.global_batch_size = batch_size
        self.device = device
        self.simulate = simulate
        self.study = study
        self.num_classes = num_classes
        self._started = time.perf_counter()
        user_log = log or (lambda line: None)
        self.log = lambda line: user_log(f"[{time.perf_counter() - self._started:5.1f} s] {line}")
        self.precisions, self.excluded = _usable_precisions(device, simulate=simulate, wanted=precisions)
        self.report = PlanReport(plan=None, excluded_precisions=self.excluded)  # type: ignore[arg-type]
        # On a real GPU the context is measured by the first probe; until then it is assumed.
        context = ESTIMATED_CUDA_CONTEXT if device == "cuda" else 0
        self.headroom = Headroom(
            device_type=device, estimated=simulate, budget_bytes=self.budget_bytes, context_bytes=context
        )
        self.exact_cache: dict[str, tuple[int, dict]] = {}
        self.real_peak_cache: dict[str, tuple[int, dict, int]] = {}
        self.measured_context = 0

    def run(self) -> PlanReport:
        from autofit.planning.cost_model import CostModel

        start = time.perf_counter()
        G = self.global_batch_size
        self.log(f"planning {self.spec.source} for a batch of {G} within {format_bytes(self.budget_bytes)} on {self.device}")
        self.study_name = self._study_name()
        stored = self._stored("cost_model")
        if stored is not None:
            model = CostModel.from_dict(stored)
            self.report.resumed = True
            self.sizes = _micro_batch_sizes(G, smallest=model.precisions[self.precisions[0]].memory.low.micro_batch_size)
            self.log("cost model loaded from the stored study")
        else:
            model = self._memory_model()
        self.model = model
        self._check_floor()
        if stored is None:
            self._speed_model()
        self._verified = self._stored("verified") or {}
        evaluations = self._search()
        chosen = self._verify(evaluations)
        unconstrained = self._unconstrained(evaluations, chosen)
        self.report.plan = self._plan(chosen, evaluations, unconstrained)
        self.report.cost_model = self.model.to_dict()
        self.report.seconds = time.perf_counter() - start
        self._store("verified", self._verified)
        self.log(f"planned in {self.report.seconds:.1f} s")
        return self.report

    # -- 1. memory -----------------------------------------------------------------
    def _memory_model(self):
        from autofit.planning.cost_model import CostModel, PrecisionCosts, SpeedCosts, memory_costs

        G = self.global_batch_size
        smallest, low_trace = self._smallest_runnable()
        self.sizes = _micro_batch_sizes(G, smallest=smallest)
        model = CostModel(blocks=low_trace.blocks, global_batch_size=G, device_type=self.device, estimated=self.simulate)
        model.output_shape = low_trace.output_shape
        self.log(f"memory: tracing {len(self.precisions)} precision(s) at micro-batch {smallest} and {G} (simulated)")
        for precision in self.precisions:
            reuse = low_trace if precision == self.precisions[0] else None
            memory = memory_costs(self.sim_spec, precision=precision, low=smallest, high=G, device_type=self.device, low_trace=reuse)
            empty = SpeedCosts(sizes=[1], step_seconds=[1.0], forward_seconds=[1.0], block_seconds=[[]], optimizer_seconds=0.0)
            model.precisions[precision] = PrecisionCosts(precision=precision, memory=memory, speed=empty)
        return model

    def _smallest_runnable(self):
        """The smallest micro-batch the model trains with (BatchNorm refuses 1 sample per channel)."""
        from autofit.planning.memory_model import trace_memory

        errors = []
        for size in _micro_batch_sizes(self.global_batch_size, smallest=1)[::-1]:
            try:
                trace = trace_memory(self.sim_spec, micro_batch_size=size, precision=self.precisions[0], device_type=self.device)
            except Exception as error:  # the user's model refused this batch size
                errors.append(f"micro-batch {size}: {type(error).__name__}: {error}")
                continue
            if errors:
                self.log(f"the model does not train below micro-batch {size} ({errors[0]})")
            return size, trace
        raise UserError(f"the model fails to train even at micro-batch {self.global_batch_size}: {errors[-1]}; fix the model file or the batch size")

    # -- floor -----------------------------------------------------------------------
    def _check_floor(self) -> None:
        """Fail early, with the floor and what would lower it, when nothing can fit."""
        blocks = frozenset(range(len(self.model.blocks)))
        smallest = self.sizes[-1]
        options = []
        for precision in self.precisions:
            for checkpoint in (blocks, frozenset()):
                options.append((self.model.peak_bytes(precision, smallest, checkpoint), precision, checkpoint))
        _, precision, checkpoint = min(options, key=lambda option: option[0])
        config = Config(precision=precision, micro_batch_size=smallest, checkpoint=tuple(self.model.blocks[b] for b in sorted(checkpoint)))
        peak, breakdown = self._checked_peak(config)
        headroom = self.headroom.for_peak(peak)
        floor = self.headroom.smallest_budget(peak)
        self.floor_config = config
        self.report.floor_bytes = floor
        self.report.floor_breakdown = {**breakdown, **{f"headroom ({k.replace('_', ' ')})": v for k, v in headroom.items()}}
        if self.budget_bytes >= floor:
            return
        frozen = frozen_note(self.sim_spec)  # LoRA, a frozen backbone: parameters without gradients or state
        parts = " + ".join(f"{k.replace('_', ' ')} {format_bytes(v)}{frozen if k == 'parameters' else ''}" for k, v in breakdown.items() if v)
        optimizer = self._optimizer_name()
        state = breakdown.get("optimizer_state", 0)
        what = f"micro-batch {smallest}, {precision}, " + ("every block checkpointed" if checkpoint else "no checkpointing")
        message = (
            f"budget {format_bytes(self.budget_bytes)} is below the floor {format_bytes(floor)} for a batch of "
            f"{self.global_batch_size} ({what}: {parts} + headroom {format_bytes(sum(headroom.values()))}); "
            f"to lower it use an optimizer with less state than {optimizer} ({format_bytes(state)} here; e.g. SGD "
            f"without momentum keeps none) {self._gpus_advice(breakdown, precision=precision)}"
        )
        raise InfeasibleBudget(message, floor_bytes=floor, breakdown=self.report.floor_breakdown)

    def _gpus_advice(self, breakdown: dict[str, int], *, precision: str) -> str:
        """How many GPUs FSDP2 would need for the floor configuration, by the conservative estimate."""
        try:
            gpus = gpus_for(self.sim_spec, breakdown=breakdown, precision=precision, usable_bytes=self.headroom.usable_bytes())
        except Exception:  # a model that cannot be built on meta: no count, the advice stays general
            return "or more GPUs (--gpus N: FSDP2 shards parameters, gradients and optimizer state)"
        if gpus is None:
            return "(more GPUs would not help: the activations and gathered blocks alone exceed it)"
        return f"or --gpus {gpus} (FSDP2 shards parameters, gradients and optimizer state; estimated)"

    def _optimizer_name(self) -> str:
        with torch.device("meta"):
            try:
                model = self.sim_spec.build_model()
                return type(self.spec.build_optimizer(model.parameters())).__name__
            except Exception:  # a model that cannot be built on meta: the name is cosmetic
                return "the optimizer"

    # -- 2. speed ----------------------------------------------------------------------
    def _speed_model(self) -> None:
        from autofit.planning.cost_model import flop_speed_costs, time_precisions

        sizes = _timing_sizes(self.sizes)
        if self.simulate:
            self.log(f"speed: estimating from FLOPs at micro-batch {', '.join(map(str, sizes))}")
            speeds = flop_speed_costs(
                self.sim_spec, precisions=self.precisions, sizes=sizes, device_type=self.device, device_name=self.info.name
            )
        else:
            self.log(f"speed: timing {', '.join(self.precisions)} at micro-batch {', '.join(map(str, sizes))} on {self.device}")
            speeds = time_precisions(self.spec, precisions=self.precisions, sizes=sizes, device=self.device)
        for precision, speed in speeds.items():
            self.model.precisions[precision].speed = speed
            if speed.note:
                self.report.precision_notes[precision] = speed.note
        self._store("cost_model", self.model.to_dict())

    # -- 3. search ---------------------------------------------------------------------
    def _search(self):
        from autofit.planning.search import cheapest_checkpoint, search
        from autofit.planning.search import Evaluation

        model, G = self.model, self.global_batch_size
        limit = self.headroom.usable_bytes() / model.memory_scale

        def evaluate(precision: str, micro_batch_size: int) -> Evaluation:
            segments, drops = model.precisions[precision].memory.at(micro_batch_size, global_batch_size=G)
            seconds = model.recompute_seconds(precision, micro_batch_size)
            plain_peak = model.peak_bytes(precision, micro_batch_size, frozenset())
            plain_speed = model.samples_per_s(precision, micro_batch_size, frozenset())
            result = Evaluation(
                precision=precision, micro_batch_size=micro_batch_size, grad_accum_steps=math.ceil(G / micro_batch_size),
                plain_peak_bytes=plain_peak, plain_samples_per_s=plain_speed,
            )
            choice = cheapest_checkpoint(segments, drops, seconds, limit_bytes=limit * (1 + MODEL_SLACK))
            if choice is not None:
                result.fits = True
                result.checkpoint = [model.blocks[b] for b in sorted(choice.blocks)]
                result.peak_bytes = model.peak_bytes(precision, micro_batch_size, choice.blocks)
                result.samples_per_s = model.samples_per_s(precision, micro_batch_size, choice.blocks)
            return result

        evaluations, sampler = search(
            evaluate, precisions=self.precisions, micro_batch_sizes=self.sizes,
            study_name=self.study_name, storage=self.study,
        )
        self.report.sampler = sampler
        self.report.evaluations = len(evaluations)
        fitting = sum(e.fits for e in evaluations)
        self.log(f"search: {len(evaluations)} (precision, micro-batch) points by {sampler}, {fitting} fit the model's budget")
        return evaluations

    # -- 4. verification -----------------------------------------------------------------
    def _verify(self, evaluations) -> dict:
        """Exact memory for the best predicted candidates, then real probes; the fastest that fits wins."""
        from autofit.planning.search import cheapest_checkpoint

        model, G = self.model, self.global_batch_size
        # Fastest predicted first; on a tie, fewer micro-steps and fewer checkpointed blocks first.
        candidates = sorted(
            (e for e in evaluations if e.fits), key=lambda e: (-round(e.samples_per_s, 6), e.grad_accum_steps, len(e.checkpoint))
        )
        accepted: list[tuple[Config, float, float, int, dict]] = []  # config, predicted speed, predicted peak, exact peak, breakdown
        best_predicted = None
        for evaluation in candidates:
            if len(accepted) >= VERIFY_TOP:
                break
            if best_predicted is not None and evaluation.samples_per_s < VERIFY_WITHIN * best_predicted:
                break
            precision, size = evaluation.precision, evaluation.micro_batch_size
            segments, drops = model.precisions[precision].memory.at(size, global_batch_size=G)
            seconds = model.recompute_seconds(precision, size)
            # Limits below are in the model's own (unscaled) bytes.
            limit = self.headroom.usable_bytes() / model.memory_scale * (1 + MODEL_SLACK)
            names = evaluation.checkpoint
            for _attempt in range(VERIFY_ATTEMPTS):
                blocks = frozenset(model.blocks.index(n) for n in names)
                raw = model.peak_bytes(precision, size, blocks) / model.memory_scale
                if raw > limit:  # the scale learnt from an earlier measurement rules this set out
                    choice = cheapest_checkpoint(segments, drops, seconds, limit_bytes=limit)
                    if choice is None:
                        break
                    names, blocks = [model.blocks[b] for b in sorted(choice.blocks)], choice.blocks
                    raw = model.peak_bytes(precision, size, blocks) / model.memory_scale
                config = Config(precision=precision, micro_batch_size=size, checkpoint=tuple(names))
                peak, breakdown = self._checked_peak(config)
                if self.device == "cuda" and not self.simulate and raw > 0:
                    # The simulated bytes miss the allocator's rounding and cache: learn by how much.
                    model.memory_scale = max(model.memory_scale, peak / raw)
                if self.headroom.fits(peak):
                    speed = model.samples_per_s(precision, size, blocks)
                    accepted.append((config, speed, model.peak_bytes(precision, size, blocks), peak, breakdown))
                    best_predicted = best_predicted or speed
                    break
                self.report.rejected.append({"config": config.key(), "why": f"measured peak {format_bytes(peak)} does not fit"})
                # The model was optimistic for this set: ask for a set it predicts smaller, and measure again.
                limit = min(limit, raw) - 1
                choice = cheapest_checkpoint(segments, drops, seconds, limit_bytes=limit)
                if choice is None:
                    break
                names = [model.blocks[b] for b in sorted(choice.blocks)]
        if not any(c.key() == self.floor_config.key() for c, *_ in accepted):
            # The floor configuration fits by construction: a plan exists even if every guess missed.
            peak, breakdown = self._checked_peak(self.floor_config)
            blocks = frozenset(model.blocks.index(n) for n in self.floor_config.checkpoint)
            speed = model.samples_per_s(self.floor_config.precision, self.floor_config.micro_batch_size, blocks)
            accepted.append((self.floor_config, speed, model.peak_bytes(self.floor_config.precision, self.floor_config.micro_batch_size, blocks), peak, breakdown))
        meter = "simulated meter" if self.simulate else f"{self.device} meter"
        self.log(f"verify: {len(accepted)} candidate(s) measured to fit ({meter})" + ("" if self.simulate else "; timing them"))
        best, fitting = None, []
        for config, predicted_speed, predicted_peak, exact_peak, breakdown in accepted:
            result = {
                "config": config, "predicted_samples_per_s": predicted_speed, "predicted_peak_bytes": predicted_peak,
                "exact_peak_bytes": exact_peak, "breakdown": breakdown,
            }
            if self.simulate:
                result.update(measured_peak_bytes=exact_peak, measured_samples_per_s=None, meter="simulated",
                              headroom=self.headroom.for_peak(exact_peak))
                if best is None:
                    best = result
                continue
            if fitting and config is self.floor_config:
                continue  # the fallback is not needed
            measured = self._real_probe(config)
            result.update(measured)
            if not result["fits"]:
                self.report.rejected.append({"config": config.key(), "why": f"measured peak {format_bytes(measured['measured_peak_bytes'])} + headroom does not fit"})
                continue
            fitting.append(result)
        # Later rounds visit every candidate again, so that a burst of other work slows one round, not one candidate.
        for _ in range(TIMING_ROUNDS - 1):
            for result in fitting:
                result["measured_samples_per_s"] = self._retime(result["config"])
        if fitting:
            fastest = max(r["measured_samples_per_s"] for r in fitting)
            ties = [r for r in fitting if r["measured_samples_per_s"] >= (1 - NOISE) * fastest]
            best = min(ties, key=lambda r: _simplicity(r["config"], self.global_batch_size))
        if best is None:
            raise UserError(
                f"no configuration was measured to fit {format_bytes(self.budget_bytes)} (the floor is "
                f"{format_bytes(self.report.floor_bytes)}); raise the budget a little or lower --batch-size"
            )
        return best

    def _checked_peak(self, config: Config) -> tuple[int, dict]:
        """A configuration's peak by the meter that has the last word: the device's, or the simulated one when simulating."""
        if self.simulate:
            return self._exact_peak(config)
        peak, breakdown, _ = self._real_peak(config)
        return peak, breakdown

    def _exact_peak(self, config: Config) -> tuple[int, dict]:
        """The simulated meter's peak of a configuration: equal to the CPU meter, no arithmetic.

        Two micro-batches stand for all of them (later micro-steps repeat the
        second), and the host's global batch is added for the samples not traced.
        """
        from autofit.measure.probe import probe

        key = config.key()
        if key not in self.exact_cache:
            G, m = self.global_batch_size, config.micro_batch_size
            traced = min(G, 2 * m)
            result = probe(
                self.sim_spec, micro_batch_size=m, global_batch_size=traced, precision=config.precision,
                checkpoint=list(config.checkpoint), device=self.device, simulate=True, steps=2,
            )
            host = (G - traced) * self._host_sample_bytes()
            breakdown = dict(result.breakdown)
            breakdown["activations"] = breakdown.get("activations", 0) + host
            self.exact_cache[key] = (result.peak_bytes + host, breakdown)
            self.report.simulated_checks += 1
        return self.exact_cache[key]

    def _real_probe(self, config: Config) -> dict:
        """Measure a configuration on the device (or reuse a stored measurement).

        Memory: a real probe with the device's meter (two micro-batches stand
        for all of them, as in ``_exact_peak``). Speed: plain training steps of
        the whole global batch, timed without the meter's bookkeeping.
        """
        from autofit.planning.cost_model import time_configuration

        key = config.key()
        if key not in self._verified:
            try:
                peak, breakdown, context = self._real_peak(config)
                speed = time_configuration(
                    self.spec, precision=config.precision, micro_batch_size=config.micro_batch_size,
                    global_batch_size=self.global_batch_size, checkpoint=list(config.checkpoint), device=self.device,
                )
            except torch.OutOfMemoryError:
                release_device_memory(self.device)
                self._verified[key] = {"measured_peak_bytes": None, "measured_samples_per_s": 0.0, "meter": self.device, "oom": True}
            else:
                self.report.real_probes += 1
                self._verified[key] = {
                    "measured_peak_bytes": peak, "measured_samples_per_s": speed, "timing_rounds": 1,
                    "meter": self.device, "breakdown": breakdown, "context_bytes": context,
                }
        measured = dict(self._verified[key])
        if measured.get("oom"):
            return {**measured, "fits": False, "headroom": {}}
        headroom = self.headroom.for_peak(measured["measured_peak_bytes"])
        measured.update(headroom=headroom, fits=self.headroom.fits(measured["measured_peak_bytes"]))
        return measured

    def _retime(self, config: Config) -> float:
        """Time a measured configuration once more (up to TIMING_ROUNDS in all); its fastest round counts."""
        from autofit.planning.cost_model import time_configuration

        entry = self._verified[config.key()]
        if not entry.get("oom") and entry.get("timing_rounds", 1) < TIMING_ROUNDS:
            speed = time_configuration(
                self.spec, precision=config.precision, micro_batch_size=config.micro_batch_size,
                global_batch_size=self.global_batch_size, checkpoint=list(config.checkpoint), device=self.device,
            )
            entry["measured_samples_per_s"] = max(entry["measured_samples_per_s"], speed)
            entry["timing_rounds"] = entry.get("timing_rounds", 1) + 1
        return entry["measured_samples_per_s"]

    def _real_peak(self, config: Config) -> tuple[int, dict, int]:
        """The device meter's peak of a configuration (less the GPU context), its breakdown, and the context."""
        from autofit.measure.probe import probe

        key = config.key()
        if key not in self.real_peak_cache:
            G, m = self.global_batch_size, config.micro_batch_size
            traced = min(G, 2 * m)
            try:
                result = probe(
                    self.spec, micro_batch_size=m, global_batch_size=traced, precision=config.precision,
                    checkpoint=list(config.checkpoint), device=self.device, steps=2,
                )
            except torch.OutOfMemoryError:
                release_device_memory(self.device)
                self.report.rejected.append({"config": key, "why": "out of memory on the device"})
                self.real_peak_cache[key] = (self.info.total_bytes, {}, 0)
                return self.real_peak_cache[key]
            breakdown = dict(result.breakdown)
            context = breakdown.pop("context", 0) if self.device == "cuda" else 0
            # The CPU meter counts the host's global batch too; the GPU meter does not see it.
            host = 0 if self.device == "cuda" else (G - traced) * self._host_sample_bytes()
            breakdown["activations"] = breakdown.get("activations", 0) + host
            self.real_peak_cache[key] = (result.peak_bytes - context + host, breakdown, context)
            self.report.memory_probes += 1
            if self.device == "cuda":
                # The context is measured now: the largest seen replaces the assumption.
                self.measured_context = max(self.measured_context, context)
                self.headroom.context_bytes = self.measured_context
        return self.real_peak_cache[key]

    def _host_sample_bytes(self) -> int:
        return next(iter(self.model.precisions.values())).memory.high.host_sample_bytes

    # -- unconstrained -------------------------------------------------------------------
    def _unconstrained(self, evaluations, chosen: dict) -> dict:
        """The fastest configuration with no budget (no checkpointing), measured for the speed ratio."""
        best = max(evaluations, key=lambda e: (round(e.plain_samples_per_s, 6), -e.grad_accum_steps))
        config = Config(precision=best.precision, micro_batch_size=best.micro_batch_size)
        result = {
            "precision": config.precision, "micro_batch_size": config.micro_batch_size,
            "grad_accum_steps": best.grad_accum_steps, "checkpoint": [],
            "predicted_peak_bytes": int(best.plain_peak_bytes), "predicted_samples_per_s": best.plain_samples_per_s,
        }
        if self.simulate:
            result["peak_bytes"] = self._exact_peak(config)[0]
            result["samples_per_s"] = None
        elif config.key() == chosen["config"].key():
            result["peak_bytes"] = chosen["measured_peak_bytes"]
            result["samples_per_s"] = chosen["measured_samples_per_s"]
        elif self.device == "cpu" or best.plain_peak_bytes < 0.9 * self.info.total_bytes:
            measured = self._real_probe(config)
            result["peak_bytes"] = measured["measured_peak_bytes"]
            result["samples_per_s"] = (self._retime(config) if not measured.get("oom") else 0.0) or None
        self.report.unconstrained = result
        return result

    # -- the plan ----------------------------------------------------------------------------
    def _plan(self, chosen: dict, evaluations, unconstrained: dict) -> Plan:
        import autofit

        config: Config = chosen["config"]
        G = self.global_batch_size
        measured = {
            "peak_bytes": int(chosen["measured_peak_bytes"]),
            "samples_per_s": chosen["measured_samples_per_s"],
            "meter": chosen["meter"],
            "breakdown": chosen.get("breakdown", {}),
        }
        measured["unconstrained"] = {
            key: unconstrained.get(key)
            for key in ("precision", "micro_batch_size", "grad_accum_steps", "peak_bytes", "samples_per_s")
        }
        if unconstrained.get("samples_per_s") and chosen["measured_samples_per_s"]:
            measured["relative_to_unconstrained"] = chosen["measured_samples_per_s"] / unconstrained["samples_per_s"]
        model_info = self._model_info()
        return Plan(
            created_by={"autofit": autofit.__version__, "torch": torch.__version__},
            model=model_info,
            notes=batch_norm_notes(model_info, micro_batch_size=config.micro_batch_size, global_batch_size=G),
            device={"type": self.info.type, "name": self.info.name, "total_bytes": self.info.total_bytes},
            budget_bytes=self.budget_bytes,
            budget_kind="cuda-process" if self.device == "cuda" else "cpu-tracked",
            global_batch_size=G,
            micro_batch_size=config.micro_batch_size,
            grad_accum_steps=math.ceil(G / config.micro_batch_size),
            precision=config.precision,
            checkpoint=list(config.checkpoint),
            estimated=self.simulate,
            predicted={
                "peak_bytes": int(chosen["predicted_peak_bytes"]),
                "samples_per_s": chosen["predicted_samples_per_s"],
            },
            measured=measured,
            headroom=chosen["headroom"],
            alternatives=self._alternatives(evaluations, chosen, unconstrained),
        )

    def _alternatives(self, evaluations, chosen: dict, unconstrained: dict) -> list[dict]:
        """The Pareto front (less memory, more samples/s) of every configuration the search scored."""
        points = []
        for e in evaluations:
            points.append((e.precision, e.micro_batch_size, e.grad_accum_steps, (), e.plain_peak_bytes, e.plain_samples_per_s))
            if e.fits and e.checkpoint:
                points.append((e.precision, e.micro_batch_size, e.grad_accum_steps, tuple(e.checkpoint), e.peak_bytes, e.samples_per_s))
        points.sort(key=lambda p: (p[4], -p[5]))
        front, best_speed = [], -1.0
        for point in points:
            if point[5] > best_speed:
                front.append(point)
                best_speed = point[5]
        config: Config = chosen["config"]
        if not any(Config(precision=p[0], micro_batch_size=p[1], checkpoint=p[3]).key() == config.key() for p in front):
            # Chosen by measurement though the model ranked it lower: list it with the front.
            front.append((config.precision, config.micro_batch_size, math.ceil(self.global_batch_size / config.micro_batch_size),
                          tuple(config.checkpoint), chosen["predicted_peak_bytes"], chosen["predicted_samples_per_s"]))
            front.sort(key=lambda p: (p[4], -p[5]))
        alternatives = []
        for precision, size, steps, checkpoint, peak, speed in front:
            config = Config(precision=precision, micro_batch_size=size, checkpoint=checkpoint)
            entry = {
                "precision": precision, "micro_batch_size": size, "grad_accum_steps": steps, "checkpoint": list(checkpoint),
                "predicted_peak_bytes": int(peak), "predicted_samples_per_s": speed,
                "fits_budget": self.headroom.fits(peak * self.model.memory_scale),
                "chosen": config.key() == chosen["config"].key(),
            }
            stored = self._verified.get(config.key())
            if stored and not self.simulate and not stored.get("oom"):
                entry["measured_peak_bytes"] = stored["measured_peak_bytes"]
                entry["measured_samples_per_s"] = stored["measured_samples_per_s"]
            alternatives.append(entry)
        return alternatives

    def _model_info(self) -> dict:
        from autofit.spec import model_fingerprint

        with torch.device("meta"):
            model = self.sim_spec.build_model()
        num_classes = self.num_classes
        output = self.model.output_shape
        if num_classes is None and len(output) == 2:
            num_classes = output[-1]
        return {
            "source": self.spec.source,
            "fingerprint": model_fingerprint(model),
            "batch_norm": any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()),
            "parameter_count": sum(p.numel() for p in model.parameters()),
            "input_shape": list(self.spec.input_shape) if self.spec.input_shape else None,
            "num_classes": num_classes,
            **self.spec.source_options,  # what else rebuilds it (hf: task, seq_len)
        }

    # -- study storage -------------------------------------------------------------------------
    def _study_name(self) -> str:
        from autofit.spec import model_fingerprint

        with torch.device("meta"):
            fingerprint = model_fingerprint(self.sim_spec.build_model())
        kind = "simulated" if self.simulate else "measured"
        self._study_prefix = f"autofit:{fingerprint}:{self.device}:{kind}:batch{self.global_batch_size}:{','.join(self.precisions)}:"
        return f"{self._study_prefix}budget{self.budget_bytes}"

    def _stored(self, key: str):
        from autofit.planning.search import stored_attribute

        return stored_attribute(self.study, prefix=self._study_prefix, key=key)

    def _store(self, key: str, value) -> None:
        if self.study is None:
            return
        from autofit.planning.search import open_study

        open_study(self.study_name, storage=self.study).set_user_attr(key, value)


MULTI_PROCESS_NOTE = (
    "{world_size} processes were not run while planning: memory and speed are one process's, training one rank's "
    "share ({rank_batch_size} samples) of the global batch; communication time is not counted"
)


class _RanksPlanner:
    """Planning for N > 1 processes (see ``plan_with_report``): one rank's share planned as one process."""

    def __init__(self, spec: ModelSpec, *, gpus: int, budget, batch_size, study, log, **arguments) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise UserError(f"--batch-size {batch_size!r} must be a whole number of samples, at least 1")
        if batch_size < gpus:
            raise UserError(
                f"--batch-size {batch_size} is smaller than --gpus {gpus}: every GPU needs at least one sample per step; "
                f"raise --batch-size or lower --gpus"
            )
        self.spec = spec
        self.world_size = gpus
        self.global_batch_size = batch_size
        self.rank_batch_size = math.ceil(batch_size / gpus)
        self.budget = budget
        self.study = study
        self.arguments = {**arguments, "log": log}
        self._started = time.perf_counter()
        user_log = log or (lambda line: None)
        self.log = lambda line: user_log(f"[{time.perf_counter() - self._started:5.1f} s] {line}")

    def run(self) -> PlanReport:
        N, G, share = self.world_size, self.global_batch_size, self.rank_batch_size
        # One rank's share of the batch with the whole per-GPU budget: parses the budget, holds the memory and speed models.
        rank = _Planner(self.spec, budget=self.budget, batch_size=share, study=None, **self.arguments)
        allowance = _gradient_bytes(rank.sim_spec)
        self.log(
            f"{N} GPUs: each rank trains {share} of the {G} samples per step; DDP first, keeping "
            f"{format_bytes(allowance)} (one gradient size) for its gradient buckets"
        )
        report = None
        if rank.budget_bytes > allowance:
            ddp = _Planner(self.spec, budget=rank.budget_bytes - allowance, batch_size=share, study=self.study, **self.arguments)
            try:
                report = ddp.run()
            except InfeasibleBudget:
                self.log("DDP does not fit: every rank would hold the whole model's state; sharding it with FSDP2")
                # The memory model does not depend on the budget: FSDP2 reuses the one DDP's attempt traced.
                rank.model, rank.sizes = ddp.model, ddp.sizes
        report = self._ddp(report, budget_bytes=rank.budget_bytes, allowance=allowance) if report else self._fsdp(rank)
        report.seconds = time.perf_counter() - self._started
        return report

    def _ddp(self, report: PlanReport, *, budget_bytes: int, allowance: int) -> PlanReport:
        """The one-process plan of a rank's share, restated for N processes under DDP."""
        from strategies import micro_batch_count

        plan = report.plan
        plan.budget_bytes = budget_bytes
        plan.global_batch_size = self.global_batch_size
        plan.world_size, plan.sharding = self.world_size, "ddp"
        plan.grad_accum_steps = micro_batch_count(
            self.global_batch_size, world_size=self.world_size, micro_batch_size=plan.micro_batch_size
        )
        # DDP's buckets (gradient_as_bucket_view off) hold one more copy of the gradients: allowed for, not measured.
        plan.headroom = {**plan.headroom, "ddp_buckets_allowance": allowance}
        plan.predicted["per_rank_peak_bytes"] = int(plan.measured["peak_bytes"]) + allowance
        plan.measured["multi_process"] = {
            "world_size": self.world_size, "sharding": "ddp", "rank_batch_size": self.rank_batch_size,
            "note": MULTI_PROCESS_NOTE.format(world_size=self.world_size, rank_batch_size=self.rank_batch_size)
            + f"; DDP's gradient buckets are an allowance ({format_bytes(allowance)}), not measured",
        }
        return report

    def _fsdp(self, rank: _Planner) -> PlanReport:
        """FSDP2: per-rank candidates ranked by the conservative estimate, the fastest verified by simulation."""
        from autofit.planning.per_rank import estimate_fsdp_peak_bytes, fsdp_layout, simulate_fsdp_peak_bytes
        from strategies import micro_batch_count
        from autofit.planning.search import cheapest_checkpoint

        N, G = self.world_size, self.global_batch_size
        if getattr(rank, "model", None) is None:
            rank.model = rank._memory_model()
        model = rank.model
        rank._speed_model()
        smallest = Config(precision=rank.precisions[0], micro_batch_size=rank.sizes[-1])
        _, single = rank._exact_peak(smallest)
        state = {key: single.get(key, 0) for key in ("parameters", "gradients", "optimizer_state")}
        with torch.device("meta"):
            layout = fsdp_layout(rank.sim_spec.build_model(), world_size=N)
        usable = rank.headroom.usable_bytes() / model.memory_scale
        candidates = []  # (predicted speed, config, grad_accum_steps, estimated per-rank peak)
        for precision in rank.precisions:
            for size in rank.sizes:
                steps = micro_batch_count(G, world_size=N, micro_batch_size=size)
                sharded = estimate_fsdp_peak_bytes(
                    parameter_bytes=state["parameters"], gradient_bytes=state["gradients"],
                    optimizer_state_bytes=state["optimizer_state"], activation_bytes=0, layout=layout,
                    world_size=N, precision=precision, grad_accum_steps=steps,
                ).peak_bytes
                # The one-process model's peak holds the whole state; a rank holds its sharded part and the buffers instead.
                swap = sharded - sum(state.values())
                segments, drops = model.precisions[precision].memory.at(size, global_batch_size=rank.global_batch_size)
                choice = cheapest_checkpoint(segments, drops, model.recompute_seconds(precision, size), limit_bytes=usable - swap)
                blocks = choice.blocks if choice is not None else frozenset(range(len(model.blocks)))
                config = Config(precision=precision, micro_batch_size=size, checkpoint=tuple(model.blocks[b] for b in sorted(blocks)))
                candidates.append((model.samples_per_s(precision, size, blocks), config, steps,
                                   model.peak_bytes(precision, size, blocks) + swap, choice is not None))
        # Estimated to fit first, fastest first; then the rest, least memory first (the estimate is 3-38% high).
        candidates.sort(key=lambda c: (not c[4], -round(c[0], 6) if c[4] else c[3], _simplicity(c[1], rank.global_batch_size)))
        self.log(f"FSDP2: {sum(c[4] for c in candidates)} of {len(candidates)} per-rank configurations fit by the estimate; simulating")
        backend = "gloo" if rank.device == "cpu" else "nccl"
        chosen, simulated, alternatives = None, 0, []
        for speed, config, steps, estimate, _ in candidates:
            entry = {
                "precision": config.precision, "micro_batch_size": config.micro_batch_size, "grad_accum_steps": steps,
                "checkpoint": list(config.checkpoint), "predicted_peak_bytes": int(estimate), "predicted_samples_per_s": speed,
                "fits_budget": rank.headroom.fits(estimate * model.memory_scale), "chosen": False,
            }
            alternatives.append(entry)
            if chosen is not None or simulated >= VERIFY_TOP + 1:
                continue
            measurement = simulate_fsdp_peak_bytes(
                rank.sim_spec, world_size=N, micro_batch_size=config.micro_batch_size, grad_accum_steps=steps,
                precision=config.precision, checkpoint=list(config.checkpoint), backend=backend,
            )
            simulated += 1
            entry.update(simulated_peak_bytes=measurement.peak_bytes, fits_budget=rank.headroom.fits(measurement.peak_bytes))
            if entry["fits_budget"]:
                chosen, entry["chosen"] = (config, steps, speed, estimate, measurement), True
            else:
                rank.report.rejected.append({"config": config.key(), "why": f"simulated per-rank peak {format_bytes(measurement.peak_bytes)} does not fit"})
        rank.report.simulated_checks = simulated
        rank.report.sampler, rank.report.evaluations = "the FSDP2 estimate (all points)", len(candidates)
        if chosen is None:
            self._infeasible(rank, single=single, smallest=smallest)
        config, steps, speed, estimate, measurement = chosen
        self.log(f"FSDP2: {config.precision}, micro-batch {config.micro_batch_size} x {steps} per rank, simulated to fit")
        rank.report.plan = self._fsdp_plan(rank, config=config, steps=steps, speed=speed, estimate=estimate, measurement=measurement,
                                           alternatives=sorted(alternatives, key=lambda a: a["predicted_peak_bytes"]))
        rank.report.cost_model = model.to_dict()
        return rank.report

    def _fsdp_plan(self, rank: _Planner, *, config: Config, steps: int, speed: float, estimate: float, measurement, alternatives) -> Plan:
        import autofit

        model_info = rank._model_info()
        return Plan(
            created_by={"autofit": autofit.__version__, "torch": torch.__version__},
            model=model_info,
            notes=batch_norm_notes(model_info, micro_batch_size=config.micro_batch_size, global_batch_size=self.global_batch_size),
            device={"type": rank.info.type, "name": rank.info.name, "total_bytes": rank.info.total_bytes},
            budget_bytes=rank.budget_bytes,
            budget_kind="cuda-process" if rank.device == "cuda" else "cpu-tracked",
            global_batch_size=self.global_batch_size,
            micro_batch_size=config.micro_batch_size,
            grad_accum_steps=steps,
            precision=config.precision,
            checkpoint=list(config.checkpoint),
            world_size=self.world_size,
            sharding="fsdp",
            estimated=True,
            predicted={
                "peak_bytes": int(measurement.peak_bytes), "per_rank_peak_bytes": int(measurement.peak_bytes),
                "samples_per_s": speed, "estimate_peak_bytes": int(estimate),
            },
            measured={
                "peak_bytes": int(measurement.peak_bytes), "samples_per_s": None,
                "meter": "simulated", "breakdown": dict(measurement.breakdown),
                "multi_process": {
                    "world_size": self.world_size, "sharding": "fsdp", "rank_batch_size": self.rank_batch_size,
                    "note": MULTI_PROCESS_NOTE.format(world_size=self.world_size, rank_batch_size=self.rank_batch_size)
                    + "; the per-rank peak is FSDP2 run in one process on a fake process group (simulated, not measured)",
                },
            },
            headroom=rank.headroom.for_peak(measurement.peak_bytes),
            alternatives=alternatives,
        )

    def _infeasible(self, rank: _Planner, *, single: dict, smallest: Config) -> None:
        N = self.world_size
        gpus = gpus_for(rank.sim_spec, breakdown=single, precision=smallest.precision, usable_bytes=rank.headroom.usable_bytes())
        advice = f"try --gpus {gpus} (estimated)" if gpus and gpus > N else "try more --gpus" if gpus else "more GPUs would not help"
        raise InfeasibleBudget(
            f"budget {format_bytes(rank.budget_bytes)} per GPU is too small for a batch of {self.global_batch_size} on {N} GPUs: "
            f"no FSDP2 configuration was simulated to fit (micro-batch down to {smallest.micro_batch_size}, checkpointing "
            f"every block); {advice}, or raise --budget",
            floor_bytes=0, breakdown=single,
        )


def _gradient_bytes(spec: ModelSpec) -> int:
    """Bytes of the model's gradients (fp32 like its parameters): one DDP bucket set."""
    with torch.device("meta"):
        model = spec.build_model()
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def gpus_for(spec: ModelSpec, *, breakdown: dict[str, int], precision: str, usable_bytes: float) -> int | None:
    """The fewest GPUs FSDP2 would need for a configuration whose one-process peak breaks down as ``breakdown``.

    By ``smallest_world_size`` (a conservative estimate: fewer may do); None when
    no number of GPUs fits.
    """
    from autofit.planning.per_rank import fsdp_layout, smallest_world_size

    state = {key: breakdown.get(key, 0) for key in ("parameters", "gradients", "optimizer_state")}
    activations = sum(value for key, value in breakdown.items() if key not in state)
    with torch.device("meta"):
        layout = fsdp_layout(spec.build_model(), world_size=2)
    return smallest_world_size(
        budget_bytes=int(usable_bytes), parameter_bytes=state["parameters"], gradient_bytes=state["gradients"],
        optimizer_state_bytes=state["optimizer_state"], activation_bytes=activations, layout=layout, precision=precision,
    )


def _simplicity(config: Config, global_batch_size: int) -> tuple:
    """Order for ties: fewer micro-steps, fewer checkpointed blocks, fp32 before autocast."""
    return (math.ceil(global_batch_size / config.micro_batch_size), len(config.checkpoint), PRECISIONS.index(config.precision))


def _usable_precisions(device: str, *, simulate: bool, wanted: Sequence[str] | None) -> tuple[list[str], dict[str, str]]:
    """The precisions to search, and why any were left out."""
    wanted = list(wanted) if wanted else list(PRECISIONS)
    unknown = [p for p in wanted if p not in PRECISIONS]
    if unknown:
        raise UserError(f"precision {unknown[0]!r} is unknown; choose from {', '.join(PRECISIONS)}")
    excluded = {p: "not asked for (--precisions)" for p in PRECISIONS if p not in wanted}
    if device == "cuda" and torch.cuda.is_available() and not simulate:
        if "bf16" in wanted and not torch.cuda.is_bf16_supported():
            major, minor = torch.cuda.get_device_capability()
            excluded["bf16"] = f"this GPU (compute capability {major}.{minor}) does not support bf16"
            wanted.remove("bf16")
    if not wanted:
        raise UserError("no precision is left to search; allow fp32 with --precisions fp32")
    return wanted, excluded


def _micro_batch_sizes(global_batch_size: int, *, smallest: int) -> list[int]:
    """Micro-batch sizes searched, largest first: the smallest size for each k in 1, 2, 3, 4, 6, 8, 12, ...

    For a given number of micro-steps k, ceil(G / k) is the smallest micro-batch
    (least memory) with that many steps, so no other size is worth searching.
    A size whose last micro-batch (the remainder) would be below ``smallest``
    is left out: BatchNorm, for one, refuses a batch of one.
    """
    steps = {1}
    power = 1
    while power <= global_batch_size:
        steps.update({power, 3 * power // 2 if power > 1 else 1})
        power *= 2
    steps.add(global_batch_size)
    sizes = {math.ceil(global_batch_size / k) for k in steps if k <= global_batch_size}
    sizes.add(smallest)
    # The last micro-batch holds the remainder: it too must be a size the model trains with.
    return sorted((s for s in sizes if s >= smallest and not 0 < global_batch_size % s < smallest), reverse=True)


def _timing_sizes(sizes: list[int]) -> list[int]:
    """A few sizes to time, spread geometrically (about x4 apart) from the largest to the smallest."""
    chosen = [sizes[0]]
    for size in sizes[1:]:
        if size * 4 <= chosen[-1] * 1.01:
            chosen.append(size)
    if chosen[-1] != sizes[-1]:
        chosen.append(sizes[-1])
    return sorted(chosen)


def batch_norm_notes(model_info: dict, *, micro_batch_size: int, global_batch_size: int) -> list[str]:
    """BatchNorm normalises over what one forward sees: a smaller micro-batch changes that statistic."""
    if not model_info.get("batch_norm") or micro_batch_size >= global_batch_size:
        return []
    return [
        f"the model has BatchNorm: it normalises over each micro-batch of {micro_batch_size}, not the batch of "
        f"{global_batch_size}, so its batch statistics (not the loss weighting) differ from one forward of the "
        "whole batch; gradients are otherwise exactly the global batch's"
    ]


def print_progress(line: str) -> None:
    """A log function for the CLI: progress on stderr, so --json keeps stdout clean."""
    print(f"  {line}", file=sys.stderr, flush=True)
