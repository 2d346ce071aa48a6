"""Data for the loop: image folders, their one-line errors, a resumable order; `autofit train` end to end."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from autofit.config import TrainingConfig
from autofit.training.data import datasets_data, epoch_order, image_folder_data, input_shape_from, make_loader
from autofit.errors import UserError
from autofit.plan_file import DeviceInfo, ModelInfo, Plan, save_plan
from autofit.spec import load_spec, model_fingerprint
from tests.helpers import EXAMPLES, ROOT

MODEL_FILE = '''
import torch
from torch import nn

INPUT_SHAPE = (1, 8, 8)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))

def build_model():
    return nn.Sequential(nn.Flatten(), nn.Sequential(Block(), Block()), nn.Linear(64, 2))

def example_batch(batch_size):
    return torch.rand(batch_size, *INPUT_SHAPE), torch.randint(0, 2, (batch_size,))

def build_optimizer(params):
    return torch.optim.AdamW(params, lr=3e-2)
'''


def write_images(folder: Path, count: int, *, value: int, size=(6, 6), mode="L") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(value)
    for i in range(count):
        pixels = np.clip(rng.normal(value, 20, size=(*size, 3) if mode == "RGB" else size), 0, 255).astype(np.uint8)
        Image.fromarray(pixels, mode=mode).save(folder / f"{i}.png")


def image_folder(root: Path, *, classes=("bright", "dark"), train=8, val=4) -> Path:
    for split, count in (("train", train), ("val", val)):
        for index, name in enumerate(classes):
            write_images(root / split / name, count, value=200 if index == 0 else 40)
    return root


def test_images_are_resized_scaled_and_labelled(tmp_path):
    data = image_folder_data(image_folder(tmp_path), input_shape=(1, 16, 16))
    assert data.classes == ["bright", "dark"] and len(data.train) == 16 and len(data.val) == 8
    image, label = data.train[0]
    assert image.shape == (1, 16, 16) and image.dtype == torch.float32 and 0 <= image.min() <= image.max() <= 1
    assert label == 0 and image.mean() > 0.5 and data.val[7][1] == 1
    write_images(tmp_path / "rgb" / "train" / "a", 2, value=100, mode="RGB")
    write_images(tmp_path / "rgb" / "val" / "a", 1, value=100, mode="RGB")
    assert image_folder_data(tmp_path / "rgb", input_shape=[3, 5, 7]).train[0][0].shape == (3, 5, 7)


def test_training_and_scoring_read_an_image_alike(tmp_path):
    from autofit.training.images import image_folder as scoring_folder

    root = image_folder(tmp_path)
    trained_on = image_folder_data(root, input_shape=(3, 5, 7)).val
    scored_on = scoring_folder(root / "val", input_shape=(3, 5, 7), classes=["bright", "dark"])
    assert len(trained_on) == len(scored_on) and all(
        torch.equal(trained_on[i][0], scored_on[i][0]) and trained_on[i][1] == scored_on[i][1] for i in range(len(scored_on))
    )


def test_unreadable_images_are_skipped_and_counted(tmp_path):
    root = image_folder(tmp_path)
    (root / "train" / "dark" / "broken.png").write_bytes(b"not a png at all")
    (root / "val" / "bright" / "cut.jpg").write_bytes(b"\xff\xd8\xff")
    (root / "train" / "dark" / "notes.txt").write_text("not an image, not counted")
    data = image_folder_data(root, input_shape=(1, 8, 8))
    assert data.skipped_images == 2 and len(data.train) == 16 and len(data.val) == 8


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda root: __import__("shutil").rmtree(root / "val"), "has no val/ folder"),
        (lambda root: __import__("shutil").rmtree(root / "train"), "has no train/ folder"),
        (lambda root: [p.unlink() for p in (root / "val" / "dark").iterdir()], "val/dark' holds no readable image"),
        (lambda root: (root / "train" / "extra").mkdir(), "different classes \\(only in train/: extra; only in val/: -\\)"),
        (
            lambda root: (root / "train" / "dark" / "0.png").write_bytes(b"") or [p.write_bytes(b"x") for p in (root / "train" / "dark").iterdir()],
            "train/dark' holds no readable image",
        ),
    ],
)
def test_bad_folders_are_one_line_errors(tmp_path, damage, message):
    root = image_folder(tmp_path)
    damage(root)
    with pytest.raises(UserError, match=message) as error:
        image_folder_data(root, input_shape=(1, 8, 8))
    assert "\n" not in str(error.value)


def test_missing_folder_and_non_image_shapes_are_refused(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        image_folder_data(tmp_path / "nowhere", input_shape=(1, 8, 8))
    with pytest.raises(UserError, match="C in 1, 3 or 4"):
        image_folder_data(image_folder(tmp_path), input_shape=(2, 8, 8))


def test_input_shapes_from_plans():
    assert input_shape_from([1, 8, 8]) == input_shape_from("1x8x8") == input_shape_from(None, fallback=(1, 8, 8)) == (1, 8, 8)
    with pytest.raises(UserError, match="INPUT_SHAPE"):
        input_shape_from(None)


def test_datasets_are_checked():
    with pytest.raises(UserError, match="DataLoader"):
        datasets_data(torch.utils.data.DataLoader(range(4)))
    with pytest.raises(UserError, match="empty"):
        datasets_data(torch.utils.data.TensorDataset(torch.zeros(0, 2)))


def test_the_order_is_fixed_per_epoch_and_a_loader_can_start_mid_epoch():
    first = epoch_order(20, seed=3, epoch=0)
    assert first == epoch_order(20, seed=3, epoch=0) and first != epoch_order(20, seed=3, epoch=1)
    assert sorted(first) == list(range(20))
    dataset = torch.utils.data.TensorDataset(torch.arange(20))
    whole = [batch[0].tolist() for batch in make_loader(dataset, batch_size=6, order=first, num_workers=0)]
    rest = [batch[0].tolist() for batch in make_loader(dataset, batch_size=6, order=first[12:], num_workers=1)]
    assert rest == whole[2:]


@pytest.fixture
def project(tmp_path):
    """A model file, an image folder and a hand-written plan for them."""
    model_file = tmp_path / "model.py"
    model_file.write_text(MODEL_FILE)
    model = load_spec(str(model_file)).build_model()
    plan = Plan(
        model=ModelInfo(source=str(model_file), fingerprint=model_fingerprint(model), input_shape=[1, 8, 8], num_classes=2),
        device=DeviceInfo(type="cpu"), budget_bytes=2**24, config=TrainingConfig(global_batch_size=4, micro_batch_size=2, checkpoint=["1.0"]),
    )
    return {"plan": save_plan(plan, tmp_path / "plan.json"), "data": image_folder(tmp_path / "data"), "root": tmp_path}


def test_autofit_train_end_to_end(project, run_cli):
    from autofit.training.weights import load_checkpoint, model_from_checkpoint

    log_dir = project["root"] / "runs" / "one"
    code, out, err = run_cli("train", "--plan", project["plan"], "--data", project["data"], "--epochs", "3",
                             "--log-dir", log_dir, "--workers", "0")
    assert code == 0, err
    assert "validation accuracy 1.0000" in out  # bright against dark images
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records].count("epoch") == 3 and [r["kind"] for r in records].count("step") == 12
    model, _ = model_from_checkpoint(load_checkpoint(log_dir / "best.pt"))
    assert load_checkpoint(log_dir / "best.pt")["classes"] == ["bright", "dark"]
    assert model(torch.full((1, 1, 8, 8), 0.8)).argmax().item() == 0

    code, out, err = run_cli("train", "--plan", project["plan"], "--data", project["data"], "--epochs", "4",
                             "--log-dir", log_dir, "--resume", "--workers", "0")
    assert code == 0, err
    assert "epoch 4/4" in out and "epoch 3/4" not in out


def test_a_quiet_run_prints_nothing(project, run_cli):
    """`train -q` (the README's promise): no lines, no bar; the run's files as without it."""
    log_dir = project["root"] / "runs" / "quiet"
    code, out, err = run_cli("train", "--plan", project["plan"], "--data", project["data"], "--epochs", "1", "--max-steps", "1",
                             "--workers", "0", "--log-dir", log_dir, "-q")
    assert code == 0, err
    assert (out, err) == ("", "")
    assert (log_dir / "metrics.jsonl").read_text().count("\n") >= 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data", "{root}/nowhere"], "data folder '{root}/nowhere' does not exist"),
        (["--data", "{root}/data/train"], "has no train/ folder"),
        (["--data", "{root}/data", "--epochs", "0"], "--epochs 0 must be at least 1"),
        (["--data", "{root}/data", "--seed", "99999999999999999999"], "--seed 99999999999999999999 must be a whole number from 0 to"),
        (["--data", "{root}/data", "--seed", "-1"], "--seed -1 must be a whole number from 0 to"),
        (["--data", "{root}/data", "--resume"], "--resume needs --log-dir"),
        (["--data", "{root}/data", "--resume", "--log-dir", "{root}/none"], "--resume: {root}/none/last.pt does not exist"),
        ([], "no training data: give --data DIR"),
    ],
)
def test_train_cli_mistakes_are_one_line_and_exit_2(project, run_cli, args, message):
    root = project["root"]
    code, out, err = run_cli("train", "--plan", project["plan"], *(a.format(root=root) for a in args))
    assert code == 2
    assert err.count("\n") == 1 and message.format(root=root) in err


def test_a_plan_for_a_missing_model_file_is_a_one_line_error(project, run_cli, tmp_path):
    plan = json.loads(project["plan"].read_text())
    plan["model"]["source"] = str(tmp_path / "gone.py")
    (tmp_path / "gone.json").write_text(json.dumps(plan))
    code, _, err = run_cli("train", "--plan", tmp_path / "gone.json")
    assert code == 2 and "give --model FILE" in err and err.count("\n") == 1


def test_the_installed_command_prints_no_traceback(project):
    done = subprocess.run(
        [sys.executable, "-m", "autofit", "train", "--plan", str(project["plan"]), "--data", str(project["root"] / "nope")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stderr.count("\n") == 1


def test_make_digits_writes_a_deterministic_stratified_split(tmp_path):
    sys.path.insert(0, str(EXAMPLES))
    try:
        from make_digits import write_digits
    finally:
        sys.path.remove(str(EXAMPLES))
    assert write_digits(tmp_path / "a") == {"train": 1437, "val": 360}
    data = image_folder_data(tmp_path / "a", input_shape=(1, 8, 8))
    assert data.classes == [str(d) for d in range(10)] and data.skipped_images == 0
    counts = torch.bincount(torch.tensor(data.val.targets))
    assert counts.min() >= 35 and counts.max() <= 37
    write_digits(tmp_path / "b")
    files = {root: sorted(p.relative_to(tmp_path / root).as_posix() for p in (tmp_path / root).rglob("*.png")) for root in "ab"}
    assert len(files["a"]) == 1797 and files["a"] == files["b"]
    assert (tmp_path / "a" / files["a"][-1]).read_bytes() == (tmp_path / "b" / files["b"][-1]).read_bytes()


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_ctrl_c_in_autofit_train_saves_and_exits_130_with_one_line(project):
    """The model file's loss sends the process a real SIGINT during step 3."""
    model_file = project["root"] / "model.py"
    model_file.write_text(MODEL_FILE + '''
import os, signal
_calls = [0]

def loss_fn(output, target):
    _calls[0] += 1
    if _calls[0] == 5:
        os.kill(os.getpid(), signal.SIGINT)
    return nn.functional.cross_entropy(output, target)
''')
    log_dir = project["root"] / "runs" / "cut"
    done = subprocess.run(
        [sys.executable, "-m", "autofit", "train", "--plan", str(project["plan"]), "--data", str(project["data"]),
         "--log-dir", str(log_dir), "--workers", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr.count("\n") == 1 and "stopped by SIGINT at epoch 1, step 3" in done.stderr and "--resume" in done.stderr
    from autofit.training.weights import load_checkpoint

    assert load_checkpoint(log_dir / "last.pt")["training"]["position"]["global_step"] == 3


def test_samples_of_another_shape_than_the_plan_s_are_one_line():
    import pytest
    import torch

    from autofit.errors import UserError
    from autofit.training.data import TrainData, check_sample_shape

    data = TrainData(train=[(torch.zeros(3, 16, 16), 0)], val=None, source="digits.py (train_dataset)")
    check_sample_shape(data, (3, 16, 16))
    check_sample_shape(data, None)  # a plan without an input shape (text, dict inputs) checks nothing
    with pytest.raises(UserError, match=r"a training sample is 3x16x16, but the plan was made for inputs of 1x8x8"):
        check_sample_shape(data, (1, 8, 8))
