"""`autofit probe` takes every choice a plan can hold (LoRA, an NF4 base, bf16-master / bf16-pure, a GPU that is not
here), builds it through the same ``TrainingConfig`` + ``apply_config`` as plans and training, and re-measures a plan
that holds them."""
import json

import pytest
import torch

from autofit.config import TrainingConfig
from autofit.measure.probe import measure
from autofit.spec import load_spec, model_fingerprint

pytest.importorskip("torchao")
pytest.importorskip("peft")

MLP_FILE = '''
import torch
from torch import nn
from torch.nn import functional as F

WIDTH = 128  # 128 x 128 = 16,384 elements: a weight NF4's blocks divide


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 5)

    def forward(self, x):  # (B, WIDTH) -> (B, 5)
        return self.head(F.gelu(self.down(F.gelu(self.up(x)))))


def build_model():
    return MLP()


def example_batch(n):
    return torch.randn(n, WIDTH), torch.randint(0, 5, (n,))
'''
LORA = "r=4,alpha=8,targets=up,down"
CARD = ["--simulate", "--device", "cuda", "--device-kind", "RTX 3090"]


@pytest.fixture(scope="module")
def mlp_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe-choices") / "mlp.py"
    path.write_text(MLP_FILE)
    return path


def test_lora_on_an_nf4_base_in_bf16_pure_on_a_card_that_is_not_here(run_cli, mlp_file):
    base = ["probe", mlp_file, "-m", "4", "--steps", "1", "--lora", LORA, "--precision", "bf16-pure", *CARD, "--json"]
    code, out, err = run_cli(*base, "--nf4-base")
    assert code == 0, err
    result = json.loads(out)
    assert result["frozen_nf4"] and result["precision"] == "bf16-pure" and result["meter"] == "simulated"
    card = result["card"]
    assert card["name"] == "simulated RTX 3090" and card["total_bytes"] == 24 * 2**30 and card["fits"]
    assert card["needed_bytes"] == result["peak_bytes"] + sum(card["headroom"].values())
    # The same configuration built as a plan holds it (TrainingConfig, applied by apply_config) measures the same bytes.
    spec = load_spec(str(mlp_file), lora=LORA)
    config = TrainingConfig(global_batch_size=4, micro_batch_size=4, precision="bf16-pure", frozen_nf4=True)
    assert measure(spec, config, device="cuda", simulate=True, steps=1).peak_bytes == result["peak_bytes"]
    code, out, err = run_cli(*base)
    dense = json.loads(out)
    # Two frozen 128 x 128 bf16 weights (64 KiB) held in NF4 instead: its codes and scales, under 0.75 bytes a weight.
    saved = dense["breakdown"]["parameters"] - result["breakdown"]["parameters"]
    assert 2 * 128 * 128 * (2 - 0.75) < saved < 2 * 128 * 128 * 2, (dense["breakdown"], result["breakdown"])


def test_bf16_master_on_a_simulated_gpu_and_the_text_report(run_cli, mlp_file):
    code, out, err = run_cli("probe", mlp_file, "-m", "4", "--steps", "1", "--precision", "bf16-master", *CARD[:3], "--device-memory", "8GiB")
    assert code == 0, err
    assert "bf16-master" in out and "card   simulated GPU, 8.00 GiB" in out and ": fits" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device-kind", "RTX 4090"], "--device-kind describes a GPU that is not here: use it with --simulate --device cuda"),
        ([*CARD[:3], "--device-kind", "TPU v9"], "--device-kind 'TPU v9' is not a GPU autofit knows"),
        ([*CARD[:3], "--device-memory", "lots"], "--device-memory: "),
        (["--simulate", "--compile"], "--compile is measured on the device, and --simulate runs nothing there"),
        (["--lora", "r=0,targets=up"], "r=0"),
        (["--precision", "bf16-pure", "--optimizer-state", "host"], "precision bf16-pure keeps its bf16 weights and state on the one device"),
        (["--simulate", "--nf4-base"], "--nf4-base holds frozen linear weights in NF4"),
        (["--precision", "fp8"], "precision 'fp8' is unknown; choose one of fp32, bf16, fp16, bf16-master, bf16-pure"),
    ],
)
def test_impossible_choices_are_one_line_errors(run_cli, mlp_file, args, message):
    code, out, err = run_cli("probe", mlp_file, "-m", "2", "--steps", "1", *args)
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_plan_with_lora_and_an_nf4_base_is_measured_as_it_names_them(run_cli, mlp_file, tmp_path):
    spec = load_spec(str(mlp_file), lora=LORA)
    with torch.device("meta"):
        fingerprint = model_fingerprint(spec.build_model())
    plan = {
        "schema_version": 1,
        "model": {"source": str(mlp_file), "fingerprint": fingerprint, "lora": LORA},
        "device": {"type": "cuda", "name": "simulated RTX 3090", "total_bytes": 24 * 2**30},
        "budget_bytes": 2**30, "budget_kind": "cuda-process", "global_batch_size": 4, "micro_batch_size": 4,
        "precision": "bf16-pure", "checkpoint": [], "frozen_nf4": True, "estimated": True,
    }
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    code, out, err = run_cli("probe", "--plan", path, "--steps", "1", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["frozen_nf4"] and result["precision"] == "bf16-pure" and result["meter"] == "simulated"
    code, direct, err = run_cli("probe", mlp_file, "-m", "4", "--steps", "1", "--lora", LORA, "--precision", "bf16-pure", "--nf4-base", *CARD[:3], "--json")
    assert json.loads(direct)["peak_bytes"] == result["peak_bytes"]
    code, _, err = run_cli("probe", "--plan", path, "--lora", LORA, "--nf4-base")
    assert code == 2 and "drop --lora, --nf4-base" in err
