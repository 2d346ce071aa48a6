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

import torch

EIGHT_BIT_ELEMENTS = 2**20
"""Parameter elements the update is timed over (4 MiB in fp32, quantized by torchao: at least 4096 and a whole number
of its 256-element blocks); it scales linearly from there."""


def time_eight_bit_update(
    build_optimizer: Callable, *, device: torch.device | str, elements: int = EIGHT_BIT_ELEMENTS, repeats: int = 3,
) -> float:
    """Seconds per parameter element that 8-bit state adds to the optimizer's step on ``device`` (negative: it saves).

    The model file's optimizer, and the same made 8-bit as training makes it
    (``eight_bit_adam``), each over one fp32 tensor of ``elements`` elements
    with a gradient: the fastest of ``repeats`` steps after one that makes the
    state (and compiles torchao's step, which training compiles too). A
    model's many tensors add per-tensor overheads (one compiled call per
    parameter) this leaves out.

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

    def fastest(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> float:
        param = torch.nn.Parameter(torch.zeros(elements, device=device))
        param.grad = torch.full_like(param, 1e-3)
        optimizer = make([param])
        optimizer.step()  # makes the state (and compiles)
        seconds = []
        for _ in range(repeats):
            _synchronize(device)
            start = time.perf_counter()
            optimizer.step()
            _synchronize(device)
            seconds.append(time.perf_counter() - start)
        return min(seconds)

    eight_bit = fastest(lambda params: eight_bit_adam(build(params)))
    plain = fastest(build)
    return (eight_bit - plain) / elements


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
