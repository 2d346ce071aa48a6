"""Write scikit-learn's digits (1797 8x8 grayscale images, 10 classes) as an image folder.

    python examples/make_digits.py data/digits

gives data/digits/train/<digit>/<index>.png (80%) and data/digits/val/<digit>/<index>.png
(20%), split per class with a fixed seed, so every run writes the same files.
The dataset ships inside scikit-learn: nothing is downloaded.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def write_digits(root: Path, *, val_fraction: float = 0.2, seed: int = 0) -> dict[str, int]:
    """Write the PNGs under ``root``; returns the number of images per split."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    indices = np.arange(len(digits.target))
    train_idx, val_idx = train_test_split(indices, test_size=val_fraction, stratify=digits.target, random_state=seed)
    counts = {}
    for split, split_idx in (("train", train_idx), ("val", val_idx)):
        for index in split_idx:
            label = int(digits.target[index])
            folder = root / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            pixels = np.round(digits.images[index] * (255 / 16)).astype(np.uint8)  # values 0..16 -> 0..255
            Image.fromarray(pixels, mode="L").save(folder / f"{index:04d}.png")
        counts[split] = len(split_idx)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="output folder, e.g. data/digits")
    args = parser.parse_args()
    try:
        counts = write_digits(args.root)
    except ImportError as error:
        sys.exit(f"make_digits: {error.name} is missing; pip install -e \".[examples]\"")
    print(f"wrote {counts['train']} train and {counts['val']} val images (10 classes) to {args.root}")


if __name__ == "__main__":
    main()
