"""A tiny image project (a model file that can signal itself, an image folder, a plan) and the train command over it."""
from pathlib import Path

import torch

from autofit.config import TrainingConfig
from autofit.plan_file import DeviceInfo, ModelInfo, Plan, save_plan
from autofit.spec import load_spec, model_fingerprint

MODEL_FILE = '''
import os
import signal

import torch
from torch import nn

INPUT_SHAPE = (1, 8, 8)


def build_model():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))


def example_batch(batch_size):
    return torch.rand(batch_size, 1, 8, 8), torch.randint(0, 2, (batch_size,))


_calls = 0


def loss_fn(output, target):
    """Cross-entropy; AUTOFIT_TEST_SIGNAL="SIGTERM:5" sends that signal to this process in the 5th call ("RAISE:5"
    raises a ValueError there, as a user's loss with a bug does)."""
    global _calls
    _calls += 1
    name, _, at = os.environ.get("AUTOFIT_TEST_SIGNAL", ":").partition(":")
    if name == "RAISE" and _calls == int(at):
        raise ValueError("the labels are not what this loss expects")
    if name and _calls == int(at):
        os.kill(os.getpid(), getattr(signal, name))
    return nn.functional.cross_entropy(output, target)
'''


def write_images(folder: Path, *, per_class: int, seed: int) -> None:
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    for label in ("a", "b"):
        (folder / label).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = (torch.rand(8, 8, generator=generator) * 255).to(torch.uint8).numpy()
            Image.fromarray(pixels, mode="L").save(folder / label / f"{i}.png")


def make_project(root: Path) -> Path:
    """A model file, an image folder (24 train / 8 val images: 3 steps of 8 per epoch) and a plan for them, in ``root``."""
    model_file = root / "tiny.py"
    model_file.write_text(MODEL_FILE)
    write_images(root / "data" / "train", per_class=12, seed=0)
    write_images(root / "data" / "val", per_class=4, seed=1)
    network = load_spec(str(model_file)).build_model()
    plan = Plan(
        model=ModelInfo(source=str(model_file), fingerprint=model_fingerprint(network), input_shape=[1, 8, 8], num_classes=2),
        device=DeviceInfo(type="cpu"), budget_bytes=10**8, config=TrainingConfig(global_batch_size=8, micro_batch_size=4, precision="fp32", checkpoint=[]),
    )
    save_plan(plan, root / "plan.json")
    return root


def train_args(project: Path, log_dir: Path, *extra: str) -> list[str]:
    return ["train", "--plan", project / "plan.json", "--data", project / "data", "--log-dir", log_dir, "--workers", "0", *extra]
