"""Headroom: the bytes a plan keeps free beyond a measured peak, by cause (see README "plan.json").

Every device keeps a safety margin. A GPU also keeps what the process holds
outside the allocator (the CUDA context and library workspaces) and an
allowance for the allocator's fragmentation, which grows with the peak; when
planning for a GPU that is not here, these are assumed, more generously.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SAFETY_MARGIN = 0.02
"""Share of the budget kept free on every device: the meters are exact, the data may not be."""
CUDA_FRAGMENTATION = 0.05
"""Share of the allocator's peak kept for fragmentation growth over a long run on a GPU."""
# Planning for a GPU that is not here (--simulate --device cuda): bench/gpu_validate.py on an
# H200 (bench/RESULTS.md) found the simulated peak 1-9% under the allocator's allocated peak,
# the allocator's cache 0.35-1.25 GiB above that, and 0.75 GiB outside the allocator in every
# case. These three cover all 24 measured cases.
ESTIMATED_CUDA_FRAGMENTATION = 0.20
"""Share of the simulated peak kept for the meter's under-count and the allocator's cache growing with it."""
ESTIMATED_CUDA_ALLOCATOR_RESERVE = 2**30
"""Fixed part of the allocator's cache (reserved - allocated) when estimated."""
ESTIMATED_CUDA_CONTEXT = 768 * 2**20
"""CUDA context and library workspaces assumed when planning for a GPU that is not here."""


@dataclass(kw_only=True, slots=True)
class Headroom:
    """Bytes kept free beyond a measured peak, by cause (see README "plan.json")."""

    device_type: str
    estimated: bool
    budget_bytes: int
    context_bytes: int = 0
    """On a GPU: what the process holds outside the allocator (measured, or assumed when estimated)."""

    def _fragmentation_share(self) -> float:
        if self.device_type != "cuda":
            return 0.0
        return ESTIMATED_CUDA_FRAGMENTATION if self.estimated else CUDA_FRAGMENTATION

    def _fixed_causes(self) -> dict[str, int]:
        """Causes that do not grow with the peak (the safety margin is added by the caller)."""
        if self.device_type != "cuda":
            return {}
        causes = {"context": self.context_bytes}
        if self.estimated:
            causes["allocator_reserve"] = ESTIMATED_CUDA_ALLOCATOR_RESERVE
        return causes

    def for_peak(self, peak_bytes: float) -> dict[str, int]:
        causes = dict(self._fixed_causes())
        if self.device_type == "cuda":
            causes["fragmentation"] = math.ceil(self._fragmentation_share() * peak_bytes)
        causes["safety_margin"] = math.ceil(SAFETY_MARGIN * self.budget_bytes)
        return causes

    def usable_bytes(self) -> float:
        """The largest peak whose headroom still fits the budget."""
        fixed = math.ceil(SAFETY_MARGIN * self.budget_bytes) + sum(self._fixed_causes().values())
        # fragmentation is rounded up per peak: keep one byte spare for it
        return (self.budget_bytes - fixed - 1) / (1 + self._fragmentation_share())

    def smallest_budget(self, peak_bytes: float) -> int:
        """The least budget whose headroom leaves room for this peak."""
        need = peak_bytes + math.ceil(self._fragmentation_share() * peak_bytes) + sum(self._fixed_causes().values())
        budget = math.ceil(need / (1 - SAFETY_MARGIN))
        probe = Headroom(device_type=self.device_type, estimated=self.estimated, budget_bytes=budget, context_bytes=self.context_bytes)
        while not probe.fits(peak_bytes):
            budget += 1 + budget // 10**6
            probe.budget_bytes = budget
        return budget

    def fits(self, peak_bytes: float) -> bool:
        return peak_bytes + sum(self.for_peak(peak_bytes).values()) <= self.budget_bytes

