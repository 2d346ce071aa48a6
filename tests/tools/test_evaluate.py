"""`autofit val`: metrics against scikit-learn, class order, one-line errors."""
import json
from pathlib import Path

import pytest
import torch

from autofit.errors import UserError
from autofit.tools.evaluate import scores_from_confusion, validate_weights
from autofit.training.images import image_folder
from autofit.spec import load_spec

from tests.helpers.regions import REGION_CLASSES, REGION_MODEL, write_checkpoint, write_image_folder, write_model_file

pytestmark = pytest.mark.usefixtures("one_thread")




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
    four_logits = REGION_MODEL.replace("nn.Linear(3, 3)", "nn.Linear(3, 4)").replace("torch.eye(3)", "torch.eye(4, 3)")
    other = load_spec(str(write_model_file(tmp_path, four_logits, "other.py")))
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
