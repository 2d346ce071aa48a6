"""`autofit plan --from-trainer-args`: the plan answers the run a TrainingArguments JSON or a Lightning config describes."""
import json

import pytest

from autofit.errors import UserError
from autofit.integrations.trainer_args import read_trainer_args
from autofit.plan_file import load_plan

MODEL_FILE = '''
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def example_batch(n):
    return torch.randn(n, 16), torch.randint(0, 4, (n,))
'''


def test_plan_answers_the_global_batch_of_trainingarguments(run_cli, tmp_path):
    model, args, out = tmp_path / "mlp.py", tmp_path / "args.json", tmp_path / "plan.json"
    model.write_text(MODEL_FILE)
    args.write_text(json.dumps({"output_dir": "out", "per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "max_grad_norm": 0.5}))
    code, stdout, err = run_cli("plan", model, "--simulate", "--budget", "1MB", "--from-trainer-args", args, "--out", out, "-q")
    assert code == 0, err
    plan = load_plan(out)
    assert (plan.config.global_batch_size, plan.config.precision, plan.config.max_grad_norm) == (6, "fp32", 0.5)
    assert "run         TrainingArguments" in stdout and "(2 per device x 3 accumulation step(s) x 1 process(es))" in stdout
    code, _, err = run_cli("plan", model, "--simulate", "--budget", "1MB", "--from-trainer-args", args, "--batch-size", "8", "--out", out)
    assert code == 2 and err.count("\n") == 1 and "--batch-size 8 contradicts the trainer's settings (6, from TrainingArguments" in err


def test_the_global_batch_counts_every_process_and_lightnings_accumulation(tmp_path):
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "bf16": True, "optim": "adamw_torch_8bit"}))
    run = read_trainer_args(args, world_size=4)
    assert (run.global_batch_size, run.precision, run.optimizer, run.max_grad_norm) == (32, "bf16", "adamw-8bit", 1.0)
    config = tmp_path / "config.yaml"
    config.write_text("trainer:\n  accumulate_grad_batches: 3\n  precision: bf16-mixed\n  devices: 2\ndata:\n  init_args:\n    batch_size: 5\n")
    run = read_trainer_args(config, world_size=1)
    assert (run.global_batch_size, run.precision, run.max_grad_norm) == (30, "bf16", None)
    args.write_text(json.dumps({"optim": "adafactor"}))
    with pytest.raises(UserError, match="optim 'adafactor' is not one a plan knows the memory of"):
        read_trainer_args(args, world_size=1)


def test_without_a_batch_size_or_trainer_args_plan_is_one_line(run_cli, tmp_path):
    code, _, err = run_cli("plan", tmp_path / "mlp.py", "--budget", "1MB")
    assert code == 2 and err.count("\n") == 1 and "--batch-size is missing: give the global batch" in err
    code, _, err = run_cli("plan", tmp_path / "mlp.py", "--budget", "1MB", "--from-trainer-args", tmp_path / "args.json")
    assert code == 2 and err.count("\n") == 1 and "args.json' does not exist; give a TrainingArguments JSON or a Lightning config" in err
