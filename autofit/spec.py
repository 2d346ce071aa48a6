"""What to train: a model file, ``torchvision:NAME``, ``timm:NAME`` or ``hf:PATH``, turned into a ModelSpec.

A model file defines ``build_model() -> nn.Module`` and
``example_batch(batch_size) -> (inputs, targets)``; optionally
``loss_fn(output, targets)``, ``count_items(inputs, targets)``,
``build_optimizer(params)`` (default AdamW), ``train_dataset()``,
``val_dataset()`` and ``collate(samples)``:

- inputs may be a tensor (``model(x)``), a tuple or list (``model(*x)``) or a
  dict (``model(**x)``); targets may be None when the labels are in the inputs.
- ``loss_fn`` returns a mean loss, or ``(loss_sum, item_count)``. Without it,
  the model's own loss is used (``output.loss``, as transformers models give
  when called with labels), else cross-entropy of the logits.
- ``count_items`` gives the items the loss averages over (tokens that are not
  padding: ``count_items = autofit.model_io.count_labels()``); micro-batches are
  then weighted by items, not samples, which keeps accumulation exact.
- ``collate(samples) -> (inputs, targets)`` makes a batch of dataset samples
  whose lists hold one entry per sample (torchvision detection:
  ``((images, targets), None)``; ``model_io.per_sample``); micro-batches then
  take whole entries, and ``example_batch`` is read the same way. A model that
  returns a dict of losses trains on their sum.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.library_models import hf_parts, timm_parts
from autofit.model_io import Loss


@dataclass(kw_only=True, slots=True)
class ModelSpec:
    source: str
    """Where the model came from: a file path, "torchvision:NAME", "timm:NAME" or "hf:PATH"."""
    build_model: Callable[[], nn.Module]
    example_batch: Callable[[int], tuple]
    loss_fn: Callable
    """``(output, targets) -> loss``; a ``model_io.Loss`` also says what the loss averages over."""
    build_optimizer: Callable
    train_dataset: Callable | None = None
    val_dataset: Callable | None = None
    input_shape: tuple[int, ...] | None = None
    """(C, H, W) of one image sample, when known; the data loader resizes to it."""
    source_options: dict = field(default_factory=dict)
    """What rebuilds the model besides its source (hf: ``task``, ``seq_len``); plans and weights keep it."""
    build_pretrained: Callable[[], nn.Module] | None = None
    """The model with pretrained weights (an ``hf:`` directory holding them), for training; planning never calls
    it (weights change no byte). None: ``build_model``'s initialisation is where training starts."""
    weights_note: str = ""
    """Where training's weights come from, as the plan summary and the run's header say it ("pretrained from
    DIR", "random init from config.json"); "" for a model file's own initialisation."""
    config_dtype: str | None = None
    """The weights' dtype the model's config names (hf: config.json's ``dtype``: "fp32", "bf16", "fp16"); None where
    none is named. The weights are built in fp32 whatever it says; a plan keeps bf16 ones only when asked
    (``PlanRequest.weights_dtype``), and ``weights_held`` says which."""
    build_base: Callable[[], nn.Module] | None = None
    """With adapters (``lora``): the model without them, with its own initialisation, which weights given to start
    from (``--weights``) are loaded into before the adapters are added. None: no adapters."""
    collate: Callable[[list], tuple] | None = None
    """Dataset samples -> ``(inputs, targets)`` with per-sample lists marked (``model_io.per_sample``); None: stacked."""
    min_micro_batch_size: int | None = None
    """The fewest samples one forward may hold, as the model file declares it (``MIN_MICRO_BATCH``: a loss that
    couples the samples of a batch, in groups of that size); None: checked instead (``planning.coupling``)."""
    simulation_fallback: str = ""
    """Why fake tensors cannot run this model ("" when they can); the cpu meter then measures instead of the simulated one."""
    context_length: int | None = None
    """The longest sequence a text model takes (hf: its config's position embeddings); None: unknown, or no text model."""


def weights_held(spec: ModelSpec, config: TrainingConfig) -> str:
    """How a plan's configuration holds the weights on the device, and what became of the dtype the config names:
    "held in fp32 (config.json's dtype bf16 is not used: ...)", "held in bf16 (bf16-pure, config.json's dtype)";
    with frozen weights in NF4, that said after it."""
    held = _precision_holds(spec.config_dtype, config.precision)
    return f"{held}; the frozen linear weights in 4-bit NF4 (QLoRA's base)" if config.frozen_nf4 else held


def _precision_holds(named: str | None, precision: str) -> str:
    from strategies import MASTER_WEIGHTS, PURE_BF16

    if precision == MASTER_WEIGHTS:
        return "held in bf16 on the device, their fp32 masters on the host (bf16-master)"
    if precision == PURE_BF16:
        return "held in bf16 (bf16-pure" + (", config.json's dtype)" if named == "bf16" else ")")
    if named in (None, "fp32"):
        return "held in fp32"
    keep = "; --weights-dtype config keeps them in bf16" if named == "bf16" else ""
    return (
        f"held in fp32 (config.json's dtype {named} is not used: the plan's precision sets the arithmetic, and pure "
        f"half-precision weights are not lossless{keep})"
    )


def default_optimizer(params) -> torch.optim.Optimizer:
    """AdamW, lr 1e-3, its weight decay (0.01) on matrices only: biases and norm weights get none (``decay_groups``)."""
    return torch.optim.AdamW(decay_groups(params), lr=1e-3)


def decay_groups(params) -> list[dict]:
    """Parameter groups with weight decay off for tensors of fewer than 2 dimensions (biases, norm weights), the
    transformers convention; decided by shape, so host copies and sharded parameters group alike.

    Example:
        >>> groups = decay_groups(torch.nn.Linear(4, 2).parameters())
        >>> [(len(g["params"]), g.get("weight_decay")) for g in groups]
        [(1, None), (1, 0.0)]
    """
    params = list(params)
    groups = [{"params": [p for p in params if p.ndim >= 2]}, {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def wants_names(build_optimizer: Callable) -> bool:
    """True when a ``build_optimizer`` takes ``named_parameters``: (name, parameter) pairs rather than parameters."""
    import inspect

    try:
        first = next(iter(inspect.signature(build_optimizer).parameters), None)
    except (TypeError, ValueError):  # a builtin or a C callable: the old contract
        return False
    return first in ("named_parameters", "named_params")


def parse_shape(text: str) -> tuple[int, ...]:
    """ "3x224x224" -> (3, 224, 224)."""
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(n < 1 for n in shape):
        raise UserError(f"input shape {text!r} is not of the form CxHxW, e.g. 3x224x224")
    return shape


LIBRARY_PREFIXES = ("torchvision:", "timm:", "hf:")
"""Sources that name a model by library rather than by a model file."""


def is_library_source(source: str) -> bool:
    """True for ``torchvision:NAME``, ``timm:NAME`` and ``hf:PATH`` (no model file to find)."""
    return source.startswith(LIBRARY_PREFIXES)


def load_spec(
    source: str,
    *,
    input_shape: str = "3x224x224",
    num_classes: int | None = None,
    task: str | None = None,
    seq_len: int | None = None,
    lora: str | None = None,
) -> ModelSpec:
    """Load a model file, ``torchvision:NAME``, ``timm:NAME`` or ``hf:PATH`` into a ModelSpec.

    Args:
        input_shape: CxHxW for torchvision and timm models (hf image models read it from their config).
        num_classes: outputs of a classifier; default 1000 for torchvision and timm, the config's for hf.
        task: hf: only; "causal-lm", "sequence-classification" or "image-classification".
        seq_len: hf: text tasks only; tokens per example sequence.
        lora: LoRA adapters over the model (``autofit.adapters``: "r=16,alpha=32,targets=q_proj,v_proj"); None: none.

    Raises:
        UserError: the file is missing, fails to import, or lacks build_model /
            example_batch; the library name is unknown or the library is not installed;
            ``num_classes`` below 2 (0 used to pass as "not given").
    """
    spec = _load_spec(source, input_shape=input_shape, num_classes=num_classes, task=task, seq_len=seq_len)
    return spec if lora is None else _with_adapters(spec, lora)


def _with_adapters(spec: ModelSpec, lora: str) -> ModelSpec:
    """``spec`` with LoRA adapters over its model, pretrained or not; its options record them (plans, weights)."""
    from autofit.adapters import parse_lora, with_lora

    settings = parse_lora(lora)
    pretrained = spec.build_pretrained
    base = spec.weights_note or "the model's own initialisation"
    return dataclasses.replace(
        spec, build_model=with_lora(spec.build_model, settings), build_base=spec.build_model,
        build_pretrained=with_lora(pretrained, settings) if pretrained is not None else None,
        source_options={**spec.source_options, "lora": settings.text()},
        weights_note=f"{base}, frozen; LoRA adapters ({settings.text()}) trained",
    )


def _load_spec(source: str, *, input_shape: str, num_classes: int | None, task: str | None, seq_len: int | None) -> ModelSpec:
    if num_classes is not None and num_classes < 2:
        raise UserError(f"--num-classes {num_classes} must be at least 2 (leave it out for the model's default)")
    if source.startswith("torchvision:"):
        return _torchvision_spec(source, parse_shape(input_shape), 1000 if num_classes is None else num_classes)
    if source.startswith("timm:"):
        parts = timm_parts(source, input_shape=parse_shape(input_shape), num_classes=num_classes)
        return ModelSpec(source=source, build_optimizer=default_optimizer, **parts)
    if source.startswith("hf:"):
        parts = hf_parts(source, task=task, seq_len=seq_len, num_classes=num_classes, input_shape=input_shape)
        return ModelSpec(source=source, build_optimizer=default_optimizer, **parts)
    return _file_spec(source)


def spec_from_source_info(info: dict, *, model_file: str | None = None) -> ModelSpec:
    """The ModelSpec that a plan's ``model`` part or a checkpoint's ``model_source`` names.

    Args:
        info: ``source``, ``input_shape`` ([C, H, W] or "CxHxW"), ``num_classes``
            and, for hf:, ``task`` and ``seq_len``.
        model_file: a model file to use instead of the recorded source.
    """
    shape = info.get("input_shape")
    if isinstance(shape, (list, tuple)):
        shape = "x".join(map(str, shape))
    return load_spec(
        model_file or info["source"],
        input_shape=shape or "3x224x224",
        num_classes=info.get("num_classes"),
        task=info.get("task"),
        seq_len=info.get("seq_len"),
        lora=info.get("lora"),
    )


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
    if not is_library_source(source) and not Path(source).is_file():
        raise UserError(f"the plan's model file {source!r} does not exist here; run from where the plan was made or give --model FILE")
    return spec_from_source_info(asdict(model_info), model_file=source)


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
    count_items = getattr(module, "count_items", None)
    if count_items is not None and not callable(count_items):
        raise UserError(f"model file {source!r}: count_items must be a function (inputs, targets) -> int, e.g. autofit.model_io.count_labels()")
    collate = getattr(module, "collate", None)
    if collate is not None and not callable(collate):
        raise UserError(f"model file {source!r}: collate must be a function samples -> (inputs, targets), e.g. ((images, targets), None)")
    min_micro_batch = getattr(module, "MIN_MICRO_BATCH", None)
    if min_micro_batch is not None and (not isinstance(min_micro_batch, int) or isinstance(min_micro_batch, bool) or min_micro_batch < 1):
        raise UserError(
            f"model file {source!r}: MIN_MICRO_BATCH = {min_micro_batch!r} must be a whole number of samples, at least 1 "
            "(the fewest one forward of its loss may hold)"
        )
    from autofit.model_checks import CheckedBuild, CheckedCollate, CheckedExampleBatch, CheckedOptimizer

    return ModelSpec(
        source=str(path),
        build_model=CheckedBuild(module.build_model, source=str(path)),
        example_batch=CheckedExampleBatch(module.example_batch, source=str(path), per_sample=collate is not None),
        collate=CheckedCollate(collate, owner=f"model file {str(path)!r}", source=str(path)) if collate is not None else None,
        loss_fn=Loss(getattr(module, "loss_fn", None), count_items=count_items),
        build_optimizer=(
            CheckedOptimizer(module.build_optimizer, source=str(path)) if getattr(module, "build_optimizer", None) else default_optimizer
        ),
        train_dataset=getattr(module, "train_dataset", None),
        val_dataset=getattr(module, "val_dataset", None),
        input_shape=tuple(shape) if shape else None,
        min_micro_batch_size=min_micro_batch,
    )


def _torchvision_spec(source: str, input_shape: tuple[int, ...], num_classes: int) -> ModelSpec:
    import torchvision

    name = source.split(":", 1)[1]
    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise UserError(
            f"torchvision model {name!r} is unknown; try e.g. torchvision:resnet18 "
            f"(classification models: {', '.join(sorted(available)[:8])}, ...)"
        )
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
        loss_fn=Loss(nn.functional.cross_entropy),
        build_optimizer=default_optimizer,
        input_shape=input_shape,
        source_options={"num_classes": num_classes},
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
    count_items: Callable | None = None,
    optimizer: Callable | None = None,
    collate: Callable | None = None,
) -> ModelSpec:
    """A ModelSpec for a model object (the Python API): probes train copies of it.

    Args:
        model: the model to plan for; it is never modified.
        example_batch: batch_size -> (inputs, targets); inputs a tensor, tuple or dict.
        loss_fn: (output, targets) -> loss (a mean, or (loss_sum, item_count));
            default the model's own ``output.loss``, else cross-entropy.
        count_items: (inputs, targets) -> items the loss averages over; default samples.
        optimizer: params -> Optimizer; default AdamW(lr=1e-3).
        collate: samples -> (inputs, targets) whose lists hold one entry per sample (a ``model_checks.CheckedCollate``);
            ``example_batch``'s lists are then read so too.
    """
    import copy


    if not isinstance(model, nn.Module):
        raise UserError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(example_batch):
        raise UserError("example_batch must be a function batch_size -> (inputs, targets)")
    from autofit.model_checks import CheckedExampleBatch

    template = copy.deepcopy(model).cpu()
    source = f"python:{type(model).__name__}"
    return ModelSpec(
        source=source,
        build_model=lambda: copy.deepcopy(template),
        # Checked where it is called: plan(model, lambda n: "batch") is one line naming example_batch, not an unpacking error.
        example_batch=CheckedExampleBatch(example_batch, source=source, per_sample=collate is not None, owner=""),
        loss_fn=Loss(loss_fn, count_items=count_items),
        build_optimizer=optimizer or default_optimizer,
        collate=collate,
    )
