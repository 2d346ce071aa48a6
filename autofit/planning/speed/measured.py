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
from dataclasses import replace

import torch

from autofit.apply import AppliedPlan, apply_config
from autofit.config import TrainingConfig
from autofit.device import steady_host_allocations
from autofit.measure.boundaries import block_boundaries
from autofit.measure.meters import release_device_memory
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
    disturbed step cannot rule a precision out. A precision whose remaining
    sizes would take more than ``time_limit_s`` stops too, its larger sizes
    extrapolated. The verification probes time whatever is chosen for real.

    Args:
        time_limit_s: seconds a precision's timing may take (default: the timing policy's).
        clock: seconds now (tests pass a noisy one).
        progress: hears which size is timed, k of n, and which round.

    Returns:
        Precision -> its speeds; ``SpeedCosts.noise`` is the largest spread of its timings.
    """
    time_limit_s = timing_policy().precision_timing_limit_s if time_limit_s is None else time_limit_s
    device_ = torch.device(device)
    torch.manual_seed(0)
    model = spec.build_model().to(device_)
    model.train()
    sizes = sorted(set(sizes))
    # The memory model's blocks: those the forward calls (one fake forward finds them), in its order.
    blocks = checkpoint_candidates(model, example_inputs=spec.example_batch(sizes[0])[0])
    optimizer = spec.build_optimizer(model.parameters())
    block_times: dict[str, float] = {}
    starts: dict[str, float] = {}

    def sync() -> None:
        if device_.type == "cuda":
            torch.cuda.synchronize(device_)

    def enter(name, args):
        sync()
        starts[name] = clock()

    def leave(name, args, kwargs, output):
        sync()
        block_times[name] = block_times.get(name, 0.0) + clock() - starts[name]

    timing_blocks = ExitStack()  # each block's forward timed until the timings are done
    timing_blocks.enter_context(block_boundaries(model, blocks, enter=enter, leave=leave))

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
        name: apply_config(model, one_micro_batch(sizes[-1], precision=name), device=device_, init_scale=1.0) for name in precisions
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

    for number, size in enumerate(sizes, start=1):
        running = []
        for name in precisions:
            if name in notes:
                continue
            if timed[name]:
                # The next size costs about its share of the last one's time, per round and warm-up.
                last = timed[name][-1]
                projected = (timing_policy().min_rounds + 1) * fastest[name, last][1] * size / last
                if spent[name] + projected > time_limit_s:
                    notes[name] = f"timed up to micro-batch {last} (the next size would pass {time_limit_s:.0f} s); larger sizes extrapolated"
                    continue
            running.append(name)
        if not running:
            break
        batches[size] = spec.example_batch(size)
        keys = [(name, size) for name in running]

        def verdicts(current: dict) -> dict[str, str]:
            reference = min(running, key=lambda n: current[n, size].best)
            return {
                name: compare(current[reference, size], current[name, size], factor=POLICY.slow_precision_ratio)
                for name in running if name != reference
            }

        with progress.doing(f"timing {', '.join(running)} at micro-batch {size}", step=number, of=len(sizes)):
            for name in running:
                with progress.doing(f"a warm-up step of {name}"):
                    started = clock()
                    one_step(applied[name], *batches[size])  # warm-up: kernels and allocator are set up per shape
                    optimizer.zero_grad(set_to_none=True)
                    warm_up = clock() - started
                spent[name] += warm_up
                repeats[name, size] = min(max(math.ceil(POLICY.shortest_measurement_s / max(warm_up, 1e-6)), 1), POLICY.max_repeats_per_measurement)
            interleaved_rounds(
                {key: measure(*key) for key in keys}, samples=samples, settled=lambda current: "unsure" not in verdicts(current).values(),
                progress=progress,
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
    # Every precision steps the same weights from gradients of their dtype, whichever autocast made them: the
    # quickest precision's micro-steps make them for all (fp16 autocast's on a CPU take many times as long, #47).
    quickest = applied[min(precisions, key=lambda n: fastest[n, sizes[0]][1])]
    for name in precisions:
        sizes_ = timed[name]
        results[name] = SpeedCosts(
            sizes=list(sizes_),
            step_seconds=[fastest[name, s][1] for s in sizes_],
            forward_seconds=[fastest[name, s][0] for s in sizes_],
            block_seconds=[fastest[name, s][2] for s in sizes_],
            optimizer_seconds=_optimizer_seconds(
                model, optimizer, applied[name], one_step, spec, sizes_[0], clock=clock, gradients=quickest,
            ),
            note=notes.get(name, ""),
            noise=noise_of([samples[name, s] for s in sizes_]),
        )
    timing_blocks.close()
    if blocks:
        flops_per_s, bytes_per_s = roofline_rates(device_.type, torch.cuda.get_device_name(device_) if device_.type == "cuda" else "")
        inputs = to_device(spec.example_batch(sizes[0])[0], device_)
        for name in precisions:
            results[name].selective_shares = selective_shares(
                applied[name], inputs, blocks=blocks, flops_per_s=flops_per_s[name], bytes_per_s=bytes_per_s
            )
        model.zero_grad(set_to_none=True)
    with progress.doing("timing steps with every block checkpointed beside plain ones"):
        _measure_recompute(model, spec, results, blocks=blocks, sizes=sizes, device=device_, one_step=one_step, clock=clock)
    for name, reference in slow.items():
        # Untimed sizes follow the reference's shape, scaled by how this precision compared at its largest timed size.
        costs = results[name]
        ratio = costs.step_seconds[-1] / results[reference].micro_step_seconds(costs.sizes[-1])
        scaled = _scaled_speed(results[reference], ratio, note=costs.note)
        scaled.optimizer_seconds, scaled.noise, scaled.selective_shares = costs.optimizer_seconds, costs.noise, costs.selective_shares
        results[name] = scaled
    model = optimizer = applied = None  # freed before the release (rebound: inner functions name them)
    release_device_memory(device)
    return results


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


def _measure_recompute(model, spec, results, *, blocks, sizes, device, one_step, clock) -> None:
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
        seconds = one_step(applied[key], inputs, targets)[1]
        applied[key].model.zero_grad(set_to_none=True)
        return seconds

    for key in applied:
        step(key)  # warm-up
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
    """

    def __init__(self, spec: ModelSpec, config: TrainingConfig, *, device: str, seed: int = 0, clock=time.perf_counter) -> None:
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

