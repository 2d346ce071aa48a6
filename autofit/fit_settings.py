"""``FitSettings``: everything ``autofit.fit`` takes besides the model, one checked, documented record.

``fit(model, settings, **keywords)`` takes it whole, or its fields one by one as keywords (``FitKeywords`` spells
them for an editor's completion and a type checker); the keywords given override the settings' own.
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, get_args

from autofit.config import DeviceChoice
from autofit.errors import UserError

if TYPE_CHECKING:
    from autofit.plan_file import Plan
    from autofit.training.loop import TrainSettings


@dataclass(frozen=True, kw_only=True, slots=True)
class FitSettings:
    """What to train on, how to plan (unless a plan is given) and how to train: ``autofit.fit``'s arguments.

    Each field is checked here, as it is built (a wrong type or value is one ``UserError`` naming the keyword);
    what needs the model or the plan (``merge`` without adapters, ``batch_size`` against a plan's) is checked by
    ``fit``.

    Example:
        >>> settings = autofit.FitSettings(train_data=train, val_data=val, budget="8GB", batch_size=256, epochs=10)
        >>> autofit.fit(model, settings, log_dir="runs/a")  # a keyword overrides the settings' own
    """

    train_data: Any
    """A map-style dataset of (input, target) or of dicts holding their labels (transformers' way: ``model(**batch)``
    returns the loss), or an image folder path holding train/<class>/* and val/<class>/* (then ``val_data`` is its
    val/ and ``input_shape`` or the plan gives the image size)."""
    val_data: Any = None
    """A dataset for validation after each epoch (best.pt follows its accuracy); None validates nothing."""
    batch_size: int | None = None
    """Samples per optimizer step (the global batch); needed to plan."""
    budget: str | int = "16GB"
    """Memory budget, e.g. "16GB", "512MiB" (ignored with ``plan``)."""
    epochs: int | None = None
    """Passes over ``train_data`` in all; default 1, or on resume the run's own."""
    plan: Plan | str | Path | None = None
    """A Plan or a plan.json path to train with instead of planning; on resume the run's saved plan is used (a plan
    given must train as it does)."""
    example_batch: Callable[[int], tuple] | None = None
    """batch_size -> (inputs, targets) for the planner's probes; default: the first samples of ``train_data``."""
    loss_fn: Callable | None = None
    """(output, targets) -> loss, a mean or (loss_sum, item_count); default the model's own ``output.loss``, else
    cross-entropy of the output's logits."""
    count_items: Callable | None = None
    """(inputs, targets) -> items the loss averages over (e.g. ``autofit.model_io.count_labels(shift=True)`` for a
    causal LM's tokens); micro-batches are weighted by them. Default: samples."""
    optimizer: Callable | None = None
    """params -> Optimizer; default AdamW(lr=1e-3)."""
    collate: Callable | None = None
    """samples -> (inputs, targets) for samples that do not stack, whose lists hold one entry per sample (torchvision
    detection: ``lambda s: (tuple(map(list, zip(*s))), None)``, the model called as ``model(images, targets)`` and
    trained on the sum of its loss dict); ``example_batch``'s lists too."""
    lr: float | None = None
    """Peak learning rate; default the optimizer's."""
    schedule: str | None = None
    """After the warm-up, "cosine" (default) or "linear" to a tenth of the peak, or "constant"."""
    warmup_steps: int | None = None
    """Optimizer steps of linear warm-up to the peak rate; default 0."""
    max_grad_norm: float | None = None
    """Clip the gradients' global norm to this before each step (``clip_grad_norm_``); planning then leaves out the
    optimizer step in backward, which cannot clip. Default: no clipping (or the plan's)."""
    init_from: Mapping | str | Path | None = None
    """Weights to start from: a state dict, or a path to one (.pt, .bin, .safetensors, an autofit last.pt/best.pt, a
    save_pretrained directory); keys and shapes must match the model's."""
    lora: str | None = None
    """LoRA adapters over the model (PEFT), e.g. "r=16,alpha=32,targets=q_proj,v_proj": its weights (after
    ``init_from``) are frozen and the adapters, added to it in place, train (``autofit.adapters``). A plan made with
    adapters brings its own; one given here must be the same."""
    merge: bool = False
    """With adapters, also save them merged into the base (``log_dir/hf/merged``, loadable with ``from_pretrained``
    alone); the returned model keeps its adapters."""
    device: DeviceChoice = "cpu"
    """"cpu" or "cuda", where to plan (and so train)."""
    input_shape: str | None = None
    """"CxHxW" images from a folder are resized to."""
    log_dir: str | Path | None = None
    """Where metrics, run_plan.json, last.pt and best.pt go; default runs/<time>. One that holds a run is refused
    (before planning) unless ``resume`` or ``overwrite``."""
    resume: bool = False
    """Continue the run in ``log_dir`` from its last.pt, with its saved settings (``lr``, ``seed`` given again must
    equal them)."""
    data_changed: bool = False
    """With ``resume``, train on although the image folder or the datasets' sizes changed since the run began
    (without it, such a resume is refused)."""
    overwrite: bool = False
    """Start a new run in a ``log_dir`` that holds one, deleting its files once the new run has saved its first
    checkpoint (without it, such a start is refused)."""
    num_workers: int | None = None
    """DataLoader worker processes; None: on the CPU the cores the step's threads leave free, on a GPU up to 4."""
    seed: int | None = None
    """Fixes the data order and the RNG; default 0, or on resume the run's own."""
    max_steps: int | None = None
    """Stop (after saving last.pt) after this many optimizer steps."""
    verbose: bool = True
    """Progress bar and a line per epoch."""

    def __post_init__(self) -> None:
        from autofit.keywords import for_caller

        if self.train_data is None:
            raise UserError("train_data=None gives nothing to train on; give a dataset or an image folder's path")
        for name in ("merge", "resume", "data_changed", "overwrite", "verbose"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"{name}={getattr(self, name)!r} must be True or False")
        for name in ("example_batch", "loss_fn", "count_items", "optimizer", "collate"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise UserError(f"{name}={value!r} is not callable ({type(value).__name__}); give a function, or None for the default")
        if self.batch_size is not None and (isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1):
            raise UserError(f"batch_size={self.batch_size!r} must be a whole number of samples per step, at least 1")
        if self.device not in get_args(DeviceChoice):
            raise UserError(f"device={self.device!r} is not one of {', '.join(map(repr, get_args(DeviceChoice)))}")
        try:
            self.train_settings()  # the training's own checks (lr, log_dir, epochs, ...), in its flags' words
        except UserError as error:
            error.args = (for_caller(str(error)),)
            raise

    def train_settings(self) -> TrainSettings:
        """The training loop's settings of these (its lines name ``fit``'s keywords, not the command line's flags)."""
        from autofit.keywords import in_python
        from autofit.training.loop import TrainSettings

        folder = str(Path(self.train_data).resolve()) if isinstance(self.train_data, (str, Path)) else None
        return TrainSettings(
            epochs=self.epochs, log_dir=self.log_dir, lr=self.lr, resume=self.resume, overwrite=self.overwrite,
            seed=self.seed, num_workers=self.num_workers, max_steps=self.max_steps, verbose=self.verbose,
            sources={"data": folder, "model": None}, schedule=self.schedule, warmup_steps=self.warmup_steps,
            spell=in_python, merge=self.merge, data_changed=self.data_changed,
        )


class FitKeywords(TypedDict, total=False):
    """``FitSettings``' fields as ``fit``'s keywords (``**keywords: Unpack[FitKeywords]``), so that an editor completes
    them and a type checker checks them; each is documented on ``FitSettings`` (a test keeps the two the same)."""

    train_data: Any
    val_data: Any
    batch_size: int | None
    budget: str | int
    epochs: int | None
    plan: Plan | str | Path | None
    example_batch: Callable[[int], tuple] | None
    loss_fn: Callable | None
    count_items: Callable | None
    optimizer: Callable | None
    collate: Callable | None
    lr: float | None
    schedule: str | None
    warmup_steps: int | None
    max_grad_norm: float | None
    init_from: Mapping | str | Path | None
    lora: str | None
    merge: bool
    device: DeviceChoice
    input_shape: str | None
    log_dir: str | Path | None
    resume: bool
    data_changed: bool
    overwrite: bool
    num_workers: int | None
    seed: int | None
    max_steps: int | None
    verbose: bool


def fit_settings(settings: FitSettings | None, keywords: dict[str, Any]) -> FitSettings:
    """``settings`` with ``keywords`` in place of their fields, or the ``FitSettings`` of ``keywords`` alone.

    Raises:
        UserError: ``settings`` is not a FitSettings, a keyword is not one of its fields (the line names it and the
            nearest field), ``train_data`` is missing, or a field's own check fails.
    """
    known = [field.name for field in dataclasses.fields(FitSettings)]
    for name in keywords:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {near[0]}?" if near else f"give any of {', '.join(known)}"
            raise UserError(f"fit() takes no keyword {name!r}; {hint} (autofit.FitSettings' fields are its keywords)")
    if settings is None:
        if "train_data" not in keywords:
            raise UserError("fit() needs train_data: a dataset of (input, target) pairs, or an image folder's path")
        return FitSettings(**keywords)
    if not isinstance(settings, FitSettings):
        raise UserError(
            f"fit()'s second argument is an autofit.FitSettings, got {type(settings).__name__}; "
            "pass the data as train_data=..."
        )
    return dataclasses.replace(settings, **keywords)
