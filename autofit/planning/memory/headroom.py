"""Headroom: the bytes a plan keeps free beyond a measured peak, by cause (docs/plan-file.md).

Every device keeps a safety margin. A GPU also keeps what the process holds
outside the allocator (the CUDA context and library workspaces) and an
allowance for the allocator's fragmentation; when planning for a GPU that is
not here, these are assumed, more generously. Nothing else: on the CPU the
meters are exact, so only the safety margin is kept.

What fragments is what is allocated and freed step after step: activations,
autocast's weight copies, workspaces, the optimizer step's temporaries. The
persistent state (parameters, gradients, optimizer state: ``PERSISTENT``) is
allocated in the same few sizes every step and does not grow the allocator's
cache. So when estimated, the fragmentation allowance is a share of the peak
less its persistent bytes (``persistent_bytes`` of the peak's breakdown), not
of the whole peak. A 1.01B-parameter transformer (bench/gpu_validate.py's at
d2048, 20 layers, 512 tokens) has a floor peak of 15.32 GiB for a GPU, 15.05
GiB of it parameters, gradients and AdamW state (simulated: bf16, micro-batch
1, every block checkpointed): it gets 0.03 GiB of fragmentation allowance
where 20% of the whole peak gave 3.06 GiB, and its estimated floor falls from
20.55 to 17.71 GiB.

Calibration of the estimate (``PlanPolicy.estimated_cuda_*``) on the H200 table in
bench/RESULTS.md ("CUDA: simulated prediction vs the real card", 24 cases:
ResNet-50, ViT-B/16 and two d768 transformers, fp32/bf16/fp16, no or full
checkpointing), with each case's persistent bytes at the simulated peak
recomputed on the CPU (``autofit probe --simulate --device cuda``: 0.29-0.35
GiB for ResNet-50, 0.96-1.27 GiB for the others):

- outside the allocator, the process held 0.74-0.75 GiB in every case: the
  context, 768 MiB;
- the rest of what the card needed beyond the simulated peak (the meter's
  under-count, 1-9% of the allocated peak, plus the allocator's cache, 0.35-1.25
  GiB) did not grow with the activations: 1.13 GiB of cache with 0.5 GiB of
  activations (the checkpointed transformers), 1.24 GiB with 5.2 GiB (ResNet-50
  fp32). So it is mostly a fixed reserve, 1.25 GiB, plus 10% of the
  non-persistent bytes; the least share that covers every case with that
  reserve is 7.9%. (With the old fixed 1 GiB the share would have to be 42% of
  the non-persistent bytes, all for the two checkpointed fp32 transformers.)

Every one of the 24 cases is covered without the safety margin: predicted +
context + reserve + fragmentation >= what the process held, with 0.04 GiB to
spare at the least (ResNet-50 fp32, every block checkpointed) and 0.55 GiB on
average (the old 20% of the whole peak: 0.07 and 0.68); tests/planning/memory/test_headroom.py
asserts it from the table. None of those models holds more than 1.27 GiB of
persistent state: that a large model's state adds nothing to the allocator's
cache is what the allocator's design says, not measured here.

With expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``,
a GPU plan's default, recorded in it and set by training) the allocator grows
its segments in place instead of caching whole blocks. Measured both ways on
an H200 (bench/gpu_allocator.py; bench/RESULTS.md, "The CUDA allocator both
ways"), the cache on the same 12 cases fell from 0.35-1.25 GiB to 0.05-0.16
GiB; with the 10% share, a fixed 0.18 GiB covers all 12, and the reserve
kept, ``PlanPolicy.estimated_cuda_expandable_reserve_bytes``, is 0.5 GiB: it
also covers the 0.25 GiB the simulated meter missed on a 0.94B decoder in
bf16-master (every block checkpointed), the largest model measured.

On a real GPU the measured peak is the allocator's reserved bytes, cache
included; ``PlanPolicy.cuda_fragmentation_share`` keeps 5% of the whole peak for that cache
growing over a long run. It stays a share of the whole peak: no long run has
been measured to say what part of the growth the persistent state causes.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from autofit.planning.policy import POLICY

PERSISTENT = ("parameters", "gradients", "optimizer_state")
"""Breakdown categories that are allocated once per step in the same sizes: they do not fragment."""


def persistent_bytes(breakdown: Mapping[str, int]) -> int:
    """Parameters, gradients and optimizer state in a peak's breakdown (``PERSISTENT``)."""
    return sum(breakdown.get(category, 0) for category in PERSISTENT)


@dataclass(kw_only=True, slots=True)
class Headroom:
    """Bytes kept free beyond a measured peak, by cause (docs/plan-file.md).

    Every method takes ``persistent_bytes``, the peak's parameters, gradients
    and optimizer state (``persistent_bytes(breakdown)``; a lower bound of
    them where the peak is only predicted). Only an estimated GPU's
    fragmentation depends on it; elsewhere any value gives the same bytes.
    """

    device_type: str
    estimated: bool
    budget_bytes: int
    context_bytes: int = 0
    """On a GPU: what the process holds outside the allocator (measured, or assumed when estimated)."""
    expandable_segments: bool = False
    """On a GPU: the allocator grows its segments in place (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``), so
    when estimated its reserve is the smaller one measured with them."""

    @classmethod
    def estimated_cuda(cls, budget_bytes: int, *, expandable_segments: bool = False) -> Headroom:
        """The headroom of a plan for a GPU that is not here: its context assumed (``POLICY``)."""
        return cls(
            device_type="cuda", estimated=True, budget_bytes=budget_bytes, context_bytes=POLICY.estimated_cuda_context_bytes,
            expandable_segments=expandable_segments,
        )

    @property
    def depends_on_persistent(self) -> bool:
        """Whether ``persistent_bytes`` changes anything here: only on a GPU that is not here (estimated)."""
        return self.device_type == "cuda" and self.estimated

    def _fragmentation(self, peak_bytes: float, persistent_bytes: float) -> int:
        """The fragmentation allowance for a peak (0 off a GPU)."""
        if self.device_type != "cuda":
            return 0
        if self.estimated:
            return math.ceil(POLICY.estimated_cuda_fragmentation_share * max(peak_bytes - persistent_bytes, 0))
        return math.ceil(POLICY.cuda_fragmentation_share * peak_bytes)

    def _fixed_causes(self) -> dict[str, int]:
        """Causes that do not grow with the peak (the safety margin is added by the caller)."""
        if self.device_type != "cuda":
            return {}
        causes = {"context": self.context_bytes}
        if self.estimated:
            causes["allocator_reserve"] = (
                POLICY.estimated_cuda_expandable_reserve_bytes if self.expandable_segments else POLICY.estimated_cuda_allocator_reserve_bytes
            )
        return causes

    def for_peak(self, peak_bytes: float, *, persistent_bytes: float) -> dict[str, int]:
        """The headroom of a peak, by cause."""
        causes = dict(self._fixed_causes())
        if self.device_type == "cuda":
            causes["fragmentation"] = self._fragmentation(peak_bytes, persistent_bytes)
        causes["safety_margin"] = math.ceil(POLICY.safety_margin_share * self.budget_bytes)
        return causes

    def usable_bytes(self, *, persistent_bytes: float) -> float:
        """The largest peak, holding at least ``persistent_bytes`` of persistent state, whose headroom still fits the budget."""
        # fragmentation is rounded up per peak: keep one byte spare for it
        free = self.budget_bytes - math.ceil(POLICY.safety_margin_share * self.budget_bytes) - sum(self._fixed_causes().values()) - 1
        if self.device_type != "cuda":
            return float(free)
        if not self.estimated:
            return free / (1 + POLICY.cuda_fragmentation_share)
        if free <= persistent_bytes:
            return float(free)  # no peak this large fits: its persistent state alone does not
        # peak + share * (peak - persistent) <= free
        return (free + POLICY.estimated_cuda_fragmentation_share * persistent_bytes) / (1 + POLICY.estimated_cuda_fragmentation_share)

    def smallest_budget(self, peak_bytes: float, *, persistent_bytes: float) -> int:
        """The least budget whose headroom leaves room for this peak."""
        need = peak_bytes + self._fragmentation(peak_bytes, persistent_bytes) + sum(self._fixed_causes().values())
        budget = math.ceil(need / (1 - POLICY.safety_margin_share))
        probe = replace(self, budget_bytes=budget)
        while not probe.fits(peak_bytes, persistent_bytes=persistent_bytes):
            budget += 1 + budget // 10**6
            probe.budget_bytes = budget
        return budget

    def fits(self, peak_bytes: float, *, persistent_bytes: float) -> bool:
        """Whether the peak and its headroom fit the budget."""
        return peak_bytes + sum(self.for_peak(peak_bytes, persistent_bytes=persistent_bytes).values()) <= self.budget_bytes

    def needed_text(self, peak_bytes: float, *, persistent_bytes: float, what: str = "measured peak") -> str:
        """The sum a peak that does not fit needs, against the budget: "measured peak 196.11 MiB + safety margin
        10.00 MiB = 206.11 MiB needed, over the budget 200.00 MiB" (a peak under the budget alone read as if it fit)."""
        from autofit.units import format_bytes

        causes = {cause: size for cause, size in self.for_peak(peak_bytes, persistent_bytes=persistent_bytes).items() if size}
        terms = [f"{what} {format_bytes(peak_bytes)}", *(f"{cause.replace('_', ' ')} {format_bytes(size)}" for cause, size in causes.items())]
        needed = peak_bytes + sum(causes.values())
        return f"{' + '.join(terms)} = {format_bytes(needed)} needed, over the budget {format_bytes(self.budget_bytes)}"
