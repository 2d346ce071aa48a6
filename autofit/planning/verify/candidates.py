"""Step 5 of planning: measure the best candidates; only a configuration measured to fit is chosen.

With every measurement of the run (``measurements.Measurements``),
``verify`` times the best predicted candidates side by side, in interleaved
rounds until the fastest is clear or the rest are within the noise
(``timing``), and measures the peak of the one it picks, in this run,
before it is chosen; ``measure_unconstrained`` reports the fastest
configuration with no budget, timed in the same rounds.

A candidate's peak is measured before it is timed only where the memory
model does not already decide that it fits: on a real GPU (whose allocator
the model only scales to), or within ``POLICY.decided_margin_share`` of the usable bytes.
"""
from __future__ import annotations

from dataclasses import replace

from autofit.errors import UserError
from autofit.config import TrainingConfig
from autofit.planning.context import PlanContext
from autofit.planning.costs import CostModel
from autofit.planning.memory.levers import LeverChoice
from autofit.planning.verify.measurements import Measurements
from autofit.planning.records import Candidate, Unconstrained, Verified
from autofit.planning.search.space import Evaluation, LeverSearch, cheapest_for
from autofit.planning.speed.timing import tie_cap
from autofit.planning.policy import POLICY
from autofit.units import format_bytes
from strategies import PRECISIONS


def verify(
    context: PlanContext,
    model: CostModel,
    evaluations: list[Evaluation],
    *,
    floor_config: TrainingConfig,
    floor_bytes: int,
    measurements: Measurements,
    reference: TrainingConfig | None = None,
    levers: LeverSearch | None = None,
) -> Verified:
    """The fastest configuration measured to fit, with its measurements (what ``write_plan`` reads).

    1. The best predicted candidates: each measured when the memory model does
       not decide that it fits, trying a few checkpoint sets while it does not.
    2. The floor configuration when none of them fit (it fits by construction: a plan always exists).
    3. When simulating, the fastest predicted wins. Otherwise they are timed on
       the device in interleaved rounds (``Measurements.race``, with
       ``reference`` for the speed ratio); speeds within the noise are a tie,
       won by the simpler configuration.
    4. The winner's peak is measured in this run; one that does not fit gives way to the next.

    ``levers``: the memory levers the search used (their time terms, and what a candidate may fall back on).

    ``model`` is frozen: what the measurements teach it (on a GPU, the allocator's rounding as ``memory_scale``) is
    a new model each helper returns to the next, and its scale is returned in ``Verified.memory_scale``, for the
    planner to fold into the cost model it goes on with.

    Raises:
        UserError: no configuration was measured to fit.
    """
    levers = levers or LeverSearch()
    candidates, model = _candidates(context, model, evaluations, measurements, levers)
    if reference is not None and reference.key() not in {c.config.key() for c in candidates}:
        # Timed beside them anyway: where it fits it is a candidate too (the simplest, often the fastest).
        plain = next((e for e in evaluations if e.plain_config.key() == reference.key()), None)
        if plain is not None and plain.fits and not plain.config.checkpoint and not plain.config.selective_checkpoint:
            fitting, model = _fitting_checkpoint_set(context, model, plain, measurements, levers)
            config = fitting.config if fitting is not None else None
            if config is not None and not config.checkpoint and not config.selective_checkpoint and not config.levers():
                candidates.append(fitting)
    if not candidates:
        candidates = [_candidate(model, floor_config, levers)]
    for candidate in candidates:
        measurements.predicted[candidate.config.key()] = candidate.predicted_peak_bytes
    meter = "simulated meter" if context.simulate else f"{context.device} meter"
    measured = sum(c.config.key() in measurements.peaks for c in candidates)
    context.log(
        f"verify: {len(candidates)} candidate(s), {measured} measured to fit ({meter}), "
        f"{len(candidates) - measured} by the memory model's margin" + ("" if context.simulate else "; timing them side by side")
    )
    if context.simulate:
        order = [c.config for c in candidates]
    else:
        timed_reference = reference if reference is not None and reference.key() not in {c.config.key() for c in candidates} else None
        order = measurements.race([c.config for c in candidates], reference=timed_reference)
    by_key = {c.config.key(): c for c in candidates}
    for config in order:
        peak, breakdown = measurements.checked_peak(config, fresh=True)
        if measurements.fits(config):
            return Verified(candidate=by_key[config.key()], measurement=measurements.result(config), memory_scale=model.memory_scale)
        excess = measurements.host_excess(measurements.host_peak(config))
        measurements.reject(config, excess or measurements.over_budget(peak, breakdown))
    # Every guess missed: the floor fits by construction.
    floor = _candidate(model, floor_config, levers)
    measurements.checked_peak(floor_config, fresh=True)
    if not measurements.fits(floor_config):
        host = measurements.host_refusal()
        if host is not None:
            raise UserError(f"no configuration fits {format_bytes(context.budget_bytes)} and the host's memory: {host}")
        raise UserError(
            f"no configuration was measured to fit {format_bytes(context.budget_bytes)} (the floor is "
            f"{format_bytes(floor_bytes)}); raise the budget a little or lower --batch-size"
        )
    if not context.simulate:
        measurements.race([floor_config])
    return Verified(candidate=floor, measurement=measurements.result(floor_config), memory_scale=model.memory_scale)


def _candidates(
    context: PlanContext, model: CostModel, evaluations: list[Evaluation], measurements: Measurements, levers: LeverSearch,
) -> tuple[list[Candidate], CostModel]:
    """Up to ``POLICY.verify_top_candidates`` candidates that fit (measured, or decided by the model), fastest predicted
    first (one when simulating), and the model as their measurements calibrated it."""
    # Fastest predicted first; on a tie, fewer micro-steps, fewer checkpointed blocks, then the simpler precision
    # (bf16 before fp16, which needs a loss scaler) first.
    ranked = sorted(
        (e for e in evaluations if e.fits),
        key=lambda e: (
            -round(e.samples_per_s, 6), e.config.grad_accum_steps,
            len(e.config.checkpoint) + len(e.config.selective_checkpoint) + len(e.config.offload), PRECISIONS.index(e.config.precision),
        ),
    )
    candidates: list[Candidate] = []
    best_predicted = None
    # Simulating, the fastest predicted that fits wins: nothing is timed, so one candidate is enough.
    wanted = 1 if context.simulate else POLICY.verify_top_candidates
    for evaluation in ranked:
        if len(candidates) >= wanted:
            break
        if best_predicted is not None and evaluation.samples_per_s < POLICY.verify_within_share * best_predicted:
            break
        candidate, model = _fitting_checkpoint_set(context, model, evaluation, measurements, levers)
        if candidate is not None:
            candidates.append(candidate)
            best_predicted = best_predicted or candidate.predicted_samples_per_s
    if best_predicted is not None and not context.simulate:
        # The predictions come from timings too: the simplest point predicted within their noise of the best
        # could win the tie once measured, so it is timed as well (a noisy size is not ruled out unseen).
        def band(e: Evaluation) -> float:
            return min(max(context.tie, model.precisions[e.config.precision].speed.noise), tie_cap(context.tie))

        near = [e for e in ranked if e.samples_per_s >= best_predicted * (1 - band(e))]
        simplest = min(
            near, key=lambda e: (
                e.config.grad_accum_steps, len(e.config.checkpoint) + len(e.config.selective_checkpoint), PRECISIONS.index(e.config.precision),
            ),
            default=None,
        )
        keys = {(c.config.precision, c.config.micro_batch_size) for c in candidates}
        if simplest is not None and (simplest.config.precision, simplest.config.micro_batch_size) not in keys:
            candidate, model = _fitting_checkpoint_set(context, model, simplest, measurements, levers)
            if candidate is not None:
                candidates.append(candidate)
        # Selective recomputation's price is an estimated share of each block's forward times a factor measured
        # apart from the plain step, which load skews: a candidate with selective blocks races its point's cheapest
        # set without them too (on a loaded CPU, two selective blocks were chosen where one full block ran 1.25x faster).
        for candidate in list(candidates):
            if candidate.config.selective_checkpoint:
                alternative, model = _without_selective(context, model, candidate.config, measurements, levers)
                if alternative is not None and alternative.config.key() not in {c.config.key() for c in candidates}:
                    candidates.append(alternative)
    return candidates, model


def _without_selective(
    context: PlanContext, model: CostModel, config: TrainingConfig, measurements: Measurements, levers: LeverSearch,
) -> tuple[Candidate | None, CostModel]:
    """The cheapest checkpoint set of this point without selective blocks (same levers), measured unless decided; and
    the model as its measurement calibrated it."""
    precision, size = config.precision, config.micro_batch_size
    limit = measurements.usable_bytes(precision) / model.memory_scale / measurements.scale(precision) * (1 + measurements.slack)
    gradient_levers = replace(lever_choice(model, config), offload=frozenset())
    choice = cheapest_for(model, precision, size, limit_bytes=limit, levers=gradient_levers, search=levers, selective=False)
    if choice is None:
        return None, model
    evaluation = Evaluation(config=_config(model, config, choice, gradient_levers), fits=True)
    candidate, model = _fitting_checkpoint_set(context, model, evaluation, measurements, levers)
    return (candidate if candidate is not None and not candidate.config.selective_checkpoint else None), model


def _decided(model: CostModel, config: TrainingConfig, measurements: Measurements) -> bool:
    """Whether the memory model alone says this configuration fits, with ``POLICY.decided_margin_share`` to spare."""
    if not measurements.model_is_exact or config.frozen_nf4:  # NF4's dequantization is bounded, not traced: measure it
        return False
    predicted = predicted_peak(model, config) * measurements.scale(config.precision)
    return predicted <= measurements.usable_bytes(config.precision) * (1 - POLICY.decided_margin_share)


def _fitting_checkpoint_set(
    context: PlanContext, model: CostModel, evaluation: Evaluation, measurements: Measurements, levers: LeverSearch,
) -> tuple[Candidate | None, CostModel]:
    """The search's checkpoint modes and levers for this point, measured unless decided; while they do not fit,
    modes the model predicts smaller (with the same step in backward and optimizer state). With it, the model as
    its measurements calibrated it (on a GPU, a larger ``memory_scale``)."""
    config = evaluation.config
    precision, size = config.precision, config.micro_batch_size
    # Limits below are in the model's own (unscaled) bytes.
    limit = measurements.usable_bytes(precision) / model.memory_scale / measurements.scale(precision) * (1 + measurements.slack)
    gradient_levers = replace(lever_choice(model, config), offload=frozenset())
    for _attempt in range(POLICY.verify_attempts):
        raw = predicted_peak(model, config) / model.memory_scale
        if raw > limit:  # the scale learnt from an earlier measurement rules this set out
            choice = cheapest_for(model, precision, size, limit_bytes=limit, levers=gradient_levers, search=levers)
            if choice is None:
                return None, model
            config = _config(model, config, choice, gradient_levers)
            raw = predicted_peak(model, config) / model.memory_scale
        if _decided(model, config, measurements) and config.key() not in measurements.peaks:
            return _candidate(model, config, levers), model
        peak, breakdown = measurements.checked_peak(config)
        if context.device == "cuda" and not context.simulate and raw > 0:
            # The simulated bytes miss the allocator's rounding and cache: learn by how much (a new model).
            model = replace(model, memory_scale=max(model.memory_scale, peak / raw))
        elif not measurements.peaks[config.key()].get("oom"):
            measurements.learn(precision, measured=peak, predicted=raw * model.memory_scale)
        if measurements.fits(config):
            return _candidate(model, config, levers), model
        excess = measurements.host_excess(measurements.host_peak(config))
        if excess is not None:  # checkpointing keeps no less on the host: this point does not fit
            measurements.reject(config, excess)
            return None, model
        measurements.reject(config, measurements.over_budget(peak, breakdown))
        # The model was optimistic for this set: ask for a set it predicts smaller, and measure again.
        limit = min(limit, raw, measurements.usable_bytes(precision) / model.memory_scale / measurements.scale(precision)) - 1
        choice = cheapest_for(model, precision, size, limit_bytes=limit, levers=gradient_levers, search=levers)
        if choice is None:
            return None, model
        config = _config(model, config, choice, gradient_levers)
    return None, model


def _indices(model: CostModel, config: TrainingConfig) -> tuple[frozenset[int], frozenset[int]]:
    """The configuration's fully and selectively checkpointed blocks, as the cost model's indices."""
    return model.indices(config.checkpoint), model.indices(config.selective_checkpoint)


def _config(model: CostModel, point: TrainingConfig, choice, levers: LeverChoice) -> TrainingConfig:
    """``point`` (its precision and micro-batch) with the knapsack's ``choice`` of blocks and ``levers``."""
    return replace(
        point, checkpoint=model.names(choice.blocks), selective_checkpoint=model.names(choice.selective),
        offload=model.names(choice.offload), optimizer_in_backward=levers.optimizer_in_backward,
        optimizer_state=levers.optimizer_state, loss_chunks=levers.loss_chunks, frozen_nf4=levers.frozen_nf4,
    )


def lever_choice(model: CostModel, config: TrainingConfig) -> LeverChoice:
    """The configuration's memory levers, as the memory model takes them."""
    return LeverChoice(
        offload=model.indices(config.offload), optimizer_in_backward=config.optimizer_in_backward,
        optimizer_state=config.optimizer_state, loss_chunks=config.loss_chunks, frozen_nf4=config.frozen_nf4,
    )


def predicted_peak(model: CostModel, config: TrainingConfig) -> float:
    """The cost model's peak of ``config`` (its precision, micro-batch, blocks and levers), before headroom."""
    blocks, selective = _indices(model, config)
    return model.peak_bytes(config.precision, config.micro_batch_size, blocks, selective, levers=lever_choice(model, config))


def _candidate(model: CostModel, config: TrainingConfig, levers: LeverSearch) -> Candidate:
    blocks, selective = _indices(model, config)
    precision, size = config.precision, config.micro_batch_size
    seconds = model.step_seconds(precision, size, blocks, selective)
    seconds += levers.lever_seconds(model, precision, size, lever_choice(model, config), checkpoint=blocks)
    return Candidate(
        config=config, predicted_samples_per_s=model.global_batch_size / seconds, predicted_peak_bytes=predicted_peak(model, config),
    )


def unconstrained_config(evaluations: list[Evaluation]) -> tuple[TrainingConfig, Evaluation]:
    """The fastest configuration with no budget (no checkpointing), as the cost model sees it."""
    best = max(evaluations, key=lambda e: (round(e.plain_samples_per_s, 6), -e.config.grad_accum_steps))
    return best.plain_config, best


def timed_reference(context: PlanContext, evaluations: list[Evaluation]) -> TrainingConfig | None:
    """The unconstrained configuration, when it is safe to time beside the candidates (not when simulating,
    nor on a GPU where it would need most of the card)."""
    if context.simulate:
        return None
    config, best = unconstrained_config(evaluations)
    if context.device == "cpu" or best.plain_peak_bytes < POLICY.timed_reference_max_memory_share * context.info.total_bytes:
        return config
    return None


def measure_unconstrained(
    context: PlanContext, evaluations: list[Evaluation], *, chosen: Verified, measurements: Measurements
) -> Unconstrained:
    """The fastest configuration with no budget (no checkpointing), for the speed ratio.

    Its speed was timed beside the candidates (``verify``'s ``reference``); its
    peak is the measured one where it was measured, else the cost model's
    (``peak_measured`` says which).
    """
    config, best = unconstrained_config(evaluations)
    entry = measurements.peaks.get(config.key())
    measured_peak = entry is not None and not entry.get("oom")
    if config.key() == chosen.config.key():
        samples_per_s = chosen.measurement.samples_per_s
    else:
        samples_per_s = None if context.simulate else measurements.samples_per_s(config)
    return Unconstrained(
        precision=config.precision, micro_batch_size=config.micro_batch_size, grad_accum_steps=config.grad_accum_steps,
        predicted_peak_bytes=int(best.plain_peak_bytes), predicted_samples_per_s=best.plain_samples_per_s,
        peak_bytes=entry["peak_bytes"] if measured_peak else int(best.plain_peak_bytes), peak_measured=measured_peak,
        samples_per_s=samples_per_s,
    )
