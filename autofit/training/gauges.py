"""Memory now and at its peak, for the progress bar and metrics.jsonl: CUDA's allocator or the process's resident set."""
from __future__ import annotations

import math
import resource
import time

import torch


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
