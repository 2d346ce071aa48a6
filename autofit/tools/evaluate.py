"""Validation of a trained classifier: accuracy, precision/recall/F1 and the confusion matrix.

Data is an image folder (``DIR/<class>/*.png``) read as training reads it
(``autofit.training.images.image_folder``): converted to the model's channels,
resized to its input size and turned into tensors in [0, 1]. Class indices
follow the order the checkpoint was trained with; a folder whose class set
differs is refused.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from autofit.errors import UserError
from autofit.model_io import as_loss, call_model, logits_of
from autofit.spec import ModelSpec, parse_shape
from autofit.step import to_device


@dataclass(kw_only=True, slots=True)
class ClassMetrics:
    name: str
    precision: float
    recall: float
    f1: float
    support: int
    """Samples of this class in the data."""


@dataclass(kw_only=True, slots=True)
class Evaluation:
    """What ``evaluate`` measured on one data set."""

    classes: list[str]
    num_samples: int
    accuracy: float
    loss: float | None
    """Mean loss per sample (None when no loss function was given)."""
    macro_precision: float
    macro_recall: float
    macro_f1: float
    per_class: list[ClassMetrics] = field(default_factory=list)
    confusion: list[list[int]] = field(default_factory=list)
    """confusion[i][j]: samples of true class i predicted as class j."""

    def to_dict(self) -> dict:
        return {
            "classes": self.classes,
            "num_samples": self.num_samples,
            "accuracy": self.accuracy,
            "loss": self.loss,
            "macro": {"precision": self.macro_precision, "recall": self.macro_recall, "f1": self.macro_f1},
            "per_class": [
                {"class": c.name, "precision": c.precision, "recall": c.recall, "f1": c.f1, "support": c.support}
                for c in self.per_class
            ],
            "confusion_matrix": self.confusion,
        }


def input_shape_of(checkpoint: dict | None, spec: ModelSpec) -> tuple[int, int, int]:
    """The (C, H, W) images are resized to: the checkpoint's, the model file's, or its example batch's."""
    text = ((checkpoint or {}).get("model_source") or {}).get("input_shape")
    if text:
        shape = parse_shape(text) if isinstance(text, str) else tuple(text)
    elif spec.input_shape:
        shape = tuple(spec.input_shape)
    else:
        inputs, _ = spec.example_batch(1)
        shape = tuple(inputs.shape[1:]) if isinstance(inputs, torch.Tensor) else ()
    if len(shape) != 3:
        raise UserError(
            f"model {spec.source!r} does not take images (input shape {'x'.join(map(str, shape)) or 'unknown'}); "
            "validation data must be an image folder for a CxHxW model"
        )
    return shape  # type: ignore[return-value]


def load_model_for_eval(weights: str | Path) -> tuple[dict, nn.Module, ModelSpec]:
    """Load a checkpoint, rebuild its model with the weights, in eval mode on the CPU."""
    from autofit.training.weights import load_checkpoint, model_from_checkpoint

    checkpoint = load_checkpoint(weights)
    model, spec = model_from_checkpoint(checkpoint, where=f"weights {str(weights)!r}")
    model.eval()
    return checkpoint, model, spec


def class_names(checkpoint: dict) -> list[str] | None:
    names = checkpoint.get("classes")
    return [str(n) for n in names] if names else None


def evaluate(
    model: Callable[[torch.Tensor], torch.Tensor],
    dataset,
    *,
    classes: Sequence[str],
    batch_size: int = 256,
    device: str = "cpu",
    loss_fn: Callable | None = None,
) -> Evaluation:
    """Run ``model`` over ``dataset`` once (no gradients) and score its predictions.

    Args:
        model: an nn.Module in eval mode, or any callable (a TorchScript module)
            mapping a batch (B, C, H, W) to logits (B, num_classes), or to an
            output with ``.logits`` (inputs may be tuples or dicts: ``model_io.call_model``).
        dataset: yields (input, class index).
        classes: class names, index i naming logit i.
        batch_size: samples per forward.
        device: where the forward runs.
        loss_fn: (output, targets) -> mean loss; when given, the mean loss is reported.

    Raises:
        UserError: the model gives fewer logits than there are classes.
    """
    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size} must be at least 1")
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)
    num_classes = len(classes)
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64)
    loss_sum = 0.0
    loss = as_loss(loss_fn)
    with torch.no_grad():
        for inputs, targets in loader:
            output = call_model(model, to_device(inputs, device))
            logits = logits_of(output)
            if logits is None or logits.ndim != 2 or logits.shape[1] < num_classes:
                shape = tuple(logits.shape) if logits is not None else type(output).__name__
                raise UserError(
                    f"the model gives outputs of shape {shape} but the data has {num_classes} classes; "
                    "use data with the classes the model was trained on"
                )
            logits = logits.float().cpu()  # (B, K)
            predicted = logits[:, :num_classes].argmax(dim=1)
            confusion += torch.bincount(targets * num_classes + predicted, minlength=num_classes * num_classes).view(num_classes, num_classes)
            if loss_fn is not None:
                loss_sum += float(loss(output, targets.to(device))) * len(targets)
    return scores_from_confusion(
        confusion.tolist(),
        classes=list(classes),
        loss=loss_sum / max(int(confusion.sum()), 1) if loss_fn is not None else None,
    )


def scores_from_confusion(confusion: list[list[int]], *, classes: list[str], loss: float | None = None) -> Evaluation:
    """Accuracy, per-class and macro precision/recall/F1 from a confusion matrix.

    A ratio with a zero denominator counts as 0. The macro average runs over
    the classes that occur in the data or in the predictions (as scikit-learn's
    ``average="macro"`` does by default).
    """
    matrix = torch.tensor(confusion, dtype=torch.float64).reshape(len(classes), len(classes))
    correct = matrix.diagonal()
    support = matrix.sum(dim=1)  # true samples per class
    predicted = matrix.sum(dim=0)  # predictions per class
    precision = torch.where(predicted > 0, correct / predicted.clamp(min=1), 0.0)
    recall = torch.where(support > 0, correct / support.clamp(min=1), 0.0)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-300), 0.0)
    present = (support > 0) | (predicted > 0)
    total = int(matrix.sum())

    def macro(values: torch.Tensor) -> float:
        return float(values[present].mean()) if bool(present.any()) else 0.0

    return Evaluation(
        classes=classes,
        num_samples=total,
        accuracy=float(correct.sum() / total) if total else 0.0,
        loss=loss,
        macro_precision=macro(precision),
        macro_recall=macro(recall),
        macro_f1=macro(f1),
        per_class=[
            ClassMetrics(name=name, precision=float(p), recall=float(r), f1=float(f), support=int(s))
            for name, p, r, f, s in zip(classes, precision, recall, f1, support)
        ],
        confusion=[[int(v) for v in row] for row in matrix.tolist()],
    )


def validate_weights(
    weights: str | Path,
    data_dir: str | Path,
    *,
    batch_size: int = 256,
    device: str = "cpu",
) -> Evaluation:
    """Score a checkpoint written by ``autofit train`` on an image folder.

    Raises:
        UserError: missing or foreign weights, a missing data folder, or
            classes that differ from the ones trained on.
    """
    from autofit.training.images import image_folder

    checkpoint, model, spec = load_model_for_eval(weights)
    dataset = image_folder(data_dir, input_shape=input_shape_of(checkpoint, spec), classes=class_names(checkpoint))
    return evaluate(
        model.to(device), dataset, classes=dataset.classes, batch_size=batch_size, device=device, loss_fn=spec.loss_fn,
    )


def score_dataset(model, dataset, *, loss_fn, batch_size: int = 256, device: str = "cpu", collate=None) -> dict:
    """Mean loss, and accuracy or perplexity, of ``model`` over any dataset (tensor, tuple or dict inputs).

    What ``autofit val`` reports without ``--data``: the model file's ``val_dataset()``, batched by its ``collate``
    (default ``collate_pairs``); a model that computes its losses only when training is scored as validation does
    (``training.validation.scored_output``).

    Returns:
        {"num_samples", "loss", "accuracy", "perplexity"} (None where it does not apply).
    """
    from autofit.model_io import Scores
    from autofit.training.data import collate_pairs
    from autofit.training.validation import scored_output

    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size} must be at least 1")
    scores = Scores(loss_fn)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate or collate_pairs)
    with torch.no_grad():
        for inputs, targets in loader:
            inputs, targets = to_device(inputs, device), to_device(targets, device)
            scores.add(scored_output(model, inputs, loss=scores.loss_fn), inputs, targets)
    return {"num_samples": int(scores.samples), "loss": scores.loss, "accuracy": scores.accuracy, "perplexity": scores.perplexity}


def validate_model_data(weights: str | Path, *, batch_size: int = 256, device: str = "cpu") -> dict:
    """Score a checkpoint on its model file's ``val_dataset()`` (any input form: tensors, tuples, dicts).

    Raises:
        UserError: missing or foreign weights, or a model without ``val_dataset()``.
    """
    checkpoint, model, spec = load_model_for_eval(weights)
    if spec.val_dataset is None:
        raise UserError(f"{spec.source} defines no val_dataset(); give --data DIR (an image folder of class folders)")
    return score_dataset(
        model.to(device), spec.val_dataset(), loss_fn=spec.loss_fn, batch_size=batch_size, device=device, collate=spec.collate,
    )


def format_scores(scores: dict) -> str:
    """One line: samples, loss, and accuracy or perplexity."""
    parts = [f"samples {scores['num_samples']}"]
    if scores["loss"] is not None:
        parts.append(f"loss {scores['loss']:.4f}")
    if scores["accuracy"] is not None:
        parts.append(f"accuracy {scores['accuracy']:.2%}")
    if scores["perplexity"] is not None:
        parts.append(f"perplexity {scores['perplexity']:.2f}")
    return "   ".join(parts)


def format_evaluation(evaluation: Evaluation) -> str:
    """The screen report: summary, a per-class table and the confusion matrix."""
    lines = [
        f"samples {evaluation.num_samples}   accuracy {evaluation.accuracy:.2%}"
        + (f"   loss {evaluation.loss:.4f}" if evaluation.loss is not None else ""),
        f"macro   precision {evaluation.macro_precision:.4f}   recall {evaluation.macro_recall:.4f}   f1 {evaluation.macro_f1:.4f}",
        "",
    ]
    width = max([len("class")] + [len(c.name) for c in evaluation.per_class])
    lines.append(f"{'class':<{width}}  {'precision':>9}  {'recall':>7}  {'f1':>7}  {'support':>7}")
    for c in evaluation.per_class:
        lines.append(f"{c.name:<{width}}  {c.precision:>9.4f}  {c.recall:>7.4f}  {c.f1:>7.4f}  {c.support:>7d}")
    lines += ["", "confusion matrix (rows: true class, columns: predicted)"]
    cell = max([len(str(v)) for row in evaluation.confusion for v in row] + [len(n) for n in evaluation.classes])
    lines.append(" " * width + "  " + " ".join(f"{n[:cell]:>{cell}}" for n in evaluation.classes))
    for name, row in zip(evaluation.classes, evaluation.confusion):
        lines.append(f"{name:<{width}}  " + " ".join(f"{v:>{cell}d}" for v in row))
    return "\n".join(lines)
