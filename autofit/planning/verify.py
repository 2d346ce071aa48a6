"""Step 4 of planning: measure the best candidates; only a configuration measured to fit is chosen.

``Measurements`` holds every measurement of one run, by configuration: exact
peaks by the simulated meter (equal to the CPU meter, no arithmetic), real
probes with the device's meter, and timings of plain training steps.
``verify`` measures the best predicted candidates with it and picks the
fastest that fits; ``measure_unconstrained`` measures the fastest
configuration with no budget, for the summary's ratio.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autofit.errors import UserError
from autofit.measure.meters import release_device_memory
from autofit.measure.probe import probe
from autofit.planning.context import Config, PlanContext
from autofit.planning.cost_model import CostModel, time_configuration
from autofit.planning.headroom import ESTIMATED_CUDA_CONTEXT, Headroom
from autofit.planning.search import MODEL_SLACK, Evaluation, cheapest_checkpoint
from autofit.units import format_bytes

VERIFY_TOP = 3
"""Candidates verified with real probes."""
VERIFY_WITHIN = 0.75
"""Only candidates predicted at least this fraction of the best candidate's speed are worth a real probe."""
NOISE = 0.03
"""Measured speeds this close are a tie (timing noise); the simpler configuration wins a tie."""
VERIFY_ATTEMPTS = 5
"""Checkpoint sets measured per (precision, micro-batch) before it is given up."""
TIMING_ROUNDS = 2
"""Each verified candidate is timed this many times, in interleaved rounds; its fastest round counts."""


class Measurements:
    """Every measurement of one planning run, by configuration, counted for the report.

    Two micro-batches stand for all of them in a memory probe (later
    micro-steps repeat the second); the samples not traced are added as the
    host's copy of the global batch where the meter counts it.
    """

    def __init__(self, context: PlanContext, *, host_sample_bytes: int, verified: dict[str, dict]) -> None:
        self.context = context
        self.host_sample_bytes = host_sample_bytes
        self.verified = verified
        """Real probes (peak and speed) by configuration key; kept in the study, so a rerun reuses them."""
        self.simulated_checks = 0
        self.memory_probes = 0
        self.real_probes = 0
        self.rejected: list[dict] = []
        """Configurations ruled out, with why."""
        self._exact: dict[str, tuple[int, dict]] = {}
        self._real: dict[str, tuple[int, dict, int]] = {}
        self._measured_context_bytes: int | None = None

    @property
    def headroom(self) -> Headroom:
        """The budget's headroom as measured so far: on a real GPU the first probe replaces the assumed context."""
        context = self.context
        assumed = ESTIMATED_CUDA_CONTEXT if context.device == "cuda" else 0
        measured = self._measured_context_bytes
        return Headroom(
            device_type=context.device, estimated=context.simulate, budget_bytes=context.budget_bytes,
            context_bytes=assumed if measured is None else measured,
        )

    def reject(self, config: Config, why: str) -> None:
        self.rejected.append({"config": config.key(), "why": why})

    def checked_peak(self, config: Config) -> tuple[int, dict]:
        """A configuration's peak by the meter that has the last word: the device's, or the simulated one when simulating."""
        if self.context.simulate:
            return self.exact_peak(config)
        peak, breakdown, _ = self.real_peak(config)
        return peak, breakdown

    def exact_peak(self, config: Config) -> tuple[int, dict]:
        """The simulated meter's peak of a configuration and its breakdown: equal to the CPU meter, no arithmetic."""
        key = config.key()
        if key not in self._exact:
            context, m = self.context, config.micro_batch_size
            traced = min(context.global_batch_size, 2 * m)
            result = probe(
                context.sim_spec, micro_batch_size=m, global_batch_size=traced, precision=config.precision,
                checkpoint=list(config.checkpoint), device=context.device, simulate=True, steps=2,
            )
            host = (context.global_batch_size - traced) * self.host_sample_bytes
            breakdown = dict(result.breakdown)
            breakdown["activations"] = breakdown.get("activations", 0) + host
            self._exact[key] = (result.peak_bytes + host, breakdown)
            self.simulated_checks += 1
        return self._exact[key]

    def real_peak(self, config: Config) -> tuple[int, dict, int]:
        """The device meter's peak of a configuration (less the GPU context), its breakdown, and the context."""
        key = config.key()
        if key not in self._real:
            context, m = self.context, config.micro_batch_size
            traced = min(context.global_batch_size, 2 * m)
            try:
                result = probe(
                    context.spec, micro_batch_size=m, global_batch_size=traced, precision=config.precision,
                    checkpoint=list(config.checkpoint), device=context.device, steps=2,
                )
            except torch.OutOfMemoryError:
                release_device_memory(context.device)
                self.reject(config, "out of memory on the device")
                self._real[key] = (context.info.total_bytes, {}, 0)
                return self._real[key]
            on_gpu = context.device == "cuda"
            breakdown = dict(result.breakdown)
            context_bytes = breakdown.pop("context", 0) if on_gpu else 0
            # The CPU meter counts the host's global batch too; the GPU meter does not see it.
            host = 0 if on_gpu else (context.global_batch_size - traced) * self.host_sample_bytes
            breakdown["activations"] = breakdown.get("activations", 0) + host
            self._real[key] = (result.peak_bytes - context_bytes + host, breakdown, context_bytes)
            self.memory_probes += 1
            if on_gpu:
                # The context is measured now: the largest seen replaces the assumption.
                self._measured_context_bytes = max(self._measured_context_bytes or 0, context_bytes)
        return self._real[key]

    def real_probe(self, config: Config) -> dict:
        """Measure a configuration on the device (or reuse a stored measurement): its peak, speed and headroom.

        Memory: ``real_peak``. Speed: plain training steps of the whole
        global batch, timed without the meter's bookkeeping.
        """
        key = config.key()
        if key not in self.verified:
            try:
                peak, breakdown, context_bytes = self.real_peak(config)
                speed = self._time(config)
            except torch.OutOfMemoryError:
                release_device_memory(self.context.device)
                self.verified[key] = {"measured_peak_bytes": None, "measured_samples_per_s": 0.0, "meter": self.context.device, "oom": True}
            else:
                self.real_probes += 1
                self.verified[key] = {
                    "measured_peak_bytes": peak, "measured_samples_per_s": speed, "timing_rounds": 1,
                    "meter": self.context.device, "breakdown": breakdown, "context_bytes": context_bytes,
                }
        measured = dict(self.verified[key])
        if measured.get("oom"):
            return {**measured, "fits": False, "headroom": {}}
        headroom = self.headroom
        measured.update(headroom=headroom.for_peak(measured["measured_peak_bytes"]), fits=headroom.fits(measured["measured_peak_bytes"]))
        return measured

    def retime(self, config: Config) -> float:
        """Time a measured configuration once more (up to TIMING_ROUNDS in all); its fastest round counts."""
        entry = self.verified[config.key()]
        if not entry.get("oom") and entry.get("timing_rounds", 1) < TIMING_ROUNDS:
            entry["measured_samples_per_s"] = max(entry["measured_samples_per_s"], self._time(config))
            entry["timing_rounds"] = entry.get("timing_rounds", 1) + 1
        return entry["measured_samples_per_s"]

    def _time(self, config: Config) -> float:
        context = self.context
        return time_configuration(
            context.spec, precision=config.precision, micro_batch_size=config.micro_batch_size,
            global_batch_size=context.global_batch_size, checkpoint=list(config.checkpoint), device=context.device,
        )


@dataclass(kw_only=True, slots=True)
class _Candidate:
    """A configuration whose exact peak fits, with what the cost model predicted for it."""

    config: Config
    predicted_samples_per_s: float
    predicted_peak_bytes: float
    exact_peak_bytes: int
    breakdown: dict
    fallback: bool = False
    """The floor configuration, added because no better candidate fit."""

    def result(self) -> dict:
        return {
            "config": self.config, "predicted_samples_per_s": self.predicted_samples_per_s,
            "predicted_peak_bytes": self.predicted_peak_bytes, "exact_peak_bytes": self.exact_peak_bytes,
            "breakdown": self.breakdown,
        }


def verify(
    context: PlanContext,
    model: CostModel,
    evaluations: list[Evaluation],
    *,
    floor_config: Config,
    floor_bytes: int,
    measurements: Measurements,
) -> dict:
    """The fastest configuration measured to fit, with its measurements (what ``write_plan`` reads).

    1. Exact memory for the best predicted candidates, trying a few checkpoint sets each.
    2. The floor configuration when none of them fit (it fits by construction: a plan always exists).
    3. When simulating, the fastest predicted wins. Otherwise each is probed on the
       device and timed in interleaved rounds; measured speeds within NOISE are a
       tie, won by the simpler configuration.

    Raises:
        UserError: no configuration was measured to fit.
    """
    candidates = _exactly_fitting(context, model, evaluations, measurements)
    if not any(c.config.key() == floor_config.key() for c in candidates):
        candidates.append(_floor_candidate(model, floor_config, measurements))
    meter = "simulated meter" if context.simulate else f"{context.device} meter"
    context.log(f"verify: {len(candidates)} candidate(s) measured to fit ({meter})" + ("" if context.simulate else "; timing them"))
    if context.simulate:
        first = candidates[0]
        return {
            **first.result(), "measured_peak_bytes": first.exact_peak_bytes, "measured_samples_per_s": None,
            "meter": "simulated", "headroom": measurements.headroom.for_peak(first.exact_peak_bytes),
        }
    fitting = _measured_on_device(candidates, measurements)
    if not fitting:
        raise UserError(
            f"no configuration was measured to fit {format_bytes(context.budget_bytes)} (the floor is "
            f"{format_bytes(floor_bytes)}); raise the budget a little or lower --batch-size"
        )
    fastest = max(r["measured_samples_per_s"] for r in fitting)
    ties = [r for r in fitting if r["measured_samples_per_s"] >= (1 - NOISE) * fastest]
    return min(ties, key=lambda r: r["config"].simplicity(context.global_batch_size))


def _exactly_fitting(
    context: PlanContext, model: CostModel, evaluations: list[Evaluation], measurements: Measurements
) -> list[_Candidate]:
    """Up to VERIFY_TOP candidates whose exact peak fits, fastest predicted first."""
    # Fastest predicted first; on a tie, fewer micro-steps and fewer checkpointed blocks first.
    ranked = sorted(
        (e for e in evaluations if e.fits), key=lambda e: (-round(e.samples_per_s, 6), e.grad_accum_steps, len(e.checkpoint))
    )
    candidates: list[_Candidate] = []
    best_predicted = None
    for evaluation in ranked:
        if len(candidates) >= VERIFY_TOP:
            break
        if best_predicted is not None and evaluation.samples_per_s < VERIFY_WITHIN * best_predicted:
            break
        candidate = _fitting_checkpoint_set(context, model, evaluation, measurements)
        if candidate is not None:
            candidates.append(candidate)
            best_predicted = best_predicted or candidate.predicted_samples_per_s
    return candidates


def _fitting_checkpoint_set(
    context: PlanContext, model: CostModel, evaluation: Evaluation, measurements: Measurements
) -> _Candidate | None:
    """The search's checkpoint set for this point, measured; while it does not fit, one the model predicts smaller."""
    precision, size = evaluation.precision, evaluation.micro_batch_size
    segments, drops = model.precisions[precision].memory.at(size, global_batch_size=context.global_batch_size)
    seconds = model.recompute_seconds(precision, size)
    # Limits below are in the model's own (unscaled) bytes.
    limit = measurements.headroom.usable_bytes() / model.memory_scale * (1 + MODEL_SLACK)
    names = evaluation.checkpoint
    for _attempt in range(VERIFY_ATTEMPTS):
        blocks = frozenset(model.blocks.index(n) for n in names)
        raw = model.peak_bytes(precision, size, blocks) / model.memory_scale
        if raw > limit:  # the scale learnt from an earlier measurement rules this set out
            choice = cheapest_checkpoint(segments, drops, seconds, limit_bytes=limit)
            if choice is None:
                return None
            names, blocks = [model.blocks[b] for b in sorted(choice.blocks)], choice.blocks
            raw = model.peak_bytes(precision, size, blocks) / model.memory_scale
        config = Config(precision=precision, micro_batch_size=size, checkpoint=tuple(names))
        peak, breakdown = measurements.checked_peak(config)
        if context.device == "cuda" and not context.simulate and raw > 0:
            # The simulated bytes miss the allocator's rounding and cache: learn by how much.
            model.memory_scale = max(model.memory_scale, peak / raw)
        if measurements.headroom.fits(peak):
            return _Candidate(
                config=config, predicted_samples_per_s=model.samples_per_s(precision, size, blocks),
                predicted_peak_bytes=model.peak_bytes(precision, size, blocks), exact_peak_bytes=peak, breakdown=breakdown,
            )
        measurements.reject(config, f"measured peak {format_bytes(peak)} does not fit")
        # The model was optimistic for this set: ask for a set it predicts smaller, and measure again.
        limit = min(limit, raw) - 1
        choice = cheapest_checkpoint(segments, drops, seconds, limit_bytes=limit)
        if choice is None:
            return None
        names = [model.blocks[b] for b in sorted(choice.blocks)]
    return None


def _floor_candidate(model: CostModel, floor_config: Config, measurements: Measurements) -> _Candidate:
    """The floor configuration as a candidate: it fits by construction, so a plan exists even if every guess missed."""
    peak, breakdown = measurements.checked_peak(floor_config)
    precision, size = floor_config.precision, floor_config.micro_batch_size
    blocks = frozenset(model.blocks.index(n) for n in floor_config.checkpoint)
    return _Candidate(
        config=floor_config, predicted_samples_per_s=model.samples_per_s(precision, size, blocks),
        predicted_peak_bytes=model.peak_bytes(precision, size, blocks), exact_peak_bytes=peak, breakdown=breakdown,
        fallback=True,
    )


def _measured_on_device(candidates: list[_Candidate], measurements: Measurements) -> list[dict]:
    """The candidates whose real probe fits, each with its fastest of TIMING_ROUNDS timings."""
    fitting = []
    for candidate in candidates:
        if fitting and candidate.fallback:
            continue  # the fallback is not needed
        measured = measurements.real_probe(candidate.config)
        if not measured["fits"]:
            why = (
                "out of memory on the device" if measured.get("oom")
                else f"measured peak {format_bytes(measured['measured_peak_bytes'])} + headroom does not fit"
            )
            measurements.reject(candidate.config, why)
            continue
        fitting.append({**candidate.result(), **measured})
    # Later rounds visit every candidate again, so that a burst of other work slows one round, not one candidate.
    for _ in range(TIMING_ROUNDS - 1):
        for result in fitting:
            result["measured_samples_per_s"] = measurements.retime(result["config"])
    return fitting


def measure_unconstrained(
    context: PlanContext, evaluations: list[Evaluation], *, chosen: dict, measurements: Measurements
) -> dict:
    """The fastest configuration with no budget (no checkpointing), measured for the speed ratio."""
    best = max(evaluations, key=lambda e: (round(e.plain_samples_per_s, 6), -e.grad_accum_steps))
    config = Config(precision=best.precision, micro_batch_size=best.micro_batch_size)
    result = {
        "precision": config.precision, "micro_batch_size": config.micro_batch_size,
        "grad_accum_steps": best.grad_accum_steps, "checkpoint": [],
        "predicted_peak_bytes": int(best.plain_peak_bytes), "predicted_samples_per_s": best.plain_samples_per_s,
    }
    if context.simulate:
        result["peak_bytes"] = measurements.exact_peak(config)[0]
        result["samples_per_s"] = None
    elif config.key() == chosen["config"].key():
        result["peak_bytes"] = chosen["measured_peak_bytes"]
        result["samples_per_s"] = chosen["measured_samples_per_s"]
    elif context.device == "cpu" or best.plain_peak_bytes < 0.9 * context.info.total_bytes:
        measured = measurements.real_probe(config)
        result["peak_bytes"] = measured["measured_peak_bytes"]
        result["samples_per_s"] = (measurements.retime(config) if not measured.get("oom") else 0.0) or None
    return result
