"""The planner's cost model: peak bytes and step time of any configuration.

Memory comes from simulated traces per precision (``memory_model``):
linear in the micro-batch size, exact in the structure of where blocks free
and recompute their activations, with the memory levers' terms
(``lever_memory``) where a configuration asks for them. Time comes from real timings on the device
(forward, forward+backward and each block's forward at a few micro-batch
sizes, the optimizer step, and what checkpointing really costs per second of
recomputed forward, fully and selectively); with ``simulate`` it comes from
FLOPs instead and is an estimate. Selective checkpointing recomputes only the
ops its policy does not save: each block's share of its forward that those
take is estimated over fake tensors (``selective_shares``), and the device's
timing says what a second of that estimate really costs. Everything here is
plain data, so a study can store it and resume.
"""
from __future__ import annotations


import copy
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from autofit.apply import AppliedPlan, TrainingConfig, apply_config
from autofit.measure.blocks import profile_blocks
from autofit.measure.meters import release_device_memory, simulated_meter
from autofit.model_io import as_loss, call_model
from autofit._torch_private import TorchDispatchMode, op_flops, tree_leaves
from autofit.planning.lever_memory import LeverChoice, add_offloaded, lever_peak_bytes
from autofit.planning.lever_memory import trace_from_dict as lever_trace_from_dict
from autofit.planning.memory_model import MemoryTrace, Segment, peak_of, trace_memory
from autofit.planning.timing import MIN_ROUNDS, Samples, compare, interleaved_rounds, noise_of
from autofit.spec import ModelSpec
from autofit.training.step import to_device, train_step
from strategies import BatchSplitConfig, checkpoint_candidates, selective_saves

SLOW_PRECISION_RATIO = 3.0
"""A precision this many times slower than the fastest at the same micro-batch is timed at one size only."""
SHORTEST_MEASUREMENT_S = 0.02
"""A micro-step shorter than this is repeated within one measurement (the fastest repeat counts)."""
SELECTIVE_FACTOR_RANGE = (0.25, 20.0)
"""Bounds of the measured selective recompute factor. The share it prices is an estimate (FLOPs and bytes
moved) that the CPU's slower transcendental ops and the policy's per-op Python dispatch can exceed several
times (6.7 and 10 measured for a chain of tanh on 2 shared cores); the lower bound keeps one noisy round from
pricing it at nothing."""


@dataclass(kw_only=True, slots=True)
class MemoryCosts:
    """Traces of one precision; bytes at any micro-batch size are linear between the two around it."""

    low: MemoryTrace
    high: MemoryTrace
    middle: MemoryTrace | None = None
    """A trace at 2 samples when ``low`` is at 1 (see ``memory_costs``): sizes from 2 up lie on the line through it and ``high``."""

    def at(self, micro_batch_size: int, *, global_batch_size: int) -> tuple[list[Segment], list[float]]:
        """The segments that bound the peak at this size, and each block's dropped bytes.

        Args:
            micro_batch_size: samples per micro-batch.
            global_batch_size: samples per optimizer step; gradients of earlier
                micro-batches are alive when it is larger than the micro-batch.
        """
        accumulating = micro_batch_size < global_batch_size
        # The optimizer step follows the last micro-batch, which may be smaller (8 = 3 + 3 + 2):
        # what that micro-step leaves alive (its input copy, the output) is of its size.
        last = global_batch_size - (math.ceil(global_batch_size / micro_batch_size) - 1) * micro_batch_size
        segments = [
            Segment(
                peak_bytes=self._interpolate(
                    [t.segments[i].peak_bytes for t in self._traces()], last if segment.phase == "optimizer" else micro_batch_size,
                    global_batch_size=global_batch_size,
                ),
                dropped=segment.dropped, phase=segment.phase, recomputes=segment.recomputes, selective=segment.selective,
            )
            for i, segment in enumerate(self.low.segments)
            if accumulating or segment.phase != "later"
        ]
        drops = [  # negative where the checkpoint keeps an input that plain training frees: it adds bytes
            self._interpolate([t.drop_bytes[b] for t in self._traces()], micro_batch_size, at_least=None)
            for b in range(len(self.low.drop_bytes))
        ]
        return segments, drops

    def selective_drops(self, micro_batch_size: int) -> list[float] | None:
        """Bytes each block's selective checkpointing frees at this size (negative where it keeps more than
        plain training); None when it frees nothing anywhere (the traces hold no selective recomputation)."""
        if not all(t.selective_drop_bytes for t in self._traces()):
            return None
        return [
            self._interpolate([t.selective_drop_bytes[b] for t in self._traces()], micro_batch_size, at_least=None)
            for b in range(len(self.low.selective_drop_bytes))
        ]

    def _traces(self) -> list[MemoryTrace]:
        return [self.low] + ([self.middle] if self.middle is not None else []) + [self.high]

    def _interpolate(
        self, values: list[float], size: int, *, global_batch_size: int | None = None, at_least: float | None = 0.0
    ) -> float:
        """Bytes at ``size`` on the line through the two traces around it (``values`` holds each trace's).

        With ``global_batch_size``, the bytes of a whole step: the traces held a
        global batch of 2 micro-batches on the host; the real one holds G samples.
        ``at_least`` bounds the line from below (None: it may go negative).
        """
        traces = self._traces()
        upper = next((i for i in range(1, len(traces)) if size <= traces[i].micro_batch_size), len(traces) - 1)
        a, b = traces[upper - 1].micro_batch_size, traces[upper].micro_batch_size
        weight = (size - a) / max(b - a, 1)
        value = values[upper - 1] + (values[upper] - values[upper - 1]) * weight
        if at_least is not None:
            value = max(value, at_least)
        if global_batch_size is not None:
            value += (global_batch_size - 2 * size) * self.high.host_sample_bytes
        return value

    def peak_bytes(
        self, micro_batch_size: int, *, global_batch_size: int, checkpoint: set[int], selective=frozenset(),
        levers: LeverChoice | None = None,
    ) -> float:
        """The peak with ``checkpoint`` blocks checkpointed fully and ``selective`` ones selectively (indices), and
        the memory levers of ``levers`` (``lever_memory``; None: none).

        Raises:
            ValueError: levers asked of traces that hold no lever record (``has_levers``).
        """
        segments, drops = self.at(micro_batch_size, global_batch_size=global_batch_size)
        selective_drops = self.selective_drops(micro_batch_size) if selective else None
        if levers is None or levers == LeverChoice():
            return peak_of(segments, drops, checkpoint, selective_drops=selective_drops, selective=selective)
        peak = lever_peak_bytes(
            self, micro_batch_size, global_batch_size=global_batch_size, drops=drops, selective_drops=selective_drops,
            checkpoint=checkpoint, selective=selective, choice=levers,
        )
        if peak is None:
            raise ValueError("these memory traces hold no lever record: trace again to model the levers")
        return peak

    def has_levers(self) -> bool:
        """Whether the traces can model the memory levers (``lever_memory``; traces stored before could not)."""
        traces = self._traces()
        return all(t.levers is not None for t in traces) and len({repr(t.levers.structure()) for t in traces}) == 1


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
        """One micro-batch's forward (what activation offload's copies to the host overlap, ``lever_costs``)."""
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


@dataclass(kw_only=True, slots=True)
class PrecisionCosts:
    precision: str
    memory: MemoryCosts
    speed: SpeedCosts


@dataclass(kw_only=True)
class CostModel:
    """Predicted peak bytes and samples/s of any (precision, micro-batch, checkpoint set)."""

    blocks: list[str]
    global_batch_size: int
    device_type: str
    estimated: bool
    """True when times come from FLOPs (simulate), not from the device."""
    precisions: dict[str, PrecisionCosts] = field(default_factory=dict)
    output_shape: list[int] = field(default_factory=list)
    memory_scale: float = 1.0
    """Measured/simulated peak ratio on a real GPU (the allocator's rounding and cache); 1 on the CPU."""

    def micro_sizes(self, micro_batch_size: int) -> list[int]:
        return BatchSplitConfig(global_batch_size=self.global_batch_size, micro_batch_size=micro_batch_size).sizes()

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
        for size in self.micro_sizes(micro_batch_size):
            for index, seconds in enumerate(per_micro_step(size)):
                totals[index] += seconds
        return totals

    def step_seconds(self, precision: str, micro_batch_size: int, checkpoint: set[int], selective=frozenset()) -> float:
        speed = self.precisions[precision].speed
        seconds = speed.optimizer_seconds
        for size in self.micro_sizes(micro_batch_size):
            seconds += speed.micro_step_seconds(size)
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
                    low=_trace_from_dict(memory["low"]),
                    high=_trace_from_dict(memory["high"]),
                    middle=_trace_from_dict(middle) if middle else None,
                ),
                speed=SpeedCosts(**costs["speed"]),
            )
        rest = {k: v for k, v in data.items() if k != "precisions"}
        return cls(precisions=precisions, **rest)


def _trace_from_dict(data: dict) -> MemoryTrace:
    fields_ = dict(data)
    fields_["segments"] = [Segment(**s) for s in data["segments"]]
    fields_["levers"] = lever_trace_from_dict(data.get("levers"))
    return MemoryTrace(**fields_)


def memory_costs(
    spec: ModelSpec, *, precision: str, low: int, high: int, device_type: str, low_trace: MemoryTrace | None = None,
    offload: bool = False,
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
        offload: also trace each size with every block offloaded (``lever_memory.add_offloaded``), so that the
            model predicts activation offload (a GPU lever: the planner asks for it for a GPU only).
    """
    def with_offload(trace: MemoryTrace) -> MemoryTrace:
        return add_offloaded(trace, spec, precision=precision, device_type=device_type) if offload else trace

    def trace(size: int) -> MemoryTrace:
        return with_offload(trace_memory(spec, micro_batch_size=size, precision=precision, device_type=device_type))

    low_trace = trace(low) if low_trace is None else with_offload(low_trace)
    if high == low:
        return MemoryCosts(low=low_trace, high=low_trace)
    high_trace = trace(high)
    middle_trace = trace(2) if low == 1 and high > 2 else None
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
        return _scaled(high_trace, trace.micro_batch_size)
    return trace


def _scaled(trace: MemoryTrace, micro_batch_size: int) -> MemoryTrace:
    ratio = micro_batch_size / trace.micro_batch_size
    return MemoryTrace(
        micro_batch_size=micro_batch_size,
        blocks=trace.blocks,
        drop_bytes=[int(b * ratio) for b in trace.drop_bytes],
        segments=trace.segments,
        prefix_shaped=trace.prefix_shaped,
        output_shape=trace.output_shape,
        selective_drop_bytes=[int(b * ratio) for b in trace.selective_drop_bytes],
    )


def time_precisions(
    spec: ModelSpec,
    *,
    precisions: list[str],
    sizes: list[int],
    device: str,
    time_limit_s: float = 20.0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, SpeedCosts]:
    """Time forward, backward, each block and the optimizer step on the device.

    One model serves every precision (autocast is a context, not a change of
    the model). Sizes are timed smallest first, after one warm-up each
    (kernels and allocator are set up per shape); at each size the precisions
    still timed take turns in interleaved rounds (``timing``), at least
    ``MIN_ROUNDS`` of them, and the fastest round of each counts. A precision
    more than SLOW_PRECISION_RATIO times slower than the fastest stops there,
    but only once the noise of both cannot explain the ratio (rounds continue
    while it could), and follows the fastest one's curve scaled: it costs
    seconds to learn that fp16 on a CPU is slow, not minutes, and one
    disturbed step cannot rule a precision out. A precision whose remaining
    sizes would take more than ``time_limit_s`` stops too, its larger sizes
    extrapolated. The verification probes time whatever is chosen for real.

    Args:
        clock: seconds now (tests pass a noisy one).

    Returns:
        Precision -> its speeds; ``SpeedCosts.noise`` is the largest spread of its timings.
    """
    device_ = torch.device(device)
    torch.manual_seed(0)
    model = spec.build_model().to(device_)
    model.train()
    sizes = sorted(set(sizes))
    # The memory model's blocks: those the forward calls (one fake forward finds them), in its order.
    blocks = checkpoint_candidates(model, example_inputs=spec.example_batch(sizes[0])[0])
    modules = dict(model.named_modules())
    optimizer = spec.build_optimizer(model.parameters())
    block_times: dict[str, float] = {}
    starts: dict[str, float] = {}

    def sync() -> None:
        if device_.type == "cuda":
            torch.cuda.synchronize(device_)

    def pre_hook(name):
        def hook(module, args):
            sync()
            starts[name] = clock()
        return hook

    def post_hook(name):
        def hook(module, args, output):
            sync()
            block_times[name] = block_times.get(name, 0.0) + clock() - starts[name]
        return hook

    handles = [modules[n].register_forward_pre_hook(pre_hook(n)) for n in blocks]
    handles += [modules[n].register_forward_hook(post_hook(n)) for n in blocks]

    def one_step(applied: AppliedPlan, inputs, targets) -> tuple[float, float, list[float]]:
        """One micro-batch's forward and backward: (forward s, forward + backward s, each block's forward s)."""
        block_times.clear()
        sync()
        start = clock()
        micro_inputs, micro_targets = to_device(inputs, device_), to_device(targets, device_)
        with applied.forward_context():
            loss = as_loss(spec.loss_fn).weighted(call_model(applied.model, micro_inputs), micro_targets, weight=1.0)
        sync()
        forward_done = clock()
        applied.backward(loss)
        sync()
        done = clock()
        return forward_done - start, done - start, [block_times.get(n, 0.0) for n in blocks]

    # Only the precision's hooks act here: one_step times a single micro-batch.
    applied = {
        name: apply_config(model, _one_micro_batch(sizes[-1], precision=name), device=device_, init_scale=1.0) for name in precisions
    }
    samples: dict[tuple[str, int], Samples] = {}
    fastest: dict[tuple[str, int], tuple] = {}
    """(precision, size) -> the parts of its fastest round."""
    timed: dict[str, list[int]] = {name: [] for name in precisions}
    notes: dict[str, str] = {}
    slow: dict[str, str] = {}
    """Precision -> the precision it was found far slower than."""
    spent = dict.fromkeys(precisions, 0.0)
    batches: dict[int, tuple] = {}

    repeats: dict[tuple[str, int], int] = {}
    """(precision, size) -> micro-steps per measurement: a step much shorter than a scheduler's slice is taken
    several times, so that one preemption by other work cannot make it look many times slower."""

    def measure(name: str, size: int) -> Callable[[], float]:
        def run() -> float:
            started = clock()
            best = None
            for _ in range(repeats[name, size]):
                parts = one_step(applied[name], *batches[size])
                optimizer.zero_grad(set_to_none=True)
                best = parts if best is None or parts[1] < best[1] else best
            spent[name] += clock() - started
            if (name, size) not in fastest or best[1] < fastest[name, size][1]:
                fastest[name, size] = best
            return best[1]
        return run

    for size in sizes:
        running = []
        for name in precisions:
            if name in notes:
                continue
            if timed[name]:
                # The next size costs about its share of the last one's time, per round and warm-up.
                last = timed[name][-1]
                projected = (MIN_ROUNDS + 1) * fastest[name, last][1] * size / last
                if spent[name] + projected > time_limit_s:
                    notes[name] = f"timed up to micro-batch {last} (the next size would pass {time_limit_s:.0f} s); larger sizes extrapolated"
                    continue
            running.append(name)
        if not running:
            break
        batches[size] = spec.example_batch(size)
        for name in running:
            started = clock()
            one_step(applied[name], *batches[size])  # warm-up: kernels and allocator are set up per shape
            optimizer.zero_grad(set_to_none=True)
            warm_up = clock() - started
            spent[name] += warm_up
            repeats[name, size] = min(max(math.ceil(SHORTEST_MEASUREMENT_S / max(warm_up, 1e-6)), 1), 16)
        keys = [(name, size) for name in running]

        def verdicts(current: dict) -> dict[str, str]:
            reference = min(running, key=lambda n: current[n, size].best)
            return {
                name: compare(current[reference, size], current[name, size], factor=SLOW_PRECISION_RATIO)
                for name in running if name != reference
            }

        interleaved_rounds(
            {key: measure(*key) for key in keys}, samples=samples, settled=lambda current: "unsure" not in verdicts(current).values()
        )
        for name in running:
            timed[name].append(size)
        reference = min(running, key=lambda n: samples[n, size].best)
        for name, verdict in verdicts(samples).items():
            # Only a ratio that the noise cannot explain stops a precision ("unsure" after the last round does not).
            if verdict == "yes":
                ratio = samples[name, size].best / samples[reference, size].best
                notes[name] = f"{ratio:.1f}x slower than {reference} at micro-batch {size}; timed up to there"
                slow[name] = reference
    results: dict[str, SpeedCosts] = {}
    for name in precisions:
        sizes_ = timed[name]
        results[name] = SpeedCosts(
            sizes=list(sizes_),
            step_seconds=[fastest[name, s][1] for s in sizes_],
            forward_seconds=[fastest[name, s][0] for s in sizes_],
            block_seconds=[fastest[name, s][2] for s in sizes_],
            optimizer_seconds=_optimizer_seconds(model, optimizer, applied[name], one_step, spec, sizes_[0], clock=clock),
            note=notes.get(name, ""),
            noise=noise_of([samples[name, s] for s in sizes_]),
        )
    for handle in handles:
        handle.remove()
    if blocks:
        flops_per_s, bytes_per_s = roofline_rates(device_.type, torch.cuda.get_device_name(device_) if device_.type == "cuda" else "")
        inputs = to_device(spec.example_batch(sizes[0])[0], device_)
        for name in precisions:
            results[name].selective_shares = selective_shares(
                applied[name], inputs, blocks=blocks, flops_per_s=flops_per_s[name], bytes_per_s=bytes_per_s
            )
        model.zero_grad(set_to_none=True)
    _measure_recompute(
        model, spec, results, blocks=blocks, sizes=sizes, device=device_, one_step=one_step, clock=clock
    )
    for name, reference in slow.items():
        # Untimed sizes follow the reference's shape, scaled by how this precision compared at its largest timed size.
        costs = results[name]
        ratio = costs.step_seconds[-1] / results[reference].micro_step_seconds(costs.sizes[-1])
        scaled = _scaled_speed(results[reference], ratio, note=costs.note)
        scaled.optimizer_seconds, scaled.noise, scaled.selective_shares = costs.optimizer_seconds, costs.noise, costs.selective_shares
        results[name] = scaled
    del model, optimizer, applied
    release_device_memory(device)
    return results


def _optimizer_seconds(model, optimizer, precision: AppliedPlan, one_step, spec: ModelSpec, size: int, *, clock) -> float:
    """The optimizer step's time (its first call creates state: not timed)."""
    inputs, targets = spec.example_batch(size)
    best = math.inf
    device = next(model.parameters()).device
    for attempt in range(3):
        one_step(precision, inputs, targets)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock()
        precision.optimizer_step(optimizer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if attempt:
            best = min(best, clock() - start)
        optimizer.zero_grad(set_to_none=True)
    return best


def _measure_recompute(model, spec, results, *, blocks, sizes, device, one_step, clock) -> None:
    """Time steps with every block checkpointed, fully and selectively, interleaved: the real price of a second
    of recompute (of the blocks' forward; of its selective share, ``SpeedCosts.selective_shares``).

    The selective steps run on a copy of the model (a block is patched in one mode only); where the device
    has no room for the copy, selective recompute is priced like full recompute per estimated second.
    """
    timed = [name for name, costs in results.items() if not costs.note]
    if not blocks or not timed:
        return
    size = sizes[len(sizes) // 2]
    inputs, targets = spec.example_batch(size)
    modes = {"full": model}
    if any(share > 0 for name in timed for share in results[name].selective_shares):
        try:
            modes["selective"] = copy.deepcopy(model)
        except torch.OutOfMemoryError:
            release_device_memory(device)
    applied = {
        (name, mode): apply_config(
            copied, _one_micro_batch(size, precision=name, checkpoint=blocks if mode == "full" else None,
                                     selective_checkpoint=blocks if mode == "selective" else None),
            device=device, init_scale=1.0,
        )
        for name in timed for mode, copied in modes.items()
    }

    def step(key) -> float:
        seconds = one_step(applied[key], inputs, targets)[1]
        applied[key].model.zero_grad(set_to_none=True)
        return seconds

    for key in applied:
        step(key)  # warm-up
    samples = interleaved_rounds({key: (lambda key=key: step(key)) for key in applied}, settled=lambda _: True)
    for name in timed:
        costs = results[name]
        extra = {mode: samples[name, mode].best - costs.micro_step_seconds(size) for mode in modes}
        plain_forward = sum(costs.recompute_seconds(size))
        if plain_forward > 0:
            costs.recompute_factor = min(max(extra["full"] / plain_forward, 0.5), 3.0)
        estimated = sum(costs.selective_recompute_seconds(size) or [])
        if estimated > 0:
            if "selective" in extra:
                costs.selective_factor = min(max(extra["selective"] / estimated, SELECTIVE_FACTOR_RANGE[0]), SELECTIVE_FACTOR_RANGE[1])
            else:
                costs.selective_factor = costs.recompute_factor
    for name, costs in results.items():
        if name not in timed:  # not timed at every size: keep a timed precision's factors
            costs.recompute_factor = results[timed[0]].recompute_factor
            costs.selective_factor = results[timed[0]].selective_factor
    del applied, modes


def _one_micro_batch(
    size: int, *, precision: str, checkpoint: list[str] | None = None, selective_checkpoint: list[str] | None = None
) -> TrainingConfig:
    """A configuration whose global batch is one micro-batch: the timings run its hooks by hand."""
    return TrainingConfig(
        global_batch_size=size, micro_batch_size=size, precision=precision, checkpoint=checkpoint or [],
        selective_checkpoint=selective_checkpoint or [],
    )


def _scaled_speed(reference: SpeedCosts, ratio: float, *, note: str) -> SpeedCosts:
    return SpeedCosts(
        sizes=list(reference.sizes),
        step_seconds=[s * ratio for s in reference.step_seconds],
        forward_seconds=[s * ratio for s in reference.forward_seconds],
        block_seconds=[[s * ratio for s in row] for row in reference.block_seconds],
        optimizer_seconds=reference.optimizer_seconds,
        recompute_factor=reference.recompute_factor,
        note=note,
        selective_shares=list(reference.selective_shares),
        selective_factor=reference.selective_factor,
    )


def flop_speed_costs(
    spec: ModelSpec, *, precisions: list[str], sizes: list[int], device_type: str, device_name: str
) -> dict[str, SpeedCosts]:
    """Times estimated from FLOPs (``--simulate``): nothing runs on the device.

    A micro-step costs 3x its forward FLOPs (forward + backward) plus a fixed
    launch cost. On a GPU each operator family runs at its precision's
    throughput class (``GpuPeaks``: convolutions in fp32 on TF32 tensor cores,
    matmuls in fp32 on CUDA cores, both in bf16/fp16 on half-precision tensor
    cores) times the share of it training reaches, which falls for a
    micro-step too small to fill the GPU (``gpu_forward_seconds``). The
    optimizer step reads and writes its state at an assumed memory bandwidth.
    """
    size = max(sizes)
    profiles = profile_blocks(spec, micro_batch_size=size, simulate=True)
    cpu = None if device_type == "cuda" else _cpu_throughput()
    flops = _forward_flops(spec, size)
    total_flops = max(sum(flops.values()), 1)
    param_bytes = _parameter_bytes(spec)
    results = {}
    for name in precisions:
        step, forward, per_block = [], [], []
        if device_type == "cuda":
            gpu, known = gpu_peaks(device_name)
            launch_s, bytes_per_s = GPU_LAUNCH_SECONDS, gpu.bandwidth * 0.5
            note = "estimated from FLOPs" + ("" if known else f" for an {_UNKNOWN_GPU_NAME}-class GPU ({device_name!r} is not in the table)")
        else:
            cpu_flops_per_s, launch_s, bytes_per_s = cpu
            note = "estimated from FLOPs"
        for s in sizes:
            scaled = {family: n * s / size for family, n in flops.items()}
            if device_type == "cuda":
                seconds = gpu_forward_seconds(scaled, gpu=gpu, precision=name)
            else:
                seconds = sum(scaled.values()) / cpu_flops_per_s
            forward.append(seconds + launch_s)
            step.append(3 * (seconds + launch_s))
            per_block.append([p.forward_flops / total_flops * seconds for p in profiles])  # each block's share of the forward
        flops_per_s, share_bytes_per_s = roofline_rates(device_type, device_name, cpu=cpu)
        results[name] = SpeedCosts(
            sizes=list(sizes),
            step_seconds=step,
            forward_seconds=forward,
            block_seconds=per_block,
            optimizer_seconds=4 * param_bytes / bytes_per_s,
            note=note,
            # The policy's saved ops (their FLOPs) are not recomputed: the rest, mostly bytes moved, is.
            selective_shares=_simulated_selective_shares(
                spec, micro_batch_size=min(sizes), precision=name, flops_per_s=flops_per_s[name], bytes_per_s=share_bytes_per_s,
            ),
        )
    return results


def roofline_rates(device_type: str, device_name: str, *, cpu: tuple[float, float, float] | None = None) -> tuple[dict, float]:
    """What ``selective_shares`` costs ops at: per precision, FLOP/s by operator family ("conv", "matmul"); and bytes/s.

    On a GPU, the table's throughput class of each family in each precision times the share training reaches
    (as ``gpu_forward_seconds``), and half the memory bandwidth; on the CPU, a measured matmul's rate
    (``_cpu_throughput``, or ``cpu`` when already measured).
    """
    from strategies import PRECISIONS

    if device_type == "cuda":
        gpu, _ = gpu_peaks(device_name)
        efficiency = {"conv": CONV_EFFICIENCY, "matmul": MATMUL_EFFICIENCY}
        rates = {
            precision: {family: getattr(gpu, kind) * efficiency[family][kind] for family, kind in _gpu_classes(precision).items()}
            for precision in PRECISIONS
        }
        return rates, gpu.bandwidth * 0.5
    flops_per_s, _, bytes_per_s = cpu or _cpu_throughput()
    return {precision: {"conv": flops_per_s, "matmul": flops_per_s} for precision in PRECISIONS}, bytes_per_s


class _OpSeconds(TorchDispatchMode):
    """Per block, the estimated seconds of the forward ops selective checkpointing keeps and of those it recomputes.

    An op costs its FLOPs at its family's rate plus the bytes it reads and writes at the bandwidth; a view moves
    nothing. Ops outside every block are not counted.
    """

    def __init__(self, *, flops_per_s: dict[str, float], bytes_per_s: float) -> None:
        super().__init__()
        self.flops_per_s, self.bytes_per_s = flops_per_s, bytes_per_s
        self.block: int | None = None
        self.kept: dict[int, float] = {}
        self.recomputed: dict[int, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.block is not None:
            into = self.kept if selective_saves(func) else self.recomputed
            into[self.block] = into.get(self.block, 0.0) + self._seconds(func, args, kwargs, out)
        return out

    def _seconds(self, func, args, kwargs, out) -> float:
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs or all(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            return 0.0  # a view, or a query (a fake tensor's device)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        moved = sum(t.numel() * t.element_size() for t in inputs + outputs)
        family = "conv" if "convolution" in str(func) else "matmul"
        return op_flops(func, args, kwargs, out) / self.flops_per_s[family] + moved / self.bytes_per_s


def selective_shares(
    applied: AppliedPlan, inputs, *, blocks: list[str], flops_per_s: dict[str, float], bytes_per_s: float
) -> list[float]:
    """Per block: the share of its forward's estimated time that selective checkpointing recomputes.

    One forward of ``inputs`` (real or fake tensors) under the configuration's
    precision; each op costed by ``_OpSeconds``. The policy's saved ops
    (``strategies.checkpointing.selective_saves``: matmuls, convolutions,
    attention) are not recomputed; the rest (norms, activations, adds, casts)
    are. The device's timing calibrates the estimate (``SpeedCosts.selective_factor``).
    """
    meter = _OpSeconds(flops_per_s=flops_per_s, bytes_per_s=bytes_per_s)
    modules = dict(applied.model.named_modules())

    def enter(index):
        def hook(module, args):
            meter.block = index
        return hook

    def leave(module, args, output):
        meter.block = None

    handles = [modules[name].register_forward_pre_hook(enter(index)) for index, name in enumerate(blocks)]
    handles += [modules[name].register_forward_hook(leave) for name in blocks]
    try:
        with meter, applied.forward_context():
            call_model(applied.model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    shares = []
    for index in range(len(blocks)):
        kept, recomputed = meter.kept.get(index, 0.0), meter.recomputed.get(index, 0.0)
        shares.append(recomputed / (kept + recomputed) if kept + recomputed > 0 else 0.0)
    return shares


def _simulated_selective_shares(spec: ModelSpec, *, micro_batch_size: int, precision: str, flops_per_s, bytes_per_s) -> list[float]:
    """``selective_shares`` over fake tensors (nothing runs), for the memory model's blocks."""
    meter = simulated_meter(spec, for_device="cpu")
    torch.manual_seed(0)
    with meter.environment():
        model = meter.build_model(spec.build_model)
        model.train()
        inputs, _ = spec.example_batch(micro_batch_size)
        blocks = checkpoint_candidates(model, example_inputs=inputs)
        applied = apply_config(model, _one_micro_batch(micro_batch_size, precision=precision), device=meter.device, use_scaler=False)
        return selective_shares(applied, inputs, blocks=blocks, flops_per_s=flops_per_s, bytes_per_s=bytes_per_s)


def _forward_flops(spec: ModelSpec, size: int) -> dict[str, int]:
    """Forward FLOPs of a micro-batch of ``size``, by operator family: "conv" and "matmul" (everything else counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    meter = simulated_meter(spec, for_device="cpu")
    with meter.environment():
        model = meter.build_model(spec.build_model)
        inputs, _ = spec.example_batch(size)
        counter = FlopCounterMode(display=False)
        with counter:
            call_model(model, inputs)
    families = {"conv": 0, "matmul": 0}
    for op, count in counter.get_flop_counts().get("Global", {}).items():
        families["conv" if "convolution" in str(op) else "matmul"] += int(count)
    if not any(families.values()):
        families["matmul"] = 1
    return families


def _parameter_bytes(spec: ModelSpec) -> int:
    with torch.device("meta"):
        model = spec.build_model()
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)  # frozen ones are not stepped


@dataclass(frozen=True, slots=True)
class GpuPeaks:
    """A GPU's dense peak rates (vendor data sheets, without sparsity), for estimates only."""

    fp32: float
    """FLOP/s on CUDA cores: fp32 matmuls (PyTorch leaves TF32 off for them by default)."""
    tf32: float
    """FLOP/s on TF32 tensor cores: fp32 convolutions (cuDNN uses TF32 by default)."""
    half: float
    """FLOP/s on bf16/fp16 tensor cores (autocast)."""
    bandwidth: float
    """Memory bytes/s."""


GPU_PEAKS = {
    "H200": GpuPeaks(fp32=67e12, tf32=495e12, half=989e12, bandwidth=4.8e12),
    "H100": GpuPeaks(fp32=67e12, tf32=495e12, half=989e12, bandwidth=3.35e12),
    "A100": GpuPeaks(fp32=19.5e12, tf32=156e12, half=312e12, bandwidth=2.0e12),
    "L40S": GpuPeaks(fp32=91.6e12, tf32=183e12, half=362e12, bandwidth=0.86e12),
    "A10": GpuPeaks(fp32=31.2e12, tf32=62.5e12, half=125e12, bandwidth=0.6e12),
    "L4": GpuPeaks(fp32=30.3e12, tf32=60e12, half=121e12, bandwidth=0.3e12),
    "RTX 4090": GpuPeaks(fp32=82.6e12, tf32=82.6e12, half=165e12, bandwidth=1.0e12),
    "RTX 3090": GpuPeaks(fp32=35.6e12, tf32=35.6e12, half=71e12, bandwidth=0.94e12),
    "V100": GpuPeaks(fp32=15.7e12, tf32=15.7e12, half=125e12, bandwidth=0.9e12),
    "T4": GpuPeaks(fp32=8.1e12, tf32=8.1e12, half=65e12, bandwidth=0.32e12),
}
_UNKNOWN_GPU_NAME = "A100"
"""The table row assumed for a GPU that is not named in it (e.g. --simulate with no GPU here)."""

# The share of a throughput class's peak that training reaches on a micro-step large enough to
# fill the GPU, by operator family. Convolutions: fitted to bench/RESULTS.md's H200 rows
# (torchvision ResNet-18 and ResNet-50 at 224x224, batch 128: 39-50 TFLOP/s, fp16 only 1.27x
# fp32); matmuls: what large transformer layers commonly reach (not yet measured here).
CONV_EFFICIENCY = {"tf32": 0.085, "half": 0.055, "fp32": 0.5}
MATMUL_EFFICIENCY = {"tf32": 0.45, "half": 0.45, "fp32": 0.6}
GPU_FILL_SECONDS = 4.2e-4
"""A micro-step whose FLOPs take this long at the class's peak runs at half the efficiency above;
small micro-steps leave a large GPU idle (fitted on the same rows: ResNet-18 reaches 0.87x of ResNet-50's rate)."""
GPU_LAUNCH_SECONDS = 5e-4
"""Launch overhead per forward (x3 per micro-step with the backward)."""


def gpu_peaks(device_name: str) -> tuple[GpuPeaks, bool]:
    """The table row for a GPU name ("NVIDIA H200", ...), and whether it was found (else an A100's)."""
    name = device_name.upper()
    for key, peaks in GPU_PEAKS.items():
        if key in name:
            return peaks, True
    return GPU_PEAKS[_UNKNOWN_GPU_NAME], False


def gpu_forward_seconds(flops: dict[str, float], *, gpu: GpuPeaks, precision: str) -> float:
    """Estimated seconds of a forward with these FLOPs by family ("conv", "matmul") on ``gpu`` in ``precision``.

    Each family runs at its throughput class for the precision: bf16/fp16 on
    half-precision tensor cores; fp32 convolutions on TF32 tensor cores and
    fp32 matmuls on CUDA cores (TF32 when ``torch.backends.cuda.matmul.allow_tf32``).
    """
    classes = _gpu_classes(precision)
    efficiency = {"conv": CONV_EFFICIENCY, "matmul": MATMUL_EFFICIENCY}
    step_at_peak = 3 * sum(n / getattr(gpu, classes[family]) for family, n in flops.items())  # forward + backward
    fill = step_at_peak / (step_at_peak + GPU_FILL_SECONDS)  # a small micro-step cannot keep a large GPU busy
    return sum(
        n / (getattr(gpu, classes[family]) * efficiency[family][classes[family]] * fill) for family, n in flops.items() if n
    )


def _gpu_classes(precision: str) -> dict[str, str]:
    """The throughput class ("fp32", "tf32", "half") each operator family runs at in ``precision``."""
    if precision == "fp32":
        conv_tf32 = torch.backends.cudnn.allow_tf32
        return {"conv": "tf32" if conv_tf32 else "fp32", "matmul": "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"}
    return {"conv": "half", "matmul": "half"}


def _cpu_throughput() -> tuple[float, float, float]:
    """(FLOP/s, seconds of launch overhead per forward, bytes/s) assumed for a CPU estimate."""
    # Measure a matmul's fp32 throughput (a tenth of a second, not the model).
    a = torch.randn(512, 512)
    start = time.perf_counter()
    for _ in range(8):
        a @ a
    fp32 = 8 * 2 * 512**3 / (time.perf_counter() - start)
    return fp32 * 0.5, 1e-3, 5e9


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


class StepTimer:
    """Plain training steps of one configuration, kept ready to be timed again (no meter running).

    The memory meter's bookkeeping costs time on every operator; the speed a
    plan promises is that of training, so it is timed here without it. The
    model, optimizer and global batch are built once: the first step is a
    warm-up and is not timed, and every later call times one more step, so
    that candidates can take turns in interleaved rounds without a rebuild.
    """

    def __init__(self, spec: ModelSpec, config: TrainingConfig, *, device: str, seed: int = 0, clock=time.perf_counter) -> None:
        self.spec, self.device, self.clock = spec, device, clock
        self.global_batch_size = config.global_batch_size
        torch.manual_seed(seed)
        model = spec.build_model()
        model.train()
        self.applied = apply_config(model, config, device=device, init_scale=1.0)
        self.optimizer = self.applied.build_optimizer(spec.build_optimizer)
        self.inputs, self.targets = spec.example_batch(config.global_batch_size)
        self._warm_up_config = _warm_up(config)
        self._warm = False

    def step_seconds(self) -> float:
        """Seconds of one more training step of the global batch (after a warm-up step the first time)."""
        if not self._warm:
            self._warm_up()
            self._warm = True
        return self._step(self.applied, self.inputs, self.targets)

    def _warm_up(self) -> None:
        """One step of a micro-batch of each size the step uses: it sets up kernels and creates the optimizer's
        state as a whole step would, without paying for every micro-step of a long accumulation."""
        config = self._warm_up_config
        if config.global_batch_size == self.global_batch_size:
            self._step(self.applied, self.inputs, self.targets)
            return
        applied = apply_config(self.applied.model, config, device=self.device, init_scale=1.0)
        inputs, targets = self.spec.example_batch(config.global_batch_size)
        self._step(applied, inputs, targets)

    def _step(self, applied: AppliedPlan, inputs, targets) -> float:
        start = self.clock()
        result = train_step(applied, inputs, targets, loss_fn=self.spec.loss_fn, optimizer=self.optimizer)
        result.loss.item()  # waits for the device
        return self.clock() - start

    def close(self) -> None:
        """Free the model, optimizer and batch (the device's cache too)."""
        del self.applied, self.optimizer, self.inputs, self.targets
        release_device_memory(self.device)


def _warm_up(config: TrainingConfig) -> TrainingConfig:
    """Two micro-batches of ``config``: a full one and its last (which may be smaller).

    A configuration with levers warms up with a whole step: offload and the
    step in backward hook the model once, and must not be applied twice.
    """
    sizes = BatchSplitConfig(global_batch_size=config.global_batch_size, micro_batch_size=config.micro_batch_size).sizes()
    levers = config.selective_checkpoint or config.offload or config.optimizer_in_backward or config.optimizer_state != "device"
    if len(sizes) <= 2 or levers:
        return config
    warm = config.micro_batch_size + sizes[-1]  # two micro-batches: the accumulation's path is set up too
    return TrainingConfig(
        global_batch_size=warm, micro_batch_size=config.micro_batch_size, precision=config.precision,
        checkpoint=list(config.checkpoint), sharding=config.sharding, world_size=config.world_size,
    )


def time_configuration(
    spec: ModelSpec,
    *,
    precision: str,
    micro_batch_size: int,
    global_batch_size: int,
    checkpoint: list[str],
    device: str,
    steps: int = 3,
    seed: int = 0,
) -> float:
    """Samples/s of plain training steps of one (precision, micro-batch, checkpoint) configuration: ``time_training``."""
    config = TrainingConfig(
        global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, precision=precision, checkpoint=list(checkpoint),
    )
    return time_training(spec, config, device=device, steps=steps, seed=seed)


def time_training(spec: ModelSpec, config: TrainingConfig, *, device: str, steps: int = 3, seed: int = 0) -> float:
    """Samples/s of plain training steps of any configuration, levers included (``StepTimer``):
    the fastest of ``steps`` - 1 after a warm-up (other work on the machine only ever slows a step down)."""
    timer = StepTimer(spec, config, device=device, seed=seed)
    try:
        return config.global_batch_size / min(timer.step_seconds() for _ in range(max(steps - 1, 1)))
    finally:
        timer.close()
