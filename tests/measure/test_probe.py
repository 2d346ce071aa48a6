import json

import pytest
import torch

from autofit.errors import UserError
from autofit.measure.probe import probe
from autofit.spec import load_spec
from tests.helpers import EXAMPLES

TRANSFORMER = str(EXAMPLES / "tiny_transformer.py")


def test_probe_json_has_the_promised_fields(run_cli):
    code, out, err = run_cli("probe", TRANSFORMER, "-m", "2", "-k", "2", "--steps", "2", "--checkpoint", "layers.1", "--json")
    assert code == 0, err
    result = json.loads(out)
    for key in ("peak_bytes", "samples_per_s", "precision", "micro_batch_size", "grad_accum_steps", "checkpoint", "meter", "breakdown"):
        assert key in result
    assert result["checkpoint"] == ["layers.1"] and result["meter"] == "cpu"
    assert result["micro_batch_size"] == 2 and result["grad_accum_steps"] == 2
    assert result["samples_per_s"] > 0 and result["peak_bytes"] == sum(result["breakdown"].values())


def test_probe_simulated_has_no_speed(run_cli):
    code, out, _ = run_cli("probe", "torchvision:resnet18", "--input-shape", "3x16x16", "--num-classes", "5", "-m", "2", "--simulate", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["meter"] == "simulated" and result["samples_per_s"] is None


def test_list_blocks(run_cli):
    code, out, _ = run_cli("probe", TRANSFORMER, "-m", "2", "--list-blocks", "--json")
    assert code == 0
    blocks = json.loads(out)
    assert [b["name"] for b in blocks] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert all(b["saved_bytes"] > b["input_bytes"] > 0 for b in blocks)
    assert 0.5 < sum(b["forward_share"] for b in blocks) <= 1.0


def test_probe_text_report(run_cli):
    code, out, _ = run_cli("probe", TRANSFORMER, "-m", "2", "--steps", "1")
    assert code == 0
    assert "optimizer state" in out and "samples/s" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["probe", "missing.py"], "does not exist"),
        (["probe", TRANSFORMER, "--precision", "fp8"], "precision 'fp8' is unknown"),
        (["probe", TRANSFORMER, "-m", "0"], "--micro-batch-size 0"),
        (["probe", TRANSFORMER, "--device", "tpu"], "--device 'tpu'"),
        (["probe", TRANSFORMER, "--checkpoint", "nope"], "candidates are: layers.0"),
        (["probe", TRANSFORMER, "--steps", "0"], "--steps 0"),
        (["probe", TRANSFORMER, "--bogus"], "No such option"),
        (["probe", "torchvision:nonet"], "torchvision model 'nonet' is unknown"),
        (["probe", "torchvision:resnet18", "--input-shape", "3by32"], "input shape '3by32'"),
    ],
)
def test_bad_flags_are_one_line_errors(run_cli, args, message):
    code, out, err = run_cli(*args)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present")
def test_cuda_without_a_gpu_is_a_one_line_error(run_cli):
    code, _, err = run_cli("probe", TRANSFORMER, "--device", "cuda")
    assert code == 2 and "no CUDA device" in err


def test_model_file_errors(tmp_path, run_cli):
    no_builder = tmp_path / "no_builder.py"
    no_builder.write_text("def example_batch(n):\n    return None\n")
    code, _, err = run_cli("probe", no_builder)
    assert code == 2 and "does not define build_model()" in err
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    code, _, err = run_cli("probe", broken)
    assert code == 2 and "failed to import: ModuleNotFoundError" in err


def test_micro_batch_larger_than_batch_is_refused():
    spec = load_spec(TRANSFORMER)
    with pytest.raises(UserError, match="larger than the batch size"):
        probe(spec, micro_batch_size=4, global_batch_size=2)


def test_uneven_global_batch():
    spec = load_spec(TRANSFORMER)
    result = probe(spec, micro_batch_size=3, global_batch_size=8, steps=1, simulate=True)
    assert result.grad_accum_steps == 3 and result.global_batch_size == 8


def test_optimizer_state_is_made_again_from_its_record():
    """The planner's traces make the optimizer's state at once (``create_optimizer_state``): with a step the first
    time, then for the same parameters and settings from the record of it, without a step, the same tensors
    (shapes, strides, dtypes, devices, the step count); other settings step again."""
    from autofit.measure import optimizer_state
    from autofit.measure.optimizer_state import create_optimizer_state

    def made(lr: float = 1e-3) -> tuple[list, int]:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        steps = []
        optimizer.register_step_post_hook(lambda *_: steps.append(1))
        create_optimizer_state(model, optimizer, at_once=True)
        state = [
            (name, tuple(v.shape), v.stride(), v.dtype, v.device, v.item() if v.dim() == 0 else float(v.abs().sum()))
            for p in model.parameters() for name, v in sorted(optimizer.state[p].items())
        ]
        assert all(p.grad is None for p in model.parameters())
        return state, len(steps)

    optimizer_state._last_state.key = None
    first, stepped = made()
    assert stepped == 1 and len(first) == 4 * 3
    again, stepped = made()
    assert stepped == 0 and again == first
    other, stepped = made(lr=1e-2)
    assert stepped == 1 and other == first


@pytest.mark.parametrize("choices", [
    dict(precision="bf16-master"), dict(optimizer_state="host"), dict(optimizer_in_backward=True),
    dict(optimizer_in_backward=True, optimizer_state="host"),
], ids=["bf16-master", "host state", "step in backward", "step in backward, host state"])
def test_a_probe_leaves_no_model_behind(choices):
    """A planner probes one configuration after another in one process: weights a probe kept alive (on a card)
    would be counted in every later probe's peak. Hooks on the parameters must not hold the optimizer."""
    import dataclasses
    import gc
    import weakref

    from autofit.config import TrainingConfig
    from autofit.measure.probe import measure
    from tests.helpers.models import layout_specs

    spec = layout_specs()["lm"]
    built = []

    def build_model():
        model = spec.build_model()
        built.extend(weakref.ref(param) for param in model.parameters())
        return model

    measure(dataclasses.replace(spec, build_model=build_model), TrainingConfig(global_batch_size=4, micro_batch_size=4, **choices), device="cpu", steps=2)
    gc.collect()
    assert built and all(reference() is None for reference in built)
