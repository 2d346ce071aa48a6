"""Meters: how many bytes one training configuration needs.

- ``cuda``: the caching allocator's peaks plus what the process holds on the
  card beyond them (CUDA context, library workspaces), from NVML.
- ``cpu``: peak bytes of live tensor storages (``StorageTracker``).
- ``simulated``: the same tracker over fake tensors: no arithmetic runs, so a
  model far larger than this machine can be measured. On the CPU it equals
  the ``cpu`` meter; against a GPU it is an estimate.

Each meter builds the model where it measures and reports a breakdown:
parameters, gradients, optimizer state, activations (and, on cuda, the
allocator's cache and the context).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from autofit._torch_private import new_fake_mode
from autofit.errors import UserError
from autofit.measure.tracker import StorageTracker
from autofit.plan_file import DeviceInfo

CUDA_BLOCK_BYTES = 512
"""The CUDA caching allocator rounds every block up to this."""


@dataclass(kw_only=True, slots=True)
class Measurement:
    peak_bytes: int = 0
    """The number a budget is compared with."""
    breakdown: dict[str, int] = field(default_factory=dict)
    host_peak_bytes: int = 0
    """Peak bytes strategies kept in host memory (offloaded activations, host optimizer state); not in peak_bytes."""


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
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
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


class Meter:
    """Builds the model where it measures, and measures a region of training."""

    name: str
    device: torch.device

    def environment(self):
        """Context inside which the model, batches and optimizer are made."""
        return nullcontext()

    def build_model(self, build: Callable[[], nn.Module]) -> nn.Module:
        return build().to(self.device)

    @contextmanager
    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[Measurement]:
        raise NotImplementedError


class TrackedMeter(Meter):
    """Peak live storage bytes, counted by ``StorageTracker`` on the CPU.

    Compiled functions (torchao's 8-bit optimizer step) run eagerly here: a
    dispatch mode cannot look inside compiled code, and ``torch.compile``
    refuses to run under one. Eager code holds at least the temporaries that
    compiled code does, so the count errs high, never low.
    """

    name = "cpu"

    def __init__(self, *, round_bytes: int = 1) -> None:
        self.device = torch.device("cpu")
        self.round_bytes = round_bytes

    def environment(self):
        return torch.compiler.set_stance("force_eager")

    @contextmanager
    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[Measurement]:
        measurement = Measurement()
        tracker = StorageTracker(round_bytes=self.round_bytes)
        params = [p for p in model.parameters()]
        tracker.track(params, "parameters")
        tracker.track(model.buffers(), "parameters")
        tracker.track(_optimizer_state(optimizer), "optimizer_state")
        hooks = [
            p.register_post_accumulate_grad_hook(lambda p: tracker.label([p.grad], "gradients"))
            for p in params
            if p.requires_grad
        ]
        try:
            with tracker:
                yield measurement
        finally:
            for hook in hooks:
                hook.remove()
        tracker.label(_optimizer_state(optimizer), "optimizer_state")
        measurement.peak_bytes = tracker.peak_bytes
        measurement.breakdown = tracker.breakdown_at_peak()
        measurement.host_peak_bytes = tracker.host_peak_bytes


class SimulatedMeter(TrackedMeter):
    """The tracker over fake tensors: shapes and bytes without arithmetic.

    Args:
        for_device: "cpu" (exact: equals the cpu meter) or "cuda" (an estimate:
            CPU autocast rules stand in for CUDA's, blocks round to 512 bytes).
    """

    name = "simulated"

    def __init__(self, *, for_device: str = "cpu") -> None:
        super().__init__(round_bytes=CUDA_BLOCK_BYTES if for_device == "cuda" else 1)
        self.for_device = for_device
        self._fake_mode = new_fake_mode()

    def environment(self):
        stack = ExitStack()
        stack.enter_context(self._fake_mode)
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        return stack

    def build_model(self, build: Callable[[], nn.Module]) -> nn.Module:
        # Build without allocating (meta), then give it fake storage. Building
        # under the fake mode directly fails on data-dependent init (trunc_normal_).
        try:
            with torch.device("meta"):
                model = build()
            return model.to_empty(device="cpu")
        except Exception:  # a model whose construction needs real values
            with torch.device("cpu"), self._fake_mode:
                return build()


class CudaMeter(Meter):
    """Allocator peaks plus the rest of the process's footprint on the card."""

    name = "cuda"

    def __init__(self) -> None:
        check_device("cuda")
        self.device = torch.device("cuda", torch.cuda.current_device())

    @contextmanager
    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[Measurement]:
        measurement = Measurement()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        torch.cuda.reset_peak_host_memory_stats()
        yield measurement
        torch.cuda.synchronize(self.device)
        # Pinned host memory (offloaded activations, host optimizer state), from the host allocator.
        measurement.host_peak_bytes = torch.cuda.host_memory_stats().get("active_bytes.peak", 0)
        allocated_peak = torch.cuda.max_memory_allocated(self.device)
        reserved_peak = torch.cuda.max_memory_reserved(self.device)
        outside_allocator = max(process_cuda_bytes(self.device) - torch.cuda.memory_reserved(self.device), 0)
        param_bytes = sum(_nbytes(t) for t in list(model.parameters()) + list(model.buffers()))
        grad_bytes = sum(_nbytes(p) for p in model.parameters() if p.requires_grad)
        state_bytes = sum(_nbytes(t) for t in _optimizer_state(optimizer) if t.is_cuda)  # host-side state is not on the card
        measurement.peak_bytes = reserved_peak + outside_allocator
        measurement.breakdown = {
            "parameters": param_bytes,
            "gradients": grad_bytes,
            "optimizer_state": state_bytes,
            "activations": max(allocated_peak - param_bytes - grad_bytes - state_bytes, 0),
            "allocator_cache": reserved_peak - allocated_peak,
            "context": outside_allocator,
        }


def process_cuda_bytes(device: torch.device) -> int:
    """Bytes this process holds on the card: NVML's per-process count, else used memory."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return int(proc.usedGpuMemory)
    except Exception:  # NVML missing or not permitted (containers): fall back below
        pass
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def release_device_memory(device_type: str) -> None:
    """Free what dead tensors left behind: Python's cycles, then the CUDA allocator's cache."""
    import gc

    gc.collect()
    if device_type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_meter(*, device_type: str, simulate: bool) -> Meter:
    if simulate:
        return SimulatedMeter(for_device=device_type)
    if device_type == "cuda":
        return CudaMeter()
    if device_type == "cpu":
        return TrackedMeter()
    raise UserError(f"device {device_type!r} is unknown; use cpu or cuda")


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
