"""`autofit val`: metrics against scikit-learn, class order, one-line errors."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from autofit.errors import UserError
from autofit.tools.evaluate import scores_from_confusion, validate_weights
from autofit.training.images import image_folder
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


pytestmark = pytest.mark.usefixtures("one_thread")


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


@pytest.fixture
def region_setup(tmp_path):
    """Weights of the region model and a val folder where 3 of 12 pictures mislead it."""
    model_file = write_model_file(tmp_path)
    weights = write_checkpoint(tmp_path / "runs" / "r" / "best.pt", model_file, classes=REGION_CLASSES)
    val = write_image_folder(tmp_path / "val", {
        "top": ["top", "top", "top", "left"],
        "bottom": ["bottom", "bottom", "bottom", "top", "bottom"],
        "left": ["left", "left", "bottom"],
    })
    return weights, val


def expected_labels():
    """(true, predicted) in the checkpoint's class indices, read off the pictures above."""
    index = {name: i for i, name in enumerate(REGION_CLASSES)}
    truth = ["top"] * 4 + ["bottom"] * 5 + ["left"] * 3
    drawn = ["top", "top", "top", "left", "bottom", "bottom", "bottom", "top", "bottom", "left", "left", "bottom"]
    return [index[t] for t in truth], [index[d] for d in drawn]


def test_metrics_match_scikit_learn(region_setup):
    from sklearn.metrics import accuracy_score, confusion_matrix, precision_recall_fscore_support

    weights, val = region_setup
    evaluation = validate_weights(weights, val)
    truth, predicted = expected_labels()
    assert evaluation.classes == REGION_CLASSES
    assert evaluation.num_samples == 12
    assert evaluation.confusion == confusion_matrix(truth, predicted, labels=[0, 1, 2]).tolist()
    assert evaluation.accuracy == pytest.approx(accuracy_score(truth, predicted)) == pytest.approx(9 / 12)
    p, r, f, s = precision_recall_fscore_support(truth, predicted, labels=[0, 1, 2], zero_division=0)
    for i, metrics in enumerate(evaluation.per_class):
        assert metrics.name == REGION_CLASSES[i]
        assert (metrics.precision, metrics.recall, metrics.f1) == pytest.approx((p[i], r[i], f[i]))
        assert metrics.support == s[i]
    macro = precision_recall_fscore_support(truth, predicted, average="macro", zero_division=0)
    assert (evaluation.macro_precision, evaluation.macro_recall, evaluation.macro_f1) == pytest.approx(macro[:3])
    assert evaluation.loss is not None and evaluation.loss > 0


def test_macro_skips_classes_absent_from_data_and_predictions():
    from sklearn.metrics import precision_recall_fscore_support

    # class "c" never occurs and is never predicted
    evaluation = scores_from_confusion([[2, 1, 0], [0, 3, 0], [0, 0, 0]], classes=["a", "b", "c"])
    truth, predicted = [0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]
    assert evaluation.macro_f1 == pytest.approx(precision_recall_fscore_support(truth, predicted, average="macro")[2])
    assert evaluation.per_class[2].f1 == 0.0


def test_folder_order_follows_the_checkpoint(tmp_path):
    write_image_folder(tmp_path / "d", {"top": ["top"], "bottom": ["bottom"], "left": ["left"]})
    dataset = image_folder(tmp_path / "d", input_shape=(1, 8, 8), classes=REGION_CLASSES)
    assert dataset.classes == REGION_CLASSES
    by_file = {Path(path).parent.name: dataset[i][1] for i, (path, _) in enumerate(dataset.samples)}
    assert by_file == {"top": 0, "bottom": 1, "left": 2}
    image, _ = dataset[0]
    assert image.shape == (1, 8, 8) and image.dtype == torch.float32 and 0 <= image.min() <= image.max() <= 1


def test_images_are_resized_to_the_input_shape(tmp_path):
    write_image_folder(tmp_path / "d", {"a": ["top"], "b": ["left"]}, size=20)
    assert image_folder(tmp_path / "d", input_shape=(3, 16, 16))[0][0].shape == (3, 16, 16)


def test_class_sets_that_differ_are_refused(tmp_path):
    write_image_folder(tmp_path / "d", {"top": ["top"], "cat": ["left"]})
    with pytest.raises(UserError, match="missing: bottom, left; unknown: cat"):
        image_folder(tmp_path / "d", input_shape=(1, 8, 8), classes=REGION_CLASSES)


def test_cli_table_and_json(region_setup, run_cli):
    weights, val = region_setup
    code, out, err = run_cli("val", "--weights", weights, "--data", val)
    assert code == 0, err
    assert "accuracy 75.00%" in out and "confusion matrix" in out
    assert "bottom" in out and "macro" in out
    code, out, err = run_cli("val", "--weights", weights, "--data", val, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["accuracy"] == pytest.approx(0.75)
    assert data["confusion_matrix"] == [[3, 0, 1], [1, 4, 0], [0, 1, 2]]
    assert [c["class"] for c in data["per_class"]] == REGION_CLASSES
    assert set(data["macro"]) == {"precision", "recall", "f1"}


def test_cli_errors_are_one_line(region_setup, tmp_path, run_cli):
    weights, val = region_setup
    # weights of another model than the named model file builds
    other = load_spec(str(write_model_file(tmp_path, REGION_MODEL.replace("nn.Linear(3, 3)", "nn.Linear(3, 4)").replace("torch.eye(3)", "torch.eye(4, 3)"), "other.py")))
    foreign = write_checkpoint(tmp_path / "foreign.pt", tmp_path / "region_model.py", classes=REGION_CLASSES, model=other.build_model())
    (val / "bottom" / "9.png").write_text("not a picture")
    cases = [
        (("--weights", weights, "--data", val), "9.png' cannot be read"),
        (("--weights", foreign, "--data", val), "another model"),
        (("--weights", tmp_path / "missing.pt", "--data", val), "does not exist"),
        (("--weights", weights, "--data", tmp_path / "nowhere"), "is not a directory"),
        (("--weights", val / "top" / "0.png", "--data", val), "cannot be read"),
    ]
    for args, message in cases:
        code, out, err = run_cli("val", *args)
        assert code == 2, (args, out, err)
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
