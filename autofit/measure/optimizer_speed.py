"""The optimizer's update on the device, measured: what 8-bit state (torchao) adds to it.

8-bit AdamW state (``strategies.optimizer_state``, searched with
``--allow-lossy-optimizer``) changes the update's arithmetic: torchao
dequantizes each moment, updates it in fp32 and quantizes it again, one
parameter at a time in a compiled function. The planner's time term for it
(``autofit.planning.lever_costs``) is this measurement, once per plan, on the
device the plan is for.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

EIGHT_BIT_ELEMENTS = 2**20
"""Elements of the large tensor the update is timed over (4 MiB in fp32)."""
SMALL_TENSORS, SMALL_ELEMENTS = 16, 4096
"""And of the small ones (what each tensor costs beside its elements: torchao makes one compiled call per parameter).
Both sizes are quantized by torchao: at least 4096 elements, a whole number of its 256-element blocks."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateCost:
    """What 8-bit state adds to one optimizer step, per parameter tensor and per element (either may be negative)."""

    per_tensor_seconds: float
    per_element_seconds: float

    def seconds(self, *, tensors: int, elements: int) -> float:
        """For a model of ``tensors`` trainable parameter tensors of ``elements`` elements in all."""
        return self.per_tensor_seconds * tensors + self.per_element_seconds * elements


def time_eight_bit_update(
    build_optimizer: Callable, *, device: torch.device | str, elements: int = EIGHT_BIT_ELEMENTS, repeats: int = 3,
) -> UpdateCost:
    """What 8-bit state adds to the optimizer's step on ``device``, per tensor and per element.

    The model file's optimizer, and the same made 8-bit as training makes it
    (``eight_bit_adam``), each timed over one fp32 tensor of ``elements``
    elements and over ``SMALL_TENSORS`` tensors of ``SMALL_ELEMENTS`` (with
    gradients; the fastest of ``repeats`` steps after one that makes the
    state and compiles torchao's step, which training compiles too). A step
    is taken as a cost per tensor plus a cost per element, solved from the
    two; the difference of the two optimizers is returned. Torchao compiles
    once per parameter shape, so a model of many shapes pays more per call
    (its compiled function's guards) than these two shapes show.

    Raises:
        UserError: the optimizer is not AdamW or Adam, or torchao is missing (``eight_bit_adam``).
    """
    from strategies.optimizer_state import eight_bit_adam

    device = torch.device(device)

    def build(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        try:
            return build_optimizer(params)
        except Exception:  # a builder that needs the model's named groups: time AdamW, the usual optimizer
            return torch.optim.AdamW(params)

    def fastest(make: Callable, sizes: list[int]) -> float:
        params = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in sizes]
        for param in params:
            param.grad = torch.full_like(param, 1e-3)
        optimizer = make(params)
        optimizer.step()  # makes the state (and compiles)
        seconds = []
        for _ in range(repeats):
            _synchronize(device)
            start = time.perf_counter()
            optimizer.step()
            _synchronize(device)
            seconds.append(time.perf_counter() - start)
        return min(seconds)

    def cost(make: Callable) -> tuple[float, float]:
        large, small = fastest(make, [elements]), fastest(make, [SMALL_ELEMENTS] * SMALL_TENSORS)
        # large = a + b * elements; small = SMALL_TENSORS * (a + b * SMALL_ELEMENTS)
        per_element = (large - small / SMALL_TENSORS) / (elements - SMALL_ELEMENTS)
        return large - per_element * elements, per_element

    eight_bit = cost(lambda params: eight_bit_adam(build(params)))
    plain = cost(build)
    return UpdateCost(per_tensor_seconds=eight_bit[0] - plain[0], per_element_seconds=eight_bit[1] - plain[1])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
