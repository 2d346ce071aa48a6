"""The planner's cost model: peak bytes and step time of any configuration, as plain data.

Memory comes from simulated traces per precision (``memory.traces``):
linear in the micro-batch size, exact in the structure of where blocks free
and recompute their activations (``memory_costs``), with the memory levers'
terms (``memory.levers``) where a configuration asks for them. Time comes from
real timings on the device (``speed.measured``: forward, forward+backward and
each block's forward at a few micro-batch sizes, the optimizer step, and what
checkpointing really costs per second of recomputed forward, fully and
selectively); with ``simulate`` it comes from FLOPs instead and is an
estimate (``speed.estimated``). Everything here is plain data, so a study can store
it and resume.
"""
from __future__ import annotations


import math
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, replace

from autofit.planning.memory.levers import LeverChoice, lever_peak_bytes
from autofit.planning.memory.levers import trace_from_dict as lever_trace_from_dict
from autofit.planning.memory.segments import Segment, peak_of
from autofit.planning.memory.traces import MemoryTrace, add_offloaded, add_recomputes, trace_memory_sizes
from autofit.progress import QUIET, Progress
from autofit.spec import ModelSpec
from strategies import BatchSplitConfig


@dataclass(kw_only=True, slots=True)
class MemoryCosts:
    """Traces of one precision; bytes at any micro-batch size are linear between the two around it."""

    low: MemoryTrace
    high: MemoryTrace
    middle: MemoryTrace | None = None
    """A trace at 2 samples when ``low`` is at 1 (see ``memory_costs``): sizes from 2 up lie on the line through it and ``high``."""
    floor: MemoryTrace | None = None
    """Where the traces hold plain training only (not ``recomputed``): the whole trace at ``low``'s size, with its
    recomputations (the floor's), so that checkpointed peaks at that one size stay known."""

    def at(self, micro_batch_size: int, *, global_batch_size: int, chunked: bool = False) -> tuple[list[Segment], list[float]]:
        """The segments that bound the peak at this size, and each block's dropped bytes.

        Args:
            micro_batch_size: samples per micro-batch.
            global_batch_size: samples per optimizer step; gradients of earlier
                micro-batches are alive when it is larger than the micro-batch.
            chunked: with the chunked output layer and loss (``has_chunks``).
        """
        deltas = self.chunk_deltas() if chunked else None
        accumulating = micro_batch_size < global_batch_size
        # The optimizer step follows the last micro-batch, which may be smaller (8 = 3 + 3 + 2):
        # what that micro-step leaves alive (its input copy, the output) is of its size.
        last = BatchSplitConfig(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size).last_size
        segments = [
            Segment(
                peak_bytes=self.interpolate(
                    [t.segments[i].peak_bytes + (deltas[n][i] if deltas else 0) for n, t in enumerate(self.traces())],
                    last if segment.phase == "optimizer" else micro_batch_size, global_batch_size=global_batch_size,
                ),
                dropped=segment.dropped, phase=segment.phase, recomputes=segment.recomputes, selective=segment.selective,
            )
            for i, segment in self._kept(accumulating=accumulating)
        ]
        drops = [  # negative where the checkpoint keeps an input that plain training frees: it adds bytes
            self.interpolate([t.drop_bytes[b] for t in self.traces()], micro_batch_size, at_least=None)
            for b in range(len(self.low.drop_bytes))
        ]
        return segments, drops

    def in_backward(self, micro_batch_size: int, *, global_batch_size: int) -> list[bool] | None:
        """Per segment of ``at`` (its order): whether some block's backward has begun in it; None without lever records."""
        levers = self.low.levers
        if levers is None:
            return None
        plain = iter(levers.in_backward)  # the plain segments come first, each with its flag; recomputations run in backward
        flags = [next(plain) if segment.recomputes is None else True for segment in self.low.segments]
        return [flags[i] for i, _ in self._kept(accumulating=micro_batch_size < global_batch_size)]

    def _kept(self, *, accumulating: bool) -> list[tuple[int, Segment]]:
        """The low trace's segments ``at`` keeps, with their indices: without accumulation, none of a later micro-step."""
        return [(i, segment) for i, segment in enumerate(self.low.segments) if accumulating or segment.phase != "later"]

    def selective_drops(self, micro_batch_size: int) -> list[float] | None:
        """Bytes each block's selective checkpointing frees at this size (negative where it keeps more than
        plain training); None when it frees nothing anywhere (the traces hold no selective recomputation)."""
        if not all(t.selective_drop_bytes for t in self.traces()):
            return None
        return [
            self.interpolate([t.selective_drop_bytes[b] for t in self.traces()], micro_batch_size, at_least=None)
            for b in range(len(self.low.selective_drop_bytes))
        ]

    def has_chunks(self) -> bool:
        """Whether the traces model the chunked output layer and loss (``traces.add_chunk_deltas``)."""
        return self.chunk_deltas() is not None

    def chunk_deltas(self) -> list[list[int]] | None:
        """Per trace (as ``traces``), per segment: what the chunked loss changes in its peak; None where not modelled."""
        deltas = [t.segment_chunk_deltas() for t in self.traces()]
        if any(d is None or len(d) != len(self.low.segments) for d in deltas):
            return None
        return deltas

    def traces(self) -> list[MemoryTrace]:
        """The traces sizes interpolate between: low, middle where there is one, high."""
        return [self.low] + ([self.middle] if self.middle is not None else []) + [self.high]

    def named(self) -> dict[str, MemoryTrace]:
        """Every trace held, by its field's name ("low", "middle", "high", "floor"): what a change to all of them
        (offload's runs, 8-bit state's record) goes through."""
        return {name: getattr(self, name) for name in ("low", "middle", "high", "floor") if getattr(self, name) is not None}

    def replace_traces(self, traces: dict[str, MemoryTrace]) -> bool:
        """Put ``traces`` (by name, as ``named`` gives them) in place; whether any of them is a new one."""
        changed = False
        for name, trace in traces.items():
            if getattr(self, name) is not trace:
                setattr(self, name, trace)
                changed = True
        return changed

    def interpolate(
        self, values: list[float], size: int, *, global_batch_size: int | None = None, at_least: float | None = 0.0
    ) -> float:
        """Bytes at ``size`` on the line through the two traces around it (``values`` holds each trace's).

        With ``global_batch_size``, the bytes of a whole step: the traces held a
        global batch of 2 micro-batches on the host; the real one holds G samples.
        ``at_least`` bounds the line from below (None: it may go negative).
        """
        traces = self.traces()
        upper = next((i for i in range(1, len(traces)) if size <= traces[i].micro_batch_size), len(traces) - 1)
        a, b = traces[upper - 1].micro_batch_size, traces[upper].micro_batch_size
        weight = (size - a) / max(b - a, 1)
        value = values[upper - 1] + (values[upper] - values[upper - 1]) * weight
        if at_least is not None:
            value = max(value, at_least)
        if global_batch_size is not None:
            value += (global_batch_size - 2 * size) * self.high.host_sample_bytes
        return value

    @property
    def recomputed(self) -> bool:
        """Whether every trace holds its recomputations: else only plain training's peaks are known."""
        return all(t.recomputed for t in self.traces())

    def with_checkpointing(self, micro_batch_size: int) -> MemoryCosts | None:
        """Memory costs that know checkpointed peaks at this size: these, or at the ``floor``'s size its trace alone;
        None where only plain training's peaks are known."""
        if self.recomputed:
            return self
        if self.floor is not None and micro_batch_size == self.floor.micro_batch_size:
            return MemoryCosts(low=self.floor, high=self.floor)
        return None

    def peak_bytes(
        self, micro_batch_size: int, *, global_batch_size: int, checkpoint: set[int], selective=frozenset(),
        levers: LeverChoice | None = None,
    ) -> float:
        """The peak with ``checkpoint`` blocks checkpointed fully and ``selective`` ones selectively (indices), and
        the memory levers of ``levers`` (``memory.levers``; None: none).

        Raises:
            ValueError: levers asked of traces that hold no lever record (``has_levers``), or checkpointed blocks
                at a size where the traces hold plain training only (``with_checkpointing``).
        """
        chunked = levers is not None and levers.loss_chunks > 1
        if chunked and not self.has_chunks():
            raise ValueError("these memory traces hold no chunked loss's run: trace it to model the chunked loss (add_chunk_deltas)")
        if checkpoint or selective:
            known = self.with_checkpointing(micro_batch_size)
            if known is None:
                raise ValueError(f"checkpointed peaks at micro-batch {micro_batch_size} need the traces' recomputations (complete_memory)")
            if known is not self:
                return known.peak_bytes(
                    micro_batch_size, global_batch_size=global_batch_size, checkpoint=checkpoint, selective=selective, levers=levers,
                )
        segments, drops = self.at(micro_batch_size, global_batch_size=global_batch_size, chunked=chunked)
        selective_drops = self.selective_drops(micro_batch_size) if selective else None
        if levers is None or levers.only_chunks():
            return peak_of(segments, drops, checkpoint, selective_drops=selective_drops, selective=selective)
        peak = lever_peak_bytes(
            self, micro_batch_size, global_batch_size=global_batch_size, drops=drops, selective_drops=selective_drops,
            checkpoint=checkpoint, selective=selective, choice=levers,
        )
        if peak is None:
            raise ValueError("these memory traces hold no lever record: trace again to model the levers")
        return peak

    def has_levers(self) -> bool:
        """Whether the traces can model the memory levers (``memory.levers``; traces stored before could not)."""
        traces = self.traces()
        return all(t.levers is not None for t in traces) and len({t.levers.structure_key() for t in traces}) == 1


@dataclass(kw_only=True, slots=True)
class SpeedCosts:
    """Times of one precision at a few micro-batch sizes; other sizes interpolate in log-log."""

    sizes: list[int]
    step_seconds: list[float]
    """Forward + backward of one micro-batch (host copy included)."""
    forward_seconds: list[float]
    block_seconds: list[list[float]]
    """Per size, each block's forward seconds."""
    optimizer_seconds: float
    recompute_factor: float = 1.0
    """Measured seconds checkpointing adds per second of the blocks' plain forward."""
    note: str = ""
    noise: float = 0.0
    """The largest spread of these timings' fastest rounds (``timing.Samples.spread``): 0.05 is 5%."""
    selective_shares: list[float] = field(default_factory=list)
    """Per block: the share of its forward that selective checkpointing recomputes (``selective_shares``,
    an estimate); empty when not known (then selective checkpointing is not searched)."""
    selective_factor: float = 1.0
    """Measured seconds selective checkpointing adds per second of that estimated share of the forward."""

    def micro_step_seconds(self, micro_batch_size: int) -> float:
        return _loglog(self.sizes, self.step_seconds, micro_batch_size)

    def forward_seconds_at(self, micro_batch_size: int) -> float:
        """One micro-batch's forward (what activation offload's copies to the host overlap, ``speed.levers``)."""
        return _loglog(self.sizes, self.forward_seconds, micro_batch_size)

    def recompute_seconds(self, micro_batch_size: int) -> list[float]:
        return [self.recompute_factor * seconds for seconds in self._block_forward_seconds(micro_batch_size)]

    def selective_recompute_seconds(self, micro_batch_size: int) -> list[float] | None:
        """Per block: seconds its selective checkpointing adds to a micro-step (None when not known)."""
        forward = self._block_forward_seconds(micro_batch_size)
        if len(self.selective_shares) != len(forward) or not forward:
            return None
        return [self.selective_factor * share * seconds for share, seconds in zip(self.selective_shares, forward)]

    def _block_forward_seconds(self, micro_batch_size: int) -> list[float]:
        columns = list(zip(*self.block_seconds)) if self.block_seconds else []
        return [_loglog(self.sizes, list(col), micro_batch_size) for col in columns]


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionCosts:
    precision: str
    memory: MemoryCosts
    speed: SpeedCosts


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Predicted peak bytes and samples/s of any (precision, micro-batch, checkpoint set).

    Frozen: what tracing, timing or a verification learns is a new model (``with_precisions``,
    ``dataclasses.replace``), which its owner keeps (the planner's ``modelling.Costs``); a search or a
    verification handed one model reads that model throughout.
    """

    blocks: list[str]
    global_batch_size: int
    device_type: str
    estimated: bool
    """True when times come from FLOPs (simulate), not from the device."""
    precisions: dict[str, PrecisionCosts] = field(default_factory=dict)
    output_shape: list[int] = field(default_factory=list)
    memory_scale: float = 1.0
    """Measured/simulated peak ratio on a real GPU (the allocator's rounding and cache); 1 on the CPU."""

    def with_precisions(self, changed: dict[str, PrecisionCosts]) -> CostModel:
        """This model with ``changed`` precisions' costs added, or in place of their own."""
        return replace(self, precisions={**self.precisions, **changed})

    def names(self, indices) -> tuple[str, ...]:
        """Block names of block indices, in the model's order (a configuration names its blocks)."""
        return tuple(self.blocks[b] for b in sorted(indices))

    def indices(self, names) -> frozenset[int]:
        """Block indices of block names (the cost model's and the knapsack's way of naming them)."""
        return frozenset(self.blocks.index(name) for name in names)

    def micro_sizes(self, micro_batch_size: int) -> list[tuple[int, int]]:
        """A step's micro-batch sizes, each with how many micro-batches have it (``BatchSplitConfig.size_counts``)."""
        return BatchSplitConfig(global_batch_size=self.global_batch_size, micro_batch_size=micro_batch_size).size_counts()

    def peak_bytes(
        self, precision: str, micro_batch_size: int, checkpoint: set[int], selective=frozenset(), levers: LeverChoice | None = None,
    ) -> float:
        """Peak bytes with ``checkpoint`` blocks checkpointed fully and ``selective`` ones selectively (indices),
        and the memory levers of ``levers`` (None: none)."""
        memory = self.precisions[precision].memory
        raw = memory.peak_bytes(
            micro_batch_size, global_batch_size=self.global_batch_size, checkpoint=checkpoint, selective=selective, levers=levers,
        )
        return raw * self.memory_scale

    def recompute_seconds(self, precision: str, micro_batch_size: int) -> list[float]:
        """Per block: seconds one optimizer step spends recomputing it if checkpointed."""
        speed = self.precisions[precision].speed
        return self._per_step(micro_batch_size, speed.recompute_seconds)

    def selective_recompute_seconds(self, precision: str, micro_batch_size: int) -> list[float] | None:
        """Per block: seconds one optimizer step spends recomputing it if checkpointed selectively (None: not known)."""
        speed = self.precisions[precision].speed
        if speed.selective_recompute_seconds(micro_batch_size) is None:
            return None
        return self._per_step(micro_batch_size, speed.selective_recompute_seconds)

    def _per_step(self, micro_batch_size: int, per_micro_step) -> list[float]:
        totals = [0.0] * len(self.blocks)
        for size, count in self.micro_sizes(micro_batch_size):
            for index, seconds in enumerate(per_micro_step(size)):
                totals[index] += count * seconds
        return totals

    def step_seconds(self, precision: str, micro_batch_size: int, checkpoint: set[int], selective=frozenset()) -> float:
        speed = self.precisions[precision].speed
        seconds = speed.optimizer_seconds
        for size, count in self.micro_sizes(micro_batch_size):
            seconds += count * speed.micro_step_seconds(size)
        recompute = self.recompute_seconds(precision, micro_batch_size)
        seconds += sum(recompute[b] for b in checkpoint)
        if selective:
            selective_recompute = self.selective_recompute_seconds(precision, micro_batch_size)
            seconds += sum(selective_recompute[b] for b in selective)
        return seconds

    def samples_per_s(self, precision: str, micro_batch_size: int, checkpoint: set[int], selective=frozenset()) -> float:
        return self.global_batch_size / self.step_seconds(precision, micro_batch_size, checkpoint, selective)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        precisions = {}
        for name, costs in data["precisions"].items():
            memory = costs["memory"]
            middle = memory.get("middle")
            precisions[name] = PrecisionCosts(
                precision=costs["precision"],
                memory=MemoryCosts(
                    low=memory_trace_from_dict(memory["low"]),
                    high=memory_trace_from_dict(memory["high"]),
                    middle=memory_trace_from_dict(middle) if middle else None,
                    floor=memory_trace_from_dict(memory["floor"]) if memory.get("floor") else None,
                ),
                speed=SpeedCosts(**costs["speed"]),
            )
        rest = {k: v for k, v in data.items() if k != "precisions"}
        return cls(precisions=precisions, **rest)


def memory_trace_from_dict(data: dict) -> MemoryTrace:
    """A ``MemoryTrace`` from its ``to_dict`` (a study or the cache keeps it so)."""
    fields_ = dict(data)
    fields_["segments"] = [Segment(**s) for s in data["segments"]]
    fields_["levers"] = lever_trace_from_dict(data.get("levers"))
    return MemoryTrace(**fields_)


def memory_costs(
    spec: ModelSpec, *, precision: str, low: int, high: int, device_type: str, low_trace: MemoryTrace | None = None,
    blocks: list[str] | None = None, pool=None, recompute: bool = True, offload: bool = False, real_sizes: Collection[int] = (),
    progress: Progress = QUIET,
) -> MemoryCosts:
    """Trace one precision at the smallest and the largest micro-batch size (simulated: no arithmetic).

    At one sample some slices and reshapes are free views that copy at any
    larger size (``logits[:, :-1].contiguous()``, a transpose of a size-1
    dimension), so a trace at 1 lies off the line the larger sizes lie on:
    when ``low`` is 1, sizes from 2 up interpolate between traces at 2 and
    ``high``, and 1 keeps its own trace.

    Args:
        low: the smallest micro-batch size planned.
        high: the largest (the global batch).
        low_trace: an existing trace at ``low`` for this precision, to reuse.
        blocks: the checkpoint candidates another trace of this model found (None: the first run finds them).
        pool: a ``memory.workers.TracePool`` whose workers run the traces at once.
        recompute: also the all-checkpointed and all-selective runs; without them only plain training's peaks
            are known, until ``complete_memory`` adds them.
        offload: also trace each size with every block offloaded (``memory.levers.add_offloaded``), so that the
            model predicts activation offload (a GPU lever: the planner asks for it for a GPU only).
        real_sizes: the sizes traced on real tensors (``trace_memory_sizes``).
        progress: hears which run is awaited, k of n.
    """
    def with_offload(trace: MemoryTrace | None) -> MemoryTrace | None:
        if not offload or trace is None:
            return trace
        return add_offloaded([trace], spec, precision=precision, device_type=device_type, pool=pool, progress=progress)[0]

    floor, low_trace = None, with_offload(low_trace)
    if low_trace is not None and not recompute:
        floor, low_trace = low_trace, _plain_part(low_trace)
    if high == low:
        low_trace = low_trace or with_offload(trace_memory_sizes(
            spec, sizes=[low], precision=precision, device_type=device_type, blocks=blocks, pool=pool, recompute=recompute,
            real_sizes=real_sizes, progress=progress,
        )[0])
        return MemoryCosts(low=floor or low_trace, high=floor or low_trace)
    sizes = traced_sizes(low=low, high=high, have_low=low_trace is not None)
    traced = trace_memory_sizes(
        spec, sizes=sizes, precision=precision, device_type=device_type, blocks=low_trace.blocks if low_trace else blocks, pool=pool,
        recompute=recompute, real_sizes=real_sizes, progress=progress,
    )
    if offload:
        traced = add_offloaded(traced, spec, precision=precision, device_type=device_type, pool=pool, progress=progress)
    traces = dict(zip(sizes, traced))
    memory = _assembled(low_trace or traces[low], traces.get(2) if low == 1 and high > 2 else None, traces[high])
    return replace(memory, floor=floor) if not memory.recomputed else memory


def traced_sizes(*, low: int, high: int, have_low: bool) -> list[int]:
    """The micro-batch sizes ``memory_costs`` traces from ``low`` to ``high``: ``high``, 2 where ``low`` is 1 (a trace
    at 1 lies off the line), and ``low`` unless its trace is at hand (``have_low``)."""
    if high == low:
        return [] if have_low else [low]
    return [high] + ([2] if low == 1 and high > 2 else []) + ([] if have_low else [low])


def complete_memory(
    spec: ModelSpec, memory: MemoryCosts, *, precision: str, device_type: str, pool=None, real_sizes: Collection[int] = (),
    progress: Progress = QUIET,
) -> MemoryCosts:
    """``memory`` with the recomputations its traces were made without (``memory_costs``' ``recompute``; ``real_sizes``
    as there)."""
    if memory.recomputed:
        return memory
    own = {t.micro_batch_size: t for t in memory.traces() if not t.scaled}
    if memory.floor is not None and memory.floor.micro_batch_size in own:
        # The whole trace the low one was cut from (``_plain_part``), selective left out where ``_assembled`` left it out.
        own[memory.floor.micro_batch_size] = memory.floor if memory.low.selective_drop_bytes else _without_selective(memory.floor)
    done = dict(zip(own, add_recomputes(
        spec, list(own.values()), precision=precision, device_type=device_type, pool=pool, real_sizes=real_sizes, progress=progress,
    )))
    high = done[memory.high.micro_batch_size]
    if memory.low.micro_batch_size == memory.high.micro_batch_size:
        return MemoryCosts(low=high, high=high)

    def again(trace: MemoryTrace | None) -> MemoryTrace | None:  # a scaled trace is scaled again from the whole high one
        if trace is None:
            return None
        return scaled_trace(high, trace.micro_batch_size) if trace.scaled else done.get(trace.micro_batch_size, trace)

    return _assembled(again(memory.low), again(memory.middle), high)


def _plain_part(trace: MemoryTrace) -> MemoryTrace:
    """``trace`` without its recomputations, as if traced without them."""
    return replace(trace, segments=[s for s in trace.segments if s.recomputes is None], recomputed=False)


def _assembled(low_trace: MemoryTrace, middle_trace: MemoryTrace | None, high_trace: MemoryTrace) -> MemoryCosts:
    traced = [t for t in (low_trace, middle_trace, high_trace) if t is not None]
    if len({bool(t.selective_drop_bytes) for t in traced}) > 1:
        # Selective checkpointing frees bytes at some sizes only (it is left out of a trace where it frees
        # nothing): it is not offered at this precision, and the traces agree without it.
        low_trace, high_trace = _without_selective(low_trace), _without_selective(high_trace)
        middle_trace = _without_selective(middle_trace) if middle_trace is not None else None
    return MemoryCosts(
        low=_same_structure(low_trace, high_trace),
        high=high_trace,
        middle=_same_structure(middle_trace, high_trace) if middle_trace is not None else None,
    )


def _without_selective(trace: MemoryTrace) -> MemoryTrace:
    """``trace`` without its selective recomputations (selective checkpointing then is not a choice)."""
    return replace(trace, segments=[s for s in trace.segments if not s.selective], selective_drop_bytes=[])


def _same_structure(trace: MemoryTrace, high_trace: MemoryTrace) -> MemoryTrace:
    """``trace``, or when the step's structure depends on the batch size (rare), the larger trace scaled down."""
    if [(s.dropped, s.phase, s.recomputes, s.selective) for s in trace.segments] != [
        (s.dropped, s.phase, s.recomputes, s.selective) for s in high_trace.segments
    ] or bool(trace.selective_drop_bytes) != bool(high_trace.selective_drop_bytes):
        return scaled_trace(high_trace, trace.micro_batch_size)
    return trace


def scaled_trace(trace: MemoryTrace, micro_batch_size: int) -> MemoryTrace:
    """``trace`` scaled to a smaller micro-batch (its bytes in proportion, its structure as it is): a trace that
    stands for one the structure of the step at that size did not allow (``_same_structure``)."""
    ratio = micro_batch_size / trace.micro_batch_size
    return MemoryTrace(
        micro_batch_size=micro_batch_size,
        blocks=trace.blocks,
        drop_bytes=[int(b * ratio) for b in trace.drop_bytes],
        segments=trace.segments,
        prefix_shaped=trace.prefix_shaped,
        output_shape=trace.output_shape,
        selective_drop_bytes=[int(b * ratio) for b in trace.selective_drop_bytes],
        recomputed=trace.recomputed,
        scaled=True,
        chunk_deltas=None if trace.chunk_deltas is None else [int(b * ratio) for b in trace.chunk_deltas],
        loss_chunks=trace.loss_chunks,
    )


def _loglog(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear interpolation in log-log space; beyond the ends, the end piece's
    slope clamped to [0, 1] (time never falls with the batch, nor grows faster than it)."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    points = [(math.log(a), math.log(max(b, 1e-12))) for a, b in zip(xs, ys)]
    lx = math.log(x)
    if lx <= points[0][0]:
        (x0, y0), (x1, y1), anchor = points[0], points[1], points[0]
    elif lx >= points[-1][0]:
        (x0, y0), (x1, y1), anchor = points[-2], points[-1], points[-1]
    else:
        index = next(i for i in range(1, len(points)) if lx <= points[i][0])
        (x0, y0), (x1, y1) = points[index - 1], points[index]
        return math.exp(y0 + (y1 - y0) * (lx - x0) / (x1 - x0))
    slope = min(max((y1 - y0) / (x1 - x0), 0.0), 1.0)
    return math.exp(anchor[1] + slope * (lx - anchor[0]))


