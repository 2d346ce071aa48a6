"""The one device check: whether this process can run a precision on a device, and what the device is.

Below the strategy owner (``apply``) and the meters, so both can ask it.
"""
from __future__ import annotations

import os

import torch

from autofit.errors import UserError
from autofit.plan_file import DeviceInfo


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
    if precision in ("bf16", "bf16-master", "bf16-pure") and not torch.cuda.is_bf16_supported():
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
