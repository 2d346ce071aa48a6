"""Frozen weights in NF4 in the memory model: what holding them in 4 bits saves, and what dequantizing one holds.

``strategies.frozen_nf4`` replaces each frozen linear weight NF4 can take
(``nf4_weights``) by torchao's NF4 tensor. Parameters live in every segment of
a step, so against the plain traces that change is the same in every segment:

- **saved**: each such weight's bytes as the plan holds it (fp32, or bf16 where
  the precision casts frozen weights to bf16: bf16-master, bf16-pure) less its
  NF4 tensor's (codes, quantized scales and their scales);
- **transient**: a linear product over an NF4 weight dequantizes it whole, in
  forward and again in backward (torchao's ``linear_nf4``), beside what the
  product over the dense weight holds; the largest of these over the model's
  NF4 weights is added to every segment. That is pessimistic by at most that
  many bytes where no product runs at a segment's peak: the verification
  measures the configuration with the weights in NF4 (``strategies.frozen_nf4``).

``nf4_record`` measures both with the meter the plan's traces use (the
simulated one over fake tensors, or the cpu meter where fake tensors cannot
run the model), one product per distinct weight shape.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autofit.measure.tracker import StorageTracker
from strategies import MASTER_WEIGHTS, PURE_BF16, nf4_weights


def nf4_weight_dtype(precision: str) -> torch.dtype:
    """The dtype a frozen weight has when NF4 quantizes it: bf16 where the precision casts frozen weights to bf16."""
    return torch.bfloat16 if precision in (MASTER_WEIGHTS, PURE_BF16) else torch.float32


@dataclass(frozen=True, kw_only=True, slots=True)
class Nf4Record:
    """What holding the frozen weights in NF4 changes in every segment of a step (``LeverTrace.nf4``)."""

    saved_bytes: int
    """What the weights in NF4 hold less than dense."""
    transient_bytes: int
    """The most one dequantized product holds beyond its weight, forward and backward."""
    weights: int
    """How many weights NF4 holds."""
    elements: int
    """Their elements in all."""


def nf4_record(spec, *, device_type: str, weight_dtype: torch.dtype) -> Nf4Record | None:
    """What NF4 changes in every segment of a step (``LeverTrace.nf4``); None for a model without a weight NF4 would
    hold.

    Raises:
        UserError: torchao is missing.
    """
    from autofit.measure.meters import simulated_meter
    from strategies.frozen_nf4 import nf4_quantizer

    to_nf4 = nf4_quantizer()
    meter = simulated_meter(spec, for_device=device_type)
    counter = StorageTracker(round_bytes=meter.round_bytes)
    saved, transient, elements, seen = 0, 0, 0, {}
    with meter.environment():
        model = meter.build_model(spec.build_model)
        weights = [linear.weight for linear in nf4_weights(model)]
        for weight in weights:
            key = tuple(weight.shape)
            if key not in seen:
                dense = weight.detach().to(weight_dtype)
                quantized = nn.Parameter(to_nf4(dense), requires_grad=False)
                saving = counter.counted_bytes(dense) - counter.counted_bytes(quantized)
                seen[key] = (saving, _product_bytes(quantized, meter) - _product_bytes(dense, meter))
                del dense, quantized
            saved += seen[key][0]
            transient = max(transient, seen[key][1])
            elements += weight.numel()
    if not weights:
        return None
    return Nf4Record(saved_bytes=saved, transient_bytes=max(transient, 0), weights=len(weights), elements=elements)


def _product_bytes(weight: torch.Tensor, meter) -> int:
    """What one row's linear product over ``weight``, forward and backward, holds beyond the weight."""
    row = torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device, requires_grad=True)
    tracker = StorageTracker(round_bytes=meter.round_bytes)
    tracker.track([weight, row])
    held = tracker.current_bytes
    with tracker:
        F.linear(row, weight).sum().backward()
    return tracker.peak_bytes - held
