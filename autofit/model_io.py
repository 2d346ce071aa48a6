"""How autofit talks to a model: how a batch is passed in, what comes out, and what the loss averages over.

Every caller (the training step, the probe, the planner's traces and
timings, validation, compare and export) goes through these helpers, so a
model that takes a dict and returns a ``ModelOutput`` works everywhere:

- ``call_model(model, inputs)``: ``model(x)`` for a tensor, ``model(*x)`` for a
  tuple or list, ``model(**x)`` for a dict (transformers' way).
- ``logits_of(output)`` and ``own_loss(output)``: a plain tensor, or an output
  with ``.logits`` / ``.loss`` (transformers' ``ModelOutput``), or a dict's ``"out"`` (torchvision segmentation).
- ``Loss``: the model file's ``loss_fn`` (or the model's own loss) and its
  ``count_items``; ``Loss.weighted`` is one micro-batch's share of the global
  batch's loss.
- ``Samples``: a list in a batch with one entry per sample (torchvision
  detection's images and target dicts), split by entry; ``per_sample`` marks
  the lists of what a model file's ``collate`` returns.

Micro-batch weights. Accumulated micro-batches give exactly the gradient of
one step over the whole batch when each micro-batch's loss is weighted by its
share of what the loss averages over: samples by default; items (e.g.
tokens that are not padding) when the model file declares
``count_items(inputs, targets)``. A loss may also return ``(loss_sum, count)``;
with ``count_items`` declared, its micro-batches are weighted by the same
items, so 8 = 4 + 4 = 3 + 3 + 2 give the same gradient even with padding.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.nn import functional as F

from autofit._torch_private import FakeTensor, fake_mode_active, register_list_type, tree_leaves, tree_map
from autofit.errors import UserError

IGNORE_INDEX = -100
"""The label that losses skip (PyTorch's cross_entropy and transformers use it for padding)."""


@register_list_type
class Samples(list):
    """One entry per sample (torchvision detection's list of images and list of target dicts): the batch holds as
    many samples as entries, and a micro-batch takes whole entries, whatever the shapes of the tensors inside.

    It is a list (the model receives it as one), and a pytree node: tensors inside move to the device and become
    fake tensors like any other.
    """


def per_sample(batch: tuple) -> tuple:
    """``(inputs, targets)`` with each list or tuple one level in marked as ``Samples``: the arguments in the inputs
    (a tuple or list of the model's arguments, or a dict of them), and the targets themselves.

    A model file that defines ``collate`` has its batches read this way (torchvision detection:
    ``((images, targets), None)``, ``model(images, targets)`` returning its losses). Anything but a pair is returned
    as it is, for ``model_checks.check_batch`` to refuse in one line.

    Example:
        >>> inputs, targets = per_sample(((["img0", "img1"], [{"boxes": 0}, {"boxes": 1}]), None))
        >>> type(inputs[0]).__name__, len(inputs[1])
        ('Samples', 2)
    """
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        return batch
    inputs, targets = batch

    def mark(part):
        return Samples(part) if isinstance(part, (list, tuple)) and not isinstance(part, Samples) else part

    if isinstance(inputs, Mapping):
        inputs = {name: mark(value) for name, value in inputs.items()}
    elif isinstance(inputs, (tuple, list)):
        inputs = tuple(mark(argument) for argument in inputs)
    return inputs, mark(targets)


def _is_samples(tree) -> bool:
    return isinstance(tree, Samples)


def batch_sizes(tree) -> list[int]:
    """The sample count of every part of a batch that has one: each ``Samples``' length and each tensor's first
    dimension (not those inside a ``Samples``)."""
    return [
        len(leaf) if isinstance(leaf, Samples) else int(leaf.shape[0])
        for leaf in tree_leaves(tree, is_leaf=_is_samples)
        if isinstance(leaf, Samples) or (isinstance(leaf, torch.Tensor) and leaf.ndim > 0)
    ]


def sliced(tree, piece: slice):
    """Samples ``piece`` of a batch: every tensor with a batch dimension sliced along it, every ``Samples`` by entry;
    other leaves (flags, None) as they are. Tensors come out as views."""
    if isinstance(tree, torch.Tensor):  # the usual case, without tree_map's cost
        return tree[piece] if tree.ndim > 0 else tree

    def cut(leaf):
        if isinstance(leaf, Samples):
            return Samples(leaf[piece])
        return leaf[piece] if isinstance(leaf, torch.Tensor) and leaf.ndim > 0 else leaf

    return tree_map(cut, tree, is_leaf=_is_samples)


def call_model(model: Callable, inputs) -> Any:
    """Run ``model`` on one batch's inputs: ``model(**x)`` for a dict, ``model(*x)`` for a tuple or list, else ``model(x)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _field(output, name: str):
    """``output.name`` or ``output[name]`` when the output carries it (a ModelOutput, a dict, a dataclass)."""
    if isinstance(output, torch.Tensor):
        return None
    if isinstance(output, Mapping):
        value = output.get(name)
    else:
        value = getattr(output, name, None)
    return value if isinstance(value, torch.Tensor) else None


def own_loss(output) -> torch.Tensor | None:
    """The loss a model computed itself, or None: ``output.loss`` (transformers models given labels), or the sum of
    a dict of losses (torchvision detection in train mode: ``{"loss_classifier": ..., "loss_box_reg": ...}``)."""
    loss = _field(output, "loss")
    if loss is None and _is_loss_dict(output):
        loss = sum(output.values())
    return loss


def _is_loss_dict(output) -> bool:
    """A dict of named losses: every key says "loss", every value a number (a 0-dim floating tensor)."""
    return (
        isinstance(output, Mapping) and len(output) > 0
        and all(isinstance(name, str) and "loss" in name for name in output)
        and all(isinstance(value, torch.Tensor) and value.ndim == 0 and value.is_floating_point() for value in output.values())
    )


def logits_of(output) -> torch.Tensor | None:
    """The prediction tensor of an output: the output itself, its ``.logits``, or the first tensor of a tuple.

    Returns None when the output holds no such tensor (a model that returns only a loss).
    """
    if isinstance(output, torch.Tensor):
        return output
    logits = _field(output, "logits")
    if logits is not None:
        return logits
    if isinstance(output, Mapping):  # torchvision segmentation's {"out": ..., "aux": ...}: "out" is the prediction
        return _field(output, "out")
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, torch.Tensor)), None)
    return None


def batch_labels(inputs, targets) -> torch.Tensor | None:
    """The labels of a batch: ``targets``, or ``inputs["labels"]`` when the targets ride with the inputs."""
    if isinstance(targets, torch.Tensor):
        return targets
    if isinstance(inputs, Mapping) and isinstance(inputs.get("labels"), torch.Tensor):
        return inputs["labels"]
    return None


def batch_size_of(inputs, targets=None) -> int:
    """Samples in a batch: the first dimension of its first tensor, or the length of its first ``Samples``
    (targets first, then inputs)."""
    sizes = batch_sizes((targets, inputs))
    if not sizes:
        raise UserError("a batch holds no tensor with a batch dimension; example_batch and datasets must return tensors")
    return sizes[0]


def count_labels(*, ignore_index: int = IGNORE_INDEX, shift: bool = False) -> Callable:
    """A ``count_items`` for a per-token loss: labels that are not ``ignore_index``.

    Args:
        ignore_index: the label the loss skips (padding).
        shift: True for a causal LM that shifts its labels itself (transformers'
            ``...ForCausalLM`` given ``labels``): the first label of each sequence is never predicted.

    Example (a model file):
        >>> count_items = count_labels(shift=True)
    """

    def count_items(inputs, targets) -> int:
        labels = batch_labels(inputs, targets)
        if labels is None:
            raise UserError("count_items: the batch has no labels (targets, or inputs['labels']) to count")
        if shift:
            labels = labels[..., 1:]
        return int((labels != ignore_index).sum())

    count_items.__qualname__ = f"count_labels(ignore_index={ignore_index}, shift={shift})"
    return count_items


def zero_loss(output) -> torch.Tensor:
    """A loss of 0 that still reaches every parameter the output depends on (for a micro-batch of weight 0).

    Its gradient is exactly 0, with no division by a count of 0: a rank with
    no samples, or a micro-batch with no counted items, joins the step and adds nothing.
    """
    tensor = logits_of(output)
    if tensor is None:
        tensor = own_loss(output)
    if tensor is None:
        tensor = next(t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point())
    return tensor.float().sum() * 0.0


class Loss:
    """What a training step minimises, and what it averages over.

    Args:
        fn: ``(output, targets) -> loss``: a mean (a 0-dim tensor), or a pair
            ``(loss_sum, item_count)``. None: the model's own loss (``output.loss``)
            when it has one, else cross-entropy of its logits against the targets.
        count_items: ``(inputs, targets) -> int``, the items the loss of a batch
            averages over (e.g. tokens that are not padding; ``count_labels()``).
            None: samples. Counts must add up over a split of the batch.

    Raises:
        UserError: when called on an output with neither a loss nor logits,
            or with a ``(sum, count)`` loss but no ``count_items``.
    """

    def __init__(self, fn: Callable | None = None, *, count_items: Callable | None = None) -> None:
        if isinstance(fn, Loss):
            fn, count_items = fn.fn, count_items or fn.count_items
        self.fn = fn
        self.count_items = count_items

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", None) or ("the model's own loss" if self.fn is None else repr(self.fn))
        return f"Loss({name}, count_items={getattr(self.count_items, '__qualname__', None)})"

    def terms(self, output, targets) -> tuple[torch.Tensor, torch.Tensor | int | None]:
        """(value, count): the loss's value and, for a ``(sum, count)`` loss, its count (else None: a mean)."""
        if self.fn is None:
            loss = own_loss(output)
            if loss is not None:
                return loss, None
            logits = logits_of(output)
            if logits is None or targets is None:
                raise UserError(
                    f"the model returned {type(output).__name__} without a loss and the batch has "
                    f"{'no targets' if targets is None else 'no logits to score'}; define loss_fn(output, targets) "
                    "in the model file, or pass the labels so that the model computes its loss (output.loss)"
                )
            return default_loss(logits, targets), None
        value = self.fn(output, targets)
        if isinstance(value, (tuple, list)):
            if len(value) != 2:
                raise UserError(f"loss_fn returned {len(value)} values; return a mean loss, or (loss_sum, item_count)")
            return value[0], value[1]
        return value, None

    def scores(self, output) -> bool:
        """Whether this loss can score ``output``: a declared ``loss_fn`` always; the default needs the model's own
        loss or logits."""
        return self.fn is not None or own_loss(output) is not None or logits_of(output) is not None

    def __call__(self, output, targets) -> torch.Tensor:
        """The mean loss of one batch (a ``(sum, count)`` loss divided by its count)."""
        value, count = self.terms(output, targets)
        return value if count is None else value / count

    def count(self, inputs, targets) -> int | None:
        """Items this batch's loss averages over; None when it averages over samples.

        Fake tensors (the simulated meter) have no values to count: their
        micro-batches are weighted by samples, which changes no byte of memory.
        """
        if fake_mode_active() or any(isinstance(t, FakeTensor) for t in tree_leaves((inputs, targets))):
            return None
        if self.count_items is None:
            # The default loss averages a per-token (or per-pixel) cross-entropy over its labels that count.
            if self.fn is None and _item_labels(targets):
                return int((targets != IGNORE_INDEX).sum())
            return None
        return int(self.count_items(inputs, targets))

    def weighted(self, output, targets, *, weight: float) -> torch.Tensor:
        """One micro-batch's loss times its weight (its share of the global batch's items), in fp32.

        The sum of these over the micro-batches of a step is the mean loss of
        the whole global batch, and so is their gradient.
        """
        if weight == 0.0:
            return zero_loss(output)
        value, count = self.terms(output, targets)
        value = value.float()
        if count is not None:
            if self.count_items is None:
                raise UserError(
                    "loss_fn returns (loss_sum, item_count): also define count_items(inputs, targets) in the model file "
                    "(e.g. count_items = autofit.model_io.count_labels()), so micro-batches are weighted by items"
                )
            # weight = items here / items in the batch, so this is loss_sum / items in the batch.
            return value * (weight / count) if isinstance(count, torch.Tensor) else value * (weight / max(count, 1))
        return value if weight == 1.0 else value * weight


def _in_batch_matches(logits: torch.Tensor, labels: torch.Tensor) -> bool:
    """Whether ``logits`` score each sample against the batch's own samples (a (B, B) similarity matrix, an
    in-batch contrastive model's) with labels 0..B-1 (sample i matches sample i): not classes."""
    size = len(labels)
    return tuple(logits.shape) == (size, size) and size > 1 and torch.equal(labels.cpu(), torch.arange(size))


def _item_labels(targets) -> bool:
    """Whether ``targets`` are class labels per item (B, T) or (B, H, W): the default loss counts those items."""
    return isinstance(targets, torch.Tensor) and targets.ndim >= 2 and not targets.is_floating_point()


def default_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` against integer ``targets``, the mean over labels that are not ``IGNORE_INDEX``.

    The classes may stand in PyTorch's place, dimension 1 ((B, C) against (B,), (B, C, H, W) against (B, H, W): a
    classifier, a segmentation), or last ((B, T, V) against (B, T): a language model's tokens).

    Raises:
        UserError: the shapes fit neither way.
    """
    if targets.is_floating_point() or logits.ndim < 2:  # class probabilities, or a regression: PyTorch's rules
        return F.cross_entropy(logits, targets)
    if logits.ndim == targets.ndim + 1:
        if logits.shape[:1] + logits.shape[2:] == targets.shape:
            return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
        if logits.shape[:-1] == targets.shape:
            return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX)
    raise UserError(
        f"the default loss (cross-entropy) cannot score logits of shape {tuple(logits.shape)} against targets of shape "
        f"{tuple(targets.shape)}: the classes must be dimension 1 or the last one; define loss_fn(output, targets) in the "
        "model file"
    )


def as_loss(loss_fn: Callable | None) -> Loss:
    """``loss_fn`` as a ``Loss`` (a plain function weights by samples; None is the model's own loss)."""
    return loss_fn if isinstance(loss_fn, Loss) else Loss(loss_fn)


class Scores:
    """Running validation totals: the mean loss over counted items, accuracy when the output classifies,
    perplexity when the loss is a language model's (per-token logits, or a model that returns only its loss).

    Example:
        >>> scores = Scores(loss)
        >>> for inputs, targets in batches:
        ...     scores.add(call_model(model, inputs), inputs, targets)
        >>> scores.loss, scores.accuracy, scores.perplexity
    """

    def __init__(self, loss: Callable | None) -> None:
        self.loss_fn = as_loss(loss)
        self.loss_sum = 0.0
        self.items = 0.0
        self.correct = 0.0
        self.samples = 0.0
        self.classified = True
        self.language_model = False

    def add(self, output, inputs, targets, *, counted: float = 1.0) -> None:
        """Add one batch (``counted`` 0 runs it without counting it: a rank's padding batch)."""
        mean = self.loss_fn(output, targets).float().item()
        size = batch_size_of(inputs, targets)
        items = self.loss_fn.count(inputs, targets)
        items = size if items is None else items
        if items:
            self.loss_sum += mean * items * counted
            self.items += items * counted
        logits, labels = logits_of(output), batch_labels(inputs, targets)
        classifies = (
            logits is not None and labels is not None and logits.ndim == 2 and labels.ndim == 1
            and not labels.is_floating_point() and not _in_batch_matches(logits, labels)
        )
        self.classified = self.classified and classifies
        if self.classified:
            self.correct += (logits.argmax(dim=1) == labels).sum().item() * counted
        self.samples += size * counted
        # Token labels (B, T) make a loss a language model's; a loss alone (CLIP's contrastive one) is not.
        tokens = labels is not None and labels.ndim == 2 and not labels.is_floating_point()
        self.language_model = self.language_model or tokens and (
            (logits is None and _field(output, "loss") is not None) or (logits is not None and logits.ndim == 3)
        )

    def totals(self) -> list[float]:
        """The sums, to add up over ranks: [loss_sum, items, correct, samples]."""
        return [self.loss_sum, self.items, self.correct, self.samples]

    def set_totals(self, totals: list[float]) -> None:
        self.loss_sum, self.items, self.correct, self.samples = totals

    @property
    def loss(self) -> float | None:
        return self.loss_sum / self.items if self.items else None

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.samples if self.classified and self.samples else None

    @property
    def perplexity(self) -> float | None:
        import math

        if self.classified or not self.language_model or self.loss is None:
            return None
        return math.exp(min(self.loss, 700.0))
