"""What dequantizing frozen NF4 weights costs (``strategies.frozen_nf4``): the speed model's term for QLoRA's base.

Each product over an NF4 weight dequantizes it whole (torchao's
``linear_nf4``), in forward and again in backward. ``time_nf4_dequantize``
times that on a device that is here; for a GPU that is not, ``nf4_bytes_moved``
counts the bytes one dequantization writes per weight element, which the
planner prices at the GPU's memory bandwidth.
"""
from __future__ import annotations

import time

import torch

from autofit._torch_private import TorchDispatchMode, tree_leaves
from autofit.measure.optimizer_speed import synchronize

TIMED_ELEMENTS = 2**20
"""Elements of the weight timed: a multiple of NF4's 16,384-element blocks, large enough to leave launch overheads behind."""


def time_nf4_dequantize(*, device: torch.device | str, dtype: torch.dtype, repeats: int = 5) -> float:
    """Seconds per weight element of one dequantization of an NF4 weight of ``dtype`` on ``device`` (the fastest of
    ``repeats``, after one that warms up).

    Raises:
        UserError: torchao is missing.
    """
    from strategies.frozen_nf4 import nf4_quantizer

    device = torch.device(device)
    weight = nf4_quantizer()(torch.randn(TIMED_ELEMENTS // 1024, 1024, dtype=dtype, device=device))
    best = float("inf")
    for _ in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        weight.get_original_weight()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best / TIMED_ELEMENTS


def nf4_bytes_moved(dtype: torch.dtype) -> float:
    """Bytes one dequantization writes per weight element (its intermediates and the dense weight; each is read
    once more), counted on a small weight on the CPU."""
    from strategies.frozen_nf4 import nf4_quantizer

    elements = 4 * 16384
    weight = nf4_quantizer()(torch.randn(elements // 256, 256, dtype=dtype))
    with _Written() as written:
        weight.get_original_weight()
    return written.bytes / elements


class _Written(TorchDispatchMode):
    """Counts the bytes of every tensor the ops under it return."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out

