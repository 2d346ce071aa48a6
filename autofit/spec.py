"""What to train: a model file or ``torchvision:NAME``, turned into a ModelSpec.

A model file defines ``build_model() -> nn.Module`` and
``example_batch(batch_size) -> (inputs, targets)``; optionally
``loss_fn(output, target)`` (default cross-entropy), ``build_optimizer(params)``
(default AdamW), ``train_dataset()`` and ``val_dataset()``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from autofit.errors import UserError


@dataclass(kw_only=True, slots=True)
class ModelSpec:
    source: str
    """Where the model came from: a file path or "torchvision:NAME"."""
    build_model: Callable[[], nn.Module]
    example_batch: Callable[[int], tuple]
    loss_fn: Callable
    build_optimizer: Callable
    train_dataset: Callable | None = None
    val_dataset: Callable | None = None
    input_shape: tuple[int, ...] | None = None
    """(C, H, W) of one image sample, when known; the data loader resizes to it."""


def default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def parse_shape(text: str) -> tuple[int, ...]:
    """ "3x224x224" -> (3, 224, 224)."""
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(n < 1 for n in shape):
        raise UserError(f"input shape {text!r} is not of the form CxHxW, e.g. 3x224x224")
    return shape


def load_spec(source: str, *, input_shape: str = "3x224x224", num_classes: int = 1000) -> ModelSpec:
    """Load a model file or ``torchvision:NAME`` into a ModelSpec.

    Raises:
        UserError: the file is missing, fails to import, or lacks build_model /
            example_batch; the torchvision name is unknown.
    """
    if source.startswith("torchvision:"):
        return _torchvision_spec(source, parse_shape(input_shape), num_classes)
    return _file_spec(source)


def spec_for_plan(model_info, *, model_file: str | None = None) -> ModelSpec:
    """The ModelSpec a plan was made for: its model file (or ``model_file``), input shape and classes.

    Args:
        model_info: the plan's ``model`` part (``ModelInfo``: source, input_shape, num_classes).
        model_file: a model file to use instead of the plan's source.

    Raises:
        UserError: the plan names no file (it was made for a Python object) or
            the file is not here.
    """
    source = model_file or model_info.source
    if not source or source.startswith("python:"):
        raise UserError(
            f"the plan names no model file ({source or 'none'}: it was made for a Python object); "
            "give --model FILE defining build_model(), or train it with autofit.fit(model, plan=...)"
        )
    if not source.startswith("torchvision:") and not Path(source).is_file():
        raise UserError(f"the plan's model file {source!r} does not exist here; run from where the plan was made or give --model FILE")
    shape = model_info.input_shape
    return load_spec(
        source,
        input_shape="x".join(map(str, shape)) if shape else "3x224x224",
        num_classes=model_info.num_classes or 1000,
    )


def _file_spec(source: str) -> ModelSpec:
    path = Path(source)
    if not path.is_file():
        raise UserError(f"model file {source!r} does not exist; give a .py file that defines build_model() and example_batch(batch_size), or torchvision:NAME")
    module_name = "autofit_model_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # the user's file: any error is theirs to fix
            del sys.modules[module_name]
            raise UserError(f"model file {source!r} failed to import: {type(error).__name__}: {error}") from error
    missing = [name for name in ("build_model", "example_batch") if not callable(getattr(module, name, None))]
    if missing:
        raise UserError(f"model file {source!r} does not define {' and '.join(missing)}(); add it (see examples/digits_cnn.py)")
    shape = getattr(module, "INPUT_SHAPE", None)
    from autofit.model_checks import CheckedBuild, CheckedExampleBatch, LogitsCrossEntropy

    return ModelSpec(
        source=str(path),
        build_model=CheckedBuild(module.build_model, source=str(path)),
        example_batch=CheckedExampleBatch(module.example_batch, source=str(path)),
        loss_fn=getattr(module, "loss_fn", None) or LogitsCrossEntropy(source=str(path)),
        build_optimizer=getattr(module, "build_optimizer", None) or default_optimizer,
        train_dataset=getattr(module, "train_dataset", None),
        val_dataset=getattr(module, "val_dataset", None),
        input_shape=tuple(shape) if shape else None,
    )


def _torchvision_spec(source: str, input_shape: tuple[int, ...], num_classes: int) -> ModelSpec:
    import torchvision

    name = source.split(":", 1)[1]
    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise UserError(f"torchvision model {name!r} is unknown; try e.g. torchvision:resnet18 (classification models: {', '.join(sorted(available)[:8])}, ...)")
    if num_classes < 2:
        raise UserError(f"--num-classes {num_classes} must be at least 2")

    def build_model() -> nn.Module:
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes)

    def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch_size, *input_shape), torch.randint(0, num_classes, (batch_size,))

    return ModelSpec(
        source=source,
        build_model=build_model,
        example_batch=example_batch,
        loss_fn=nn.functional.cross_entropy,
        build_optimizer=default_optimizer,
        input_shape=input_shape,
    )


def model_fingerprint(model: nn.Module) -> str:
    """A hash of parameter and buffer names and shapes: which model a plan or weights belong to."""
    digest = hashlib.sha256()
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        digest.update(f"{name}:{tuple(tensor.shape)};".encode())
    return digest.hexdigest()[:16]


def spec_from_model(
    model: nn.Module,
    example_batch: Callable[[int], tuple],
    *,
    loss_fn: Callable | None = None,
    optimizer: Callable | None = None,
) -> ModelSpec:
    """A ModelSpec for a model object (the Python API): probes train copies of it.

    Args:
        model: the model to plan for; it is never modified.
        example_batch: batch_size -> (inputs, targets).
        loss_fn: (output, target) -> loss; default cross-entropy.
        optimizer: params -> Optimizer; default AdamW(lr=1e-3).
    """
    import copy

    if not isinstance(model, nn.Module):
        raise UserError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(example_batch):
        raise UserError("example_batch must be a function batch_size -> (inputs, targets)")
    template = copy.deepcopy(model).cpu()
    return ModelSpec(
        source=f"python:{type(model).__name__}",
        build_model=lambda: copy.deepcopy(template),
        example_batch=example_batch,
        loss_fn=loss_fn or nn.functional.cross_entropy,
        build_optimizer=optimizer or default_optimizer,
    )
