"""What the verification hands on: typed, frozen records in place of dicts read by key.

``Candidate`` is a configuration the search predicted and the verification may measure; ``Measurement`` is
what the plan's meter (and the race, where one ran) said of a configuration; ``Verified`` is the chosen one,
with both, and the memory model's calibration learnt while measuring (``memory_scale``), which the planner folds
into the next cost model: the verification changes nothing it did not make. ``Unconstrained`` is the fastest
configuration with no budget, for the speed ratio. ``VerifiedPoint`` is what verification measured of any
configuration, for the plan's alternatives.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from autofit.config import TrainingConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """A configuration that fits (measured, or decided by the memory model), with what the cost model predicted."""

    config: TrainingConfig
    predicted_samples_per_s: float
    predicted_peak_bytes: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """What was measured of one configuration, for the plan (``Measurements.result``)."""

    peak_bytes: int
    """The meter's peak (on cuda without the CUDA context, which is under the headroom)."""
    samples_per_s: float | None
    """The median of its timed rounds; None when nothing was timed (simulating)."""
    meter: str
    """"simulated", "cpu" or "cuda"."""
    breakdown: dict[str, int] = field(default_factory=dict)
    noise: float | None = None
    """How well its fastest rounds repeated (0.05 is 5%); None when not timed."""
    context_bytes: int = 0
    host_peak_bytes: int = 0
    headroom: dict[str, int] = field(default_factory=dict)
    """The headroom its peak needs, by cause (``Headroom.for_peak``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Verified:
    """The configuration the verification chose: what was predicted of it and what was measured."""

    candidate: Candidate
    measurement: Measurement
    memory_scale: float = 1.0
    """The cost model's measured/simulated peak ratio after this verification (``CostModel.memory_scale``): the
    planner folds it into the cost model it writes the plan with."""

    @property
    def config(self) -> TrainingConfig:
        return self.candidate.config

    def with_config(self, config: TrainingConfig, measurement: Measurement) -> Verified:
        """The same prediction for another form of the configuration (compiled), with that form's measurement."""
        return replace(self, candidate=replace(self.candidate, config=config), measurement=measurement)


@dataclass(frozen=True, kw_only=True, slots=True)
class Unconstrained:
    """The fastest configuration with no budget (no checkpointing): what the plan's speed is compared with."""

    precision: str
    micro_batch_size: int
    grad_accum_steps: int
    predicted_peak_bytes: int
    predicted_samples_per_s: float
    peak_bytes: int
    """Measured where it was measured (``peak_measured``), else the cost model's."""
    peak_measured: bool
    samples_per_s: float | None
    """Timed beside the candidates; None when not timed."""

    def for_plan(self) -> dict:
        """The fields the plan file keeps (``Measured.unconstrained``)."""
        return {
            "precision": self.precision, "micro_batch_size": self.micro_batch_size, "grad_accum_steps": self.grad_accum_steps,
            "peak_bytes": self.peak_bytes, "peak_measured": self.peak_measured, "samples_per_s": self.samples_per_s,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifiedPoint:
    """What verification measured of one configuration, for the plan's alternatives (``Measurements.verified``)."""

    fits: bool
    """The measured peak and its headroom fit the budget (False: out of memory on the device)."""
    measured_peak_bytes: int | None = None
    """None: its peak was not measured (out of memory on the device)."""
    measured_samples_per_s: float | None = None
    """None: never timed."""
    rejected: str | None = None
    """Why verification rejected it (None: it did not)."""

    def alternative_fields(self) -> dict:
        """The fields an alternative of the plan adds from it: the measured peak and speed where the peak was
        measured, and why it was rejected where it was."""
        fields: dict = {}
        if self.measured_peak_bytes is not None:
            fields |= {"measured_peak_bytes": self.measured_peak_bytes, "measured_samples_per_s": self.measured_samples_per_s}
        if self.rejected is not None:
            fields["rejected"] = self.rejected
        return fields

