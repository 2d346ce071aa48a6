"""Options and output helpers shared by several commands."""
from __future__ import annotations

import json
import sys

import typer

from autofit.units import format_bytes

DEVICES = ("cpu", "cuda")

MODEL_ARG = typer.Argument(..., help="A model file defining build_model() and example_batch(n), or torchvision:NAME.")
INPUT_SHAPE = typer.Option("3x224x224", "--input-shape", help="Input shape CxHxW for torchvision models.")
NUM_CLASSES = typer.Option(1000, "--num-classes", help="Classes for torchvision models.")


def print_json(data) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def breakdown_lines(breakdown: dict[str, int], peak_bytes: int) -> list[str]:
    width = max((len(k) for k in breakdown), default=10)
    lines = [f"  {name.replace('_', ' '):<{width}}  {format_bytes(value):>12}" for name, value in breakdown.items()]
    lines.append(f"  {'peak':<{width}}  {format_bytes(peak_bytes):>12}")
    return lines
