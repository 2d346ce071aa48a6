"""The probe: a few real optimizer steps of ONE configuration, measured.

Everything the planner decides rests on this: peak bytes (with a breakdown)
and samples per second of a configuration, on the device that will train.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from autofit.apply import AppliedPlan, apply_config, checkpointed_blocks, offloaded_blocks, selectively_checkpointed_blocks, use_plan_allocator
from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit._torch_private import FAKE_TENSOR_LIMITS
from autofit.device import check_device, steady_host_allocations
from autofit.measure.kernels import precision_failure
from autofit.measure.meters import (
    Measurement, SimulatedMeter, compiled_step_on_cpu, fails_only_on_fake_tensors, fall_back_from_simulation, make_meter, noting_padding,
    release_device_memory, state_bytes,
)
from autofit.measure.tracker import ACTIVATIONS
from autofit.measure.optimizer_state import create_optimizer_state
from autofit.plan_file import Plan
from autofit.progress import QUIET, Progress
from autofit.spec import ModelSpec, model_fingerprint
from autofit.step import StepResult, train_step
from strategies.frozen_nf4 import NF4_BLOCK_ELEMENTS, is_nf4


@dataclass(kw_only=True, slots=True)
class ProbeResult:
    peak_bytes: int
    samples_per_s: float | None
    """None when simulated: nothing ran."""
    precision: str
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int
    checkpoint: list[str]
    meter: str
    device: str
    breakdown: dict[str, int] = field(default_factory=dict)
    selective_checkpoint: list[str] = field(default_factory=list)
    offload: list[str] = field(default_factory=list)
    optimizer_in_backward: bool = False
    optimizer_state: str = "device"
    loss_chunks: int = 1
    frozen_nf4: bool = False
    """The frozen linear weights (a LoRA base) held in 4-bit NF4 (QLoRA)."""
    max_grad_norm: float | None = None
    host_peak_bytes: int = 0
    """Peak bytes kept in host memory (offloaded activations, host optimizer state); not in peak_bytes."""
    step_seconds: list[float] = field(default_factory=list)
    compile: bool = False
    compiled_change_bytes: int | None = None
    """Compiled on the CPU: how the compiled step's peak differed from the eager one the tracker counted (in peak_bytes)."""

    def to_dict(self) -> dict:
        return asdict(self)


def probe(
    spec: ModelSpec,
    *,
    micro_batch_size: int,
    grad_accum_steps: int = 1,
    global_batch_size: int | None = None,
    precision: str = "fp32",
    checkpoint: str | list[str] | None = None,
    selective_checkpoint: str | list[str] | None = None,
    offload: str | list[str] | None = None,
    optimizer_in_backward: bool = False,
    optimizer_state: str = "device",
    loss_chunks: int = 1,
    frozen_nf4: bool = False,
    compile: bool = False,
    max_grad_norm: float | None = None,
    device: str = "cpu",
    simulate: bool = False,
    steps: int = 3,
    seed: int = 0,
    progress: Progress = QUIET,
) -> ProbeResult:
    """Run ``steps`` optimizer steps of one configuration and measure them.

    Args:
        spec: the model, its example batches, loss and optimizer.
        micro_batch_size: samples per forward/backward.
        grad_accum_steps: micro-batches per optimizer step (ignored when
            global_batch_size is given).
        global_batch_size: samples per optimizer step; defaults to m * k.
        precision: one of ``strategies.precision.PRECISIONS`` (fp32, bf16, fp16, bf16-master, bf16-pure).
        checkpoint: "all", "none", "a,b" or a list of block names.
        selective_checkpoint: blocks checkpointed selectively (same forms).
        offload: blocks whose saved activations go to host memory (same forms).
        optimizer_in_backward: step each parameter as its gradient is ready.
        optimizer_state: "device", "host" or "8bit".
        loss_chunks: a causal LM's output layer and loss in this many chunks (1: not chunked).
        frozen_nf4: hold the frozen linear weights (LoRA's base, ``load_spec(..., lora=...)``) in NF4 (QLoRA).
        compile: ``torch.compile`` the model (not with ``simulate``: nothing runs to compile).
        max_grad_norm: clip the step's gradients to this global norm (None: no clipping).
        device: "cpu" or "cuda".
        simulate: measure over fake tensors (no arithmetic, no speed).
        steps: optimizer steps; the first is a warm-up and is not timed.
        progress: hears which step runs, k of n (``autofit.progress``).

    Returns:
        The peak bytes with breakdown, and samples/s (None when simulated).

    Raises:
        UserError: a bad setting; the message names it.
    """
    if grad_accum_steps < 1:
        raise UserError(f"--grad-accum-steps {grad_accum_steps} must be at least 1")
    config = TrainingConfig(
        global_batch_size=global_batch_size or micro_batch_size * grad_accum_steps,
        micro_batch_size=micro_batch_size, precision=precision, checkpoint=checkpoint,
        selective_checkpoint=selective_checkpoint, offload=offload,
        optimizer_in_backward=optimizer_in_backward, optimizer_state=optimizer_state, loss_chunks=loss_chunks,
        frozen_nf4=frozen_nf4, compile=compile, max_grad_norm=max_grad_norm,
    )
    return measure(spec, config, device=device, simulate=simulate, steps=steps, seed=seed, progress=progress)


def probe_plan(spec: ModelSpec, plan: Plan, *, steps: int = 3, seed: int = 0, progress: Progress = QUIET) -> ProbeResult:
    """Re-measure exactly the configuration a plan names, on its device and with its meter.

    A plan for several processes is measured as the planner measured it: one
    process training one rank's share of the global batch (its per-rank
    peak under FSDP2 is the simulation in ``predicted.per_rank_peak_bytes``).

    Raises:
        UserError: the model is not the one the plan was made for.
    """
    if not plan.estimated:  # a card measures with the allocator the plan trains with
        use_plan_allocator(plan, device=torch.device(plan.device.type))
    return measure(
        spec, plan.config.rank_share(), device=plan.device.type, simulate=plan.estimated, steps=steps, seed=seed,
        fingerprint=plan.model.fingerprint, progress=progress,
    )


def measure(
    spec: ModelSpec,
    config: TrainingConfig,
    *,
    device: str,
    simulate: bool = False,
    steps: int = 3,
    seed: int = 0,
    fingerprint: str | None = None,
    progress: Progress = QUIET,
) -> ProbeResult:
    """Run ``steps`` optimizer steps of ``config``, applied by the one strategy owner, under the device's meter.

    Args:
        fingerprint: when given, the model must have it (a plan's model).
        progress: hears which step runs, k of n.
    """
    settings = dict(device=device, simulate=simulate, steps=steps, seed=seed, fingerprint=fingerprint, progress=progress)
    try:
        return _measure(spec, config, **settings)
    except FAKE_TENSOR_LIMITS as error:
        if not simulate or spec.simulation_fallback:
            raise
        # Fake tensors cannot run this model: one line says so, and the cpu meter measures it.
        spec = fall_back_from_simulation(spec, error, for_device=device)
        return _measure(spec, config, **settings)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as error:
        if simulate and not spec.simulation_fallback and fails_only_on_fake_tensors(spec):
            # An op whose fake kernel refuses what its real one runs (grouped_mm's in fp32): as above.
            spec = fall_back_from_simulation(spec, error, for_device=device)
            return _measure(spec, config, **settings)
        # An op with no kernel for the precision on this device (fp16 LSTM on a CPU): one line and the way out.
        if simulate or config.precision == "fp32":
            raise
        why = precision_failure(spec, precision=config.precision, device=device)
        if why is None:  # the precision runs the model, or fp32 fails as well: not a missing kernel
            raise
        others = " or ".join(p for p in ("bf16", "fp32") if p != config.precision)
        raise UserError(
            f"precision {config.precision} cannot train this model on {device}: an op has no {config.precision} "
            f"kernel there ({why}); use --precision {others}"
        ) from error


def optimizer_step_measurement(spec: ModelSpec, config: TrainingConfig, *, device: str) -> Measurement:
    """``config``'s optimizer step alone, measured as ``measure`` measures a step on the simulated meter (the same
    strategy owner, optimizer and tracker, each storage rounded as the meter rounds it), with no forward or
    backward: the gradients are set as backward leaves them before it begins, and not counted.

    Its ``host_peak_bytes``: for a host optimizer (host state, bf16-master) the parameters' fp32 copies, the
    gradients' buffers, the optimizer's state and its step's temporaries (a one-parameter-at-a-time AdamW: two of the
    largest parameter's). Its ``peak_bytes``: the parameters, the optimizer's state on the device and its step's
    temporaries there (a foreach AdamW's fp32 copy of every parameter), by the breakdown's categories. What
    activations add (offload) is in neither. Over fake tensors: no memory is taken and nothing computed, so a plan can
    know these from sizes alone (``planning.bounds``).
    """
    meter = SimulatedMeter(for_device=device)  # fake tensors always: the cpu meter's fallback would allocate them
    with meter.environment():
        model = meter.build_model(spec.build_model)
        model.train()
        applied = apply_config(model, config, device=meter.device, use_scaler=False)
        optimizer = applied.build_optimizer(spec.build_optimizer)
        create_optimizer_state(applied.model, optimizer)
        for param in applied.model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)  # what backward leaves (a host optimizer's hook would move it)
        with meter.measure(applied.model, optimizer) as measurement:
            applied.optimizer_step(optimizer)
            optimizer.zero_grad(set_to_none=True)
    return measurement


def _measure(
    spec: ModelSpec, config: TrainingConfig, *, device: str, simulate: bool, steps: int, seed: int, fingerprint: str | None,
    progress: Progress,
) -> ProbeResult:
    _check_request(config, device=device, simulate=simulate, steps=steps)
    steady_host_allocations()  # its steps timed as training runs them
    meter = make_meter(device_type=device, simulate=simulate, spec=spec)
    torch.manual_seed(seed)
    with meter.environment():
        model = meter.build_model(spec.build_model)
        _check_fingerprint(model, fingerprint, source=spec.source)
        model.train()
        # A small first loss scale: the probe must step like steady training does, not
        # spend its few steps skipping while GradScaler searches down from 2^16.
        applied = apply_config(model, config, device=meter.device, use_scaler=not simulate, init_scale=1.0)
        _check_nf4(applied, config, source=spec.source)
        blocks = checkpointed_blocks(applied.model)
        selective, offloaded = selectively_checkpointed_blocks(applied.model), offloaded_blocks(applied.model)
        optimizer = applied.build_optimizer(spec.build_optimizer)
        create_optimizer_state(applied.model, optimizer)
        # The global batch lives on the host; train_step copies each micro-batch to the device.
        example_batch = noting_padding(spec.example_batch) if simulate else spec.example_batch
        inputs, targets = example_batch(config.global_batch_size)

        def step() -> StepResult:
            return train_step(applied, inputs, targets, loss_fn=spec.loss_fn, optimizer=optimizer)

        with meter.measure(applied.model, optimizer) as measurement:
            step_seconds = _timed_steps(step, steps=steps, simulate=simulate, progress=progress)
        compiled_change = None
        if config.compile and meter.name == "cpu":  # the tracker ran the compiled model eagerly
            compiled_change, seconds = compiled_step_on_cpu(lambda: step().loss.item())
            measurement.peak_bytes += compiled_change
            measurement.breakdown[ACTIVATIONS] = measurement.breakdown.get(ACTIVATIONS, 0) + compiled_change
            step_seconds = [seconds]
    timed = step_seconds[1:] or step_seconds
    samples_per_s = None if simulate else config.global_batch_size * len(timed) / sum(timed)
    # Rebound, not deleted (inner functions name them): the model and its state are freed before the release.
    held = state_bytes(model)
    model = applied = optimizer = inputs = targets = None
    release_device_memory(device, held_bytes=held)
    return ProbeResult(
        peak_bytes=measurement.peak_bytes,
        samples_per_s=samples_per_s,
        precision=config.precision,
        micro_batch_size=config.micro_batch_size,
        grad_accum_steps=config.grad_accum_steps,
        global_batch_size=config.global_batch_size,
        checkpoint=blocks,
        meter=meter.name,
        device=device,
        breakdown=measurement.breakdown,
        step_seconds=[] if simulate else step_seconds,
        selective_checkpoint=selective,
        offload=offloaded,
        optimizer_in_backward=config.optimizer_in_backward,
        optimizer_state=config.optimizer_state,
        loss_chunks=config.loss_chunks,
        frozen_nf4=config.frozen_nf4,
        max_grad_norm=config.max_grad_norm,
        host_peak_bytes=measurement.host_peak_bytes,
        compile=config.compile,
        compiled_change_bytes=compiled_change,
    )


def _check_request(config: TrainingConfig, *, device: str, simulate: bool, steps: int) -> None:
    """What a probe cannot be asked, before anything is built."""
    if steps < 1:
        raise UserError(f"--steps {steps} must be at least 1")
    if config.compile and simulate:
        raise UserError("--compile is measured on the device, and --simulate runs nothing there; drop one of them")
    check_device(device, precision=config.precision, simulate=simulate)


def _check_fingerprint(model: torch.nn.Module, fingerprint: str | None, *, source: str) -> None:
    if fingerprint and model_fingerprint(model) != fingerprint:
        raise UserError(
            f"the plan was made for another model (fingerprint {fingerprint}, {source}'s is "
            f"{model_fingerprint(model)}); re-plan with `autofit plan` for this model"
        )


def _check_nf4(applied: AppliedPlan, config: TrainingConfig, *, source: str) -> None:
    if config.frozen_nf4 and not any(is_nf4(p) for p in applied.model.parameters()):
        raise UserError(
            f"--nf4-base holds frozen linear weights in NF4, and {source} has none NF4 can take (frozen, a "
            f"multiple of {NF4_BLOCK_ELEMENTS} elements, not the output layer); add --lora r=8 (its base is frozen), "
            "or drop --nf4-base"
        )


def _timed_steps(step: Callable[[], StepResult], *, steps: int, simulate: bool, progress: Progress) -> list[float]:
    """Seconds of each of ``steps`` training steps (waiting for the device after each when it runs for real)."""
    step_seconds = []
    for number in range(1, steps + 1):
        with progress.doing(f"{'simulated ' if simulate else ''}optimizer step", step=number, of=steps):
            start = time.perf_counter()
            result = step()
            if not simulate:
                result.loss.item()  # waits for the device
            step_seconds.append(time.perf_counter() - start)
    return step_seconds
