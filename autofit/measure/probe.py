"""The probe: a few real optimizer steps of ONE configuration, measured.

Everything the planner decides rests on this: peak bytes (with a breakdown)
and samples per second of a configuration, on the device that will train.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

import torch
from torch._subclasses.fake_tensor import FakeTensor

from autofit.apply import (
    TrainingConfig,
    apply_config,
    checkpointed_blocks,
    offloaded_blocks,
    plan_config,
    selectively_checkpointed_blocks,
)
from autofit.errors import UserError
from autofit._torch_private import FAKE_TENSOR_LIMITS
from autofit.measure.meters import check_device, fall_back_from_simulation, make_meter, release_device_memory
from autofit.plan_file import Plan
from autofit.spec import ModelSpec, model_fingerprint
from autofit.training.step import train_step


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
    host_peak_bytes: int = 0
    """Peak bytes kept in host memory (offloaded activations, host optimizer state); not in peak_bytes."""
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
    selective_checkpoint: str | list[str] | None = None,
    offload: str | list[str] | None = None,
    optimizer_in_backward: bool = False,
    optimizer_state: str = "device",
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
        selective_checkpoint: blocks checkpointed selectively (same forms).
        offload: blocks whose saved activations go to host memory (same forms).
        optimizer_in_backward: step each parameter as its gradient is ready.
        optimizer_state: "device", "host" or "8bit".
        device: "cpu" or "cuda".
        simulate: measure over fake tensors (no arithmetic, no speed).
        steps: optimizer steps; the first is a warm-up and is not timed.

    Returns:
        The peak bytes with breakdown, and samples/s (None when simulated).

    Raises:
        UserError: a bad setting; the message names it.
    """
    if grad_accum_steps < 1:
        raise UserError(f"--grad-accum-steps {grad_accum_steps} must be at least 1")
    config = TrainingConfig(
        global_batch_size=global_batch_size or micro_batch_size * grad_accum_steps,
        micro_batch_size=micro_batch_size, precision=precision, checkpoint=checkpoint or [],
        selective_checkpoint=selective_checkpoint or [], offload=offload or [],
        optimizer_in_backward=optimizer_in_backward, optimizer_state=optimizer_state,
    )
    return measure(spec, config, device=device, simulate=simulate, steps=steps, seed=seed)


def probe_plan(spec: ModelSpec, plan: Plan, *, steps: int = 3, seed: int = 0) -> ProbeResult:
    """Re-measure exactly the configuration a plan names, on its device and with its meter.

    A plan for several processes is measured as the planner measured it: one
    process training one rank's share of the global batch (its per-rank
    peak under FSDP2 is the simulation in ``predicted.per_rank_peak_bytes``).

    Raises:
        UserError: the model is not the one the plan was made for.
    """
    config = plan_config(plan)
    if config.world_size > 1:
        share = -(-config.global_batch_size // config.world_size)
        config = replace(config, global_batch_size=share, micro_batch_size=min(config.micro_batch_size, share), sharding="none", world_size=1)
    return measure(
        spec, config, device=plan.device.type, simulate=plan.estimated, steps=steps, seed=seed,
        fingerprint=plan.model.fingerprint,
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
) -> ProbeResult:
    """Run ``steps`` optimizer steps of ``config``, applied by the one strategy owner, under the device's meter.

    Args:
        fingerprint: when given, the model must have it (a plan's model).
    """
    try:
        return _measure(spec, config, device=device, simulate=simulate, steps=steps, seed=seed, fingerprint=fingerprint)
    except FAKE_TENSOR_LIMITS as error:
        if not simulate or spec.simulation_fallback:
            raise
        # Fake tensors cannot run this model: one line says so, and the cpu meter measures it.
        spec = fall_back_from_simulation(spec, error)
        return _measure(spec, config, device=device, simulate=simulate, steps=steps, seed=seed, fingerprint=fingerprint)


def _measure(spec: ModelSpec, config: TrainingConfig, *, device: str, simulate: bool, steps: int, seed: int, fingerprint: str | None) -> ProbeResult:
    if steps < 1:
        raise UserError(f"--steps {steps} must be at least 1")
    check_device(device, precision=config.precision, simulate=simulate)
    meter = make_meter(device_type=device, simulate=simulate, spec=spec)
    torch.manual_seed(seed)
    with meter.environment():
        model = meter.build_model(spec.build_model)
        if fingerprint and model_fingerprint(model) != fingerprint:
            raise UserError(
                f"the plan was made for another model (fingerprint {fingerprint}, {spec.source}'s is "
                f"{model_fingerprint(model)}); re-plan with `autofit plan` for this model"
            )
        model.train()
        # A small first loss scale: the probe must step like steady training does, not
        # spend its few steps skipping while GradScaler searches down from 2^16.
        applied = apply_config(model, config, device=meter.device, use_scaler=not simulate, init_scale=1.0)
        blocks = checkpointed_blocks(applied.model)
        selective, offloaded = selectively_checkpointed_blocks(applied.model), offloaded_blocks(applied.model)
        optimizer = applied.build_optimizer(spec.build_optimizer)
        create_optimizer_state(applied.model, optimizer)
        # The global batch lives on the host; train_step copies each micro-batch to the device.
        inputs, targets = spec.example_batch(config.global_batch_size)
        step_seconds = []
        with meter.measure(applied.model, optimizer) as measurement:
            for _ in range(steps):
                start = time.perf_counter()
                result = train_step(applied, inputs, targets, loss_fn=spec.loss_fn, optimizer=optimizer)
                if not simulate:
                    result.loss.item()  # waits for the device
                step_seconds.append(time.perf_counter() - start)
    timed = step_seconds[1:] or step_seconds
    samples_per_s = None if simulate else config.global_batch_size * len(timed) / sum(timed)
    del model, applied, optimizer, inputs, targets, result
    release_device_memory(device)
    return ProbeResult(
        peak_bytes=measurement.peak_bytes,
        samples_per_s=samples_per_s,
        precision=config.precision,
        micro_batch_size=config.micro_batch_size,
        grad_accum_steps=-(-config.global_batch_size // config.micro_batch_size),
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
        host_peak_bytes=measurement.host_peak_bytes,
    )


def create_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, at_once: bool = False) -> None:
    """Make the optimizer's lazily created state now, as any real step would.

    fp16's GradScaler skips the first steps while it finds its scale; without
    this a short probe could end before the state exists and under-count it.

    With ``at_once`` (what the planner's traces ask: the state itself, not how a step makes it), every parameter
    group steps at once (``stepping_at_once``) where the optimizer can: the same state, made about twice as fast
    over fake tensors; the step's transient bytes differ. And where the last state made at once in this process was
    for the same parameters and optimizer settings and held only plain tensors and numbers, it is made again from
    that record (``_StateRecord``): one allocation per tensor, no step (ResNet-50 over fake tensors: 0.04-0.07 s
    against 0.26-0.37 s warm).
    """
    def step() -> None:
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if not at_once:
        return step()
    key = _StateRecord.key_of(optimizer)
    if key is not None and _last_state.key == key:
        return _last_state.fill(optimizer)
    try:
        with stepping_at_once(optimizer):
            step()
    except Exception:  # an optimizer (or a parameter type) foreach does not take: one parameter at a time
        optimizer.state.clear()
        step()
    if key is not None:
        _last_state.record(key, optimizer)


@dataclass(slots=True)
class _StateRecord:
    """The shapes, strides, dtypes and devices of an optimizer's state per parameter (numbers as they were), to
    make the same state again for the same parameters without a step. Holds one optimizer's at a time."""

    key: tuple | None = None
    entries: list[dict | None] = field(default_factory=list)

    @staticmethod
    def key_of(optimizer: torch.optim.Optimizer) -> tuple | None:
        """The optimizer's class, each group's settings and each parameter's shape, dtype, device and whether it
        trains; None where a setting is not a plain value (a tensor learning rate: not recorded)."""
        groups = []
        for group in optimizer.param_groups:
            settings = tuple(sorted((k, v) for k, v in group.items() if k != "params"))
            if not all(_plain(v) for _, v in settings):
                return None
            parameters = tuple((tuple(p.shape), p.dtype, str(p.device), p.requires_grad, type(p).__name__) for p in group["params"])
            groups.append((settings, parameters))
        return (type(optimizer).__module__, type(optimizer).__qualname__, tuple(groups))

    def record(self, key: tuple, optimizer: torch.optim.Optimizer) -> None:
        """Keep ``optimizer``'s state as made, where every value is a plain tensor with a storage of its own or a plain
        number (else keep nothing: a tensor subclass's bytes or shared storages would not be made again alike)."""
        self.key, self.entries = None, []
        entries, storages = [], set()
        for param in _parameters(optimizer):
            state = optimizer.state.get(param)
            if state is None:
                entries.append(None)
                continue
            entry = {}
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    if not _plain_tensor(value) or id(value.untyped_storage()) in storages:
                        return
                    storages.add(id(value.untyped_storage()))
                    value = _TensorShape.of(value)
                elif not _plain(value):
                    return
                entry[name] = value
            entries.append(entry)
        self.key, self.entries = key, entries

    def fill(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the recorded state for ``optimizer``'s parameters (zeros but single values; under a fake mode, fake tensors)."""
        for param, entry in zip(_parameters(optimizer), self.entries):
            if entry is not None:
                optimizer.state[param] = {
                    name: value.zeros() if isinstance(value, _TensorShape) else value for name, value in entry.items()
                }


@dataclass(frozen=True, slots=True)
class _TensorShape:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    value: float | int | bool | None = None
    """A single value's, where it could be read (a step count: a step reads it, and a fake tensor has it only when
    made from a number)."""

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _TensorShape:
        value = None
        if tensor.dim() == 0:
            try:
                value = tensor.item()
            except Exception:  # a fake tensor not made from a number: its value is not known
                value = None
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device, value)

    def zeros(self) -> torch.Tensor:
        """The tensor again: zeros, or its single value."""
        if self.value is not None:
            return torch.tensor(self.value, dtype=self.dtype, device=self.device)
        tensor = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        return tensor if isinstance(tensor, FakeTensor) else tensor.zero_()  # a fake tensor holds no values to clear


_last_state = _StateRecord()


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _plain(value) -> bool:
    """A number, string, bool or None, or a tuple of them (an optimizer setting or a state's scalar)."""
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return value is None or type(value) in (int, float, bool, str)


def _plain_tensor(tensor: torch.Tensor) -> bool:
    """A tensor whose class is torch's own (a fake one counts): not a subclass that packs its bytes differently."""
    return type(tensor) in (torch.Tensor, FakeTensor)


@contextmanager
def stepping_at_once(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, the optimizer's groups step all their parameters at once (``foreach``) where the optimizer has the
    choice. Over fake tensors each operator costs the same whatever its size, so a step with one operator per
    list of tensors runs several times faster than one per parameter; it makes the same state."""
    groups = [group for group in optimizer.param_groups if "foreach" in group]
    before = [group["foreach"] for group in groups]
    for group in groups:
        group["foreach"] = True
    try:
        yield
    finally:
        for group, value in zip(groups, before):
            group["foreach"] = value
