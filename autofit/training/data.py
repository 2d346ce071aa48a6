"""Training data for the loop: an image folder, text for a language model, the model file's datasets, or datasets you pass.

``cli_data`` picks the reader for ``--data``: a .txt, .jsonl or .parquet file or a
folder saved by 🤗 datasets is text (``autofit.training.text``, tokenized with the
``hf:DIR`` model's tokenizer); any other folder is an image folder.

An image folder is ``DIR/train/<class>/<image>`` and ``DIR/val/<class>/<image>``
(torchvision's ImageFolder layout), each read by ``autofit.training.images.image_folder``:
images are resized to the plan's input shape (C, H, W) and scaled to [0, 1].
Files that PIL cannot read are skipped and counted when the folder is scanned;
files that pass the scan but fail to decode when read (a truncated JPEG) are
left out of their batch (``make_loader`` yields them beside it) and named in the log.

Batches come in a fixed order per (seed, epoch), so a resumed run sees exactly
the batches an uninterrupted one would: ``epoch_order`` is that order, and
``make_loader`` starts it at any batch.
"""
from __future__ import annotations

import functools
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from autofit.errors import UserError
from autofit.spec import ModelSpec, parse_shape
from autofit.training.images import SkipUnreadable, Unreadable, image_folder, image_mode

@dataclass(kw_only=True, slots=True)
class TrainData:
    """The datasets one run trains and validates on."""

    train: Dataset
    val: Dataset | None
    """None: no validation; best.pt then follows the training loss."""
    classes: list[str] | None = None
    """Class names by label index, when known (saved with the weights)."""
    skipped_images: int = 0
    """Files with an image extension that could not be read, left out."""
    source: str = "datasets"
    """Where the data came from, for messages."""
    collate: Callable[[list], tuple] | None = None
    """Samples -> ``(inputs, targets)`` (a model file's ``collate``); None: ``collate_pairs``."""


def input_shape_from(value, *, fallback: Sequence[int] | None = None) -> tuple[int, ...]:
    """A plan's ``model["input_shape"]`` ([1, 8, 8], (1, 8, 8) or "1x8x8") as a tuple.

    Raises:
        UserError: neither the value nor the fallback names a shape.
    """
    if isinstance(value, str):
        return parse_shape(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(n, int) and n > 0 for n in value):
        return tuple(value)
    if fallback:
        return tuple(fallback)
    raise UserError(
        f"the plan's model input_shape {value!r} is not a shape like [1, 32, 32]; "
        "set INPUT_SHAPE in the model file and re-plan, or give input_shape=\"CxHxW\""
    )


def image_folder_data(root: str | Path, *, input_shape: Sequence[int]) -> TrainData:
    """Read ``root/train/<class>/*`` and ``root/val/<class>/*`` as image datasets.

    Args:
        root: the folder holding train/ and val/.
        input_shape: (C, H, W) every image is converted and resized to; C is 1
            (grayscale), 3 (RGB) or 4 (RGBA).

    Raises:
        UserError: the folder or train/ or val/ is missing, a class folder holds
            no readable image, or train/ and val/ hold different classes.
    """
    root = Path(root)
    image_mode(input_shape)
    if not root.is_dir():
        raise UserError(
            f"data folder {str(root)!r} does not exist; give a folder with train/<class>/<image> and "
            f"val/<class>/<image> (e.g. `python examples/make_digits.py {root}`)"
        )
    class_sets = {}
    for split in ("train", "val"):
        folder = root / split
        if not folder.is_dir():
            raise UserError(f"data folder {str(root)!r} has no {split}/ folder; expected {root / split}/<class>/<image>")
        class_sets[split] = sorted(entry.name for entry in folder.iterdir() if entry.is_dir())
        if not class_sets[split]:
            raise UserError(f"{str(folder)!r} holds no class folders; expected {folder}/<class>/<image>")
    if class_sets["train"] != class_sets["val"]:
        only_train = sorted(set(class_sets["train"]) - set(class_sets["val"]))
        only_val = sorted(set(class_sets["val"]) - set(class_sets["train"]))
        raise UserError(
            f"train/ and val/ in {str(root)!r} hold different classes (only in train/: {', '.join(only_train) or '-'}; "
            f"only in val/: {', '.join(only_val) or '-'}); give both the same class folders"
        )
    datasets = {
        split: SkipUnreadable(image_folder(root / split, input_shape=input_shape, skip_unreadable=True))
        for split in ("train", "val")
    }
    return TrainData(
        train=datasets["train"], val=datasets["val"], classes=list(datasets["train"].classes),
        skipped_images=datasets["train"].unreadable + datasets["val"].unreadable, source=str(root),
    )


def cli_data(
    path: Path, *, spec: ModelSpec, input_shape, seq_len: int | None, pack: bool = True, val_fraction: float | None = None,
) -> TrainData:
    """The data ``--data PATH`` names: text (by suffix, or a datasets folder) or an image folder.

    Raises:
        UserError: text for a model that is not an ``hf:`` causal LM or has no tokenizer, text options
            given for an image folder, or bad data (see the readers).
    """
    from autofit.training.text import DEFAULT_VAL_FRACTION, is_text_source, load_tokenizer, text_datasets

    if not is_text_source(path):
        if spec.source_options.get("task") == "causal-lm":
            raise UserError(
                f"--data {str(path)!r} is not text this language model can read; give a .txt (paragraphs), .jsonl "
                "(text, or prompt and completion), .parquet (a text column) or a folder saved by datasets' save_to_disk"
            )
        if not pack or val_fraction is not None:
            raise UserError(
                f"--no-pack and --val-fraction are for text data (.txt, .jsonl, .parquet or a datasets folder); "
                f"{str(path)!r} is read as an image folder, whose val/ is the validation data"
            )
        return image_folder_data(path, input_shape=input_shape_from(input_shape))
    if not spec.source.startswith("hf:") or spec.source_options.get("task") != "causal-lm" or not seq_len:
        raise UserError(
            f"--data {str(path)!r} is text, which trains an hf:DIR causal language model (its tokenizer in DIR); "
            f"this plan is for {spec.source}: plan `autofit plan hf:DIR --task causal-lm`, or give an image folder"
        )
    from transformers import AutoConfig  # hf: read this config to build the model

    from autofit.library_models import hf_dir

    model_dir = hf_dir(spec.source)
    tokenizer = load_tokenizer(model_dir)
    val_fraction = DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction
    train, val = text_datasets(
        path, tokenizer=tokenizer, seq_len=seq_len, pack=pack, val_fraction=val_fraction,
        vocab_size=getattr(AutoConfig.from_pretrained(model_dir, local_files_only=True), "vocab_size", None),
    )
    return TrainData(train=train, val=val, source=f"{path} ({train.description}; {val.description if val else 'no validation'})")


def model_file_data(spec: ModelSpec) -> TrainData:
    """The model file's ``train_dataset()`` and (optional) ``val_dataset()``.

    Raises:
        UserError: the model file defines no ``train_dataset()``.
    """
    if spec.train_dataset is None:
        raise UserError(
            f"no training data: give --data DIR (DIR/train/<class>/<image>, DIR/val/<class>/<image>) "
            f"or define train_dataset() in {spec.source}"
        )
    train = spec.train_dataset()
    description = getattr(train, "description", None)  # e.g. hf: text tasks' synthetic tokens
    source = f"{spec.source} ({description})" if description else spec.source
    return datasets_data(train, spec.val_dataset() if spec.val_dataset else None, source=source, collate=spec.collate)


def check_sample_shape(data: TrainData, input_shape: Sequence[int] | None) -> None:
    """Refuse data whose samples are not of the shape the plan was measured for (its memory holds for that shape).

    Only a sample that is a single tensor is compared (a dict of inputs carries no one shape).

    Raises:
        UserError: the first training sample's shape differs from ``input_shape``.
    """
    if not input_shape:
        return
    sample = data.train[0]
    inputs = sample[0] if isinstance(sample, (tuple, list)) else sample
    if isinstance(inputs, torch.Tensor) and tuple(inputs.shape) != tuple(input_shape):
        shape, planned = "x".join(map(str, inputs.shape)) or "a scalar", "x".join(map(str, input_shape))
        raise UserError(
            f"{data.source}: a training sample is {shape}, but the plan was made for inputs of {planned} (INPUT_SHAPE); "
            "its memory does not hold for other shapes: set INPUT_SHAPE to the data's shape and plan again"
        )


def datasets_data(train, val=None, *, source: str = "datasets", collate: Callable[[list], tuple] | None = None) -> TrainData:
    """Wrap map-style datasets (``len`` and ``[i]`` -> (input, target), or a dict holding its labels).

    Args:
        collate: samples -> ``(inputs, targets)``, for samples that do not stack (a model file's ``collate``).

    Raises:
        UserError: a dataset is a DataLoader, not indexable, or empty.
    """
    for name, dataset in (("train_data", train), ("val_data", val)):
        if dataset is None and name == "val_data":
            continue
        if isinstance(dataset, DataLoader):
            raise UserError(f"{name} is a DataLoader; pass its dataset (loader.dataset): autofit batches by the plan's batch size")
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise UserError(f"{name} ({type(dataset).__name__}) is not a map-style dataset with len() and [i]; wrap it in a torch Dataset")
        if len(dataset) == 0:
            raise UserError(f"{name} is empty; give at least one sample")
    classes = getattr(train, "classes", None)
    return TrainData(train=train, val=val, classes=list(classes) if classes is not None else None, source=source, collate=collate)


def epoch_order(num_samples: int, *, seed: int, epoch: int) -> list[int]:
    """The sample order of one epoch: a permutation fixed by (seed, epoch)."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def make_loader(
    dataset: Dataset, *, batch_size: int, order: Sequence[int], num_workers: int, collate: Callable[[list], tuple] | None = None,
) -> DataLoader:
    """Batches of ``dataset`` taken in ``order`` (indices; start mid-epoch by slicing it).

    Each batch is ``(inputs, targets, unreadable)``: the samples that could be
    read, collated by ``collate`` (default ``collate_pairs``; None, None when
    none could), and the ``Unreadable`` ones.

    Workers ignore Ctrl-C, SIGTERM and SIGHUP (sent to the whole process group
    by a terminal or a job scheduler): the main process finishes its step and
    saves, and its workers end with it.
    """
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=order,
        num_workers=num_workers,
        collate_fn=functools.partial(collate_readable, collate=collate or collate_pairs),
        worker_init_fn=_ignore_interrupts if num_workers else None,
        # A fixed generator: creating the iterator does not draw from the global RNG,
        # which a resumed run must find exactly where it was saved.
        generator=torch.Generator().manual_seed(0),
        persistent_workers=False,
    )


def collate_pairs(samples: list):
    """Stack samples into one batch, ``(inputs, targets)`` for training.

    A sample is ``(input, target)`` (each a tensor, tuple or dict of tensors), or
    a dict of tensors that holds its own labels (transformers' way): the batch is
    then ``(dict, None)`` and the model is called as ``model(**inputs)``. Other
    samples are stacked as ``default_collate`` stacks them. In dict samples, an entry that is ``True``, ``False``
    or ``None`` in every sample (a keyword flag such as ``return_loss=True``) is passed as it is.
    """
    constants = _constants(samples)
    if constants:  # a flag for the model's forward (CLIP's return_loss=True) stays what it is, not a tensor of flags
        samples = [{key: value for key, value in sample.items() if key not in constants} for sample in samples]
    batch = default_collate(samples)
    if isinstance(batch, Mapping):
        return {**batch, **constants}, None
    return batch


def _constants(samples: list) -> dict:
    """The entries of dict samples that are a Python ``True``/``False``/``None`` in every sample alike: keyword
    arguments of the model (transformers' ``return_loss``), passed as they are rather than collated into a tensor."""
    if not samples or not all(isinstance(sample, Mapping) for sample in samples):
        return {}
    first = samples[0]
    return {
        key: value for key, value in first.items()
        if (value is None or isinstance(value, bool)) and all(key in sample and sample[key] is value for sample in samples)
    }


def collate_readable(samples: list, *, collate: Callable[[list], tuple] = collate_pairs) -> tuple:
    """``(inputs, targets, unreadable)``: the readable samples collated by ``collate``, and the ``Unreadable`` ones apart."""
    unreadable = [sample for sample in samples if isinstance(sample, Unreadable)]
    readable = [sample for sample in samples if not isinstance(sample, Unreadable)]
    collated = collate(readable) if readable else (None, None)
    return (*collated, unreadable)


def _ignore_interrupts(worker_id: int) -> None:
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_IGN)
