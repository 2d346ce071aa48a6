"""Options and output helpers shared by several commands."""
from __future__ import annotations

import copy
import inspect
import json
import sys
from collections.abc import Callable
from typing import get_args

import typer

from autofit.config import DeviceChoice
from autofit.units import format_bytes

DEVICES: tuple[DeviceChoice, ...] = get_args(DeviceChoice)


def one_of(choices) -> str:
    """A closed choice's values as a help text gives them: "cpu or cuda", "device, host or 8bit" (``choices``: a
    ``Literal`` alias of ``autofit.config``, so the flags say what the plan file and ``TrainingConfig`` accept)."""
    values = get_args(choices)
    return ", ".join(values[:-1]) + " or " + values[-1] if len(values) > 1 else values[0]

MODEL_ARG = typer.Argument(
    ..., help="A model file defining build_model() and example_batch(n), torchvision:NAME, timm:NAME or hf:DIR (a transformers config)."
)
INPUT_SHAPE = typer.Option("3x224x224", "--input-shape", help="Input shape CxHxW for torchvision and timm models.")
NUM_CLASSES = typer.Option(None, "--num-classes", help="Classes: default 1000 for torchvision and timm, the config's for hf:.")
TASK = typer.Option(None, "--task", help="hf: only: causal-lm, sequence-classification or image-classification (default from the config).")
SEQ_LEN = typer.Option(None, "--seq-len", help="hf: text tasks: tokens per example sequence (default 128, or the context length if shorter).")


LORA = typer.Option(
    None, "--lora", help="LoRA adapters over the model (PEFT; its weights frozen), e.g. r=16,alpha=32,targets=q_proj,v_proj.",
)


def load_model_spec(model: str, *, input_shape: str, num_classes: int | None, task: str | None, seq_len: int | None, lora: str | None = None):
    """The ModelSpec a command's MODEL and model options name; --task/--seq-len only for hf:."""
    from autofit.errors import UserError
    from autofit.spec import load_spec

    if not model.startswith("hf:") and (task is not None or seq_len is not None):
        raise UserError(f"--task and --seq-len are for hf: models; {model} takes neither")
    return load_spec(model, input_shape=input_shape, num_classes=num_classes, task=task, seq_len=seq_len, lora=lora)


def print_json(data) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def breakdown_lines(breakdown: dict[str, int], peak_bytes: int) -> list[str]:
    """What was alive at the peak, by kind, then the peak. A kind at 0 B says why: the breakdown is taken at the peak,
    and a full fine-tune's gradients, say, are not alive then when the peak comes before backward makes them."""
    width = max((len(k) for k in breakdown), default=10)
    lines = [
        f"  {name.replace('_', ' '):<{width}}  {format_bytes(value):>12}" + ("  (none alive at the peak)" if value == 0 else "")
        for name, value in breakdown.items()
    ]
    lines.append(f"  {'peak':<{width}}  {format_bytes(peak_bytes):>12}  (each line above: alive at that moment)")
    return lines


def in_panels(command: Callable, panels: dict[str, tuple[str, ...]]) -> None:
    """Group ``command``'s arguments and options under ``--help`` into ``panels`` (typer's ``rich_help_panel``), in the
    table's order, from one table beside the command: its own signature stays as it reads (typer reads the
    ``__signature__`` this sets; a call passes every value by name). Each one gets its own copy, so that an option
    shared by several commands (``INPUT_SHAPE``) keeps the other commands' help as it is.

    Raises:
        ValueError: a name in ``panels`` that is not a parameter of ``command``, or a parameter in no panel (a help
            that would leave one option alone under "Options").
    """
    signature = inspect.signature(command)
    panel_of = {name: panel for panel, members in panels.items() for name in members}
    if set(panel_of) != set(signature.parameters):
        raise ValueError(
            f"{command.__name__}'s panels: unknown {sorted(set(panel_of) - set(signature.parameters))}, "
            f"left out {sorted(set(signature.parameters) - set(panel_of))}"
        )
    parameters = []
    for name in panel_of:  # the table's order: typer shows the panels in the order their first option comes
        parameter = signature.parameters[name]
        info = copy.copy(parameter.default)
        info.rich_help_panel = panel_of[name]
        parameters.append(parameter.replace(default=info))
    command.__signature__ = signature.replace(parameters=parameters)
