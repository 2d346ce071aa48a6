"""The speed half of the cost model measured on the device: step, forward, block, optimizer and recompute times.

``time_precisions`` times each precision at a few micro-batch sizes, interleaved
so that a shared machine's noise cannot rule out one precision on a disturbed
round (``timing``); ``StepTimer`` and ``time_training`` time whole training
steps of one configuration (the verification's and the levers' timings).
"""
from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

import torch

from autofit.apply import AppliedPlan, apply_config
from autofit.config import TrainingConfig
from autofit.device import steady_host_allocations
from autofit.measure.boundaries import block_boundaries
from autofit.measure.meters import release_device_memory, state_bytes
from autofit.measure.optimizer_state import create_optimizer_state
from autofit.model_io import as_loss, call_model
from autofit.planning.costs import SpeedCosts
from autofit.planning.policy import POLICY, timing_policy
from autofit.planning.speed.estimated import one_micro_batch, roofline_rates, selective_shares
from autofit.planning.speed.timing import Samples, compare, interleaved_rounds, noise_of
from autofit.progress import QUIET, Progress
from autofit.spec import ModelSpec
from autofit.step import to_device, train_step
from strategies import BatchSplitConfig, checkpoint_candidates


def time_precisions(
    spec: ModelSpec,
    *,
    precisions: list[str],
    sizes: list[int],
    device: str,
    time_limit_s: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    progress: Progress = QUIET,
    most_noise: float | None = None,
) -> dict[str, SpeedCosts]:
    """Time forward, backward, each block and the optimizer step on the device.

    One model serves every precision (autocast is a context, not a change of
    the model). Sizes are timed smallest first, after one warm-up each
    (kernels and allocator are set up per shape); at each size the precisions
    still timed take turns in interleaved rounds (``timing``), at least
    the timing policy's ``min_rounds`` of them, and the fastest round of each counts. A precision
    more than ``POLICY.slow_precision_ratio`` times slower than the fastest stops there,
    but only once the noise of both cannot explain the ratio (rounds continue
    while it could), and follows the fastest one's curve scaled: it costs
    seconds to learn that fp16 on a CPU is slow, not minutes, and one
    disturbed step cannot rule a precision out. A precision whose warm-up alone
    is that many times slower than the quickest warm-up counts it as its first
    round and waits for the others' rounds: one round more, and two steps far
    slower stop it there. A precision whose remaining
    sizes would take more than ``time_limit_s`` stops too, its larger sizes
    extrapolated. The verification probes time whatever is chosen for real.

    Args:
        time_limit_s: seconds a precision's timing may take (default: the timing policy's).
        clock: seconds now (tests pass a noisy one).
        progress: hears which size is timed, k of n, and which round.
        most_noise: stop once a size's rounds (``min_rounds`` of them) repeat worse than this (their ``noise_of``),
            raising ``NoisyTiming``; None: time on whatever the noise.

    Returns:
        Precision -> its speeds; ``SpeedCosts.noise`` is the largest spread of its timings.

    Raises:
        NoisyTiming: a size's rounds repeated worse than ``most_noise``.
    """
    time_limit_s = timing_policy().precision_timing_limit_s if time_limit_s is None else time_limit_s
    device_ = torch.device(device)
    torch.manual_seed(0)
    model = spec.build_model().to(device_)
    model.train()
    sizes = sorted(set(sizes))
    # The memory model's blocks: those the forward calls (one fake forward finds them), in its order.
    blocks = checkpoint_candidates(model, example_inputs=spec.example_batch(sizes[0])[0])
    timer = _PrecisionTimer(
        spec, model, precisions, blocks=blocks, largest=sizes[-1], device=device_, time_limit_s=time_limit_s, clock=clock,
    )
    for number, size in enumerate(sizes, start=1):
        if not timer.time_size(size, progress=progress, number=number, of=len(sizes), most_noise=most_noise):
            break
    results = {name: timer.speed_costs(name) for name in precisions}
    timer.steps.stop_block_timing()
    if blocks:
        _add_selective_shares(results, timer.applied(), spec, blocks=blocks, size=sizes[0], device=device_)
        model.zero_grad(set_to_none=True)
    with progress.doing("timing steps with every block checkpointed beside plain ones"):
        measure_recompute(model, spec, results, blocks=blocks, sizes=sizes, device=device_, one_step=timer.steps.one_step, clock=clock)
    for name, run in timer.runs.items():
        if run.slower_than:
            results[name] = _follow_reference(results[name], results[run.slower_than])
    held = state_bytes(model)
    model = timer = None  # freed before the release
    release_device_memory(device, held_bytes=held)
    return results


class NoisyTiming(Exception):
    """A size of ``time_precisions`` repeated worse than its ``most_noise``: the timing stops, its samples dropped."""

    def __init__(self, *, noise: float, size: int) -> None:
        super().__init__(f"timings at micro-batch {size} repeated within {noise:.0%}")
        self.noise, self.size = noise, size


@dataclass(frozen=True)
class StepParts:
    """One micro-batch's forward and backward, timed."""

    forward_s: float
    step_s: float
    """Forward and backward."""
    block_s: list[float]
    """Each block's forward, in the blocks' order (empty once block timing stopped: zeros)."""


class _StepClock:
    """Times one micro-batch's forward and backward, and each block's forward inside it (hooks at its boundaries)."""

    def __init__(self, model: torch.nn.Module, blocks: list[str], *, loss_fn, device: torch.device, clock: Callable[[], float]) -> None:
        self.blocks, self.loss_fn, self.device, self.clock = blocks, loss_fn, device, clock
        self._block_s: dict[str, float] = {}
        self._starts: dict[str, float] = {}
        self._hooks = ExitStack()  # each block's forward timed until the timings are done
        self._hooks.enter_context(block_boundaries(model, blocks, enter=self._enter, leave=self._leave))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _enter(self, name, args) -> None:
        self.sync()
        self._starts[name] = self.clock()

    def _leave(self, name, args, kwargs, output) -> None:
        self.sync()
        self._block_s[name] = self._block_s.get(name, 0.0) + self.clock() - self._starts[name]

    def one_step(self, applied: AppliedPlan, inputs, targets) -> StepParts:
        """One micro-batch's forward and backward."""
        self._block_s.clear()
        self.sync()
        start = self.clock()
        micro_inputs, micro_targets = to_device(inputs, self.device), to_device(targets, self.device)
        with applied.forward_context():
            loss = as_loss(self.loss_fn).weighted(call_model(applied.model, micro_inputs), micro_targets, weight=1.0)
        self.sync()
        forward_done = self.clock()
        applied.backward(loss)
        self.sync()
        done = self.clock()
        return StepParts(forward_done - start, done - start, [self._block_s.get(n, 0.0) for n in self.blocks])

    def stop_block_timing(self) -> None:
        self._hooks.close()


@dataclass
class _PrecisionRun:
    """One precision's timing as it goes."""

    applied: AppliedPlan
    sizes: list[int] = field(default_factory=list)
    """Micro-batch sizes timed, smallest first."""
    spent_s: float = 0.0
    fastest: dict[int, StepParts] = field(default_factory=dict)
    """Size -> the parts of its fastest round."""
    repeats: dict[int, int] = field(default_factory=dict)
    """Size -> micro-steps per measurement: a step much shorter than a scheduler's slice is taken several times,
    so that one preemption by other work cannot make it look many times slower."""
    note: str = ""
    """Why it stopped before the largest size ("" while it goes on)."""
    slower_than: str = ""
    """The precision it was found far slower than, whose curve it follows, scaled."""


class _PrecisionTimer:
    """The precisions' timings size by size: which still run, their warm-ups, their interleaved rounds, their verdicts."""

    def __init__(self, spec: ModelSpec, model, precisions: list[str], *, blocks: list[str], largest: int, device: torch.device,
                 time_limit_s: float, clock: Callable[[], float]) -> None:
        self.spec, self.model, self.time_limit_s, self.clock = spec, model, time_limit_s, clock
        self.optimizer = spec.build_optimizer(model.parameters())
        self.steps = _StepClock(model, blocks, loss_fn=spec.loss_fn, device=device, clock=clock)
        # Only the precision's hooks act here: one_step times a single micro-batch.
        self.runs = {
            name: _PrecisionRun(apply_config(model, one_micro_batch(largest, precision=name), device=device, init_scale=1.0))
            for name in precisions
        }
        self.samples: dict[tuple[str, int], Samples] = {}
        self.batches: dict[int, tuple] = {}
        self._optimizer_s: dict[bool, float] = {}
        """Whether a loss scaler steps -> seconds of the optimizer step (``optimizer_seconds``)."""

    def applied(self) -> dict[str, AppliedPlan]:
        return {name: run.applied for name, run in self.runs.items()}

    def still_running(self, size: int) -> list[str]:
        """The precisions timed at ``size``: not stopped, and whose next size fits in their time limit."""
        running = []
        for name, run in self.runs.items():
            if run.note:
                continue
            if run.sizes:
                # The next size costs about its share of the last one's time, per round and warm-up.
                last = run.sizes[-1]
                projected = (timing_policy().min_rounds + 1) * run.fastest[last].step_s * size / last
                if run.spent_s + projected > self.time_limit_s:
                    run.note = f"timed up to micro-batch {last} (the next size would pass {self.time_limit_s:.0f} s); larger sizes extrapolated"
                    continue
            running.append(name)
        return running

    def time_size(self, size: int, *, progress: Progress, number: int, of: int, most_noise: float | None = None) -> bool:
        """Time the precisions still running at ``size``; False when none is.

        Raises:
            NoisyTiming: the rounds repeat worse than ``most_noise`` (None: never), said after ``min_rounds``.
        """
        running = self.still_running(size)
        if not running:
            return False
        self.batches[size] = self.spec.example_batch(size)

        def noise(current: dict, names: list[str]) -> float:
            return noise_of([current[name, size] for name in names])

        def settled(names: list[str]) -> Callable[[dict], bool]:
            def decided(current: dict) -> bool:
                if most_noise is not None and noise(current, names) > most_noise:
                    return True  # no more rounds of a timing that will be dropped
                return "unsure" not in self.verdicts(current, names, size).values()
            return decided

        with progress.doing(f"timing {', '.join(running)} at micro-batch {size}", step=number, of=of):
            warm = {}
            for name in running:
                with progress.doing(f"a warm-up step of {name}"):
                    warm[name] = self.warm_up(name, size)
            # A precision whose warm-up step alone took more than ``slow_precision_ratio`` times the quickest warm-up
            # (which set the shape's kernels up too) counts that step as its first round and is timed once, after the
            # others' rounds: where those two steps decide it far slower, it is timed no more (fp16 autocast's steps
            # on a CPU, ~40x fp32's, were a third of a ResNet-18 plan's speed step). Else the rounds go on for all.
            quickest = min(parts.step_s for parts in warm.values())
            far = [
                name for name in running
                if self.runs[name].repeats[size] == 1 and warm[name].step_s > POLICY.slow_precision_ratio * quickest
            ]
            near = [name for name in running if name not in far]
            interleaved_rounds(
                {(name, size): self.measure(name, size) for name in near}, samples=self.samples, settled=settled(near), progress=progress,
            )
            for name in far:
                self.samples[name, size] = Samples(seconds=[warm[name].step_s])
                self.runs[name].fastest[size] = warm[name]
                with progress.doing(f"one round of {name}, far slower in its warm-up"):
                    self.samples[name, size].seconds.append(self.measure(name, size)())
            if far:
                interleaved_rounds(
                    {(name, size): self.measure(name, size) for name in running}, samples=self.samples, settled=settled(running),
                    progress=progress,
                )
        if most_noise is not None and noise(self.samples, running) > most_noise:
            raise NoisyTiming(noise=noise(self.samples, running), size=size)
        for name in running:
            self.runs[name].sizes.append(size)
        self.stop_the_slow(running, size)
        return True

    def warm_up(self, name: str, size: int) -> StepParts:
        """One step that sets kernels and allocator up for the shape; its time sets the repeats per measurement.

        Returns:
            Its parts (a far slower precision's first round: ``time_size``).
        """
        run = self.runs[name]
        started = self.clock()
        parts = self.steps.one_step(run.applied, *self.batches[size])
        self.optimizer.zero_grad(set_to_none=True)
        warm_up = self.clock() - started
        run.spent_s += warm_up
        run.repeats[size] = min(max(math.ceil(POLICY.shortest_measurement_s / max(warm_up, 1e-6)), 1), POLICY.max_repeats_per_measurement)
        return parts

    def measure(self, name: str, size: int) -> Callable[[], float]:
        """One measurement of ``name`` at ``size`` for the rounds: the fastest of its repeats, in seconds."""
        run = self.runs[name]

        def once() -> float:
            started = self.clock()
            best = None
            for _ in range(run.repeats[size]):
                parts = self.steps.one_step(run.applied, *self.batches[size])
                self.optimizer.zero_grad(set_to_none=True)
                best = parts if best is None or parts.step_s < best.step_s else best
            run.spent_s += self.clock() - started
            if size not in run.fastest or best.step_s < run.fastest[size].step_s:
                run.fastest[size] = best
            return best.step_s
        return once

    @staticmethod
    def verdicts(samples: dict, running: list[str], size: int) -> dict[str, str]:
        """Precision -> whether it is far slower than the fastest at ``size`` ("yes", "no", "unsure")."""
        reference = min(running, key=lambda n: samples[n, size].best)
        return {
            name: compare(samples[reference, size], samples[name, size], factor=POLICY.slow_precision_ratio)
            for name in running if name != reference
        }

    def stop_the_slow(self, running: list[str], size: int) -> None:
        reference = min(running, key=lambda n: self.samples[n, size].best)
        for name, verdict in self.verdicts(self.samples, running, size).items():
            # Only a ratio that the noise cannot explain stops a precision ("unsure" after the last round does not).
            if verdict == "yes":
                ratio = self.samples[name, size].best / self.samples[reference, size].best
                self.runs[name].note = f"{ratio:.1f}x slower than {reference} at micro-batch {size}; timed up to there"
                self.runs[name].slower_than = reference

    def quickest(self) -> AppliedPlan:
        """The precision quickest at the smallest size timed. Every precision steps the same weights from gradients of
        their dtype, whichever autocast made them: its micro-steps make them for all optimizer timings (fp16
        autocast's on a CPU take many times as long, #47)."""
        return min(self.runs.values(), key=lambda run: run.fastest[run.sizes[0]].step_s).applied

    def optimizer_seconds(self, name: str) -> float:
        """``name``'s optimizer step, timed once per way of stepping: every precision here steps the same fp32 weights
        from fp32 gradients (autocast changes the compute, not them), so only a loss scaler, which unscales the
        gradients first (fp16), makes another step to time; fp32's and bf16's are one."""
        run = self.runs[name]
        scaled = run.applied.scaler.is_enabled()
        if scaled not in self._optimizer_s:
            self._optimizer_s[scaled] = _optimizer_seconds(
                self.model, self.optimizer, run.applied, self.steps.one_step, self.spec, run.sizes[0], clock=self.clock,
                gradients=self.quickest(),
            )
        return self._optimizer_s[scaled]

    def speed_costs(self, name: str) -> SpeedCosts:
        """``name``'s speeds at the sizes it was timed at, and its optimizer step's."""
        run = self.runs[name]
        return SpeedCosts(
            sizes=list(run.sizes),
            step_seconds=[run.fastest[s].step_s for s in run.sizes],
            forward_seconds=[run.fastest[s].forward_s for s in run.sizes],
            block_seconds=[run.fastest[s].block_s for s in run.sizes],
            optimizer_seconds=self.optimizer_seconds(name),
            note=run.note,
            noise=noise_of([self.samples[name, s] for s in run.sizes]),
        )


def _add_selective_shares(results: dict[str, SpeedCosts], applied: dict[str, AppliedPlan], spec: ModelSpec, *,
                          blocks: list[str], size: int, device: torch.device) -> None:
    """Each precision's share of each block's forward that selective recompute runs again, estimated from its operators."""
    flops_per_s, bytes_per_s = roofline_rates(device.type, torch.cuda.get_device_name(device) if device.type == "cuda" else "")
    inputs = to_device(spec.example_batch(size)[0], device)
    for name, costs in results.items():
        costs.selective_shares = selective_shares(applied[name], inputs, blocks=blocks, flops_per_s=flops_per_s[name], bytes_per_s=bytes_per_s)


def _follow_reference(costs: SpeedCosts, reference: SpeedCosts) -> SpeedCosts:
    """A precision stopped as far slower: its untimed sizes follow the reference's shape, scaled by how it
    compared at its largest timed size; what it measured itself (optimizer, noise, selective shares) stays."""
    ratio = costs.step_seconds[-1] / reference.micro_step_seconds(costs.sizes[-1])
    scaled = _scaled_speed(reference, ratio, note=costs.note)
    scaled.optimizer_seconds, scaled.noise, scaled.selective_shares = costs.optimizer_seconds, costs.noise, costs.selective_shares
    return scaled


def _optimizer_seconds(
    model, optimizer, precision: AppliedPlan, one_step, spec: ModelSpec, size: int, *, clock, gradients: AppliedPlan | None = None,
) -> float:
    """The optimizer step's time under ``precision`` (its first call creates state: not timed), after a micro-step
    of ``gradients`` (default: ``precision``) makes the gradients it steps with."""
    inputs, targets = spec.example_batch(size)
    best = math.inf
    device = next(model.parameters()).device
    for attempt in range(timing_policy().optimizer_step_timings):
        one_step(gradients or precision, inputs, targets)
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


def measure_recompute(model, spec, results, *, blocks, sizes, device, one_step, clock) -> None:
    """Time steps with every block checkpointed, fully and selectively, interleaved with plain steps: the real
    price of a second of recompute (of the blocks' forward; of its selective share, ``SpeedCosts.selective_shares``).

    The selective and the plain steps run on copies of the model (a block is patched in one mode only); where
    the device has no room for the selective copy, selective recompute is priced like full recompute per
    estimated second, and without the plain copy the plain step is the speed model's (timed in other rounds:
    on a loaded machine a difference of steps timed apart can shrink or grow, and selective was once priced
    below full where it ran slower).
    """
    timed = [name for name, costs in results.items() if not costs.note]
    if not blocks or not timed:
        return
    size = sizes[len(sizes) // 2]
    inputs, targets = spec.example_batch(size)
    modes = {"full": model}
    wanted = ["none"] + (["selective"] if any(share > 0 for name in timed for share in results[name].selective_shares) else [])
    for mode in wanted:
        try:
            modes[mode] = copy.deepcopy(model)
        except torch.OutOfMemoryError:
            release_device_memory(device)
    applied = {
        (name, mode): apply_config(
            copied, one_micro_batch(size, precision=name, checkpoint=blocks if mode == "full" else None,
                                     selective_checkpoint=blocks if mode == "selective" else None),
            device=device, init_scale=1.0,
        )
        for name in timed for mode, copied in modes.items()
    }

    def step(key) -> float:
        seconds = one_step(applied[key], inputs, targets).step_s
        applied[key].model.zero_grad(set_to_none=True)
        return seconds

    # No warm-up: this size was just timed in this process with each precision timed here, so its kernels are set
    # up, and a checkpointed step runs the same forwards again; a ResNet-18's first rounds were within 6% of the
    # fastest of the next two, and the fastest round counts (its six warm-up steps were 0.55 s of the plan).
    samples = interleaved_rounds({key: (lambda key=key: step(key)) for key in applied}, settled=lambda _: True)
    for name in timed:
        costs = results[name]
        plain = samples[name, "none"].best if "none" in modes else costs.micro_step_seconds(size)
        extra = {mode: samples[name, mode].best - plain for mode in modes if mode != "none"}
        plain_forward = sum(costs.recompute_seconds(size))
        if plain_forward > 0:
            costs.recompute_factor = min(max(extra["full"] / plain_forward, POLICY.recompute_factor_range[0]), POLICY.recompute_factor_range[1])
        estimated = sum(costs.selective_recompute_seconds(size) or [])
        if estimated > 0:
            if "selective" in extra:
                costs.selective_factor = min(max(extra["selective"] / estimated, POLICY.selective_factor_range[0]), POLICY.selective_factor_range[1])
            else:
                costs.selective_factor = costs.recompute_factor
    for name, costs in results.items():
        if name not in timed:  # not timed at every size: keep a timed precision's factors
            costs.recompute_factor = results[timed[0]].recompute_factor
            costs.selective_factor = results[timed[0]].selective_factor
    applied = modes = None  # freed now (rebound: inner functions name them)


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


class StepTimer:
    """Plain training steps of one configuration, kept ready to be timed again (no meter running).

    The memory meter's bookkeeping costs time on every operator; the speed a
    plan promises is that of training, so it is timed here without it. The
    model, optimizer and global batch are built once: the first step is a
    warm-up and is not timed, and every later call times one more step, so
    that candidates can take turns in interleaved rounds without a rebuild.

    ``set_up``: this process has just stepped the same configuration on the CPU (its memory probe, every micro-batch
    of the same size), so oneDNN's kernels for its shapes are made: the optimizer's state is created without a
    step, and the first call is timed (a ResNet-18's first step then repeats the next ones within 2-4%, and its
    warm-up was 0.2 s of each candidate's turn).
    """

    def __init__(
        self, spec: ModelSpec, config: TrainingConfig, *, device: str, seed: int = 0, clock=time.perf_counter, set_up: bool = False,
    ) -> None:
        steady_host_allocations()  # as training allocates
        self.spec, self.device, self.clock = spec, device, clock
        self.global_batch_size = config.global_batch_size
        torch.manual_seed(seed)
        model = spec.build_model()
        model.train()
        self.applied = apply_config(model, config, device=device, init_scale=1.0)
        self.optimizer = self.applied.build_optimizer(spec.build_optimizer)
        self.inputs, self.targets = spec.example_batch(config.global_batch_size)
        self._warm_up_config = _warm_up(config)
        self._warm = set_up
        if set_up:
            create_optimizer_state(self.applied.model, self.optimizer)

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
        held = state_bytes(self.applied.model)
        del self.applied, self.optimizer, self.inputs, self.targets
        release_device_memory(self.device, held_bytes=held)


def _warm_up(config: TrainingConfig) -> TrainingConfig:
    """Two micro-batches of ``config``: a full one and its last (which may be smaller).

    A configuration with levers warms up with a whole step: offload and the
    step in backward hook the model once, and must not be applied twice.
    """
    split = BatchSplitConfig(global_batch_size=config.global_batch_size, micro_batch_size=config.micro_batch_size)
    levers = config.selective_checkpoint or config.offload or config.optimizer_in_backward or config.optimizer_state != "device"
    if split.grad_accum_steps <= 2 or levers:
        return config
    warm = config.micro_batch_size + split.last_size  # two micro-batches: the accumulation's path is set up too
    return replace(config, global_batch_size=warm)


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

