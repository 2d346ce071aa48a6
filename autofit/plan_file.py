"""plan.json: the decision the planner made, read by the training loop.

The file is the ``Plan`` dataclass as JSON (schema 1; docs/plan-file.md lists
every field). ``load_plan`` refuses, with one line naming the field, its value
and the way out, a file that is missing, corrupt, of another schema version,
or that holds a field of the wrong type or an impossible value. Keys it does
not know are ignored, so that a file from a newer autofit still loads.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from autofit.atomic import write_atomic
from autofit.config import MAX_LOSS_CHUNKS, TrainingConfig, step_in_backward_refusal
from autofit.errors import UserError
from strategies.batch_split import micro_batch_count
from strategies.optimizer_state import OPTIMIZER_STATES
from strategies.sharding import SHARDINGS
from strategies.precision import PRECISIONS

SCHEMA_VERSION = 1
BUDGET_KINDS = ("cpu-tracked", "cuda-process")
DEVICE_TYPES = ("cpu", "cuda")
EXPANDABLE_SEGMENTS = "expandable_segments:True"
DEFAULT_SEGMENTS = "expandable_segments:False"
ALLOCATOR_SETTINGS = (EXPANDABLE_SEGMENTS, DEFAULT_SEGMENTS)
"""The CUDA allocator settings a plan may name: with or without expandable segments (docs/plan-file.md)."""
METERS = ("cpu", "cuda", "simulated")
"""The ``name`` of each meter in ``autofit.measure.meters``."""
MAX_BATCH_SIZE = 2**31
"""A larger batch (or process count) in a plan file is a typo, not a plan."""
MAX_BYTES = 2**63 - 1
"""Byte counts are int64 everywhere else (PyTorch's allocator statistics)."""
RECREATE = "re-create it with `autofit plan`"


@dataclass(kw_only=True, slots=True)
class ModelInfo:
    """The model a plan was made for. ``None`` is unknown (a plan written by hand)."""

    source: str | None = None
    """A file path, ``torchvision:NAME`` or ``python:Class``."""
    fingerprint: str | None = None
    """Hash of parameter and buffer names and shapes (``autofit.spec.model_fingerprint``): a plan refuses another model."""
    batch_norm: bool | None = None
    """Whether the model has BatchNorm (it then normalises over each micro-batch)."""
    parameter_count: int | None = None
    input_shape: list[int] | None = None
    """One sample's shape, e.g. ``[C, H, W]``."""
    num_classes: int | None = None
    task: str | None = None
    """For an ``hf:`` model: causal-lm, sequence-classification or image-classification."""
    seq_len: int | None = None
    """For an ``hf:`` text model: tokens per sample."""
    lora: str | None = None
    """LoRA adapters over the model (``autofit.adapters``), e.g. "r=16,alpha=32,targets=q_proj,v_proj"; None: none."""
    min_micro_batch_size: int | None = None
    """The fewest samples one forward may hold: its loss couples the samples of a batch (``planning.coupling``), so
    training never halves the micro-batch below it after running out of memory; None: any."""


@dataclass(kw_only=True, slots=True)
class DeviceInfo:
    """The device a plan is for; ``autofit.device.device_info`` fills it in."""

    type: str = "cpu"
    """"cpu" or "cuda"."""
    name: str | None = None
    total_bytes: int | None = None
    """The card's memory, or the machine's RAM for "cpu"."""
    allocator_settings: str | None = None
    """On a GPU: the CUDA caching allocator's settings the plan was made for, in ``PYTORCH_CUDA_ALLOC_CONF``'s
    syntax ("expandable_segments:True"); training sets them (``apply_plan``). None: the allocator as it is."""


@dataclass(kw_only=True, slots=True)
class Predicted:
    """What the cost model predicted for the chosen configuration."""

    peak_bytes: int
    samples_per_s: float
    per_rank_peak_bytes: int | None = None
    """On several processes: one rank's peak, DDP's bucket allowance or FSDP2's simulated peak included."""
    estimate_peak_bytes: int | None = None
    """FSDP2: the conservative formula's peak, which ranked the candidates."""

    def to_dict(self) -> dict:
        """Schema 1: the two optional keys only when set."""
        return {key: value for key, value in asdict(self).items() if value is not None}


@dataclass(kw_only=True, slots=True)
class MultiProcess:
    """How a plan for several processes was measured: one process training one rank's share."""

    world_size: int
    sharding: str
    """"ddp", "fsdp" or "hsdp"."""
    rank_batch_size: int
    """Samples each rank trains per step: ceil(global batch / world_size)."""
    note: str
    """What was not measured (communication, N real processes), in words for the summary."""


@dataclass(kw_only=True, slots=True)
class Measured:
    """What the device's meter measured (or the simulated meter estimated) for the chosen configuration."""

    peak_bytes: int
    """The meter's peak; on cuda without the CUDA context, which is under ``Plan.headroom``."""
    samples_per_s: float | None = None
    """Plain training steps of the global batch; None when estimated."""
    meter: str
    """"cpu", "cuda" or "simulated"."""
    breakdown: dict[str, int] = field(default_factory=dict)
    """Bytes at the peak by kind (parameters, gradients, optimizer_state, activations, ...)."""
    unconstrained: dict | None = None
    """The fastest configuration with no budget: precision, micro_batch_size, grad_accum_steps, peak_bytes, samples_per_s."""
    relative_to_unconstrained: float | None = None
    """This plan's samples/s over the unconstrained configuration's."""
    multi_process: MultiProcess | None = None
    """Set for plans of several processes."""
    threads: int | None = None
    """Intra-op threads (``torch.set_num_threads``) the speed was timed with on the CPU; training uses the same.
    None: not recorded (a plan of an older autofit, or not timed on the CPU)."""
    noise: float | None = None
    """How well the timed speed repeated: the second-fastest round over the fastest, minus 1 (0.05 is 5%).
    None: timed once, or not recorded."""
    host_peak_bytes: int | None = None
    """What the configuration kept in host memory at most (host state, bf16 weights' masters, offloaded activations);
    None where it keeps nothing there."""

    def to_dict(self) -> dict:
        """Schema 1: ``samples_per_s`` always (null when estimated), the last six keys only when set."""
        data = asdict(self)
        optional = ("unconstrained", "relative_to_unconstrained", "multi_process", "threads", "noise", "host_peak_bytes")
        return {key: value for key, value in data.items() if key not in optional or value is not None}


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """How to train one model inside a budget: a configuration and the evidence for it. docs/plan-file.md lists
    every field.

    ``config`` holds the strategy choices (written as plan.json's top-level
    ``precision``, ``micro_batch_size``, ``checkpoint``, ...); the rest is
    what they were measured and planned for. A plan is frozen: training
    after an out-of-memory error goes on with a new plan (``changed``).

    Example:
        >>> plan = Plan(budget_bytes=2**30, config=TrainingConfig(global_batch_size=64, micro_batch_size=16, precision="bf16"))
        >>> plan.config.grad_accum_steps
        4
    """

    schema_version: int = SCHEMA_VERSION
    created_by: dict[str, str] = field(default_factory=dict)
    """{"autofit": version, "torch": version}."""
    model: ModelInfo = field(default_factory=ModelInfo)
    device: DeviceInfo = field(default_factory=DeviceInfo)
    budget_bytes: int
    budget_kind: str = "cpu-tracked"
    """"cuda-process" (all the process holds on the card) or "cpu-tracked" (peak live tensor bytes)."""
    host_budget_bytes: int | None = None
    """Host memory a GPU plan may spend (``--host-memory``, else the machine's); None on the CPU or in an older plan."""
    config: TrainingConfig
    """The strategy choices: batch sizes, precision, checkpointed, selective and offloaded blocks, the optimizer's
    levers, processes and sharding."""
    estimated: bool = False
    """True when the numbers come from the simulated meter and a FLOP model, not a real probe."""
    predicted: Predicted | None = None
    """From the cost model; None for a plan written by hand."""
    measured: Measured | None = None
    """From real probes of exactly this configuration (or simulated when ``estimated``); None for a plan written by hand."""
    headroom: dict[str, int] = field(default_factory=dict)
    """Bytes kept free beyond the measured peak, by cause (context, fragmentation, safety margin)."""
    alternatives: list[dict] = field(default_factory=list)
    """Other configurations tried: the Pareto front of memory against samples/s."""
    history: list[dict] = field(default_factory=list)
    """Changes made while training (e.g. micro-batch halved after an OOM)."""
    notes: list[str] = field(default_factory=list)
    """What the user should know about training with this plan (e.g. BatchNorm and micro-batches)."""

    def changed(self, config: TrainingConfig, *, event: dict) -> Plan:
        """This plan training with ``config`` from now on, ``event`` (why) added to its history."""
        return dataclasses.replace(self, config=config, history=[*copy.deepcopy(self.history), dict(event)])

    def to_dict(self) -> dict:
        """plan.json's object (schema 1, the keys in docs/plan-file.md's order); ``grad_accum_steps`` is written for readers."""
        config = self.config
        return {
            "schema_version": self.schema_version,
            "created_by": dict(self.created_by),
            # Schema 1: an hf: model's task and sequence length are written when it has them.
            "model": {
                k: v for k, v in asdict(self.model).items() if v is not None or k not in ("task", "seq_len", "lora", "min_micro_batch_size")
            },
            "device": {key: value for key, value in asdict(self.device).items() if key != "allocator_settings" or value is not None},
            "budget_bytes": self.budget_bytes,
            "budget_kind": self.budget_kind,
            **({"host_budget_bytes": self.host_budget_bytes} if self.host_budget_bytes is not None else {}),
            "global_batch_size": config.global_batch_size,
            "micro_batch_size": config.micro_batch_size,
            "grad_accum_steps": config.grad_accum_steps,
            "precision": config.precision,
            "checkpoint": list(config.checkpoint),
            # Schema 1: the levers beyond the recipe are written when they are on.
            **({"selective_checkpoint": list(config.selective_checkpoint)} if config.selective_checkpoint else {}),
            **({"offload": list(config.offload)} if config.offload else {}),
            **({"optimizer_in_backward": True} if config.optimizer_in_backward else {}),
            **({"optimizer_state": config.optimizer_state} if config.optimizer_state != "device" else {}),
            **({"loss_chunks": config.loss_chunks} if config.loss_chunks != 1 else {}),
            **({"compile": True} if config.compile else {}),
            **({"frozen_nf4": True} if config.frozen_nf4 else {}),
            "world_size": config.world_size,
            "sharding": config.sharding,
            **({"nodes": config.nodes} if config.nodes != 1 else {}),
            **({"max_grad_norm": config.max_grad_norm} if config.max_grad_norm is not None else {}),
            "estimated": self.estimated,
            "predicted": self.predicted.to_dict() if self.predicted else {},
            "measured": self.measured.to_dict() if self.measured else {},
            "headroom": dict(self.headroom),
            "alternatives": copy.deepcopy(self.alternatives),
            "history": copy.deepcopy(self.history),
            "notes": list(self.notes),
        }


def save_plan(plan: Plan, path: str | Path) -> Path:
    """Write atomically: a crash never leaves half a plan."""
    return write_atomic(path, json.dumps(plan.to_dict(), indent=2) + "\n")


def load_plan(path: str | Path) -> Plan:
    """Read a plan.json.

    Raises:
        UserError: the file is missing, not JSON, of another schema version, or
            a field has the wrong type or an impossible value (one line naming it).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"plan file {str(path)!r} does not exist; create one with `autofit plan MODEL --budget 16GB --batch-size 256`")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"plan file {str(path)!r} is not valid JSON ({error}); {RECREATE}") from error
    return plan_from_dict(data, where=f"plan file {str(path)!r}")


def plan_from_dict(data: dict, *, where: str = "plan") -> Plan:
    """The ``Plan`` of a plan.json object, every field checked; unknown keys are ignored.

    Args:
        data: the JSON object (``Plan.to_dict()``, or a checkpoint's copy of it).
        where: names the source in errors, e.g. "plan file 'plan.json'".

    Raises:
        UserError: one line: "{where}: field micro_batch_size is "x", expected ...; re-create it with `autofit plan`".
    """
    if not isinstance(data, dict):
        raise UserError(f"{where} is not a JSON object; {RECREATE}")
    values = _read(data, _PLAN_FIELDS, where=where, required=("schema_version", "budget_bytes", "global_batch_size", "micro_batch_size"))
    values["model"] = ModelInfo(**_read(values.get("model", {}), _MODEL_FIELDS, where=where, prefix="model."))
    values["device"] = DeviceInfo(**_read(values.get("device", {}), _DEVICE_FIELDS, where=where, prefix="device."))
    if values.get("predicted"):
        values["predicted"] = Predicted(**_read(
            values["predicted"], _PREDICTED_FIELDS, where=where, prefix="predicted.", required=("peak_bytes", "samples_per_s"),
        ))
    else:
        values["predicted"] = None  # {}: a plan written by hand
    if values.get("measured"):
        measured = _read(values["measured"], _MEASURED_FIELDS, where=where, prefix="measured.", required=("peak_bytes", "meter"))
        if measured.get("multi_process") is not None:
            measured["multi_process"] = MultiProcess(**_read(
                measured["multi_process"], _MULTI_PROCESS_FIELDS, where=where, prefix="measured.multi_process.",
                required=tuple(_MULTI_PROCESS_FIELDS),
            ))
        values["measured"] = Measured(**measured)
    else:
        values["measured"] = None
    grad_accum_steps = values.pop("grad_accum_steps", None)
    choices = {name: values.pop(name) for name in _CONFIG_FIELDS if name in values}
    _check_together(choices, grad_accum_steps=grad_accum_steps, where=where)
    return Plan(config=TrainingConfig(**choices), **values)


def _check_together(choices: dict, *, grad_accum_steps: int | None, where: str) -> None:
    """Fields that are each fine but impossible together, named as the file spells them (before the
    configuration refuses them in its own words)."""
    N, G, m = choices.get("world_size", 1), choices["global_batch_size"], choices["micro_batch_size"]
    sharding, precision = choices.get("sharding", "none"), choices.get("precision", "fp32")
    if N == 1 and sharding != "none":
        _refuse(where, "sharding", sharding, '"none" for world_size 1 (one process shards nothing)')
    if N > 1 and sharding == "none":
        _refuse(where, "sharding", sharding, f'"ddp", "fsdp" or "hsdp" for world_size {N}')
    nodes = choices.get("nodes", 1)
    if N % nodes:
        _refuse(where, "nodes", nodes, f"a divisor of world_size {N} (the same number of processes on each node)")
    if sharding == "hsdp" and (nodes < 2 or N // nodes < 2):
        _refuse(where, "sharding", sharding, f'"fsdp" or "ddp" unless nodes is 2 or more with 2 or more processes each (nodes {nodes}, world_size {N})')
    if N > G:
        _refuse(where, "world_size", N, f"at most global_batch_size {G}: every process needs a sample per step")
    share = math.ceil(G / N)
    if m > share:
        within = f"global_batch_size {G}" if N == 1 else f"{share}, one process's share of global_batch_size {G} over world_size {N}"
        _refuse(where, "micro_batch_size", m, f"at most {within}")
    checkpoint = choices.get("checkpoint", [])
    for mode in ("selective_checkpoint", "offload"):
        both = sorted(set(checkpoint) & set(choices.get(mode, [])))
        if both:
            _refuse(where, mode, choices[mode], f"blocks not also in checkpoint (a block takes one mode: {both[0]})")
    if choices.get("optimizer_in_backward") and step_in_backward_refusal(
        precision=precision, global_batch_size=G, micro_batch_size=m, world_size=N, max_grad_norm=choices.get("max_grad_norm"),
    ):
        _refuse(where, "optimizer_in_backward", True, "false unless one micro-batch per step on one process, not fp16, no max_grad_norm")
    if choices.get("frozen_nf4") and N > 1:
        _refuse(where, "frozen_nf4", True, f"false for world_size {N} (NF4 frozen weights run on one process)")
    if choices.get("optimizer_state") == "host" and N > 1:
        _refuse(where, "optimizer_state", "host", f'"device" or "8bit" for world_size {N} (host state runs on one process)')
    expected_steps = micro_batch_count(G, world_size=N, micro_batch_size=m)
    if grad_accum_steps is not None and grad_accum_steps != expected_steps:
        samples = f"global_batch_size {G}" if N == 1 else f"one process's share ({share}) of global_batch_size {G}"
        _refuse(
            where, "grad_accum_steps", grad_accum_steps,
            f"{expected_steps} (ceil({share} / {m}): micro-batches of {m} in {samples})",
            way_out="drop it (it follows from the batch sizes) or " + RECREATE,
        )


@dataclass(frozen=True, slots=True)
class _Kind:
    """What a field may hold: a test, and the words for it in an error."""

    expected: str
    accepts: Callable[[Any], bool]

    def or_null(self) -> _Kind:
        return _Kind(f"{self.expected}, or null", lambda value: value is None or self.accepts(value))


def _integer(low: int, high: int, expected: str) -> _Kind:
    # type() and not isinstance(): True is an int in Python, but not a batch size.
    return _Kind(expected, lambda value: type(value) is int and low <= value <= high)


def _number(value) -> bool:
    return type(value) is int or (type(value) is float and math.isfinite(value))


def _choice(options: tuple[str, ...]) -> _Kind:
    return _Kind("one of " + ", ".join(f'"{o}"' for o in options), lambda value: isinstance(value, str) and value in options)


def _list_of(item: _Kind, expected: str) -> _Kind:
    return _Kind(expected, lambda value: isinstance(value, list) and all(item.accepts(x) for x in value))


def _object_of(item: _Kind, expected: str) -> _Kind:
    return _Kind(expected, lambda value: isinstance(value, dict) and all(
        isinstance(k, str) and item.accepts(x) for k, x in value.items()
    ))


ANY = _Kind("anything", lambda value: True)
OBJECT = _Kind("an object", lambda value: isinstance(value, dict))
STRING = _Kind("a string", lambda value: isinstance(value, str))
TEXT = _Kind("a non-empty string", lambda value: isinstance(value, str) and value != "")
FLAG = _Kind("true or false", lambda value: isinstance(value, bool))
SAMPLES = _integer(1, MAX_BATCH_SIZE, f"a whole number of samples from 1 to {MAX_BATCH_SIZE}")
COUNT = _integer(1, MAX_BATCH_SIZE, f"a whole number from 1 to {MAX_BATCH_SIZE}")
BYTES = _integer(0, MAX_BYTES, "a whole number of bytes, 0 or more")
POSITIVE_BYTES = _integer(1, MAX_BYTES, "a whole number of bytes, at least 1")
NUMBER = _Kind("a number", _number)
SPEED = _Kind("a positive number (samples/s)", lambda value: _number(value) and value > 0)
NAMES = _Kind(
    "a list of distinct module names (strings)",
    lambda value: isinstance(value, list) and all(TEXT.accepts(x) for x in value) and len(set(value)) == len(value),
)

_PLAN_FIELDS = {  # checked in this order: the schema version first
    "schema_version": _integer(SCHEMA_VERSION, SCHEMA_VERSION, f"{SCHEMA_VERSION} (the only version this autofit reads)"),
    "created_by": _object_of(STRING, 'an object of version strings, e.g. {"autofit": "0.1.0"}'),
    "model": OBJECT,
    "device": OBJECT,
    "budget_bytes": POSITIVE_BYTES,
    "budget_kind": _choice(BUDGET_KINDS),
    "host_budget_bytes": POSITIVE_BYTES,
    "global_batch_size": SAMPLES,
    "micro_batch_size": SAMPLES,
    "grad_accum_steps": COUNT,
    "precision": _choice(PRECISIONS),
    "checkpoint": NAMES,
    "selective_checkpoint": NAMES,
    "offload": NAMES,
    "optimizer_in_backward": FLAG,
    "optimizer_state": _choice(OPTIMIZER_STATES),
    "loss_chunks": _integer(1, MAX_LOSS_CHUNKS, f"a whole number of chunks from 1 (the model's own loss) to {MAX_LOSS_CHUNKS}"),
    "compile": FLAG,
    "frozen_nf4": FLAG,
    "world_size": _integer(1, MAX_BATCH_SIZE, f"a whole number of processes from 1 to {MAX_BATCH_SIZE}"),
    "sharding": _choice(SHARDINGS),
    "nodes": _integer(1, MAX_BATCH_SIZE, f"a whole number of machines from 1 to {MAX_BATCH_SIZE}"),
    "max_grad_norm": _Kind("a positive number", lambda value: _number(value) and value > 0).or_null(),
    "estimated": FLAG,
    "predicted": OBJECT,
    "measured": OBJECT,
    "headroom": _object_of(BYTES, "an object of byte counts (whole numbers, 0 or more) by cause"),
    "alternatives": _list_of(OBJECT, "a list of objects"),
    "history": _list_of(OBJECT, "a list of objects"),
    "notes": _list_of(STRING, "a list of strings"),
}
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(TrainingConfig))
"""plan.json's top-level keys that make up ``Plan.config``."""
_MODEL_FIELDS = {
    "source": TEXT.or_null(),
    "fingerprint": TEXT.or_null(),
    "batch_norm": FLAG.or_null(),
    "parameter_count": _integer(0, MAX_BYTES, "a whole number, 0 or more").or_null(),
    "input_shape": _Kind(
        "a non-empty list of whole numbers from 1 up, e.g. [3, 32, 32]",
        lambda value: isinstance(value, list) and value != [] and all(COUNT.accepts(x) for x in value),
    ).or_null(),
    "num_classes": COUNT.or_null(),
    "task": _choice(("causal-lm", "sequence-classification", "image-classification")).or_null(),
    "seq_len": COUNT.or_null(),
    "lora": TEXT.or_null(),
    "min_micro_batch_size": COUNT.or_null(),
}
_DEVICE_FIELDS = {
    "type": _choice(DEVICE_TYPES),
    "name": TEXT.or_null(),
    "total_bytes": POSITIVE_BYTES.or_null(),
    "allocator_settings": _choice(ALLOCATOR_SETTINGS).or_null(),
}
_PREDICTED_FIELDS = {
    "peak_bytes": BYTES,
    "samples_per_s": SPEED,
    "per_rank_peak_bytes": BYTES.or_null(),
    "estimate_peak_bytes": BYTES.or_null(),
}
_MEASURED_FIELDS = {
    "peak_bytes": BYTES,
    "samples_per_s": SPEED.or_null(),
    "meter": _choice(METERS),
    "breakdown": _object_of(NUMBER, "an object of byte counts by kind"),
    "unconstrained": OBJECT.or_null(),
    "relative_to_unconstrained": _Kind("a positive number", lambda value: _number(value) and value > 0).or_null(),
    "multi_process": OBJECT.or_null(),
    "threads": COUNT.or_null(),
    "noise": _Kind("a number, 0 or more", lambda value: _number(value) and value >= 0).or_null(),
    "host_peak_bytes": BYTES.or_null(),
}
_MULTI_PROCESS_FIELDS = {
    "world_size": _integer(2, MAX_BATCH_SIZE, f"a whole number of processes from 2 to {MAX_BATCH_SIZE}"),
    "sharding": _choice(("ddp", "fsdp", "hsdp")),
    "rank_batch_size": SAMPLES,
    "note": TEXT,
}


def _read(data: dict, table: dict[str, _Kind], *, where: str, prefix: str = "", required: tuple[str, ...] = ()) -> dict:
    """The fields of ``table`` that ``data`` holds, each checked; other keys are ignored (a newer autofit may add some)."""
    values = {}
    for name, kind in table.items():
        if name not in data:
            if name in required:
                raise UserError(f"{where}: field {prefix}{name} is missing, expected {kind.expected}; {RECREATE}")
            continue
        if not kind.accepts(data[name]):
            _refuse(where, prefix + name, data[name], kind.expected)
        values[name] = data[name]
    return values


def _refuse(where: str, name: str, value, expected: str, *, way_out: str = RECREATE) -> NoReturn:
    raise UserError(f"{where}: field {name} is {_shown(value)}, expected {expected}; {way_out}")


def _shown(value, limit: int = 60) -> str:
    """The value as JSON on one line (as the file spells it), cut short if long."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
