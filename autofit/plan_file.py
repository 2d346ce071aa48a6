"""plan.json: the decision the planner made, read by the training loop.

The file is the ``Plan`` dataclass as JSON. ``load_plan`` refuses a file
that is missing, corrupt or of another schema version with one line.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from autofit.atomic import write_atomic
from autofit.errors import UserError

SCHEMA_VERSION = 1


@dataclass(kw_only=True)
class Plan:
    """How to train one model inside a budget. See README "plan.json" for every field."""

    schema_version: int = SCHEMA_VERSION
    created_by: dict = field(default_factory=dict)
    """{"autofit": version, "torch": version}."""
    model: dict = field(default_factory=dict)
    """{"source", "fingerprint", "parameter_count", "input_shape", "num_classes"}."""
    device: dict = field(default_factory=dict)
    """{"type": "cpu"|"cuda", "name", "total_bytes"}."""
    budget_bytes: int
    budget_kind: str = "cpu-tracked"
    """"cuda-process" (all the process holds on the card) or "cpu-tracked" (peak live tensor bytes)."""
    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int
    precision: str = "fp32"
    checkpoint: list[str] = field(default_factory=list)
    """Module names whose forward recomputes in backward."""
    world_size: int = 1
    """Processes (GPUs) the plan trains on."""
    sharding: str = "none"
    """"none", "ddp" or "fsdp" (when world_size > 1)."""
    estimated: bool = False
    """True when the numbers come from the simulated meter and a FLOP model, not a real probe."""
    predicted: dict = field(default_factory=dict)
    """{"peak_bytes", "samples_per_s"} from the cost model."""
    measured: dict = field(default_factory=dict)
    """{"peak_bytes", "samples_per_s", "meter"} from real probes of exactly this configuration."""
    headroom: dict = field(default_factory=dict)
    """Bytes kept free, by cause (context, fragmentation, safety margin)."""
    alternatives: list[dict] = field(default_factory=list)
    """Other configurations tried: the Pareto front of memory against samples/s."""
    history: list[dict] = field(default_factory=list)
    """Changes made while training (e.g. micro-batch halved after an OOM)."""
    notes: list[str] = field(default_factory=list)
    """What the user should know about training with this plan (e.g. BatchNorm and micro-batches)."""

    def to_dict(self) -> dict:
        return asdict(self)


def save_plan(plan: Plan, path: str | Path) -> Path:
    """Write atomically: a crash never leaves half a plan."""
    return write_atomic(path, json.dumps(plan.to_dict(), indent=2) + "\n")


def plan_from_dict(data: dict, *, where: str = "plan") -> Plan:
    if not isinstance(data, dict):
        raise UserError(f"{where} is not a JSON object; re-create it with `autofit plan`")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise UserError(f"{where} has schema_version {version!r}, this autofit reads {SCHEMA_VERSION}; re-create it with `autofit plan`")
    known = {f.name for f in fields(Plan)}
    try:
        return Plan(**{k: v for k, v in data.items() if k in known})
    except TypeError as error:
        raise UserError(f"{where} is incomplete ({error}); re-create it with `autofit plan`") from error


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"plan file {str(path)!r} does not exist; create one with `autofit plan MODEL --budget 16GB --batch-size 256`")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"plan file {str(path)!r} is not valid JSON ({error}); re-create it with `autofit plan`") from error
    return plan_from_dict(data, where=f"plan file {str(path)!r}")

