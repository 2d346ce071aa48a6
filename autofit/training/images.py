"""Class folders of images (torchvision's ``ImageFolder`` layout: ``DIR/<class>/<image>``), read one way.

Training (``autofit.training.data.image_folder_data``) and the tools that score
weights (``autofit val``, ``compare``, ``export``) read images alike: converted to
the model's channels (1 grayscale, 3 RGB, 4 RGBA), resized to its H x W and
turned into float tensors in [0, 1].
"""
from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.data import Dataset

from autofit.errors import UserError

IMAGE_MODES = {1: "L", 3: "RGB", 4: "RGBA"}
"""PIL mode for each channel count an image folder can be read as."""


def image_folder(
    folder: str | Path,
    *,
    input_shape: Sequence[int],
    classes: Sequence[str] | None = None,
    skip_unreadable: bool = False,
):
    """An ``ImageFolder`` over ``folder``'s class folders: (image (C, H, W) in [0, 1], class index).

    Args:
        folder: a folder of class folders of images.
        input_shape: (C, H, W) every image is converted and resized to.
        classes: the class names in the model's order, which the targets then
            index; None keeps the folders' (alphabetical) order.
        skip_unreadable: check every file when the folder is scanned and leave
            out those PIL cannot read, counted in the dataset's ``unreadable``
            (training data); otherwise such a file is an error when it is read
            (scoring weights, where every image must count).

    Raises:
        UserError: ``input_shape`` is not an image shape, the folder is missing
            or holds no class folders, a class folder holds no (readable)
            image, or the class folders differ from ``classes``.
    """
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    mode = image_mode(input_shape)
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"data folder {str(folder)!r} is not a directory; give a folder of class folders of images (e.g. data/digits/val)")
    if not any(entry.is_dir() for entry in folder.iterdir()):
        raise UserError(f"{str(folder)!r} holds no class folders; expected {folder}/<class>/<image>")
    _check_no_link_loops(folder)
    _, height, width = input_shape
    check = _ReadableImage() if skip_unreadable else None
    dataset = ImageFolder(
        str(folder), transform=transforms.Compose([transforms.Resize((height, width)), transforms.ToTensor()]),
        loader=functools.partial(load_image, mode=mode), is_valid_file=check, allow_empty=True,
    )
    dataset.unreadable = check.unreadable if check is not None else 0
    counts = torch.bincount(torch.tensor(dataset.targets, dtype=torch.long), minlength=len(dataset.classes))
    empty = [name for name, count in zip(dataset.classes, counts.tolist()) if count == 0]
    if empty:
        raise UserError(
            f"class folder {str(folder / empty[0])!r} holds no readable image"
            f"{f' (nor do {len(empty) - 1} more)' if len(empty) > 1 else ''}; add images or remove the folder"
        )
    if classes is not None:
        _number_as(dataset, list(classes), folder=folder)
    return dataset


class Unreadable(NamedTuple):
    """A sample whose file failed to decode when read (``SkipUnreadable``); the batch leaves it out."""

    path: str
    reason: str


class SkipUnreadable(Dataset):
    """An image folder whose files that fail to decode when read become ``Unreadable`` samples instead of errors.

    A file can pass the scan (``skip_unreadable``: PIL opens and verifies its
    header) and still fail to decode, e.g. a truncated JPEG. Training leaves
    such a sample out of its batch and names it in the log, rather than
    stopping at the same batch on every resume. The folder's attributes
    (``classes``, ``targets``, ``samples``, ...) read through.
    """

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        try:
            return self.dataset[index]
        except UserError as error:  # load_image's: the file did not decode
            return Unreadable(path=self.dataset.samples[index][0], reason=str(error.__cause__ or error))

    def __getattr__(self, name: str):
        if name == "dataset":  # not set yet (while unpickling in a DataLoader worker)
            raise AttributeError(name)
        return getattr(self.dataset, name)


def image_mode(input_shape: Sequence[int]) -> str:
    """The PIL mode images are converted to for a model taking ``input_shape`` (C, H, W).

    Raises:
        UserError: the shape is not CxHxW with C in 1, 3 or 4.
    """
    if len(input_shape) != 3 or input_shape[0] not in IMAGE_MODES:
        raise UserError(
            f"input shape {'x'.join(map(str, input_shape))} is not an image shape CxHxW with C in 1, 3 or 4; "
            "image folders need one (set INPUT_SHAPE in the model file)"
        )
    return IMAGE_MODES[input_shape[0]]


def load_image(path: str, *, mode: str):
    """One image file as a PIL image in ``mode``.

    Raises:
        UserError: PIL cannot read the file.
    """
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.convert(mode)
    except Exception as error:  # PIL raises many types for a file that does not decode
        raise UserError(f"image {path!r} cannot be read ({error}); replace or remove it") from error


def _check_no_link_loops(folder: Path) -> None:
    """Refuse a symbolic link to a folder that holds it: torchvision follows links, and would read it over and over.

    Raises:
        UserError: naming the link and where it points.
    """
    for root, dirs, _ in os.walk(folder, followlinks=True):
        here = os.path.realpath(root)
        for name in list(dirs):
            link = os.path.join(root, name)
            if not os.path.islink(link):
                continue
            target = os.path.realpath(link)
            if here == target or here.startswith(target.rstrip(os.sep) + os.sep):
                raise UserError(
                    f"{link!r} is a symbolic link to {target!r}, a folder that holds it, so it would be read without end; "
                    "remove the link"
                )


def _number_as(dataset, classes: list[str], *, folder: Path) -> None:
    """Make ``dataset``'s targets index ``classes`` (ImageFolder numbers folders alphabetically)."""
    if set(dataset.classes) != set(classes):
        missing = sorted(set(classes) - set(dataset.classes))
        extra = sorted(set(dataset.classes) - set(classes))
        raise UserError(
            f"data folder {str(folder)!r} has other classes than the model was trained on "
            f"(missing: {', '.join(missing) or 'none'}; unknown: {', '.join(extra) or 'none'}); "
            "use the validation split of the training data"
        )
    folder_to_model = [classes.index(name) for name in dataset.classes]
    dataset.target_transform = folder_to_model.__getitem__
    dataset.classes = classes


class _ReadableImage:
    """ImageFolder's file filter: image extensions PIL can open and verify; counts the rest."""

    def __init__(self) -> None:
        self.unreadable = 0

    def __call__(self, path: str) -> bool:
        from PIL import Image
        from torchvision.datasets.folder import IMG_EXTENSIONS

        if not path.lower().endswith(IMG_EXTENSIONS):
            return False
        try:
            with Image.open(path) as image:
                image.verify()
        except Exception:  # PIL raises many types for a bad file; any means unreadable
            self.unreadable += 1
            return False
        return True
