"""`autofit export`: permanent pruning, int8 Linear layers, a file that reloads and scores."""
import importlib.util
import json
import warnings

import pytest
import torch

from autofit.errors import UserError
from autofit.tools.export import ExportConfig, export_weights, prune_global_l1, quantize_int8
from autofit.spec import load_spec
from tests.helpers.regions import REGION_CLASSES, write_checkpoint, write_image_folder, write_model_file

# Most parameters sit in Linear layers, as in classifier heads: int8 shows in the file size.
MLP_MODEL = '''
import torch
from torch import nn

INPUT_SHAPE = (1, 16, 16)


def build_model():
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 16 * 16, 128), nn.ReLU(), nn.Linear(128, 3))


def example_batch(n):
    return torch.rand(n, 1, 16, 16), torch.randint(0, 3, (n,))
'''

HAS_ONNX = all(importlib.util.find_spec(name) is not None for name in ("onnx", "onnxscript"))


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def mlp_weights(tmp_path):
    torch.manual_seed(0)
    model_file = write_model_file(tmp_path, MLP_MODEL, "mlp.py")
    return write_checkpoint(tmp_path / "runs" / "m" / "best.pt", model_file, classes=["a", "b", "c"], input_shape="1x16x16")


@pytest.fixture
def region(tmp_path):
    """The region model (its accuracy is known: 9 of 12) and its validation folder."""
    weights = write_checkpoint(tmp_path / "runs" / "r" / "best.pt", write_model_file(tmp_path), classes=REGION_CLASSES)
    val = write_image_folder(tmp_path / "val", {
        "top": ["top", "top", "top", "left"], "bottom": ["bottom", "bottom", "bottom", "top", "bottom"], "left": ["left", "left", "bottom"],
    })
    return weights, val


def test_global_pruning_is_permanent_and_global():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 5))
    with torch.no_grad():
        model[1].weight.uniform_(1.0, 2.0)  # larger than every first-layer weight: a global threshold spares them
    sparsity = prune_global_l1(model, 0.3)
    assert sparsity == pytest.approx(0.3, abs=0.01)
    assert sorted(name for name, _ in model.named_parameters()) == ["0.bias", "0.weight", "1.bias", "1.weight"]  # no weight_orig left
    assert not any(name.endswith("_mask") for name, _ in model.named_buffers())
    assert (model[0].weight == 0).float().mean() == pytest.approx(0.3 * 300 / 200, abs=0.01)
    assert int((model[1].weight == 0).sum()) == 0


def test_int8_applies_to_linear_layers_only():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(2 * 6 * 6, 3))
    quantized, count = quantize_int8(model)
    assert count == 1 and type(quantized[0]) is torch.nn.Conv2d
    assert isinstance(quantized[2], torch.ao.nn.quantized.dynamic.Linear)
    conv_only = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3))
    assert quantize_int8(conv_only) == (conv_only, 0)


def test_torchscript_export_prunes_quantizes_and_reloads(mlp_weights, tmp_path):
    report = export_weights(mlp_weights, config=ExportConfig(prune_amount=0.5, quantize="int8"), out=tmp_path / "model.pt")
    assert report.sparsity == pytest.approx(0.5, abs=0.01) and report.quantized_layers == 2
    assert report.size_after_bytes < 0.5 * report.size_before_bytes  # fp32 -> int8 Linear weights
    assert report.gzip_after_bytes < report.gzip_before_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated in recent releases
        loaded = torch.jit.load(str(tmp_path / "model.pt"))
    inputs = torch.rand(5, 1, 16, 16)
    # the file computes what the pruned, quantized model computes
    spec = load_spec(str(tmp_path / "mlp.py"))
    model = spec.build_model()
    model.load_state_dict(torch.load(mlp_weights, weights_only=False)["model_state"])
    prune_global_l1(model, 0.5)
    expected, _ = quantize_int8(model.eval())
    with torch.no_grad():
        assert torch.allclose(loaded(inputs), expected(inputs), atol=1e-5)
        assert loaded(inputs).shape == (5, 3)


def test_pruning_alone_shrinks_the_compressed_file_not_the_dense_one(mlp_weights):
    report = export_weights(mlp_weights, config=ExportConfig(prune_amount=0.6))
    assert report.out.endswith("best-export.pt")
    assert abs(report.size_after_bytes - report.size_before_bytes) < 0.01 * report.size_before_bytes
    assert report.gzip_after_bytes < 0.8 * report.gzip_before_bytes


def test_accuracy_before_and_after_of_the_exported_file(region, tmp_path, run_cli):
    weights, val = region
    code, stdout, stderr = run_cli("export", "--weights", weights, "--prune", 0.3, "--quantize", "int8", "--data", val, "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    # 3 of the 9 Linear weights are the zeros off the diagonal: pruning 30% of 10 weights leaves the model as it was
    assert report["accuracy_before"] == pytest.approx(0.75) and report["accuracy_after"] == pytest.approx(0.75)
    assert report["quantized_layers"] == 1
    code, stdout, stderr = run_cli("export", "--weights", weights, "--data", val, "--out", tmp_path / "r.pt")
    assert code == 0, stderr
    assert "val accuracy   75.00% -> 75.00%" in stdout and "file size" in stdout and "gzip size" in stdout


def test_conv_only_model_notes_that_int8_does_not_apply(tmp_path):
    source = MLP_MODEL.replace(
        "nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 16 * 16, 128), nn.ReLU(), nn.Linear(128, 3))",
        "nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten())",
    )
    weights = write_checkpoint(tmp_path / "c.pt", write_model_file(tmp_path, source, "conv.py"), classes=None, input_shape="1x16x16")
    report = export_weights(weights, config=ExportConfig(quantize="int8"))
    assert report.quantized_layers == 0 and any("no Linear layers" in note for note in report.notes)


@pytest.mark.skipif(HAS_ONNX, reason="onnx is installed: the real export is tested below")
def test_onnx_without_the_package_is_a_one_line_error(mlp_weights, run_cli):
    code, _, stderr = run_cli("export", "--weights", mlp_weights, "--format", "onnx")
    assert code == 2 and "pip install onnx onnxscript" in stderr and len(stderr.strip().splitlines()) == 1


@pytest.mark.skipif(not HAS_ONNX, reason="needs the onnx and onnxscript packages")
def test_onnx_export(region, tmp_path):
    weights, val = region
    report = export_weights(weights, config=ExportConfig(prune_amount=0.3, format="onnx"), data=val, batch_size=5)
    assert report.out.endswith("best.onnx")
    import onnx

    onnx.checker.check_model(onnx.load(report.out))
    if importlib.util.find_spec("onnxruntime") is not None:
        assert not report.notes  # scored from the .onnx file itself
    assert report.accuracy_before == pytest.approx(0.75) and report.accuracy_after == pytest.approx(0.75)


def test_bad_inputs_are_one_line_errors(region, tmp_path, run_cli):
    weights, val = region
    cases = [
        (("--prune", 1.0), "--prune 1.0 must be in [0, 1)"),
        (("--prune", -0.1), "--prune -0.1 must be in [0, 1)"),
        (("--quantize", "int4"), "--quantize 'int4' is unknown"),
        (("--format", "tflite"), "--format 'tflite' is unknown"),
        (("--format", "onnx", "--quantize", "int8"), "cannot be exported to ONNX"),
        (("--data", tmp_path / "nowhere"), "is not a directory"),
        (("--out", weights), "is the weights file itself"),
    ]
    for args, message in cases:
        code, stdout, stderr = run_cli("export", "--weights", weights, *args)
        assert code == 2, (args, stdout, stderr)
        assert message in stderr and len(stderr.strip().splitlines()) == 1, (args, stderr)
    with pytest.raises(UserError, match="does not exist"):
        export_weights(tmp_path / "none.pt", config=ExportConfig())
