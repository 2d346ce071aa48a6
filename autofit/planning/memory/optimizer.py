"""The optimizer's bytes in the memory model: its state, and what its step holds beyond it, per parameter.

Made over fake tensors, one optimizer per distinct parameter shape (as the step in backward builds them), once per
model in a process: every trace of a plan asks for the same, at any micro-batch size and precision. 8-bit state's
record (``eight_bit_record``) is made the same way with the optimizer made 8-bit as the strategy makes it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autofit.measure.tracker import StorageTracker


@dataclass(frozen=True, kw_only=True, slots=True)
class EightBitRecord:
    """What torchao's 8-bit AdamW holds on the device in place of the model's optimizer (``LeverTrace.eight_bit``)."""

    state_bytes: int
    """Its state, every trainable parameter's."""
    step_temporaries: list[int]
    """Per parameter (``model.parameters()`` order): what stepping it alone holds beyond its state."""


_optimizer_bytes_made: dict = {"spec": None, "made": {}}
"""``optimizer_bytes``' results in this process for the last spec asked about, by (device type, state). Every trace
of a plan asks for the same (it depends on neither the micro-batch nor the precision); one spec only, so a Python
session that plans many models holds none of the earlier ones."""


def optimizer_bytes(spec, *, device_type: str, optimizer_state: str = "device") -> tuple[int, list[int]]:
    """The optimizer state's bytes, and per parameter what its step alone holds beyond them (over fake tensors):
    made once per spec, device type and state in a process.

    One optimizer per distinct parameter shape, built by the spec's own
    builder over that parameter alone (as the step in backward builds them),
    stepped once to make its state and once more under a tracker. With
    ``optimizer_state`` "8bit", the builder's optimizer made 8-bit as the
    strategy makes it (``strategies.optimizer_state.eight_bit_adam``): torchao
    quantizes the moments of the parameters with at least 4096 elements, a
    whole number of its 256-element blocks (uint8 codes, an fp32 scale per
    block, a 256-entry fp32 map per moment) and keeps the others' in fp32;
    its step runs eagerly under the meters, as here.

    Raises:
        UserError: "8bit" for an optimizer other than AdamW or Adam, or without torchao.
    """
    if _optimizer_bytes_made["spec"] is not spec:
        _optimizer_bytes_made.update(spec=spec, made={})
    made = _optimizer_bytes_made["made"]
    if (device_type, optimizer_state) not in made:
        made[device_type, optimizer_state] = _optimizer_bytes(spec, device_type=device_type, optimizer_state=optimizer_state)
    state_bytes, temporaries = made[device_type, optimizer_state]
    return state_bytes, list(temporaries)


def _optimizer_bytes(spec, *, device_type: str, optimizer_state: str) -> tuple[int, list[int]]:
    from autofit.measure.meters import simulated_meter
    from strategies.optimizer_state import eight_bit_adam

    build = spec.build_optimizer
    if optimizer_state == "8bit":
        build = lambda params: eight_bit_adam(spec.build_optimizer(params))  # noqa: E731
    meter = simulated_meter(spec, for_device=device_type)
    counter = StorageTracker(round_bytes=meter.round_bytes)
    state_bytes, temporaries, seen = 0, [], {}
    with meter.environment():
        model = meter.build_model(spec.build_model)
        for param in model.parameters():
            if not param.requires_grad:
                temporaries.append(0)
                continue
            key = (tuple(param.shape), param.dtype)
            if key not in seen:
                optimizer = build([param])
                param.grad = torch.zeros_like(param)
                optimizer.step()  # makes the state
                state = [t for t in optimizer.state[param].values() if isinstance(t, torch.Tensor)]
                tracker = StorageTracker(round_bytes=meter.round_bytes)
                tracker.track([param, param.grad, *state])  # what the step updates in place is not new
                held = tracker.current_bytes
                with tracker:
                    optimizer.step()
                seen[key] = (sum(counter.counted_bytes(t) for t in state), tracker.peak_bytes - held)
                param.grad = None
                del optimizer
            state_bytes += seen[key][0]
            temporaries.append(seen[key][1])
    return state_bytes, temporaries


def eight_bit_record(spec, *, device_type: str) -> EightBitRecord:
    """What 8-bit optimizer state holds on the device (``LeverTrace.eight_bit``): it is the same at every micro-batch
    size and precision, so one record serves every trace of a plan.

    Raises:
        UserError: the spec's optimizer is not AdamW or Adam, or torchao is missing.
    """
    state_bytes, temporaries = optimizer_bytes(spec, device_type=device_type, optimizer_state="8bit")
    return EightBitRecord(state_bytes=state_bytes, step_temporaries=temporaries)
