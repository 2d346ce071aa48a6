"""The probe: a few real optimizer steps of ONE configuration, measured.

Everything the planner decides rests on this: peak bytes (with a breakdown)
and samples per second of a configuration, on the device that will train.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from autofit.errors import UserError
from autofit.measure.meters import make_meter, release_device_memory
from autofit.spec import ModelSpec
from autofit.training.step import train_step
from strategies import BatchSplit, BatchSplitConfig, CheckpointConfig, Checkpointing, Precision, PrecisionConfig


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
    step_seconds: list[float] = field(default_factory=list)

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
    device: str = "cpu",
    simulate: bool = False,
    steps: int = 3,
    seed: int = 0,
) -> ProbeResult:
    """Run ``steps`` optimizer steps of one configuration and measure them.

    Args:
        spec: the model, its example batches, loss and optimizer.
        micro_batch_size: samples per forward/backward.
        grad_accum_steps: micro-batches per optimizer step (ignored when
            global_batch_size is given).
        global_batch_size: samples per optimizer step; defaults to m * k.
        precision: "fp32", "bf16" or "fp16".
        checkpoint: "all", "none", "a,b" or a list of block names.
        device: "cpu" or "cuda".
        simulate: measure over fake tensors (no arithmetic, no speed).
        steps: optimizer steps; the first is a warm-up and is not timed.

    Returns:
        The peak bytes with breakdown, and samples/s (None when simulated).

    Raises:
        UserError: a bad setting; the message names it.
    """
    if steps < 1:
        raise UserError(f"--steps {steps} must be at least 1")
    if grad_accum_steps < 1:
        raise UserError(f"--grad-accum-steps {grad_accum_steps} must be at least 1")
    split = BatchSplit(
        BatchSplitConfig(
            global_batch_size=global_batch_size or micro_batch_size * grad_accum_steps,
            micro_batch_size=micro_batch_size,
        )
    )
    precision_config = PrecisionConfig(precision=precision)
    check_precision_supported(precision, device)
    meter = make_meter(device_type=device, simulate=simulate)
    torch.manual_seed(seed)
    with meter.environment():
        model = meter.build_model(spec.build_model)
        model.train()
        checkpointing = Checkpointing(CheckpointConfig(blocks=checkpoint or []))
        model = checkpointing.apply(model)
        blocks = [name for name, m in model.named_modules() if getattr(m, "_autofit_checkpointed", False)]
        optimizer = spec.build_optimizer(model.parameters())
        _create_optimizer_state(model, optimizer)
        # A small first loss scale: the probe must step like steady training does, not
        # spend its few steps skipping while GradScaler searches down from 2^16.
        step_precision = Precision(precision_config, device_type=meter.device.type, use_scaler=not simulate, init_scale=1.0)
        # The global batch lives on the host; train_step copies each micro-batch to the device.
        inputs, targets = spec.example_batch(split.config.global_batch_size)
        step_seconds = []
        with meter.measure(model, optimizer) as measurement:
            for _ in range(steps):
                start = time.perf_counter()
                result = train_step(
                    model, inputs, targets,
                    loss_fn=spec.loss_fn, optimizer=optimizer, precision=step_precision,
                    split=split, device=meter.device,
                )
                if not simulate:
                    result.loss.item()  # waits for the device
                step_seconds.append(time.perf_counter() - start)
    timed = step_seconds[1:] or step_seconds
    samples_per_s = None if simulate else split.config.global_batch_size * len(timed) / sum(timed)
    del model, optimizer, inputs, targets, result
    release_device_memory(device)
    return ProbeResult(
        peak_bytes=measurement.peak_bytes,
        samples_per_s=samples_per_s,
        precision=precision,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=split.config.grad_accum_steps,
        global_batch_size=split.config.global_batch_size,
        checkpoint=blocks,
        meter=meter.name,
        device=device,
        breakdown=measurement.breakdown,
        step_seconds=[] if simulate else step_seconds,
    )


def check_precision_supported(precision: str, device: str) -> None:
    """Raise when the device cannot run this precision, saying which can."""
    if device == "cuda" and torch.cuda.is_available() and precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise UserError("precision bf16 is not supported on this GPU; use fp16 or fp32")


def _create_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Make the optimizer's lazily created state now, as any real step would.

    fp16's GradScaler skips the first steps while it finds its scale; without
    this a short probe could end before the state exists and under-count it.
    """
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
