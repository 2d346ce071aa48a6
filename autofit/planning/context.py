"""What one planning run is about, fixed before anything is measured, and the points it searches.

``plan_context`` checks the arguments (device, batch, budget, precisions) and
returns a frozen ``PlanContext`` that every step of the run receives: the
model's spec, the device, the budget in bytes, the global batch, the
precisions to search, where the study is kept, and the progress log.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from autofit.errors import UserError
from autofit.measure.meters import DeviceInfo, check_device, checked_for_simulation, device_info
from autofit.planning.memory_model import simulation_spec
from autofit.planning.search import Study
from autofit.spec import ModelSpec, model_fingerprint
from autofit.units import parse_budget
from strategies import PRECISIONS


@dataclass(frozen=True, kw_only=True)
class PlanContext:
    """One planning run's fixed inputs, shared by its steps."""

    spec: ModelSpec
    sim_spec: ModelSpec
    """The same model for the simulated meter (``simulation_spec``)."""
    device: str
    """"cpu" or "cuda"."""
    info: DeviceInfo
    simulate: bool
    """Plan with the simulated meter and FLOP-based speeds (the plan is marked estimated)."""
    budget_bytes: int
    global_batch_size: int
    precisions: list[str]
    """The precisions searched, in the order the user gave them."""
    excluded_precisions: dict[str, str]
    """Precision -> why it is not searched."""
    num_classes: int | None
    study: Study
    user_log: Callable[[str], None] | None = None
    """Receives the progress lines (``log``)."""
    started: float = field(default_factory=time.perf_counter)
    """``time.perf_counter()`` when the run started."""

    def log(self, line: str) -> None:
        """A progress line, stamped with the seconds since the run started."""
        if self.user_log is not None:
            self.user_log(f"[{time.perf_counter() - self.started:5.1f} s] {line}")


def plan_context(
    spec: ModelSpec,
    *,
    budget: str | int,
    batch_size: int,
    device: str,
    simulate: bool,
    device_memory: str | int | None,
    study: str | None,
    precisions: Sequence[str] | None,
    num_classes: int | None,
    log: Callable[[str], None] | None,
) -> PlanContext:
    """Check a planning run's arguments (see ``autofit.plan``) and fix what the run is about.

    Raises:
        UserError: an unknown device, a bad batch size or budget, no CUDA device
            for ``device="cuda"`` without ``simulate``, or no precision left to search.
    """
    started = time.perf_counter()
    check_device(device, simulate=simulate)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise UserError(f"--batch-size {batch_size!r} must be a whole number of samples, at least 1")
    total = parse_budget(device_memory) if device_memory is not None else None
    info = device_info(device, total_bytes=total)
    sim_spec = checked_for_simulation(simulation_spec(spec))  # or the cpu meter, with one line saying why
    budget_bytes = parse_budget(budget, device_total_bytes=info.total_bytes)
    kept, excluded = usable_precisions(device, simulate=simulate, wanted=precisions)
    with torch.device("meta"):
        fingerprint = model_fingerprint(sim_spec.build_model())
    # One prefix per model, device, meter, batch and precisions: a study of another budget shares its cost model.
    kind = "simulated" if simulate else "measured"
    prefix = f"autofit:{fingerprint}:{device}:{kind}:batch{batch_size}:{','.join(kept)}:"
    return PlanContext(
        spec=spec, sim_spec=sim_spec, device=device, info=info, simulate=simulate, budget_bytes=budget_bytes,
        global_batch_size=batch_size, precisions=kept, excluded_precisions=excluded, num_classes=num_classes,
        study=Study(storage=study, prefix=prefix, name=f"{prefix}budget{budget_bytes}"), user_log=log, started=started,
    )


def usable_precisions(device: str, *, simulate: bool, wanted: Sequence[str] | None) -> tuple[list[str], dict[str, str]]:
    """The precisions to search, and why any were left out."""
    wanted = list(wanted) if wanted else list(PRECISIONS)
    unknown = [p for p in wanted if p not in PRECISIONS]
    if unknown:
        raise UserError(f"precision {unknown[0]!r} is unknown; choose from {', '.join(PRECISIONS)}")
    excluded = {p: "not asked for (--precisions)" for p in PRECISIONS if p not in wanted}
    if device == "cuda" and torch.cuda.is_available() and not simulate:
        if "bf16" in wanted and not torch.cuda.is_bf16_supported():
            major, minor = torch.cuda.get_device_capability()
            excluded["bf16"] = f"this GPU (compute capability {major}.{minor}) does not support bf16"
            wanted.remove("bf16")
    if not wanted:
        raise UserError("no precision is left to search; allow fp32 with --precisions fp32")
    return wanted, excluded


@dataclass(kw_only=True, slots=True)
class Config:
    """One configuration the planner measures: precision, micro-batch size, checkpointed blocks."""

    precision: str
    micro_batch_size: int
    checkpoint: tuple[str, ...] = ()

    def key(self) -> str:
        return f"{self.precision}:{self.micro_batch_size}:{','.join(self.checkpoint)}"

    def simplicity(self, global_batch_size: int) -> tuple:
        """Order for ties: fewer micro-steps, fewer checkpointed blocks, fp32 before autocast."""
        return (math.ceil(global_batch_size / self.micro_batch_size), len(self.checkpoint), PRECISIONS.index(self.precision))
