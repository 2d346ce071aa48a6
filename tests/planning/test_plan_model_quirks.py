"""Models that ended `autofit plan` and `autofit probe` in a traceback: a convolution's kept output overwritten by
ReLU(inplace=True) under selective checkpointing, and an op with no kernel for a precision on this CPU."""
import json

import pytest
import torch

from autofit.plan_file import load_plan
from tests.helpers.models import TinyLSTM

IN_PLACE_FILE = '''
from tests.helpers.models import InplaceCNN, _small_images

def build_model():
    return InplaceCNN()

def example_batch(n):
    return _small_images(n)
'''

LSTM_FILE = '''
from tests.helpers.models import TinyLSTM, _sequences

def build_model():
    return TinyLSTM()

def example_batch(n):
    return _sequences(n)
'''


def _fp16_lstm_fails() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            TinyLSTM()(torch.randn(1, 12, 16))
    except RuntimeError:
        return True
    return False


FP16_LSTM_FAILS = _fp16_lstm_fails()
needs_fp16_lstm_failure = pytest.mark.skipif(not FP16_LSTM_FAILS, reason="this CPU has an fp16 LSTM kernel")


@pytest.fixture
def model_file(tmp_path):
    def write(text: str) -> str:
        path = tmp_path / "model.py"
        path.write_text(text)
        return str(path)
    return write


@pytest.mark.parametrize(("meter", "budget_args"), [
    ("simulated", ["--simulate", "--budget", "200KB"]),
    ("cpu", ["--precisions", "fp32", "--budget", "150KB"]),
])
@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_a_cnn_with_in_place_relus_plans(run_cli, one_thread, model_file, tmp_path, meter, budget_args):
    """Budgets at which the planner traces and times selective checkpointing of the blocks (it raised there)."""
    out = tmp_path / "plan.json"
    code, _, err = run_cli("plan", model_file(IN_PLACE_FILE), "--batch-size", "8", *budget_args, "--no-cache", "--out", out, "-q")
    assert code == 0, err
    assert "Traceback" not in err and load_plan(out).measured.meter == meter


@needs_fp16_lstm_failure
def test_a_precision_without_kernels_is_left_out_with_a_line(run_cli, one_thread, model_file, tmp_path):
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli("plan", model_file(LSTM_FILE), "--batch-size", "8", "--budget", "10MB", "--no-cache", "--out", out)
    assert code == 0, err
    assert load_plan(out).config.precision in ("fp32", "bf16")
    # bf16 is left out too on a CPU without a bf16 LSTM kernel either; nothing is left out for another reason.
    lines = [line for line in stdout.splitlines() if line.strip().startswith("left out")]
    assert any("fp16: an op of the model has no fp16 kernel on cpu (could not create a primitive descriptor" in line for line in lines)
    assert all(" kernel on cpu (" in line for line in lines), lines


@needs_fp16_lstm_failure
def test_only_a_precision_without_kernels_is_one_line_and_the_way_out(run_cli, model_file, tmp_path):
    code, _, err = run_cli("plan", model_file(LSTM_FILE), "--batch-size", "8", "--budget", "10MB", "--precisions", "fp16",
                           "--no-cache", "--out", tmp_path / "plan.json")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "fp16 cannot train this model on cpu" in err and err.strip().endswith("plan with --precisions fp32 or bf16")


@needs_fp16_lstm_failure
def test_probing_a_precision_without_kernels_is_one_line_and_the_way_out(run_cli, model_file):
    code, _, err = run_cli("probe", model_file(LSTM_FILE), "-m", "2", "--precision", "fp16")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "precision fp16 cannot train this model on cpu" in err and err.strip().endswith("use --precision bf16 or fp32")


def test_probing_selective_checkpointing_of_in_place_relus(run_cli, model_file):
    code, stdout, err = run_cli("probe", model_file(IN_PLACE_FILE), "-m", "2", "--steps", "2", "--selective-checkpoint", "all", "--json")
    assert code == 0, err
    assert json.loads(stdout)["selective_checkpoint"] == ["blocks.0", "blocks.1", "blocks.2"]


def test_a_model_that_fails_in_fp32_too_has_no_missing_kernel():
    """The model's own RuntimeError (here a shape mismatch, in every precision) is not a precision's missing kernel."""
    from autofit.measure.kernels import precision_failures
    from autofit.spec import ModelSpec, default_optimizer

    spec = ModelSpec(
        source="tests:mismatch", build_model=lambda: torch.nn.Linear(8, 4), example_batch=lambda n: (torch.randn(n, 5), torch.zeros(n)),
        loss_fn=torch.nn.functional.mse_loss, build_optimizer=default_optimizer,
    )
    assert precision_failures(spec, precisions=["fp32", "bf16", "fp16"], device="cpu") == {}



BUILT_ONLY_ON_FAKE_TENSORS_FILE = '''
import torch
from torch import nn


def build_model():
    made = torch.empty(0)  # as an 8B model would: too big to build here for real
    if made.device.type != "meta" and type(made).__name__ != "FakeTensor":
        raise RuntimeError("built for real")
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def example_batch(n):
    return torch.randn(n, 16), torch.randint(0, 4, (n,))
'''


def test_with_simulate_a_model_file_is_never_built_for_real(run_cli, model_file, tmp_path):
    """plan --simulate, probe --simulate and probe --plan of an estimated plan check the model on fake tensors."""
    source, out = model_file(BUILT_ONLY_ON_FAKE_TENSORS_FILE), tmp_path / "plan.json"
    code, _, err = run_cli("plan", source, "--simulate", "--budget", "1MB", "--batch-size", "4", "--precisions", "fp32", "--out", out)
    assert code == 0, err
    code, _, err = run_cli("probe", source, "--simulate", "-m", "4")
    assert code == 0, err
    code, _, err = run_cli("probe", "--plan", out)
    assert code == 0, err
    code, _, err = run_cli("probe", source, "-m", "4")  # without --simulate it is built for real, and the line says why it failed
    assert code == 2 and "built for real" in err


HUGE_FILE = '''
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(100_000, 100_000), nn.Linear(100_000, 4))  # 40 GB of fp32 weights


def example_batch(n):
    return torch.randn(n, 100_000), torch.randint(0, 4, (n,))
'''


def test_a_model_this_machine_cannot_hold_is_one_line_before_it_is_built(run_cli, model_file, tmp_path, monkeypatch):
    import autofit.measure.meters as meters

    monkeypatch.setattr(meters, "host_memory_bytes", lambda available: 8 * 2**30)  # however much this machine has
    source = model_file(HUGE_FILE)
    code, _, err = run_cli("plan", source, "--budget", "16GB", "--batch-size", "4", "--out", tmp_path / "plan.json")
    assert code == 2 and "too big for this machine: it would need at least 149.02 GiB" in err and "--simulate" in err
    code, _, err = run_cli("probe", source, "-m", "1")
    assert code == 2 and "too big for this machine" in err
