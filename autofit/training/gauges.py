"""Memory now and at its peak, for the progress bar and metrics.jsonl (CUDA's allocator or the process's resident set),
and the watch that keeps a run to its plan's budget."""
from __future__ import annotations

import math
import resource
import time
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from autofit.plan_file import Plan
from autofit.units import format_bytes


class MemoryGauge:
    """Memory now and at its peak, cheap enough to read every step.

    ``read`` asks the device at most every ``interval_s`` and otherwise
    returns the last reading (on CUDA one reading builds the allocator's whole
    statistics dict); the peak is a running maximum, so none is missed.
    """

    note = ""
    interval_s = 0.5

    def __init__(self) -> None:
        self._read_at = -math.inf
        self._reading = (0, 0)

    def read(self) -> tuple[int, int]:
        """(now_bytes, peak_bytes), at most ``interval_s`` old."""
        now = time.perf_counter()
        if now - self._read_at >= self.interval_s:
            self._reading, self._read_at = (self.now_bytes(), self.peak_bytes()), now
        return self._reading

    def now_bytes(self) -> int:
        raise NotImplementedError

    def peak_bytes(self) -> int:
        raise NotImplementedError


class ProcessMemory(MemoryGauge):
    """CPU: the process's resident set (no tensor tracking while training: it would slow every step).

    It counts the interpreter and libraries too, so it reads above the plan's
    budget, which counts tensor bytes only (the cpu-tracked meter).
    """

    note = "memory is the process's resident set (interpreter included); the budget counts tensor bytes"

    def __init__(self) -> None:
        super().__init__()
        self._page_bytes = resource.getpagesize()

    def now_bytes(self) -> int:
        try:
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[1]) * self._page_bytes
        except OSError:
            return self.peak_bytes()

    def peak_bytes(self) -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class CudaMemory(MemoryGauge):
    """CUDA: bytes allocated now, and the allocator's peak reserved bytes since training began."""

    note = "memory is allocated now and peak reserved by the CUDA allocator"

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        torch.cuda.reset_peak_memory_stats(device)

    def now_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)


def memory_gauge(device: torch.device) -> MemoryGauge:
    return CudaMemory(device) if device.type == "cuda" else ProcessMemory()


class BudgetWatch:
    """Keeps a run to its plan's memory, and says once when memory goes beyond what the plan promised.

    On CUDA the allocator is capped at the budget, less the CUDA context the
    plan measured (``torch.cuda.set_per_process_memory_fraction``, put back
    when the run ends), so a run that would grow past its budget runs out of
    memory and halves its micro-batch instead; the warning comes when the
    allocator's peak passes the plan's predicted peak. On the CPU one step in
    a while (the second this process runs, and the first after a micro-batch
    change) is counted by the tracker the planner measures with, and the
    warning comes when that peak passes the budget (the resident set the
    progress bar shows counts the interpreter too).

    Use it as a context manager around the run.
    """

    def __init__(self, plan: Plan, *, device: torch.device) -> None:
        self.plan, self.device = plan, device
        self.warned = False
        self._previous_fraction: float | None = None
        self._steps_to_track = 2
        self.tracked_peak_bytes: int | None = None
        self.tracked_last = False
        """Whether the last step ran under the tracker (slower by its bookkeeping: not a step to time)."""

    def __enter__(self) -> BudgetWatch:
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            total = torch.cuda.get_device_properties(index).total_memory
            allocator_bytes = self.plan.budget_bytes - self.plan.headroom.get("context", 0)
            getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
            self._previous_fraction = getter(index) if getter is not None else 1.0
            torch.cuda.set_per_process_memory_fraction(min(1.0, max(allocator_bytes, 1) / total), index)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous_fraction is not None:
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            torch.cuda.set_per_process_memory_fraction(self._previous_fraction, index)

    def measuring(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        """The context of one step: on the CPU, now and then, the tracker counting its live tensor bytes."""
        self.tracked_last = False
        if self.device.type != "cpu" or self._steps_to_track <= 0:
            return nullcontext()
        self._steps_to_track -= 1
        if self._steps_to_track:
            return nullcontext()
        self.tracked_last = True
        return self._tracked(model, optimizer)

    @contextmanager
    def _tracked(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        from autofit.measure.meters import TrackedMeter

        meter = TrackedMeter()
        # Its environment too: compiled code (torchao's 8-bit step) runs eagerly under the tracker's dispatch mode.
        with meter.environment(), meter.measure(model, optimizer) as measurement:
            yield
        self.tracked_peak_bytes = measurement.peak_bytes

    def micro_batch_changed(self) -> None:
        """Count the next step again: its peak is another one."""
        self._steps_to_track = 1

    def warning(self, peak_bytes: int) -> str | None:
        """A line the first time memory passes what was planned (``peak_bytes``: the gauge's, on CUDA); else None."""
        if self.warned:
            return None
        if self.device.type == "cuda":
            predicted = self.plan.predicted.peak_bytes if self.plan.predicted else None
            if predicted is None or peak_bytes <= predicted:
                return None
            text = f"the allocator's peak {format_bytes(peak_bytes)} passed the plan's predicted {format_bytes(predicted)}"
        else:
            tracked = self.tracked_peak_bytes
            if tracked is None or tracked <= self.plan.budget_bytes:
                return None
            text = f"a step's live tensors peaked at {format_bytes(tracked)}, past the budget"
        self.warned = True
        return (
            f"memory: {text} (budget {format_bytes(self.plan.budget_bytes)}); the plan may not hold for this data: "
            "re-plan with a lower --budget or on batches like these"
        )
