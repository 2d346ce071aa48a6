"""The one device check: whether this process can run a precision on a device, and what the device is.

Below the strategy owner (``apply``) and the meters, so both can ask it.
"""
from __future__ import annotations

import os

import torch

from autofit.errors import UserError
from autofit.plan_file import DeviceInfo
from strategies.precision import precision_dtype


def check_device(device_type: str, *, precision: str | None = None, simulate: bool = False) -> None:
    """The one check that this process can run ``precision`` on ``device_type`` (real, or simulated).

    Raises:
        UserError: an unknown device, no visible GPU for a real cuda run, or
            bf16 on a GPU without it; the message names the way out.
    """
    if device_type not in ("cpu", "cuda"):
        raise UserError(f"--device {device_type!r} is unknown; use cpu or cuda")
    if device_type != "cuda" or simulate:
        return
    if not torch.cuda.is_available():
        raise UserError(
            "device cuda: no CUDA device is visible; use --device cpu, or plan with --simulate "
            "--device-memory 24GiB for a GPU you do not have and train on a machine that has it"
        )
    if precision is not None and precision_dtype(precision) == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise UserError("precision bf16 is not supported on this GPU; use fp16 or fp32")


def device_info(device_type: str, *, total_bytes: int | None = None) -> DeviceInfo:
    """Name and total memory of the device (of this machine's RAM for "cpu")."""
    if device_type == "cpu":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return DeviceInfo(type="cpu", name="cpu", total_bytes=total_bytes or ram)
    if device_type == "cuda":
        if not torch.cuda.is_available():
            if total_bytes is None:
                check_device(device_type)
            return DeviceInfo(type="cuda", name="simulated cuda", total_bytes=total_bytes)
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return DeviceInfo(type="cuda", name=props.name, total_bytes=total_bytes or props.total_memory)
    raise UserError(f"device {device_type!r} is unknown; use cpu or cuda")


def peak_resident_bytes() -> int:
    """The most memory this process has held resident so far (``getrusage``'s maximum resident set size)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def host_memory_bytes(*, available: bool) -> int:
    """This machine's RAM: what is available now (``MemAvailable``), or all of it."""
    if available:
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
"""glibc's ``mallopt`` parameters (malloc.h)."""
_steady_allocations: bool | None = None
STEADY_MMAP_THRESHOLD_BYTES = 256 * 2**20
"""Blocks up to this size come from the heap (glibc's own threshold adapts up to 32 MiB at most)."""


def steady_host_allocations() -> bool:
    """Have glibc's malloc keep freed memory for the next allocation rather than give it back each time; once a process.

    PyTorch's CPU allocator caches nothing: each step's activations are
    malloc'd and freed. By default glibc maps large blocks afresh and trims
    the heap's freed top, so every step faults its pages in again. On 2 cores
    that was a third of the digits CNN's step (bf16, 64 x 1: 63 ms a step
    against 45 ms with the heap kept), and it depended on what the process had
    allocated before: the planner, after its traces, timed 46 ms where a fresh
    training process stepped in 60-70 ms (issue 28's quiet-machine gap). So
    the planner, the probe and training all allocate the same steady way:
    blocks up to ``STEADY_MMAP_THRESHOLD_BYTES`` come from the heap, and up to
    2 GiB of freed heap is kept. The process's resident memory then stays near
    its peak, which a training process reaches every step anyway.

    Returns:
        Whether the setting is in force (False off glibc, where nothing is changed).
    """
    global _steady_allocations
    if _steady_allocations is None:
        _steady_allocations = False
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            kept = libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
            mapped = libc.mallopt(_M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD_BYTES)
            _steady_allocations = bool(kept and mapped)
        except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator as it is
            pass
    return _steady_allocations
