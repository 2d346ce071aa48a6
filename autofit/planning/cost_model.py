"""The planner's cost model: peak bytes and step time of any configuration.

Memory comes from two simulated traces per precision (``memory_model``):
linear in the micro-batch size, exact in the structure of where blocks free
and recompute their activations. Time comes from real timings on the device
(forward, forward+backward and each block's forward at a few micro-batch
sizes, the optimizer step, and what checkpointing really costs per second of
recomputed forward); with ``simulate`` it comes from FLOPs instead and is an
estimate. Everything here is plain data, so a study can store it and resume.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from autofit.apply import AppliedPlan, TrainingConfig, apply_config
from autofit.measure.blocks import profile_blocks
from autofit.measure.meters import SimulatedMeter, release_device_memory
from autofit.planning.memory_model import MemoryTrace, Segment, trace_memory
from autofit.planning.timing import MIN_ROUNDS, Samples, compare, interleaved_rounds, noise_of
from autofit.spec import ModelSpec
from autofit.training.step import to_device, train_step
from strategies import BatchSplitConfig, checkpoint_candidates

SLOW_PRECISION_RATIO = 3.0
"""A precision this many times slower than the fastest at the same micro-batch is timed at one size only."""
SHORTEST_MEASUREMENT_S = 0.02
"""A micro-step shorter than this is repeated within one measurement (the fastest repeat counts)."""


@dataclass(kw_only=True, slots=True)
class MemoryCosts:
    """Two traces of one precision; bytes at any micro-batch size are linear between them."""

    low: MemoryTrace
    high: MemoryTrace

    def at(self, micro_batch_size: int, *, global_batch_size: int) -> tuple[list[Segment], list[float]]:
        """The segments that bound the peak at this size, and each block's dropped bytes.

        Args:
            micro_batch_size: samples per micro-batch.
            global_batch_size: samples per optimizer step; gradients of earlier
                micro-batches are alive when it is larger than the micro-batch.
        """
        low, high = self.low, self.high
        accumulating = micro_batch_size < global_batch_size
        span = max(high.micro_batch_size - low.micro_batch_size, 1)
        weight = (micro_batch_size - low.micro_batch_size) / span

        def interpolate(a: float, b: float) -> float:
            return max(a + (b - a) * weight, 0.0)

        # The traces held a global batch of 2 micro-batches on the host; the real one holds G samples.
        host = (global_batch_size - 2 * micro_batch_size) * high.host_sample_bytes
        segments = [
            Segment(peak_bytes=interpolate(a.peak_bytes, b.peak_bytes) + host, dropped=a.dropped, phase=a.phase, recomputes=a.recomputes)
            for a, b in zip(low.segments, high.segments)
            if accumulating or a.phase != "later"
        ]
        drops = [interpolate(a, b) for a, b in zip(low.drop_bytes, high.drop_bytes)]
        return segments, drops

    def peak_bytes(self, micro_batch_size: int, *, global_batch_size: int, checkpoint: set[int]) -> float:
        segments, drops = self.at(micro_batch_size, global_batch_size=global_batch_size)
        return max(
            (
                s.peak_bytes - sum(drops[b] for b in s.dropped if b in checkpoint)
                for s in segments
                if s.recomputes is None or s.recomputes in checkpoint
            ),
            default=0.0,
        )


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

    def micro_step_seconds(self, micro_batch_size: int) -> float:
        return _loglog(self.sizes, self.step_seconds, micro_batch_size)

    def recompute_seconds(self, micro_batch_size: int) -> list[float]:
        columns = list(zip(*self.block_seconds)) if self.block_seconds else []
        return [self.recompute_factor * _loglog(self.sizes, list(col), micro_batch_size) for col in columns]


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

    def peak_bytes(self, precision: str, micro_batch_size: int, checkpoint: set[int]) -> float:
        memory = self.precisions[precision].memory
        raw = memory.peak_bytes(micro_batch_size, global_batch_size=self.global_batch_size, checkpoint=checkpoint)
        return raw * self.memory_scale

    def recompute_seconds(self, precision: str, micro_batch_size: int) -> list[float]:
        """Per block: seconds one optimizer step spends recomputing it if checkpointed."""
        speed = self.precisions[precision].speed
        totals = [0.0] * len(self.blocks)
        for size in self.micro_sizes(micro_batch_size):
            for index, seconds in enumerate(speed.recompute_seconds(size)):
                totals[index] += seconds
        return totals

    def step_seconds(self, precision: str, micro_batch_size: int, checkpoint: set[int]) -> float:
        speed = self.precisions[precision].speed
        seconds = speed.optimizer_seconds
        for size in self.micro_sizes(micro_batch_size):
            seconds += speed.micro_step_seconds(size)
        recompute = self.recompute_seconds(precision, micro_batch_size)
        return seconds + sum(recompute[b] for b in checkpoint)

    def samples_per_s(self, precision: str, micro_batch_size: int, checkpoint: set[int]) -> float:
        return self.global_batch_size / self.step_seconds(precision, micro_batch_size, checkpoint)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        precisions = {}
        for name, costs in data["precisions"].items():
            memory = costs["memory"]
            precisions[name] = PrecisionCosts(
                precision=costs["precision"],
                memory=MemoryCosts(low=_trace_from_dict(memory["low"]), high=_trace_from_dict(memory["high"])),
                speed=SpeedCosts(**costs["speed"]),
            )
        rest = {k: v for k, v in data.items() if k != "precisions"}
        return cls(precisions=precisions, **rest)


def _trace_from_dict(data: dict) -> MemoryTrace:
    fields_ = dict(data)
    fields_["segments"] = [Segment(**s) for s in data["segments"]]
    return MemoryTrace(**fields_)


def memory_costs(
    spec: ModelSpec, *, precision: str, low: int, high: int, device_type: str, low_trace: MemoryTrace | None = None
) -> MemoryCosts:
    """Trace one precision at two micro-batch sizes (simulated: no arithmetic).

    Args:
        low_trace: an existing trace at ``low`` for this precision, to reuse.
    """
    if low_trace is None:
        low_trace = trace_memory(spec, micro_batch_size=low, precision=precision, device_type=device_type)
    if high == low:
        return MemoryCosts(low=low_trace, high=low_trace)
    high_trace = trace_memory(spec, micro_batch_size=high, precision=precision, device_type=device_type)
    if [(s.dropped, s.phase, s.recomputes) for s in low_trace.segments] != [
        (s.dropped, s.phase, s.recomputes) for s in high_trace.segments
    ]:
        # The step's structure depends on the batch size (rare): trust the larger trace, scaled.
        return MemoryCosts(low=_scaled(high_trace, low), high=high_trace)
    return MemoryCosts(low=low_trace, high=high_trace)


def _scaled(trace: MemoryTrace, micro_batch_size: int) -> MemoryTrace:
    ratio = micro_batch_size / trace.micro_batch_size
    return MemoryTrace(
        micro_batch_size=micro_batch_size,
        blocks=trace.blocks,
        drop_bytes=[int(b * ratio) for b in trace.drop_bytes],
        segments=trace.segments,
        prefix_shaped=trace.prefix_shaped,
        output_shape=trace.output_shape,
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
    blocks = checkpoint_candidates(model)
    modules = dict(model.named_modules())
    optimizer = spec.build_optimizer(model.parameters())
    sizes = sorted(set(sizes))
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
            loss = spec.loss_fn(applied.model(micro_inputs), micro_targets).float()
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
    _measure_recompute(
        model, spec, results, blocks=blocks, sizes=sizes, device=device_, one_step=one_step, optimizer=optimizer, clock=clock
    )
    for name, reference in slow.items():
        # Untimed sizes follow the reference's shape, scaled by how this precision compared at its largest timed size.
        costs = results[name]
        ratio = costs.step_seconds[-1] / results[reference].micro_step_seconds(costs.sizes[-1])
        scaled = _scaled_speed(results[reference], ratio, note=costs.note)
        scaled.optimizer_seconds, scaled.noise = costs.optimizer_seconds, costs.noise
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


def _measure_recompute(model, spec, results, *, blocks, sizes, device, one_step, optimizer, clock) -> None:
    """Time steps with every block checkpointed, interleaved: the real price of a second of recompute."""
    timed = [name for name, costs in results.items() if not costs.note]
    if not blocks or not timed:
        return
    size = sizes[len(sizes) // 2]
    inputs, targets = spec.example_batch(size)
    applied = {
        name: apply_config(model, _one_micro_batch(size, precision=name, checkpoint=blocks), device=device, init_scale=1.0)
        for name in timed
    }

    def step(name: str) -> float:
        seconds = one_step(applied[name], inputs, targets)[1]
        optimizer.zero_grad(set_to_none=True)
        return seconds

    for name in timed:
        step(name)  # warm-up
    samples = interleaved_rounds({name: (lambda name=name: step(name)) for name in timed}, settled=lambda _: True)
    for name in timed:
        costs = results[name]
        plain_forward = sum(costs.recompute_seconds(size))
        if plain_forward > 0:
            extra = samples[name].best - costs.micro_step_seconds(size)
            costs.recompute_factor = min(max(extra / plain_forward, 0.5), 3.0)
    for name, costs in results.items():
        if name not in timed:  # not timed at every size: keep a timed precision's factor
            costs.recompute_factor = results[timed[0]].recompute_factor


def _one_micro_batch(size: int, *, precision: str, checkpoint: list[str] | None = None) -> TrainingConfig:
    """A configuration whose global batch is one micro-batch: the timings run its hooks by hand."""
    return TrainingConfig(global_batch_size=size, micro_batch_size=size, precision=precision, checkpoint=checkpoint or [])


def _scaled_speed(reference: SpeedCosts, ratio: float, *, note: str) -> SpeedCosts:
    return SpeedCosts(
        sizes=list(reference.sizes),
        step_seconds=[s * ratio for s in reference.step_seconds],
        forward_seconds=[s * ratio for s in reference.forward_seconds],
        block_seconds=[[s * ratio for s in row] for row in reference.block_seconds],
        optimizer_seconds=reference.optimizer_seconds,
        recompute_factor=reference.recompute_factor,
        note=note,
    )


def flop_speed_costs(
    spec: ModelSpec, *, precisions: list[str], sizes: list[int], device_type: str, device_name: str
) -> dict[str, SpeedCosts]:
    """Times estimated from FLOPs (``--simulate``): nothing runs on the device.

    A micro-step costs 3x its forward FLOPs (forward + backward) at the
    device's assumed throughput for the precision, plus a fixed cost per
    operator launch; the optimizer step reads and writes its state at an
    assumed memory bandwidth.
    """

    size = max(sizes)
    profiles = profile_blocks(spec, micro_batch_size=size, simulate=True)
    forward_flops = _forward_flops(spec, size)
    param_bytes = _parameter_bytes(spec)
    results = {}
    for name in precisions:
        flops_per_s, launch_s, bytes_per_s = _assumed_throughput(device_type, device_name, name)
        per_sample = forward_flops / size
        step, forward, per_block = [], [], []
        for s in sizes:
            fwd = per_sample * s / flops_per_s + launch_s
            forward.append(fwd)
            step.append(3 * fwd)
            per_block.append([p.forward_flops / size * s / flops_per_s for p in profiles])
        results[name] = SpeedCosts(
            sizes=list(sizes),
            step_seconds=step,
            forward_seconds=forward,
            block_seconds=per_block,
            optimizer_seconds=4 * param_bytes / bytes_per_s,
            note="estimated from FLOPs",
        )
    return results


def _forward_flops(spec: ModelSpec, size: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode


    meter = SimulatedMeter(for_device="cpu")
    with meter.environment():
        model = meter.build_model(spec.build_model)
        inputs, _ = spec.example_batch(size)
        counter = FlopCounterMode(display=False)
        with counter:
            model(inputs)
    return max(int(counter.get_total_flops()), 1)


def _parameter_bytes(spec: ModelSpec) -> int:
    with torch.device("meta"):
        model = spec.build_model()
    return sum(p.numel() * p.element_size() for p in model.parameters())


# Assumed dense throughputs (FLOP/s) and memory bandwidths for estimates only.
_GPU_TABLE = {
    "H200": (60e12, 700e12, 4.8e12),
    "H100": (55e12, 700e12, 3.3e12),
    "A100": (17e12, 250e12, 1.5e12),
    "L4": (25e12, 100e12, 0.3e12),
    "V100": (13e12, 100e12, 0.9e12),
}


def _assumed_throughput(device_type: str, device_name: str, precision: str) -> tuple[float, float, float]:
    """(FLOP/s, seconds per micro-step launch overhead, bytes/s) assumed for an estimate."""
    if device_type == "cuda":
        fp32, half, bandwidth = next((v for k, v in _GPU_TABLE.items() if k in device_name.upper()), (15e12, 100e12, 1e12))
        return (fp32 if precision == "fp32" else half) * 0.4, 2e-3, bandwidth * 0.5
    # A CPU: measure a matmul's fp32 throughput (a tenth of a second, not the model).
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
        self.optimizer = spec.build_optimizer(self.applied.model.parameters())
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
    """Two micro-batches of ``config``: a full one and its last (which may be smaller)."""
    sizes = BatchSplitConfig(global_batch_size=config.global_batch_size, micro_batch_size=config.micro_batch_size).sizes()
    if len(sizes) <= 2:
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
    """Samples/s of plain training steps of one configuration (``StepTimer``): the fastest of ``steps`` - 1 after a warm-up."""
    config = TrainingConfig(
        global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, precision=precision, checkpoint=list(checkpoint),
    )
    timer = StepTimer(spec, config, device=device, seed=seed)
    try:
        return global_batch_size / min(timer.step_seconds() for _ in range(max(steps - 1, 1)))
    finally:
        timer.close()
