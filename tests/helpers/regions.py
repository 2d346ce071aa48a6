"""A model that scores three image regions, image folders of those regions and checkpoints of it: the tools' tests share them."""
from pathlib import Path

import numpy as np
from PIL import Image

from autofit.spec import load_spec, model_fingerprint
from autofit.training.weights import save_checkpoint

# A model that scores three image regions: logit k is the mean brightness of
# region k (top half, bottom half, left half) times 10. Its predictions are
# known from the pictures, so the metrics can be checked exactly. Its logits
# are in the order top, bottom, left: NOT the alphabetical folder order.
REGION_MODEL = '''
import torch
from torch import nn

INPUT_SHAPE = (1, 8, 8)


class RegionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Conv2d(1, 1, 1, bias=False)
        self.head = nn.Linear(3, 3)
        with torch.no_grad():
            self.scale.weight.fill_(1.0)
            self.head.weight.copy_(torch.eye(3) * 10)
            self.head.bias.zero_()

    def forward(self, x):  # (B, 1, H, W)
        x = self.scale(x)
        h, w = x.shape[2] // 2, x.shape[3] // 2
        regions = [x[:, :, :h].mean((1, 2, 3)), x[:, :, h:].mean((1, 2, 3)), x[..., :w].mean((1, 2, 3))]
        return self.head(torch.stack(regions, dim=1))  # (B, 3)


def build_model():
    return RegionNet()


def example_batch(n):
    return torch.rand(n, 1, 8, 8), torch.randint(0, 3, (n,))
'''

REGION_CLASSES = ["top", "bottom", "left"]


def pattern(kind: str, size: int = 8, seed: int = 0) -> np.ndarray:
    """A grayscale picture bright in one region, with a little noise."""
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 40, (size, size)).astype(np.uint8)
    half = size // 2
    if kind == "top":
        image[:half] = 230
    elif kind == "bottom":
        image[half:] = 230
    elif kind == "left":
        image[:, :half] = 230
    return image


def write_image_folder(root: Path, contents: dict[str, list[str]], *, size: int = 8) -> Path:
    """root/<class>/<i>.png, each picture drawn as the pattern named in ``contents[class][i]``."""
    for name, kinds in contents.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i, kind in enumerate(kinds):
            Image.fromarray(pattern(kind, size, seed=i)).save(root / name / f"{i}.png")
    return root


def write_model_file(tmp_path: Path, source: str = REGION_MODEL, name: str = "region_model.py") -> Path:
    path = tmp_path / name
    path.write_text(source)
    return path


def write_checkpoint(path: Path, model_file: Path, *, classes, input_shape="1x8x8", num_classes=3, model=None) -> Path:
    """A checkpoint in autofit's layout, as `autofit train` writes it."""
    spec = load_spec(str(model_file))
    model = model if model is not None else spec.build_model()
    return save_checkpoint(path, {
        "model_source": {"source": str(model_file), "input_shape": input_shape, "num_classes": num_classes},
        "fingerprint": model_fingerprint(model),
        "classes": classes,
        "model_state": model.state_dict(),
        "plan": {},
        "training": {},
    })
