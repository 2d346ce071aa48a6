"""Step 5 of planning: the plan, and the report of how it was found.

``write_plan`` turns the verified choice into a ``Plan``: what was predicted,
what was measured, the headroom, and the Pareto front of everything the
search scored as alternatives, each marked as measured or predicted to fit,
or rejected with why. ``PlanReport`` carries what the CLI's summary
shows beyond plan.json.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autofit.version import __version__
from autofit.plan_file import DeviceInfo, Measured, ModelInfo, Plan, Predicted
from autofit.planning.context import PlanContext
from autofit.planning.costs import CostModel
from autofit.planning.search.space import Evaluation
from autofit.planning.records import Unconstrained, Verified, VerifiedPoint
from autofit.spec import model_fingerprint
from autofit.units import format_bytes


@dataclass(kw_only=True)
class PlanReport:
    """What the summary shows beyond plan.json: how the plan was found."""

    plan: Plan
    floor_bytes: int = 0
    floor_breakdown: dict[str, int] = field(default_factory=dict)
    excluded_precisions: dict[str, str] = field(default_factory=dict)
    """Precision -> why it was left out."""
    precision_notes: dict[str, str] = field(default_factory=dict)
    unconstrained: Unconstrained | None = None
    """The fastest configuration with no budget, and its measured speed."""
    sampler: str = ""
    evaluations: int = 0
    simulated_checks: int = 0
    memory_probes: int = 0
    """Real probes of a configuration's peak (on its meter)."""
    real_probes: int = 0
    """Configurations timed for real."""
    resumed: bool = False
    seconds: float = 0.0
    rejected: list[dict] = field(default_factory=list)
    """Candidates that failed verification, with why."""
    costs: CostModel | None = None
    """The cost model the search used (``cost_model`` as a dict)."""
    speeds: dict[str, dict] = field(default_factory=dict)
    """Every precision's speeds (``SpeedCosts`` as a dict), timed or estimated, traced or not."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per step of the run: memory, floor, speed, search, verify, write."""
    timing: dict = field(default_factory=dict)
    """The verification's timing: "rounds", "noise" and "worst_noise" (how well the candidates' fastest rounds
    repeated, the median and the largest: 0.05 is 5%),
    "within_noise" (configurations as fast as the chosen one within the noise), "behind" (each other contender:
    how much slower its fastest round was than the chosen one's), "reused" (from a stored run)."""
    speed_noise: float = 0.0
    """The largest spread of the speed model's timings (0 when estimated)."""
    threads_note: str = ""
    """Why the run measured with fewer threads than PyTorch's, when it did."""
    study: str = ""
    """Where the cost model and measurements were kept: the cache's or --study's storage, or "" (nowhere)."""
    study_problems: list[str] = field(default_factory=list)

    @property
    def cost_model(self) -> dict:
        """The cost model the search used as a dict (``CostModel.from_dict`` reads it), made when asked: for a
        model of many blocks it is large."""
        return {} if self.costs is None else self.costs.to_dict()


def write_plan(
    context: PlanContext,
    model: CostModel,
    *,
    chosen: Verified,
    evaluations: list[Evaluation],
    unconstrained: Unconstrained | None,
    usable_bytes: float | dict[str, float],
    verified: dict[str, VerifiedPoint],
) -> Plan:
    """The plan of the verified choice (``verify``'s result) on one process.

    Args:
        usable_bytes: the largest predicted peak that fits (``Measurements.usable_bytes``), or that per precision,
            for the alternatives that were not measured.
        verified: configuration key -> what was measured of it (``Measurements.verified``).
    """
    config, measurement = chosen.config, chosen.measurement
    measured = Measured(
        peak_bytes=int(measurement.peak_bytes),
        samples_per_s=measurement.samples_per_s,
        meter=measurement.meter,
        breakdown=measurement.breakdown,
        # What training needs to run as fast as this was timed (``autofit.training.threads``).
        threads=context.threads if context.device == "cpu" and measurement.samples_per_s else None,
        noise=measurement.noise,
        host_peak_bytes=measurement.host_peak_bytes or None,
    )
    measured.unconstrained = unconstrained.for_plan() if unconstrained is not None else dict.fromkeys(
        ("precision", "micro_batch_size", "grad_accum_steps", "peak_bytes", "peak_measured", "samples_per_s")
    )
    if unconstrained is not None and unconstrained.samples_per_s and measurement.samples_per_s:
        measured.relative_to_unconstrained = measurement.samples_per_s / unconstrained.samples_per_s
    basics = plan_basics(context, output_shape=model.output_shape, micro_batch_size=config.micro_batch_size, global_batch_size=config.global_batch_size)
    return basics.plan(
        config=config,
        estimated=context.simulate,
        predicted=Predicted(
            peak_bytes=int(chosen.candidate.predicted_peak_bytes),
            samples_per_s=chosen.candidate.predicted_samples_per_s,
        ),
        measured=measured,
        headroom=measurement.headroom,
        alternatives=alternatives_table(context, model, evaluations, chosen=chosen, usable_bytes=usable_bytes, verified=verified),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanBasics:
    """The fields every plan starts with: who wrote it, the model, its notes, the device and the budget."""

    created_by: dict[str, str]
    model: ModelInfo
    notes: list[str]
    device: DeviceInfo
    budget_bytes: int
    budget_kind: str
    """"cuda-process" or "cpu-tracked" (``plan_file.BUDGET_KINDS``)."""
    host_budget_bytes: int | None

    def plan(self, **decision) -> Plan:
        """The plan of these fields and ``decision``'s (its configuration, what was predicted and measured, ...)."""
        return Plan(
            created_by=self.created_by, model=self.model, notes=self.notes, device=self.device, budget_bytes=self.budget_bytes,
            budget_kind=self.budget_kind, host_budget_bytes=self.host_budget_bytes, **decision,
        )


def plan_basics(context: PlanContext, *, output_shape: list[int], micro_batch_size: int, global_batch_size: int) -> PlanBasics:
    """The fields every plan starts with (``PlanBasics``)."""
    model_info = model_info_of(context, output_shape=output_shape)
    notes = batch_norm_notes(model_info, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size)
    if context.host_budget_note.startswith("assumed"):
        notes.append(f"host memory {format_bytes(context.host_budget_bytes)}: {context.host_budget_note}")
    return PlanBasics(
        created_by={"autofit": __version__, "torch": torch.__version__},
        model=model_info,
        notes=notes,
        device=context.info,
        budget_bytes=context.budget_bytes,
        budget_kind="cuda-process" if context.device == "cuda" else "cpu-tracked",
        host_budget_bytes=context.host_budget_bytes,
    )


def alternatives_table(
    context: PlanContext, model: CostModel, evaluations: list[Evaluation], *, chosen: Verified, usable_bytes: float | dict[str, float],
    verified: dict[str, VerifiedPoint],
) -> list[dict]:
    """The Pareto front (less memory, more samples/s) of every configuration the search scored.

    ``fits_budget`` is what was measured where a configuration was measured
    (with ``measured_peak_bytes``, and ``rejected``: why, where verification
    rejected it), else what the cost model predicts; the chosen one is measured.
    """
    points = []
    for e in evaluations:
        points.append((e.plain_config, e.plain_peak_bytes, e.plain_samples_per_s))
        if e.fits and e.config != e.plain_config:
            points.append((e.config, e.peak_bytes, e.samples_per_s))
    points.sort(key=lambda p: (p[1], -p[2]))
    front, best_speed = [], -1.0
    for point in points:
        if point[2] > best_speed:
            front.append(point)
            best_speed = point[2]
    config = chosen.config
    if not any(p[0].key() == config.key() for p in front):
        # Chosen by measurement though the model ranked it lower: list it with the front.
        front.append((config, chosen.candidate.predicted_peak_bytes, chosen.candidate.predicted_samples_per_s))
        front.sort(key=lambda p: (p[1], -p[2]))
    measured_chosen = VerifiedPoint(
        fits=True, measured_peak_bytes=chosen.measurement.peak_bytes, measured_samples_per_s=chosen.measurement.samples_per_s,
    )
    chosen_key = config.key()
    alternatives = []
    for config, peak, speed in front:
        key = config.key()
        is_chosen = key == chosen_key
        entry = {
            "precision": config.precision, "micro_batch_size": config.micro_batch_size, "grad_accum_steps": config.grad_accum_steps,
            "checkpoint": list(config.checkpoint),
            **({"selective_checkpoint": list(config.selective_checkpoint)} if config.selective_checkpoint else {}),
            **({"offload": list(config.offload)} if config.offload else {}),
            **({"optimizer_in_backward": True} if config.optimizer_in_backward else {}),
            **({"optimizer_state": config.optimizer_state} if config.optimizer_state != "device" else {}),
            **({"loss_chunks": config.loss_chunks} if config.loss_chunks != 1 else {}),
            **({"frozen_nf4": True} if config.frozen_nf4 else {}),
            **({"compile": True} if config.compile else {}),
            "predicted_peak_bytes": int(peak), "predicted_samples_per_s": speed,
            "fits_budget": peak * model.memory_scale <= (usable_bytes[config.precision] if isinstance(usable_bytes, dict) else usable_bytes),
            "chosen": is_chosen,
        }
        if is_chosen:  # the plan's own prediction (its levers priced as every row's are), not the point it came from
            entry["predicted_samples_per_s"] = chosen.candidate.predicted_samples_per_s
        measured = measured_chosen if is_chosen else verified.get(key)
        if measured is not None:
            entry["fits_budget"] = measured.fits
            entry |= measured.alternative_fields()
        alternatives.append(entry)
    return alternatives


def model_info_of(context: PlanContext, *, output_shape: list[int]) -> ModelInfo:
    model = context.meta_model
    options = dict(context.spec.source_options)  # what else rebuilds it (hf: task, seq_len; torchvision, timm: num_classes)
    given = options.pop("num_classes", None)
    num_classes = context.num_classes if context.num_classes is not None else given
    if num_classes is None and len(output_shape) == 2:
        num_classes = output_shape[-1]
    return ModelInfo(
        source=context.spec.source,
        fingerprint=model_fingerprint(model),
        batch_norm=any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()),
        parameter_count=sum(p.numel() for p in model.parameters()),
        input_shape=list(context.spec.input_shape) if context.spec.input_shape else None,
        num_classes=num_classes,
        **options,
    )


def batch_norm_notes(model_info: ModelInfo, *, micro_batch_size: int, global_batch_size: int) -> list[str]:
    """BatchNorm normalises over what one forward sees: a smaller micro-batch changes that statistic."""
    if not model_info.batch_norm or micro_batch_size >= global_batch_size:
        return []
    return [
        f"the model has BatchNorm: it normalises over each micro-batch of {micro_batch_size}, not the batch of "
        f"{global_batch_size}, so its batch statistics (not the loss weighting) differ from one forward of the "
        "whole batch; gradients are otherwise exactly the global batch's"
    ]
