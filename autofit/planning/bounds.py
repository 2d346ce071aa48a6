"""Bounds a plan can check from sizes alone, before anything is traced.

A GPU plan keeps the model's state either on the device (its weights and optimizer state there, the gradients
stepped away in backward at best) or on the host (host optimizer state and bf16 masters: the trained weights'
fp32 copies, their gradients and the optimizer's state, all on the host). Where neither place can hold it, no
configuration can fit, whatever the activations do: the plan says so in seconds, not after its traces.

Each side is counted as the planner's last check counts it, so that what that check would refuse for these bytes
alone is refused here, before the traces: the host's bytes by the same meter, strategy owner and optimizer as a
measured configuration's (``measure.probe.optimizer_step_measurement``: with its step's temporaries and the meter's
rounding), the device's with the headroom a measured peak gets (``PlanContext.headroom``). Only what sizes cannot
say (activations, gradients alive in backward) is left out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from strategies import MASTER_WEIGHTS, PURE_BF16
from strategies.optimizer_state import held_weight_bytes
from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.measure.probe import optimizer_step_measurement
from autofit.planning.context import PlanContext, meta_model_of
from autofit.spec import wants_names
from autofit.units import format_bytes

EIGHT_BIT_STATE_SHARE = 0.25
"""8-bit optimizer state over fp32 state: one byte of each four (block scales left out: a lower bound)."""
BF16_STATE_SHARE = 0.5
"""bf16-pure's optimizer state over fp32 state: the state takes the weights' bf16."""


@dataclass(frozen=True, kw_only=True)
class StateSizes:
    """The model's state in bytes, counted on the meta device (no memory, no step)."""

    weight_bytes: int
    """Every parameter and buffer as the model holds them."""
    cast_weight_bytes: int
    """The same with the trained weights in bf16 (bf16-master and bf16-pure)."""
    trained_bytes: int
    """The trained parameters in fp32: what host state and bf16 masters copy to the host."""
    state_bytes: int
    """The optimizer's state for the trained parameters, as the model file's optimizer makes it."""

    def device_bytes(self, *, pure_bf16: bool, eight_bit: bool) -> int:
        """The least a configuration that keeps everything on the device holds there (no gradient, no activation)."""
        share = EIGHT_BIT_STATE_SHARE if eight_bit else 1.0
        least = self.weight_bytes + int(self.state_bytes * share)
        if pure_bf16:
            least = min(least, self.cast_weight_bytes + int(self.state_bytes * min(share, BF16_STATE_SHARE)))
        return least


def state_sizes(context: PlanContext) -> StateSizes | None:
    """The model's ``StateSizes``, its optimizer stepped once over meta tensors; None where the optimizer cannot
    step there (then nothing is said before the traces, which measure it)."""
    model = meta_model_of(context.spec)
    trained = [p for p in model.parameters() if p.requires_grad]
    try:
        build = context.spec.build_optimizer
        optimizer = build(list(model.named_parameters()) if wants_names(build) else list(model.parameters()))
        for param in trained:
            param.grad = torch.zeros_like(param)
        optimizer.step()
    except Exception:  # a model file's optimizer may do anything a meta tensor cannot; the traces will say
        return None
    state = [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return StateSizes(
        weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()) + buffers,
        cast_weight_bytes=held_weight_bytes(model, cast=True) + buffers,
        trained_bytes=sum(p.numel() * 4 for p in trained),
        state_bytes=sum(t.numel() * t.element_size() for t in state if t.dim() > 0),
    )


HostStepper = Literal["host state", "bf16-master"]
"""The configurations that step the optimizer on the host: optimizer state there, or bf16 weights with fp32 masters."""
_STEPPING_ON_HOST: dict[HostStepper, TrainingConfig] = {
    "host state": TrainingConfig(global_batch_size=1, micro_batch_size=1, optimizer_state="host"),
    "bf16-master": TrainingConfig(global_batch_size=1, micro_batch_size=1, precision=MASTER_WEIGHTS),
}


def host_step_bytes(context: PlanContext, stepper: HostStepper) -> int | None:
    """What a configuration that steps on the host (``stepper``) keeps there at the least, counted as the planner
    counts a measured configuration's host bytes (``optimizer_step_measurement``: the fp32 copies, the gradients'
    buffers, the optimizer's state and its step's temporaries, as the meter rounds them; activations left out); None
    where the optimizer cannot step over fake tensors."""
    # The step's bytes follow the parameters and the optimizer, not the inputs: a model asked at other sequence
    # lengths (``capacity --longest``, ``plan --seq-len max``) is counted once.
    options = {k: v for k, v in context.spec.source_options.items() if k != "seq_len"}
    parameters = tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in context.meta_model.named_parameters())
    key = (context.spec.source, repr(sorted(options.items())), parameters, stepper, context.device)
    if key not in _host_step_bytes:
        try:
            with context.progress.doing(f"counting what {stepper} keeps in host memory (simulated meter, no trace)"):
                _host_step_bytes[key] = optimizer_step_measurement(context.spec, _STEPPING_ON_HOST[stepper], device=context.device).host_peak_bytes
        except Exception:  # a model file's optimizer may do anything a fake tensor cannot; the traces will say
            _host_step_bytes[key] = None
    return _host_step_bytes[key]


_host_step_bytes: dict[tuple, int | None] = {}
"""``host_step_bytes`` by the model's source, its options but the sequence length, its parameters, the stepper and
the device."""


def host_state_bytes(context: PlanContext) -> int | None:
    """The least ``host_step_bytes`` of host state and, where searched, bf16-master; None where not known. With fp32
    weights the two keep the same tensors there (host state's copies are fp32 like bf16-master's masters): one is
    counted."""
    fp32 = all(p.dtype == torch.float32 for p in context.meta_model.parameters() if p.requires_grad)
    steppers: list[HostStepper] = ["host state"]
    if MASTER_WEIGHTS in context.precisions and not fp32:
        steppers.append("bf16-master")
    counted = [host_step_bytes(context, stepper) for stepper in steppers]
    return None if None in counted else min(counted)


def check_state_fits(context: PlanContext, *, allow_lossy_optimizer: bool, allow_lossy_base: bool) -> None:
    """Refuse a GPU plan whose state fits neither the device nor the host (``StateSizes``), naming the bytes
    and the flags that change them.

    Raises:
        UserError: the least the device and the host would each need are both more than they have.
    """
    if context.device != "cuda" or context.host_budget_bytes is None or allow_lossy_base:
        return  # the CPU is its own host; NF4 weights are sized by their traces
    sizes = state_sizes(context)
    if sizes is None or not sizes.trained_bytes:
        return
    device = sizes.device_bytes(pure_bf16=PURE_BF16 in context.precisions, eight_bit=allow_lossy_optimizer)
    # A simulated plan's headroom is fixed before anything runs; a real GPU's context is measured by its first probe.
    headroom = context.headroom() if context.simulate else None
    if (device <= context.budget_bytes if headroom is None else headroom.fits(device, persistent_bytes=device)):
        return
    host = host_state_bytes(context)
    if host is None or host <= context.host_budget_bytes:
        return
    on_device = (
        f"the weights and optimizer state alone need {format_bytes(device)}, more than --budget {format_bytes(context.budget_bytes)}"
        if headroom is None else headroom.needed_text(device, persistent_bytes=device, what="the weights and optimizer state alone")
    )
    note = context.host_budget_note
    raise UserError(
        f"no configuration fits: on the device {on_device}; stepped on the host they need {format_bytes(host)} of host "
        "memory at least (fp32 copies, gradients, optimizer state and the step's temporaries), more than the host's "
        f"{format_bytes(context.host_budget_bytes)} "
        f"({note if note.startswith('--') else note.split(' (')[0]}); give --host-memory for the machine that trains, or "
        "train fewer parameters (--lora)"
    )


@dataclass(frozen=True, kw_only=True)
class RankState:
    """What a rank of several shards (FSDP2: fp32 weights, their gradients and the optimizer's state, on the device),
    for the whole model, and its optimizer step's temporaries there: counted from sizes alone."""

    breakdown: dict[str, int]
    """"parameters" (with buffers), "gradients" and "optimizer_state", as a peak's breakdown names them."""
    step_bytes: int
    """The step's temporaries above them (a foreach AdamW's fp32 copy of every parameter), as the meter counts them."""


def rank_state(context: PlanContext) -> RankState | None:
    """The model's ``RankState``, its optimizer stepped once on the simulated meter as on the device (no trace); None
    where the optimizer cannot step over fake tensors."""
    try:
        with context.progress.doing("counting what a rank's optimizer step holds (simulated meter, no trace)"):
            step = optimizer_step_measurement(context.spec, TrainingConfig(global_batch_size=1, micro_batch_size=1), device=context.device)
    except Exception:  # a model file's optimizer may do anything a fake tensor cannot; the traces will say
        return None
    trained = sum(p.numel() * p.element_size() for p in context.meta_model.parameters() if p.requires_grad)
    parameters, state = step.breakdown.get("parameters", 0), step.breakdown.get("optimizer_state", 0)
    return RankState(
        breakdown={"parameters": parameters, "gradients": trained, "optimizer_state": state},
        step_bytes=max(step.peak_bytes - parameters - state, 0),
    )
