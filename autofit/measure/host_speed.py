"""The host side of the GPU levers, measured: pinned copies between host and GPU, and the optimizer's update on the host.

Activation offload and optimizer state on the host move bytes over the link
between host memory and the GPU (PCIe or NVLink-C2C), and host state runs the
optimizer's update on the host's CPU. The planner's speed terms for them
(``autofit.planning.speed.levers``) use these numbers where they can be
measured, and say what they assumed where not.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

LINK_COPY_BYTES = 64 * 2**20
"""Bytes of each timed copy: large enough to reach the link's rate, small enough to take milliseconds."""
LINK_REPEATS = 5
"""Copies timed per direction; the first warms up and is not counted, the fastest of the rest counts."""
HOST_UPDATE_ELEMENTS = 2**22
"""Parameter elements the host update is timed over (16 MiB in fp32); it scales linearly from there."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HostLink:
    """Copy rates between pinned host memory and the GPU."""

    to_host_bytes_per_s: float
    """Device -> pinned host memory."""
    to_device_bytes_per_s: float
    """Pinned host memory -> device."""
    measured: bool
    """Timed on this machine's GPU (else assumed)."""
    source: str
    """Where the rates come from, as the plan's notes say it."""


def measure_host_link(device: torch.device | str = "cuda", *, nbytes: int = LINK_COPY_BYTES, repeats: int = LINK_REPEATS) -> HostLink:
    """Time pinned copies of ``nbytes`` each way between host memory and ``device`` (CUDA events on its stream).

    The copies are what offload and host optimizer state issue
    (``copy_(..., non_blocking=True)`` from or to pinned memory); each is
    timed alone, so the rates are the link's, without compute beside them.

    Raises:
        RuntimeError: no CUDA device (callers check ``torch.cuda.is_available()``).
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"measuring the host link needs a CUDA device, not {device}")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.current_stream(device)

    def fastest(copy: Callable[[], object]) -> float:
        seconds = []
        for _ in range(max(repeats, 2)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            copy()
            end.record(stream)
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        return min(seconds[1:])

    to_host = fastest(lambda: host.copy_(on_device, non_blocking=True))
    to_device = fastest(lambda: on_device.copy_(host, non_blocking=True))
    name = torch.cuda.get_device_name(device)
    return HostLink(
        to_host_bytes_per_s=nbytes / to_host, to_device_bytes_per_s=nbytes / to_device, measured=True,
        source=f"measured on this {name} ({nbytes // 2**20} MiB pinned copies)",
    )


def time_host_update(build_optimizer: Callable, *, elements: int = HOST_UPDATE_ELEMENTS, repeats: int = 3) -> float:
    """Seconds per parameter element of ``build_optimizer``'s step on this CPU (fp32, the state made first).

    The model file's optimizer over one tensor of ``elements`` elements with a
    gradient; the fastest of ``repeats`` steps after one that makes the state.
    A model's many tensors add per-tensor overheads this leaves out.
    """
    param = torch.nn.Parameter(torch.zeros(elements))
    param.grad = torch.full_like(param, 1e-3)
    try:
        optimizer = build_optimizer([param])
    except Exception:  # a builder that needs the model's named groups: time AdamW, the usual host optimizer
        optimizer = torch.optim.AdamW([param])
    optimizer.step()  # makes the state
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    return min(seconds) / elements
