"""The optimizer's update on the device, measured: what 8-bit state (torchao) and the step in backward add to it.

8-bit AdamW state (``strategies.optimizer_state``, searched with
``--allow-lossy-optimizer``) changes the update's arithmetic: torchao
dequantizes each moment, updates it in fp32 and quantizes it again, one
parameter at a time in a compiled function. The planner's time term for it
(``autofit.planning.speed.levers``) is this measurement, once per plan, on the
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
    """What a lever adds to one optimizer step, per parameter tensor and per element (either may be negative)."""

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

    eight_bit = _update_cost(lambda params: eight_bit_adam(_built(build_optimizer, params)), device=device, elements=elements, repeats=repeats)
    plain = _update_cost(lambda params: _built(build_optimizer, params), device=device, elements=elements, repeats=repeats)
    return UpdateCost(per_tensor_seconds=eight_bit[0] - plain[0], per_element_seconds=eight_bit[1] - plain[1])


def time_step_in_backward(build_optimizer: Callable, *, device: torch.device | str, repeats: int = 7) -> UpdateCost:
    """What the optimizer step in backward adds to the update on ``device``: a cost per parameter tensor.

    The same updates run, but one optimizer per parameter, each stepped on its own (``OptimizerInBackward``, as
    its gradient hooks step it): every parameter pays the step's own overheads (a Python call and its hooks, and
    on a GPU the kernel launches a foreach step shares over every parameter); the arithmetic per element is the
    same, so no cost per element is counted. Timed over ``SMALL_TENSORS`` tensors of ``SMALL_ELEMENTS``, the
    model file's optimizer as one optimizer and once per parameter (the fastest of ``repeats`` steps each).
    """
    from strategies.optimizer_in_backward import OptimizerInBackward

    made: list[OptimizerInBackward] = []

    def per_parameter(params):
        made.append(OptimizerInBackward(params, build=lambda one: _built(build_optimizer, one)))
        return made[-1]

    sizes = [SMALL_ELEMENTS] * SMALL_TENSORS
    try:
        stepping = _fastest_step(per_parameter, sizes, device=device, repeats=repeats)
    finally:
        for optimizer in made:
            optimizer.remove_hooks()
    plain = _fastest_step(lambda params: _built(build_optimizer, params), sizes, device=device, repeats=repeats)
    return UpdateCost(per_tensor_seconds=(stepping - plain) / SMALL_TENSORS, per_element_seconds=0.0)


def _built(build_optimizer: Callable, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    try:
        return build_optimizer(params)
    except Exception:  # a builder that needs the model's named groups: time AdamW, the usual optimizer
        return torch.optim.AdamW(params)


def _update_cost(make: Callable, *, device, elements: int, repeats: int) -> tuple[float, float]:
    """One optimizer step of ``make(params)`` as a cost per tensor plus a cost per element, solved from its step
    over one tensor of ``elements`` and over ``SMALL_TENSORS`` of ``SMALL_ELEMENTS`` (``_fastest_step``)."""
    large = _fastest_step(make, [elements], device=device, repeats=repeats)
    small = _fastest_step(make, [SMALL_ELEMENTS] * SMALL_TENSORS, device=device, repeats=repeats)
    # large = a + b * elements; small = SMALL_TENSORS * (a + b * SMALL_ELEMENTS)
    per_element = (large - small / SMALL_TENSORS) / (elements - SMALL_ELEMENTS)
    return large - per_element * elements, per_element


def _fastest_step(make: Callable, sizes: list[int], *, device, repeats: int) -> float:
    """The fastest of ``repeats`` steps of ``make(params)`` over fp32 tensors of ``sizes`` on ``device``, gradients
    set before each, after one step that makes the state (and compiles)."""
    device = torch.device(device)
    params = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in sizes]
    optimizer = make(params)
    seconds = []
    for repeat in range(repeats + 1):
        for param in params:
            param.grad = torch.full_like(param, 1e-3)
        synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        synchronize(device)
        if repeat:
            seconds.append(time.perf_counter() - start)
    return min(seconds)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
