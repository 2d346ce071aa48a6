"""Steps 1 and 3 of planning: the cost model's memory half (simulated traces) and speed half (timings or FLOPs).

Memory: two simulated traces per precision (no arithmetic), at the smallest
micro-batch the model trains with and at the global batch, give every
configuration's peak (``memory.traces``). Speed: real timings on the device at
a few micro-batch sizes per precision (``costs``); with ``simulate``,
FLOPs instead. A stored study (the cache, or ``--study``) can hold both, and
a rerun then measures neither.

Only what the search can use is traced:

- the floor needs each precision's trace at the smallest micro-batch only,
  and only until one precision shows the budget is above it;
- a precision is traced in full only when the fastest it could run with no
  budget at all (its speeds, no checkpointing) reaches ``POLICY.verify_within_share`` of the
  fastest configuration found to fit so far (simulating, the fastest itself):
  below that, the verification would never time it (``worth_tracing``);
- fp16 and bf16 autocast save tensors of the same sizes wherever autocast
  follows the same rules for both (the CPU's, which the simulated meter uses
  for a GPU too): one's traces serve the other once a forward of the model
  under each has been checked to make the same operators with outputs of the
  same shapes and element sizes (``same_autocast_bytes``).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from autofit._torch_private import TorchDispatchMode, op_flops, tree_leaves
from autofit.apply import apply_config
from autofit.config import TrainingConfig
from autofit.device import host_memory_bytes
from autofit.errors import UserError
from autofit.measure.meters import simulated_meter, state_bytes
from autofit.model_io import as_loss, call_model
from autofit.planning.context import PlanContext
from autofit.planning.costs import (
    CostModel, MemoryCosts, PrecisionCosts, SpeedCosts, complete_memory, memory_costs, memory_trace_from_dict, scaled_trace, traced_sizes,
)
from autofit.planning.speed.estimated import flop_speed_costs
from autofit.planning.memory.levers import add_eight_bit, add_nf4
from autofit.planning.memory.nf4 import nf4_record, nf4_weight_dtype
from autofit.planning.memory.optimizer import eight_bit_record
from autofit.planning.memory.traces import MemoryTrace, add_chunk_deltas, add_offloaded, add_recomputes, trace_memory_sizes
from autofit.planning.speed.measured import NoisyTiming, time_precisions
from autofit.planning.policy import POLICY
from strategies import MASTER_WEIGHTS, PURE_BF16, checkpoint_candidates

HALF_PRECISIONS = ("bf16", "fp16")
"""Autocast to one 2-byte type or the other: the same rules on the CPU."""


@dataclass(kw_only=True)
class Costs:
    """The run's cost model, the speeds of every precision, and the micro-batch sizes searched (largest first).

    ``model.precisions`` holds the precisions traced in full; ``low_only``
    those traced at the smallest micro-batch only (enough for the floor).

    The planner's one working record, mutable: tracing and timing fill it in as the plan needs them (``model`` is
    frozen, each change a new one set here), and the search and verification read its ``model`` as it is then.
    """

    model: CostModel
    micro_batch_sizes: list[int]
    speeds: dict[str, SpeedCosts] = field(default_factory=dict)
    """Precision -> its speeds (timed, or from FLOPs), traced or not."""
    low_only: dict[str, MemoryCosts] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    """Precision -> a note on its speed or its traces."""
    shared: dict[str, str] = field(default_factory=dict)
    """Precision -> the precision whose traces it shares (checked: ``same_autocast_bytes``)."""
    halves_same: bool | None = None
    """Whether autocast makes the same tensors under fp16 and bf16 (``compare_halves``; None: not asked); not stored."""
    update_seconds: dict[str, float] = field(default_factory=dict)
    """What a lever adds to the optimizer's update on this device, timed once ("step_in_backward": per parameter
    tensor, ``levers.step_in_backward_time``)."""
    first_step: FakeStep | None = None
    """``smallest_runnable``'s micro-step over fake tensors, where it ran the whole model: what the first traced run
    is weighed by before any run is (``real_trace_sizes``); not stored."""
    resumed: bool = False
    """The cost model came from a stored study."""
    changed: bool = False
    """Traced or timed in this run: the study should keep it."""

    @property
    def host_sample_bytes(self) -> int:
        """Bytes of one sample of the host's copy of the global batch."""
        memory = next(iter(self.model.precisions.values()), None)
        memory = memory.memory if memory is not None else next(iter(self.low_only.values()))
        return memory.low.host_sample_bytes

    @property
    def smallest(self) -> int:
        return self.micro_batch_sizes[-1]

    def memory_for_floor(self) -> dict[str, MemoryCosts]:
        """Every precision traced with its recomputations at least at the smallest micro-batch (all the floor needs)."""
        return {
            **self.low_only,
            **{p: c.memory for p, c in self.model.precisions.items() if c.memory.with_checkpointing(self.smallest) is not None},
        }

    def untraced(self, precisions: list[str]) -> list[str]:
        return [p for p in precisions if p not in self.model.precisions]

    def to_store(self) -> dict:
        return {
            "cost_model": self.model.to_dict(), "micro_batch_sizes": self.micro_batch_sizes,
            "speeds": {p: _speed_dict(s) for p, s in self.speeds.items()},
            "low_only": {p: {"low": m.low.to_dict()} for p, m in self.low_only.items()},
            "notes": self.notes, "shared": self.shared, "update_seconds": self.update_seconds,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class FakeStep:
    """One micro-step (forward, loss, backward) over fake tensors: what it cost and what it would compute."""

    micro_batch_size: int
    cpu_seconds: float
    """Its process's CPU seconds."""
    flops: int
    """FLOPs of its ops (``torch.utils.flop_counter``'s formulas)."""


def _speed_dict(speed: SpeedCosts) -> dict:
    from dataclasses import asdict

    return asdict(speed)


def stored_or_new(context: PlanContext) -> Costs:
    """The costs a stored study holds for this model, device, batch and precisions; else new ones.

    New costs know the smallest micro-batch the model trains with and hold the
    first precision's trace at it (``smallest_runnable``); nothing else is traced yet.
    """
    stored = context.study.load("costs")
    if stored is not None:
        try:
            costs = from_store(stored)
        except (KeyError, TypeError, ValueError, AttributeError):  # another version's store, or a damaged one
            context.log("the stored costs could not be read: measuring again")
            costs = None
        if costs is not None:
            context.log(
                f"costs loaded from the stored study: {', '.join(costs.model.precisions) or 'no precision'} traced, "
                f"{', '.join(costs.speeds) or 'no precision'} timed"
            )
            return costs
    G = context.global_batch_size
    blocks = checkpoint_candidates(context.meta_model)
    smallest, step = smallest_runnable(context)
    model = CostModel(blocks=blocks, global_batch_size=G, device_type=context.device, estimated=context.simulate)
    return Costs(model=model, micro_batch_sizes=micro_batch_sizes(G, smallest=smallest), first_step=step)


def from_store(stored: dict) -> Costs:
    costs = Costs(
        model=CostModel.from_dict(stored["cost_model"]), micro_batch_sizes=list(stored["micro_batch_sizes"]),
        speeds={p: SpeedCosts(**s) for p, s in stored["speeds"].items()},
        low_only={p: _low_memory(memory_trace_from_dict(m["low"])) for p, m in stored["low_only"].items()},
        notes=dict(stored["notes"]), shared=dict(stored["shared"]), update_seconds=dict(stored.get("update_seconds", {})), resumed=True,
    )
    if any(t.levers is None for memory in costs.memory_for_floor().values() for t in memory.traces()):
        raise ValueError("traces stored before the memory levers were modelled")  # measured again
    for precision, other in costs.shared.items():  # one set of traces again, as when traced: completed once for both
        precisions = costs.model.precisions
        if precision in precisions and other in precisions:
            costs.model = costs.model.with_precisions({precision: replace(precisions[precision], memory=precisions[other].memory)})
    return costs


def _low_memory(trace) -> MemoryCosts:
    """A precision's memory known at its low trace only: exact at that micro-batch, which is all the floor asks."""
    return MemoryCosts(low=trace, high=trace)


def smallest_runnable(context: PlanContext) -> tuple[int, FakeStep | None]:
    """The smallest micro-batch the model trains with (BatchNorm refuses 1 sample per channel), and what its
    simulated step cost where it ran the whole model (None where it ran a stand-in).

    A simulated forward and backward per size (no arithmetic), smallest first; a model with a long run of
    identical blocks has it cut short for them (``PlanContext.stand_in``).
    """
    # The meter first: where fake tensors cannot run the model, that is one line of its own, not a size refused.
    context.sim_spec  # noqa: B018
    errors = []
    sizes = micro_batch_sizes(context.global_batch_size, smallest=1)[::-1]
    for number, size in enumerate(sizes, start=1):
        try:
            with context.progress.doing(f"simulating a step at micro-batch {size}, the smallest it may train with", step=number, of=len(sizes)):
                started = time.process_time()
                flops = _simulated_forward(context, size=size, precision=context.precisions[0], backward=True, stand_in=True, log=_FlopLog)
                seconds = time.process_time() - started
        except Exception as error:  # the user's model refused this batch size
            errors.append(f"micro-batch {size}: {type(error).__name__}: {error}")
            continue
        if errors:
            context.log(f"the model does not train below micro-batch {size} ({errors[0]})")
        whole = context.stand_in(context.sim_spec) is None
        return size, FakeStep(micro_batch_size=size, cpu_seconds=seconds, flops=sum(flops)) if whole else None
    raise UserError(f"the model fails to train even at micro-batch {context.global_batch_size}: {errors[-1]}; fix the model file or the batch size")


def trace_low(context: PlanContext, costs: Costs, precision: str, *, meanwhile: Callable[[], None] | None = None) -> None:
    """Trace a precision at the smallest micro-batch only (what the floor needs); ``meanwhile`` as ``trace_memory_sizes``'."""
    if precision in costs.memory_for_floor():
        return
    shared = _shared_with(context, costs, precision)
    if shared is not None:
        costs.low_only[precision] = costs.memory_for_floor()[shared]
        return
    sizes = [costs.smallest]
    real = real_trace_sizes(context, costs, precision, sizes)
    context.log(f"memory: tracing {precision} at micro-batch {costs.smallest} ({_meter_words(context, sizes, real)})")
    plain = trace_memory_sizes(
        context.sim_spec, sizes=sizes, precision=precision, device_type=context.device, blocks=_traced_blocks(costs),
        pool=context.trace_pool, recompute=False, real_sizes=real, progress=context.progress, meanwhile=meanwhile,
    )
    # Before any step is timed, the plain run's FLOPs and time say where its recomputing runs cost less for real.
    recomputing = real_trace_sizes(context, costs, precision, sizes, traced=plain)
    if recomputing != real:
        context.log(f"memory: tracing {precision}'s recomputations at micro-batch {costs.smallest} ({_meter_words(context, sizes, recomputing)})")
    trace = add_recomputes(
        context.sim_spec, plain, precision=precision, device_type=context.device, pool=context.trace_pool, real_sizes=recomputing,
        progress=context.progress,
    )[0]
    _check_blocks(costs, trace.blocks)
    costs.low_only[precision] = _low_memory(trace)
    costs.changed = True


def trace_full(context: PlanContext, costs: Costs, precision: str, *, recompute: bool = True) -> None:
    """Trace a precision at the smallest micro-batch and at the global batch: its whole memory model.

    Without ``recompute``, plain training's runs only (``add_recomputations`` adds the checkpointed ones when
    the search needs them); the floor's trace at the smallest micro-batch, with them, is kept (``MemoryCosts.floor``).
    """
    if precision in costs.model.precisions:
        return
    G = context.global_batch_size
    shared = _shared_with(context, costs, precision, full=True)
    if shared is not None:
        memory = costs.model.precisions[shared].memory
    else:
        low = costs.low_only.get(precision)
        sizes = [G] + ([] if low else [costs.smallest])
        traced = traced_sizes(low=costs.smallest, high=G, have_low=low is not None)
        real = real_trace_sizes(context, costs, precision, traced)
        context.log(f"memory: tracing {precision} at micro-batch {' and '.join(map(str, sizes))} ({_meter_words(context, traced, real)})")
        memory = memory_costs(
            context.sim_spec, precision=precision, low=costs.smallest, high=G, device_type=context.device,
            low_trace=low.low if low else None, blocks=_traced_blocks(costs), pool=context.trace_pool, recompute=recompute,
            real_sizes=real, progress=context.progress,
        )
        _check_blocks(costs, memory.low.blocks)
    costs.low_only.pop(precision, None)
    model = costs.model if costs.model.output_shape else replace(costs.model, output_shape=memory.high.output_shape)
    costs.model = model.with_precisions({precision: PrecisionCosts(precision=precision, memory=memory, speed=costs.speeds[precision])})
    costs.changed = True


def rank_compute_memory(context: PlanContext, costs: Costs) -> MemoryCosts | None:
    """What an FSDP2 rank computes over in a half precision, traced: bf16 weights under bf16 autocast
    (bf16-master's traces, with every block checkpointed too). FSDP2 gathers the weights in the autocast dtype
    (``MixedPrecisionPolicy``), so what its forward makes and saves is made from bf16 weights: the residual stream
    between layers is bf16, where autocast over fp32 weights keeps it fp32. None on the CPU (bf16-master is a
    GPU's choice), or without a half precision to plan.
    """
    if context.device != "cuda" or not any(p in HALF_PRECISIONS for p in context.precisions):
        return None
    G = context.global_batch_size
    context.log(
        f"memory: tracing bf16 autocast over bf16 weights (as FSDP2's ranks compute) at micro-batch {G} and "
        f"{costs.smallest} ({context.trace_meter})"
    )
    return memory_costs(
        context.sim_spec, precision=MASTER_WEIGHTS, low=costs.smallest, high=G, device_type=context.device,
        blocks=_traced_blocks(costs), pool=context.trace_pool, progress=context.progress,
    )


def add_recomputations(context: PlanContext, costs: Costs, precision: str) -> None:
    """A precision traced without its recomputations (``trace_full``), with them: checkpointed peaks now known."""
    memory = costs.model.precisions[precision].memory
    if memory.recomputed:
        return
    shared = costs.shared.get(precision)
    if shared in costs.model.precisions:  # its traces are this one's: complete them once
        add_recomputations(context, costs, shared)
        completed = costs.model.precisions[shared].memory
    else:
        sizes = sorted({t.micro_batch_size for t in memory.traces() if not t.scaled})
        real = real_trace_sizes(context, costs, precision, sizes)
        context.log(f"memory: tracing {precision}'s recomputations (checkpointed blocks; {_meter_words(context, sizes, real)})")
        completed = complete_memory(
            context.sim_spec, memory, precision=precision, device_type=context.device, pool=context.trace_pool, real_sizes=real,
            progress=context.progress,
        )
    costs.model = costs.model.with_precisions({
        name: replace(costs_of, memory=completed) for name, costs_of in costs.model.precisions.items()
        if costs_of.memory is memory or name == precision
    })
    costs.changed = True


def needs_recomputations(
    costs: Costs, evaluations: list, *, within: float, candidates: int | None = None, tie: float = 0.0,
) -> list[str]:
    """Precisions traced without recomputations where a point that does not fit as plain training could, if
    checkpointed, beat what it reaches without and come within ``within`` of the best that fits (nothing fits:
    every one where checkpointing could fit a point). Its speed with checkpointing is bounded by the search's
    choice as if recomputing held nothing (``Evaluation.bound_samples_per_s``; the plain speed where unknown).

    A point that fits only with a memory lever that costs time (8-bit state, host state, offload) counts too:
    checkpointing might cost less.

    With ``candidates`` (the verification's count, ``POLICY.verify_top_candidates``), such a point counts only where
    it could also be one of them: fewer than ``candidates`` points that fit are faster than its bound, or its bound is
    within ``tie`` of the best (the verification also times the simplest point in a tie with the best). Else the
    verification would time the same candidates with the recomputations traced or without.
    """
    fitting = [e.samples_per_s for e in evaluations if e.fits]
    best = max(fitting, default=0.0)

    def could_be_timed(e) -> bool:
        if candidates is None:
            return True
        bound = e.plain_samples_per_s if e.bound_samples_per_s is None else e.bound_samples_per_s
        return sum(speed > bound for speed in fitting) < candidates or bound >= best * (1 - tie)

    return sorted({
        e.config.precision for e in evaluations
        if not costs.model.precisions[e.config.precision].memory.recomputed and _bound_could_win(e, best=best, within=within)
        and could_be_timed(e)
    })


def _bound_could_win(e, *, best: float, within: float) -> bool:
    """Whether a point's speed bound (``Evaluation.bound_samples_per_s``; its plain speed where unknown) beats what it
    reaches now (nothing where it does not fit) and comes within ``within`` of ``best``, the best that fits."""
    bound = e.plain_samples_per_s if e.bound_samples_per_s is None else e.bound_samples_per_s
    return bound > 0 and bound > (e.samples_per_s if e.fits else 0.0) and bound >= within * best


def real_trace_sizes(
    context: PlanContext, costs: Costs, precision: str, sizes: list[int], *, traced: list[MemoryTrace] = (),
) -> frozenset[int]:
    """Of ``sizes``, those whose runs are traced on real tensors with the cpu meter rather than over fake tensors.

    Where a plan for this CPU times real steps anyway (not ``--simulate``), the cpu meter is what the simulated one
    stands for. A traced run is two micro-steps and an optimizer step, through the tracker's Python per op; over
    fake tensors each op costs the same whatever its size (FakeTensor's dispatch cache and rebuilt outputs: a
    Python loop of small ops traces slowly, #47). A size is traced for real where ``POLICY.real_trace_steps`` of its
    micro-steps take no longer than a run over fake tensors took (the slowest so far, of ``costs`` and ``traced``;
    before any, twice ``Costs.first_step``, the simulated micro-step that found the smallest micro-batch), and its
    activations (the smallest trace's, scaled; before any, the training state) leave most of this machine's free
    memory to the runs traced at once. A micro-step's seconds are the speed model's (per thread: a trace worker has
    one); before any step is timed, its FLOPs at this CPU's measured matmul rate and its optimizer step's bytes
    (``PlanContext.cpu_rates``), as that step or a traced run counted them. Nothing where neither is known (a model
    whose first step ran cut short, before its first trace).
    """
    if context.device != "cpu" or context.simulate or context.sim_spec.simulation_fallback:
        return frozenset()
    memories = [*(c.memory for c in costs.model.precisions.values()), *costs.low_only.values()]
    known = [*(t for memory in memories for t in memory.traces()), *traced]
    fake_s = max((t.fake_cpu_seconds for t in known), default=0.0)
    counted = [t.flops / (2 * t.micro_batch_size) for t in known if t.flops > 0]  # per sample and micro-step
    if costs.first_step is not None:  # a run is two such micro-steps and an optimizer step
        fake_s = max(fake_s, 2 * costs.first_step.cpu_seconds)
        counted.append(costs.first_step.flops / costs.first_step.micro_batch_size)
    if fake_s <= 0.0 or (precision not in costs.speeds and not counted):
        return frozenset()
    if precision in costs.speeds:
        speed, threads = costs.speeds[precision], max(1, context.threads)

        def step_s(size: int) -> float:
            return threads * speed.micro_step_seconds(size)
    else:
        flops_per_s, bytes_per_s = context.cpu_rates
        per_sample = max(counted)
        optimizer_s = state_bytes(context.meta_model) / bytes_per_s

        def step_s(size: int) -> float:
            return size * per_sample / flops_per_s + optimizer_s / 2
    # The activations a real run holds, by the smallest trace (before one: the weights, gradients and AdamW state).
    smallest = min(known, key=lambda t: t.micro_batch_size, default=None)
    per_sample_bytes = (
        max(s.peak_bytes for s in smallest.segments) / smallest.micro_batch_size if smallest is not None
        else state_bytes(context.meta_model)
    )
    room = POLICY.real_trace_memory_share * host_memory_bytes(available=True) / max(1, context.trace_pool.workers)
    return frozenset(size for size in sizes if POLICY.real_trace_steps * step_s(size) <= fake_s and per_sample_bytes * size <= room)


def _meter_words(context: PlanContext, sizes: list[int], real: frozenset[int]) -> str:
    """How the runs at ``sizes`` measure, as a progress line says it (``real``: those on real tensors)."""
    if not real:
        return context.trace_meter
    if all(size in real for size in sizes):
        return "cpu meter: a real step here costs less than a run over fake tensors"
    return f"cpu meter at {', '.join(str(s) for s in sizes if s in real)}, {context.trace_meter} at {', '.join(str(s) for s in sizes if s not in real)}"


def _traced_blocks(costs: Costs) -> list[str] | None:
    """The checkpoint candidates as a trace over fake tensors found them (``_check_blocks``); None before the first trace."""
    return list(costs.model.blocks) if costs.model.precisions or costs.low_only else None


def offload_untraced(context: PlanContext, costs: Costs, precision: str, *, usable_bytes: float) -> bool:
    """Whether ``trace_offload`` would trace this precision: a GPU, traces that model the levers without their
    offloading runs, and a budget that needs activations dropped at the global batch (its plain peak does not fit)."""
    if context.device != "cuda" or precision not in costs.model.precisions:
        return False
    model = costs.model
    traces = model.precisions[precision].memory.traces()
    if all(t.levers is None or t.levers.offloaded is not None for t in traces):
        return False
    return model.peak_bytes(precision, model.global_batch_size, frozenset()) > usable_bytes


def needs_offload(context: PlanContext, costs: Costs, evaluations: list, *, within: float, usable_bytes: float) -> list[str]:
    """Precisions ``trace_offload`` would trace where a point that does not fit as plain training could, if
    offloaded, beat what it reaches without and come within ``within`` of the best that fits. Its speed with
    offload is bounded by the search's choice as if the copies back held nothing and cost the least they can
    (``Evaluation.bound_samples_per_s``; the plain speed where unknown: offload only adds time)."""
    best = max((e.samples_per_s for e in evaluations if e.fits), default=0.0)
    winning = {e.config.precision for e in evaluations if _bound_could_win(e, best=best, within=within)}
    return sorted(p for p in winning if offload_untraced(context, costs, p, usable_bytes=usable_bytes))


def trace_offload(context: PlanContext, costs: Costs, precision: str, *, usable_bytes: float) -> None:
    """On a GPU, where the budget needs activations dropped at the global batch (``offload_untraced``), trace
    the precision's sizes again with every block offloaded, so that the search can offload
    (``memory.levers.add_offloaded``; the runs at once in the trace pool's workers where it has them). A roomy
    budget never pays for that trace; the search asks for it only where it could matter (``needs_offload``)."""
    if not offload_untraced(context, costs, precision, usable_bytes=usable_bytes):
        return
    memory = costs.model.precisions[precision].memory
    named = memory.named()
    sizes = sorted({trace.micro_batch_size for trace in named.values()})
    context.log(f"memory: tracing {precision} with every block offloaded at micro-batch {', '.join(map(str, sizes))} ({context.trace_meter})")
    done = add_offloaded(
        list(named.values()), context.sim_spec, precision=precision, device_type=context.device, pool=context.trace_pool,
        progress=context.progress,
    )
    memory.replace_traces(dict(zip(named, done)))
    costs.changed = True


def add_eight_bit_state(context: PlanContext, costs: Costs) -> None:
    """With --allow-lossy-optimizer: 8-bit optimizer state's record in every trace, so that the memory model predicts
    it (``memory.levers.add_eight_bit``). The record is the same at every size and precision: made once (over fake
    tensors, one 8-bit step per parameter shape), or taken from a trace that has it (a stored study's)."""
    memories = [c.memory for c in costs.model.precisions.values()] + list(costs.low_only.values())
    traces = [t for memory in memories for t in memory.named().values()]
    record = next((t.levers.eight_bit for t in traces if t.levers is not None and t.levers.eight_bit is not None), None)
    if record is None:
        context.log(f"memory: 8-bit optimizer state's bytes, one 8-bit step per parameter shape ({context.trace_meter})")
        with context.progress.doing("stepping 8-bit optimizer state, one parameter shape after another"):
            record = eight_bit_record(context.sim_spec, device_type=context.device)
    for memory in memories:
        if memory.replace_traces({name: add_eight_bit(t, record) for name, t in memory.named().items()}):
            costs.changed = True


def add_nf4_state(context: PlanContext, costs: Costs) -> None:
    """With --allow-lossy-base: NF4's record in every trace (``memory.levers.add_nf4``), so that the memory model
    predicts the frozen weights in NF4. The record depends on the dtype the precision gives frozen weights only
    (``memory.nf4.nf4_weight_dtype``): made once per dtype (over fake tensors, one product per weight shape), or
    taken from a trace of the same precision that has it (a stored study's)."""
    memories = [(p, c.memory) for p, c in costs.model.precisions.items()] + list(costs.low_only.items())
    records: dict = {}
    for precision, memory in memories:
        for trace in memory.named().values():
            if trace.levers is not None and trace.levers.nf4 is not None:
                records.setdefault(nf4_weight_dtype(precision), trace.levers.nf4)
    for precision, memory in memories:
        dtype = nf4_weight_dtype(precision)
        if dtype not in records:
            context.log(f"memory: frozen weights in NF4 ({str(dtype).removeprefix('torch.')}), one product per weight shape ({context.trace_meter})")
            with context.progress.doing("multiplying by NF4 weights, one weight shape after another"):
                records[dtype] = nf4_record(context.sim_spec, device_type=context.device, weight_dtype=dtype)
        if records[dtype] is not None and memory.replace_traces({name: add_nf4(t, records[dtype]) for name, t in memory.named().items()}):
            costs.changed = True


def add_loss_chunks(context: PlanContext, costs: Costs, *, chunks: int, usable_bytes: float) -> None:
    """The chunked output layer and loss's change to each traced precision's segments (``traces.add_chunk_deltas``:
    each size's step traced again with the loss in ``chunks`` chunks), so that the memory model predicts it.

    Only where it could matter: a precision whose plain training at the global batch fits is never given a lever
    (``search.score_space``), so it is not traced again.
    """
    model = costs.model
    for precision, known in model.precisions.items():
        memory = known.memory
        if memory.has_chunks() and memory.low.loss_chunks == chunks:
            continue
        if model.peak_bytes(precision, model.global_batch_size, frozenset()) <= usable_bytes:
            continue
        named = memory.named()
        own = {name: t for name, t in named.items() if not t.scaled}
        sizes = sorted({t.micro_batch_size for t in own.values()})
        context.log(
            f"memory: tracing {precision} with the output layer and loss in {chunks} chunks at micro-batch "
            f"{', '.join(map(str, sizes))} ({context.trace_meter})"
        )
        done = dict(zip(own, add_chunk_deltas(
            list(own.values()), context.sim_spec, precision=precision, device_type=context.device, chunks=chunks,
            pool=context.trace_pool, progress=context.progress,
        )))
        high = done.get("high", named["high"])
        for name, trace in named.items():  # a trace scaled from the high one: scaled again, with its change
            if trace.scaled:
                done[name] = scaled_trace(high, trace.micro_batch_size)
        if memory.replace_traces(done):
            costs.changed = True


def _check_blocks(costs: Costs, traced_blocks: list[str]) -> None:
    if traced_blocks != costs.model.blocks:  # the model on meta and over fake tensors must agree
        costs.model = replace(costs.model, blocks=list(traced_blocks))


def _shared_with(context: PlanContext, costs: Costs, precision: str, *, full: bool = False) -> str | None:
    """The other half precision, when it is traced (in full, if asked; else with what the floor needs) and autocast
    saves the same bytes under both."""
    if precision not in HALF_PRECISIONS:
        return None
    other = next(p for p in HALF_PRECISIONS if p != precision)
    # For the floor, a precision traced in full without its recomputations (a plan whose floor was well under its
    # budget, from the cache) is not traced enough: it cannot lend the floor its checkpointed peak.
    traced = other in costs.model.precisions if full else other in costs.memory_for_floor()
    if not traced:
        return None
    if costs.shared.get(precision) != other:
        same = costs.halves_same if costs.halves_same is not None else same_autocast_bytes(context, precision, other, size=costs.smallest)
        if not same:
            context.log(f"memory: {precision} and {other} autocast save different bytes for this model: tracing both")
            return None
        costs.shared[precision] = other
        costs.changed = True
    context.log(f"memory: {precision} shares {other}'s traces (checked: autocast makes the same tensors under both)")
    return other


def compare_halves(context: PlanContext, costs: Costs) -> None:
    """Where the plan has both half precisions, whether autocast makes the same tensors under them
    (``same_autocast_bytes``), into ``costs.halves_same``: what ``_shared_with`` asks later, asked while the first
    trace runs in a worker (two forwards over fake tensors, a ResNet-18's 0.23 s)."""
    if costs.halves_same is None and all(p in context.precisions for p in HALF_PRECISIONS) and not costs.shared:
        costs.halves_same = same_autocast_bytes(context, *HALF_PRECISIONS, size=costs.smallest)


def same_autocast_bytes(context: PlanContext, first: str, second: str, *, size: int) -> bool:
    """Whether a forward (with its loss) under the two precisions makes the same operators with outputs of the
    same shapes and element sizes: then backward, the optimizer and every saved tensor weigh the same too.

    Run over fake tensors (no arithmetic) at ``size`` samples, on the model with its run of identical blocks cut
    short (``PlanContext.stand_in``): the blocks cut make what the ones kept make.
    """
    try:
        with context.progress.doing(f"comparing {first}'s and {second}'s tensors (two simulated forwards)"):
            return (
                _simulated_forward(context, size=size, precision=first, stand_in=True)
                == _simulated_forward(context, size=size, precision=second, stand_in=True)
            )
    except Exception:  # a model the comparison cannot run: trace both
        return False


class _FlopLog(TorchDispatchMode):
    """Each operator's FLOPs (``torch.utils.flop_counter``'s formulas; 0 for most)."""

    def __init__(self, model=None) -> None:
        super().__init__()
        self.entries: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.entries.append(op_flops(func, args, kwargs, out))
        return out


class _OperatorLog(TorchDispatchMode):
    """Each operator and its outputs' shapes and element sizes (the dtype's name left out: bf16 and fp16 are both 2 bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = tuple(
            (tuple(t.shape), t.element_size(), t.dtype.is_floating_point) for t in tree_leaves(out) if isinstance(t, torch.Tensor)
        )
        self.entries.append((str(func), shapes))
        return out


def _simulated_forward(
    context: PlanContext, *, size: int, precision: str, backward: bool = False, log: Callable[[torch.nn.Module], TorchDispatchMode] | None = None,
    stand_in: bool = False,
):
    """One micro-batch's forward and loss (and backward) over fake tensors; the operators it made (or what ``log``,
    made over the model, returns as ``entries``). ``stand_in``: over the model with its run of identical blocks cut
    short (``PlanContext.stand_in``), where there is one and that runs; else over the whole model."""
    short = context.stand_in(context.sim_spec) if stand_in else None
    if short is not None:
        try:
            return _forward_over(context, short, size=size, precision=precision, backward=backward, log=log)
        except Exception:  # a forward that counts on every block being there: the whole model has the last word
            pass
    return _forward_over(context, context.sim_spec, size=size, precision=precision, backward=backward, log=log)


def _forward_over(context: PlanContext, spec, *, size: int, precision: str, backward: bool, log) -> list:
    meter = simulated_meter(spec, for_device=context.device)  # the cpu meter for a model fake tensors cannot run
    torch.manual_seed(0)
    with meter.environment():
        model = meter.build_model(spec.build_model)
        model.train()
        config = TrainingConfig(global_batch_size=size, micro_batch_size=size, precision=precision)
        applied = apply_config(model, config, device=meter.device, use_scaler=False)
        inputs, targets = spec.example_batch(size)
        mode = _OperatorLog() if log is None else log(applied.model)
        with mode, applied.forward_context():
            loss = as_loss(spec.loss_fn).weighted(call_model(applied.model, inputs), targets, weight=1.0)
        if backward:
            loss.backward()
    return mode.entries


def weight_casts(context: PlanContext, precision: str) -> dict[str, int]:
    """Parameter name -> bytes of the copy autocast makes of it in one forward at ``precision`` (each trained fp32
    weight a matmul or convolution takes, cast once, cached until the forward ends and held for its backward): what a
    one-process trace holds that FSDP2, whose gathered parameters are already in the autocast dtype, does not.
    Empty without autocast, or for a model the fake forward cannot run."""
    if precision not in HALF_PRECISIONS:
        return {}
    try:
        return _simulated_forward(context, size=1, precision=precision, log=_WeightCasts)
    except Exception:  # a model the forward cannot run here: nothing is taken off
        return {}


class _WeightCasts(TorchDispatchMode):
    """The bytes of each trained parameter's first cast to a 2-byte type (autocast's), by parameter name."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
        self.entries: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = args[0] if args else None
        if (
            func is torch.ops.aten._to_copy.default and id(source) in self.names and source.dtype == torch.float32
            and isinstance(out, torch.Tensor) and out.element_size() == 2
        ):
            self.entries.setdefault(self.names[id(source)], out.numel() * out.element_size())
        return out


def add_speeds(context: PlanContext, costs: Costs) -> dict[str, str]:
    """Time (or estimate) every precision's speeds, unless the costs already hold them.

    Returns:
        Precision -> a note on its speed (e.g. not timed past the smallest size: far slower than the fastest).
    """
    wanted = [p for p in context.precisions if p not in costs.speeds]
    # bf16 weights compute as bf16 autocast does: bf16's speeds, its host update and copies priced apart
    # (``speed.levers``: its fp32 masters step on the host).
    timed = list(dict.fromkeys("bf16" if p in (MASTER_WEIGHTS, PURE_BF16) else p for p in wanted))
    timed = [p for p in timed if p not in costs.speeds]
    if timed:
        sizes = timing_sizes(costs.micro_batch_sizes)
        if context.simulate:
            context.log(f"speed: estimating from FLOPs at micro-batch {', '.join(map(str, sizes))}")
            settings = dict(
                precisions=timed, sizes=sizes, device_type=context.device, device_name=context.info.name, pool=context.trace_pool,
            )
            with context.progress.doing(f"counting {', '.join(timed)}'s FLOPs (simulated forwards)"):
                try:  # counted on the model with its run of identical blocks cut short
                    speeds = flop_speed_costs(context.sim_spec, repeat=context.repeat, **settings)
                except Exception:
                    if context.repeat is None:
                        raise
                    # A forward that counts on every block being there: counted on the whole model (its own error, if any).
                    speeds = flop_speed_costs(context.sim_spec, **settings)
        else:
            context.log(f"speed: timing {', '.join(timed)} at micro-batch {', '.join(map(str, sizes))} on {context.device}, interleaved")
            speeds = _timed_speeds(context, precisions=timed, sizes=sizes)
        costs.speeds.update(speeds)
    borrowed = {
        MASTER_WEIGHTS: "bf16's compute; the fp32 masters' update on the host and its copies are priced apart",
        PURE_BF16: "bf16's compute and optimizer step",
    }
    if any(p in borrowed for p in wanted):
        speeds = {**speeds} if timed else {}
        for precision in (p for p in wanted if p in borrowed):
            speeds[precision] = replace(costs.speeds["bf16"], note=borrowed[precision])
            costs.speeds[precision] = speeds[precision]
    if wanted:
        costs.changed = True
        for precision, speed in speeds.items():
            if speed.note:
                costs.notes[precision] = speed.note
            if precision in costs.model.precisions:
                costs.model = costs.model.with_precisions({precision: replace(costs.model.precisions[precision], speed=speed)})
    return {p: costs.notes[p] for p in context.precisions if p in costs.notes}


def _timed_speeds(context: PlanContext, *, precisions: list[str], sizes: list[int]) -> dict[str, SpeedCosts]:
    """``time_precisions`` with the threads the machine leaves free now, and with one where several time too noisily.

    Several intra-op threads over a model of many small ops wait for each other at every parallel region, and
    on a shared CPU their steps repeat so far apart (``POLICY.threads_noise_share``) that the rounds cannot rank
    anything and run to their limits. Where the run may still cut its threads (``TimingThreads.may_cut``), a size
    whose rounds repeat worse than that stops the timing: its samples are dropped, and every size is timed again with
    one thread and its CPU-time clock (``PlanContext.clock``). Samples of two thread counts are never compared.
    """
    context.recheck_threads()
    settings = dict(precisions=precisions, sizes=sizes, device=context.device, progress=context.progress)
    if not context.thread_choice.may_cut(context.device):
        return time_precisions(context.spec, clock=context.clock, **settings)
    threads = context.threads
    try:
        return time_precisions(context.spec, clock=context.clock, most_noise=POLICY.threads_noise_share, **settings)
    except NoisyTiming as noisy:
        context.cut_threads(1, (
            f"timings on {threads} threads repeated within {noisy.noise:.0%} at micro-batch {noisy.size} (more than "
            f"{POLICY.threads_noise_share:.0%}): measured again with 1 thread, steps timed by its CPU time"
        ))
        return time_precisions(context.spec, clock=context.clock, **settings)


def best_plain_samples_per_s(costs: Costs, precision: str) -> float:
    """The fastest a precision could train with no budget: its best micro-batch, no checkpointing (speeds only)."""
    speed, G = costs.speeds[precision], costs.model.global_batch_size
    best = 0.0
    for size in costs.micro_batch_sizes:
        seconds = speed.optimizer_seconds + sum(n * speed.micro_step_seconds(s) for s, n in costs.model.micro_sizes(size))
        best = max(best, G / seconds)
    return best


def worth_tracing(costs: Costs, precision: str, *, best_fitting: float, within: float = POLICY.verify_within_share) -> bool:
    """Whether a precision could reach the verification: its best plain speed is at least ``within`` of the best fit.

    Checkpointing and accumulation only slow a precision down, so a precision
    below that line at its fastest has no configuration the verification
    would time, whatever its memory. A simulated plan times nothing and takes
    the fastest predicted: there ``within`` is 1.
    """
    return best_plain_samples_per_s(costs, precision) >= within * best_fitting


def save(context: PlanContext, costs: Costs) -> None:
    """Keep the costs in the study (the cache or ``--study``) when this run added to them (none kept: ``--no-cache``)."""
    if costs.changed and context.study.storage is not None:
        context.study.save("costs", costs.to_store())
        costs.changed = False


def micro_batch_sizes(global_batch_size: int, *, smallest: int) -> list[int]:
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


def timing_sizes(sizes: list[int]) -> list[int]:
    """A few sizes to time, spread geometrically (about ``POLICY.timing_sizes_apart`` times apart) from the largest to the smallest."""
    chosen = [sizes[0]]
    for size in sizes[1:]:
        if size * POLICY.timing_sizes_apart <= chosen[-1] * POLICY.timing_sizes_apart_tolerance:
            chosen.append(size)
    if chosen[-1] != sizes[-1]:
        chosen.append(sizes[-1])
    return sorted(chosen)
