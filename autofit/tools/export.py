"""Export trained weights for inference: prune, quantize, and save as TorchScript or ONNX.

- Pruning is global L1 unstructured (``torch.nn.utils.prune``): the smallest
  ``amount`` of all conv/linear weights, pooled, become zero, and the pruning
  is made permanent (the mask is folded into the weight).
- Quantization is dynamic int8 of Linear layers
  (``torch.ao.quantization.quantize_dynamic``): weights stored as int8,
  activations quantized on the fly. It applies only where the model has Linear
  layers; convolutions stay in fp32.

Unstructured zeros do not shrink a dense file: they compress. So the report
gives each file's size and its gzip size, before and after, both exported in
the same format, and, with data, the validation accuracy of the exported
artifact itself (reloaded from disk) against the original model's.
"""
from __future__ import annotations

import gzip
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from autofit.atomic import write_atomic
from autofit.errors import UserError
from autofit.model_io import logits_of

FORMATS = ("torchscript", "onnx")
QUANTIZATIONS = ("none", "int8")
_SUFFIXES = {"torchscript": "-export.pt", "onnx": ".onnx"}


@dataclass(kw_only=True, slots=True)
class ExportConfig:
    prune_amount: float = 0.0
    """Share of conv/linear weights set to zero, in [0, 1); 0 prunes nothing."""
    quantize: str = "none"
    """"int8" (dynamic quantization of Linear layers) or "none"."""
    format: str = "torchscript"
    """"torchscript" or "onnx"."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.prune_amount < 1.0:
            raise UserError(f"--prune {self.prune_amount} must be in [0, 1), the share of weights set to zero; e.g. --prune 0.3")
        if self.quantize not in QUANTIZATIONS:
            raise UserError(f"--quantize {self.quantize!r} is unknown; use int8 (or leave it out)")
        if self.format not in FORMATS:
            raise UserError(f"--format {self.format!r} is unknown; use torchscript or onnx")
        if self.format == "onnx" and self.quantize == "int8":
            raise UserError(
                "--quantize int8 cannot be exported to ONNX (dynamically quantized Linear layers have no ONNX export); "
                "use --format torchscript, or drop --quantize"
            )


@dataclass(kw_only=True, slots=True)
class ExportReport:
    out: str
    format: str
    prune_amount: float
    sparsity: float
    """Measured share of zeros in the prunable weights after pruning."""
    prunable_weights: int
    quantized_layers: int
    """Linear layers now int8 (0 without --quantize, or when the model has none)."""
    checkpoint_bytes: int
    """The checkpoint file exported from, for reference (it may also hold optimizer state)."""
    size_before_bytes: int
    """The unchanged model exported in the same format."""
    size_after_bytes: int
    gzip_before_bytes: int
    gzip_after_bytes: int
    accuracy_before: float | None = None
    accuracy_after: float | None = None
    """Of the exported file, reloaded (ONNX: with onnxruntime when installed)."""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def prunable(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, "weight") of every layer with a matrix or kernel weight: Linear, Conv, Embedding..."""
    return [
        (module, "weight")
        for module in model.modules()
        if isinstance(getattr(module, "weight", None), nn.Parameter) and module.weight.dim() >= 2
    ]


def prune_global_l1(model: nn.Module, amount: float) -> float:
    """Zero the ``amount`` smallest-magnitude weights across all prunable layers, permanently.

    Returns:
        The measured share of zeros in those weights afterwards.
    """
    from torch.nn.utils import prune

    targets = prunable(model)
    if not targets:
        return 0.0
    if amount > 0:
        prune.global_unstructured(targets, pruning_method=prune.L1Unstructured, amount=amount)
        for module, name in targets:
            prune.remove(module, name)  # folds weight_orig * weight_mask into a plain weight
    zeros = sum(int((module.weight == 0).sum()) for module, _ in targets)
    return zeros / sum(module.weight.numel() for module, _ in targets)


def quantize_int8(model: nn.Module) -> tuple[nn.Module, int]:
    """Dynamic int8 quantization of the Linear layers; returns the model and how many were quantized."""
    linears = sum(1 for m in model.modules() if type(m) is nn.Linear)
    if linears == 0:
        return model, 0
    with warnings.catch_warnings():
        # quantize_dynamic warns that quantized tensor types are deprecated; they still run on this torch.
        warnings.simplefilter("ignore")
        quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    return quantized, linears


class LogitsOnly(nn.Module):
    """The model as an inference file keeps it: its inputs in, its logits (a ModelOutput's ``.logits``) out.

    Args:
        keys: for a model that takes a dict: the names of the tensors the file
            takes positionally, in this order (``model(**dict(zip(keys, inputs)))``).
    """

    def __init__(self, model: nn.Module, *, keys: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.model = model
        self.keys = keys

    def forward(self, *inputs):
        output = self.model(**dict(zip(self.keys, inputs))) if self.keys else self.model(*inputs)
        logits = logits_of(output)
        return output if logits is None else logits


def save_model(model: nn.Module, example, path: Path, *, file_format: str) -> Path:
    """Write ``model`` (eval mode) as TorchScript (traced) or ONNX (batch dimension dynamic).

    ``example`` is one batch of inputs: a tensor, a tuple (the file takes them
    positionally) or a dict (TorchScript only: the file takes its tensors
    positionally in the dict's order, ``labels`` left out). The file returns the logits.
    A TorchScript file is written beside and renamed into place (``write_atomic``), so an earlier export is
    never left half overwritten.

    Raises:
        UserError: the disk is full, whichever layer says it (torch's zip writer raises a RuntimeError of its own).
    """
    try:
        return _save_model(model, example, path, file_format=file_format)
    except (OSError, RuntimeError) as error:
        from autofit.training.weights import disk_full

        full = disk_full(error, path)
        if full is None:
            raise
        raise UserError(
            f"the disk holding {path.parent} is full ({full.strerror}) writing {path.name}; free space, then export again"
        ) from error


def _save_model(model: nn.Module, example, path: Path, *, file_format: str) -> Path:
    model.eval()
    if file_format == "torchscript":
        keys: tuple[str, ...] = ()
        if isinstance(example, dict):
            keys = tuple(key for key in example if key != "labels")  # inference predicts them
            example = tuple(example[key] for key in keys)
        inputs = tuple(example) if isinstance(example, (tuple, list)) else (example,)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # torch.jit is deprecated upstream, still the asked-for format
            traced = torch.jit.trace(LogitsOnly(model, keys=keys), inputs, strict=False)
            write_atomic(path, lambda file: torch.jit.save(traced, file))
        return path
    if not isinstance(example, torch.Tensor):
        raise UserError(
            f"ONNX export takes a model with one tensor input; this one takes a {type(example).__name__}: use --format torchscript"
        )
    _require_onnx()
    batch = torch.export.Dim("batch", min=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, (example,), dynamo=True, dynamic_shapes=({0: batch},),
            input_names=["input"], output_names=["logits"], verbose=False,
        )
    program.save(str(path))
    return path


def load_exported(path: Path, *, file_format: str) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, str | None]:
    """The exported file as a callable for validation, or (None, why not)."""
    if file_format == "torchscript":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            module = torch.jit.load(str(path))
        module.eval()
        return module, None
    try:
        import onnxruntime
    except ImportError:
        return None, "onnxruntime is not installed: accuracy after is of the exported model in memory, not of the .onnx file (pip install onnxruntime)"
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def run(inputs: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run(None, {"input": inputs.cpu().numpy()})[0])

    return run, None


def export_weights(
    weights: str | Path,
    *,
    config: ExportConfig,
    out: str | Path | None = None,
    data: str | Path | None = None,
    batch_size: int = 256,
) -> ExportReport:
    """Prune and/or quantize a trained checkpoint and export it.

    Args:
        weights: a checkpoint from ``autofit train`` (runs/NAME/best.pt).
        config: pruning, quantization and format.
        out: the file to write; default beside the weights (best-export.pt / best.onnx).
        data: a validation image folder; when given, accuracy before and after.
        batch_size: samples per forward when validating.

    Raises:
        UserError: foreign or missing weights, a missing data folder, a format
            whose package is not installed, or ``out`` naming the weights file.
    """
    from autofit.atomic import check_writable
    from autofit.tools.evaluate import evaluate, load_model_for_eval

    if config.format == "onnx":
        _require_onnx()
    weights = Path(weights)
    out = Path(out) if out is not None else weights.with_name(weights.stem + _SUFFIXES[config.format])
    if out.resolve() == weights.resolve():
        raise UserError(f"--out {str(out)!r} is the weights file itself; choose another path")
    checkpoint, model, spec = load_model_for_eval(weights)
    check_writable(out, option="--out")
    example, dataset = _example_and_data(checkpoint, spec, data)
    notes: list[str] = []

    def accuracy(predict) -> float | None:
        if dataset is None:
            return None
        return evaluate(predict, dataset, classes=dataset.classes, batch_size=batch_size).accuracy

    accuracy_before = accuracy(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    size_before, gzip_before = _baseline_sizes(model, example, scratch_in=out.parent, file_format=config.format)
    prunable_weights = sum(module.weight.numel() for module, _ in prunable(model))
    sparsity = prune_global_l1(model, config.prune_amount)
    if config.prune_amount > 0 and not prunable_weights:
        notes.append("the model has no conv/linear weights: nothing was pruned")
    quantized_layers = 0
    if config.quantize == "int8":
        model, quantized_layers = quantize_int8(model)
        if quantized_layers == 0:
            notes.append("the model has no Linear layers: int8 dynamic quantization does not apply; weights stay fp32")
    save_model(model, example, out, file_format=config.format)
    predict, why_not = load_exported(out, file_format=config.format)
    if why_not:
        notes.append(why_not)
    accuracy_after = accuracy(predict or model)
    return ExportReport(
        out=str(out),
        format=config.format,
        prune_amount=config.prune_amount,
        sparsity=sparsity,
        prunable_weights=prunable_weights,
        quantized_layers=quantized_layers,
        checkpoint_bytes=weights.stat().st_size,
        size_before_bytes=size_before,
        size_after_bytes=out.stat().st_size,
        gzip_before_bytes=gzip_before,
        gzip_after_bytes=_gzip_size(out),
        accuracy_before=accuracy_before,
        accuracy_after=accuracy_after,
        notes=notes,
    )


def _example_and_data(checkpoint: dict, spec, data: str | Path | None):
    """(an example input for the exported file, the validation images or None).

    Raises:
        UserError: ``data`` given for a model that does not take images, or a folder that is not one.
    """
    from autofit.tools.evaluate import class_names, input_shape_of
    from autofit.training.images import image_folder

    try:
        shape = input_shape_of(checkpoint, spec)
    except UserError:  # not an image model: its own example inputs (a tuple, a dict) give the file's input form
        if data is not None:
            raise
        shape = None
    dataset = image_folder(data, input_shape=shape, classes=class_names(checkpoint)) if data is not None else None
    example = torch.zeros(2, *shape) if shape else spec.example_batch(2)[0]
    return example, dataset


def _baseline_sizes(model: torch.nn.Module, example, *, scratch_in: Path, file_format: str) -> tuple[int, int]:
    """Bytes of the model exported as it is, plain and gzipped (written in a scratch folder beside the output)."""
    with tempfile.TemporaryDirectory(dir=scratch_in, prefix=".autofit-export-") as scratch:
        baseline = save_model(model, example, Path(scratch) / ("baseline" + _SUFFIXES[file_format]), file_format=file_format)
        return baseline.stat().st_size, _gzip_size(baseline)


def format_report(report: ExportReport) -> str:
    """The screen report: what was done, sizes and accuracy before and after."""
    from autofit.units import format_bytes

    def change(before: int, after: int) -> str:
        return f"{format_bytes(before):>12} -> {format_bytes(after):>12}  ({after / before:.0%})" if before else f"{format_bytes(after)}"

    lines = [
        f"wrote {report.out} ({report.format})",
        f"  pruning        {report.prune_amount:.0%} global L1 unstructured, {report.sparsity:.1%} of {report.prunable_weights} conv/linear weights now zero",
        f"  quantization   {f'int8 dynamic, {report.quantized_layers} Linear layer(s)' if report.quantized_layers else 'none'}",
        f"  file size      {change(report.size_before_bytes, report.size_after_bytes)}",
        f"  gzip size      {change(report.gzip_before_bytes, report.gzip_after_bytes)}",
        f"  (checkpoint file: {format_bytes(report.checkpoint_bytes)})",
    ]
    if report.accuracy_before is not None:
        lines.append(f"  val accuracy   {report.accuracy_before:.2%} -> {report.accuracy_after:.2%}")
    lines += [f"  note: {note}" for note in report.notes]
    return "\n".join(lines)


def _gzip_size(path: Path) -> int:
    return len(gzip.compress(path.read_bytes(), compresslevel=6))


def _require_onnx() -> None:
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as error:
        raise UserError(
            f"--format onnx needs the {error.name} package, which is not installed; run `pip install onnx onnxscript`, "
            "or use --format torchscript"
        ) from error
