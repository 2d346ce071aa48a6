"""The run a trainer's settings describe, for ``autofit plan --from-trainer-args FILE``.

Two kinds of file, told apart by their keys:

- a transformers ``TrainingArguments`` JSON (``args.to_json_string()``, or the file ``HfArgumentParser`` reads): the
  global batch is ``per_device_train_batch_size`` × ``gradient_accumulation_steps`` × the processes (``--gpus`` ×
  ``--nodes``); ``bf16``/``fp16`` the precision; ``optim`` the optimizer; ``max_grad_norm`` the clipping;
- a Lightning config (LightningCLI's YAML or JSON, with a ``trainer`` section): the global batch is the ``data``
  section's ``batch_size`` × ``trainer.accumulate_grad_batches`` × ``trainer.devices`` × ``trainer.num_nodes``;
  ``trainer.precision`` the precision; ``trainer.gradient_clip_val`` the clipping.

Values left out take the trainer's defaults, so the plan answers the run the file would launch.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from autofit.errors import UserError

HF_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_grad_norm": 1.0, "optim": "adamw_torch"}
"""transformers' ``TrainingArguments`` defaults for what a plan reads (5.x)."""

LIGHTNING_PRECISIONS: dict[str, Precision] = {
    "32": "fp32", "32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16", "16": "fp16", "bf16": "bf16",
}
"""Lightning's ``precision`` values a plan can answer, as autofit names them."""

Optimizer = Literal["adamw", "adamw-8bit", "sgd"]
"""The planner's default AdamW, AdamW whose state the planner may hold in 8 bits (a lossy choice the run already
made), or SGD without momentum (no state)."""
Precision = Literal["fp32", "bf16", "fp16"]

OPTIMIZERS: dict[str, Optimizer] = {
    "adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw_torch_xla": "adamw", "adamw_apex_fused": "adamw",
    "adamw_torch_npu_fused": "adamw", "adamw_8bit": "adamw-8bit", "adamw_bnb_8bit": "adamw-8bit", "adamw_torch_4bit": "adamw-8bit",
    "adamw_torch_8bit": "adamw-8bit", "paged_adamw_8bit": "adamw-8bit", "sgd": "sgd",
}
"""transformers' ``optim`` names a plan can answer (its memory is AdamW's, AdamW's in 8 bits, or SGD's)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerRun:
    """What a trainer's settings say about the run a plan must answer."""

    global_batch_size: int
    """Samples per optimizer step over every process."""
    precision: Precision
    """The only precision searched."""
    optimizer: Optimizer = "adamw"
    learning_rate: float | None = None
    """The optimizer's learning rate, where the file names one (it changes no byte)."""
    max_grad_norm: float | None = None
    """Clipping the trainer will do (None: none)."""
    source: str
    """How the file was read, for the plan's summary: "TrainingArguments ... (8 x 4 x 1 process)"."""


def read_trainer_args(path: str | Path, *, world_size: int) -> TrainerRun:
    """The run ``path`` describes, over ``world_size`` processes (``--gpus`` × ``--nodes``).

    Raises:
        UserError: the file is missing, not JSON/YAML, neither kind, or holds a value a plan cannot answer (one line
            naming the key, its value and the way out).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--from-trainer-args {str(path)!r} does not exist; give a TrainingArguments JSON or a Lightning config")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else _yaml(text)
    except ValueError as error:
        raise UserError(f"--from-trainer-args {str(path)!r} is not {'JSON' if path.suffix == '.json' else 'YAML or JSON'} ({error})") from None
    if not isinstance(data, dict):
        raise UserError(f"--from-trainer-args {str(path)!r} holds no object of settings; give a TrainingArguments JSON or a Lightning config")
    if isinstance(data.get("trainer"), dict):
        return _lightning(data, where=str(path))
    return _transformers(data, where=str(path), world_size=world_size)


def _yaml(text: str):
    try:
        import yaml
    except ImportError:
        return json.loads(text)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(str(error).replace("\n", " ")) from None


def _transformers(data: dict, *, where: str, world_size: int) -> TrainerRun:
    values = {**HF_DEFAULTS, **{k: v for k, v in data.items() if v is not None}}
    micro = _whole(values, "per_device_train_batch_size", where)
    steps = _whole(values, "gradient_accumulation_steps", where)
    if values.get("bf16") and values.get("fp16"):
        raise UserError(f"{where}: bf16 and fp16 are both true; the Trainer takes one of them")
    precision = "bf16" if values.get("bf16") else "fp16" if values.get("fp16") else "fp32"
    optim = str(values["optim"])
    if optim not in OPTIMIZERS:
        raise UserError(
            f"{where}: optim {optim!r} is not one a plan knows the memory of; use one of {', '.join(sorted(OPTIMIZERS))}, "
            "or plan a model file whose build_optimizer builds it"
        )
    clip = values["max_grad_norm"]
    return TrainerRun(
        global_batch_size=micro * steps * world_size, precision=precision, optimizer=OPTIMIZERS[optim],
        learning_rate=values.get("learning_rate"), max_grad_norm=float(clip) if clip and clip > 0 else None,
        source=f"TrainingArguments {where} ({micro} per device x {steps} accumulation step(s) x {world_size} process(es))",
    )


def _lightning(data: dict, *, where: str) -> TrainerRun:
    trainer = data["trainer"]
    data_section = data.get("data") or {}
    batch = {**data_section, **(data_section.get("init_args") or {})} if isinstance(data_section, dict) else {}
    if "batch_size" not in batch:
        raise UserError(f"{where}: no data.batch_size (nor data.init_args.batch_size); add the DataLoader's batch size there")
    micro = _whole(batch, "batch_size", where, prefix="data.")
    steps = _whole({"accumulate_grad_batches": 1, **trainer}, "accumulate_grad_batches", where, prefix="trainer.")
    devices = _whole({"devices": 1, **trainer}, "devices", where, prefix="trainer.", way_out="a number of devices (not auto)")
    nodes = _whole({"num_nodes": 1, **trainer}, "num_nodes", where, prefix="trainer.")
    precision_value = str(trainer.get("precision", "32-true"))
    if precision_value not in LIGHTNING_PRECISIONS:
        raise UserError(
            f"{where}: trainer.precision {precision_value!r} is not one a plan answers; use one of "
            f"{', '.join(sorted(set(LIGHTNING_PRECISIONS) - {'32', '16', 'bf16'}))}"
        )
    clip = trainer.get("gradient_clip_val")
    return TrainerRun(
        global_batch_size=micro * steps * devices * nodes, precision=LIGHTNING_PRECISIONS[precision_value],
        max_grad_norm=float(clip) if clip else None,
        source=f"Lightning config {where} ({micro} per batch x {steps} accumulated x {devices * nodes} device(s))",
    )


def _whole(values: dict, key: str, where: str, *, prefix: str = "", way_out: str = "a whole number, at least 1") -> int:
    value = values[key]
    if type(value) is not int or value < 1:
        raise UserError(f"{where}: {prefix}{key} is {json.dumps(value)}, expected {way_out}")
    return value


def plan_options(run: TrainerRun, *, batch_size: int | None, precisions: list[str] | None, max_grad_norm: float | None) -> dict:
    """``autofit plan``'s batch size, precisions, clipping and lossy-optimizer permission for ``run``; a flag given
    as well must agree with it.

    Raises:
        UserError: a flag contradicts the file (one line naming both).
    """
    def agree(flag: str, given, wanted) -> None:
        if given is not None and given != wanted:
            raise UserError(f"{flag} {given} contradicts the trainer's settings ({wanted}, from {run.source}); leave {flag} out")

    agree("--batch-size", batch_size, run.global_batch_size)
    if precisions is not None and run.precision not in precisions:
        raise UserError(f"--precisions {','.join(precisions)} leaves out {run.precision}, which {run.source} trains with; leave --precisions out")
    agree("--max-grad-norm", max_grad_norm, run.max_grad_norm)
    return {
        "batch_size": run.global_batch_size, "precisions": [run.precision], "max_grad_norm": run.max_grad_norm,
        "allow_lossy_optimizer": run.optimizer == "adamw-8bit",
    }


def with_optimizer(spec, run: TrainerRun):
    """``spec`` whose optimizer is the run's: SGD for "sgd" (the plan then holds no optimizer state), else the spec's own
    (AdamW for every model autofit loads without a model file's ``build_optimizer``)."""
    if run.optimizer != "sgd":
        return spec
    import torch

    learning_rate = run.learning_rate or 1e-3
    return dataclasses.replace(spec, build_optimizer=lambda params: torch.optim.SGD(params, lr=learning_rate))
