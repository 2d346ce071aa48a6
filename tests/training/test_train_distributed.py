"""`autofit train` on a plan for 2 processes, under torchrun with gloo on the CPU.

Each torchrun launch costs seconds (two interpreters importing torch), so the
runs are made once per module and the tests read their files.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from autofit.config import TrainingConfig
from autofit.apply import AppliedPlan
from autofit.distributed import DistributedEnv
from autofit.errors import UserError
from autofit.plan_file import DeviceInfo, ModelInfo, Plan, save_plan
from autofit.training.weights import load_checkpoint
from strategies import BatchSplit, BatchSplitConfig, Precision, PrecisionConfig
from tests.helpers import ROOT, main_exit_code

pytestmark = [
    pytest.mark.slow,  # the torchrun launches of `runs`: about two minutes
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="torch.distributed with the gloo backend is not available in this torch build",
    ),
]

WORLD_SIZE, GLOBAL_BATCH_SIZE, EPOCHS = 2, 8, 2
TRAIN_SAMPLES = 37  # 5 global batches a epoch, the last of 5 samples: 3 on rank 0, 2 on rank 1 (one weight-0 micro-batch)

MODEL_FILE = '''
import torch
from torch import nn

INPUT_SHAPE = (1, 4, 4)
NUM_CLASSES = 3
DROPOUT = {dropout}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, x):  # (B, 16)
        return x + self.dropout(torch.tanh(self.linear(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(3)))
        self.head = nn.Linear(16, NUM_CLASSES)

    def forward(self, x):  # (B, 1, 4, 4) -> (B, NUM_CLASSES)
        return self.head(self.blocks(x.flatten(1)))


def build_model():
    return Net()


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _dataset(samples, seed):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 1, 4, 4, generator=generator)
    return torch.utils.data.TensorDataset(inputs, torch.randint(0, NUM_CLASSES, (samples,), generator=generator))


def train_dataset():
    return _dataset({train_samples}, 1)


def val_dataset():
    return _dataset(13, 2)


def example_batch(batch_size):
    return _dataset(batch_size, 3).tensors
'''


def _write_model(path, *, dropout: float) -> None:
    path.write_text(textwrap.dedent(MODEL_FILE).format(dropout=dropout, train_samples=TRAIN_SAMPLES))


def _plan(model_file, *, world_size: int, sharding: str, micro_batch_size: int, nodes: int = 1) -> Plan:
    """A plan written by hand: micro-batch and accumulation per rank, the global batch over all ranks."""
    return Plan(
        model=ModelInfo(source=str(model_file), input_shape=[1, 4, 4], num_classes=3),
        device=DeviceInfo(type="cpu"), budget_bytes=10**8, config=TrainingConfig(
            global_batch_size=GLOBAL_BATCH_SIZE, micro_batch_size=micro_batch_size, world_size=world_size, sharding=sharding,
            nodes=nodes, checkpoint=["blocks.0", "blocks.1"],
        ),
    )


def _env() -> dict:
    # PYTHONFAULTHANDLER: a rank that aborts prints every thread's Python stack, so a failure says where.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}


def _arguments(plan_path, log_dir, *extra: str) -> list[str]:
    return ["train", "--plan", str(plan_path), "--log-dir", str(log_dir), "--epochs", str(EPOCHS), "--workers", "0", *extra]


def _torchrun(cwd, plan_path, log_dir, *extra: str, processes: int = WORLD_SIZE) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
        "-m", "autofit", *_arguments(plan_path, log_dir, *extra),
    ]
    done = subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def _one_process(plan_path, log_dir) -> None:
    """`autofit train` in this process (one interpreter start less than a subprocess)."""
    assert main_exit_code(*_arguments(plan_path, log_dir)) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process, FSDP and DDP on 2 processes (no dropout); with dropout: 2 processes whole, and stopped + resumed."""
    root = tmp_path_factory.mktemp("train_distributed")
    plain, dropout = root / "plain_model.py", root / "dropout_model.py"
    _write_model(plain, dropout=0.0)
    _write_model(dropout, dropout=0.3)
    plans = {
        "one": _plan(plain, world_size=1, sharding="none", micro_batch_size=3),
        "fsdp": _plan(plain, world_size=WORLD_SIZE, sharding="fsdp", micro_batch_size=2),
        "ddp": _plan(plain, world_size=WORLD_SIZE, sharding="ddp", micro_batch_size=2),
        "fsdp_dropout": _plan(dropout, world_size=WORLD_SIZE, sharding="fsdp", micro_batch_size=2),
        # 2 nodes of 2 processes (one machine stands for both: the mesh is the same), 4 ranks x micro-batch 2.
        "hsdp": _plan(plain, world_size=4, sharding="hsdp", micro_batch_size=2, nodes=2),
    }
    paths = {name: save_plan(plan, root / f"{name}.json") for name, plan in plans.items()}
    _one_process(paths["one"], root / "one")
    outputs = {
        "fsdp": _torchrun(root, paths["fsdp"], root / "fsdp"),
        "ddp": _torchrun(root, paths["ddp"], root / "ddp"),
        "hsdp": _torchrun(root, paths["hsdp"], root / "hsdp", processes=4),
        "hsdp_cut": _torchrun(root, paths["hsdp"], root / "hsdp_resumed", "--max-steps", "3", processes=4),
        "hsdp_resumed": _torchrun(root, paths["hsdp"], root / "hsdp_resumed", "--resume", processes=4),
        "whole": _torchrun(root, paths["fsdp_dropout"], root / "whole"),
        # Stopped mid-epoch 1 (after step 3 of 5), then 2 new processes continue.
        "cut": _torchrun(root, paths["fsdp_dropout"], root / "resumed", "--max-steps", "3"),
        "resumed": _torchrun(root, paths["fsdp_dropout"], root / "resumed", "--resume"),
    }
    return root, outputs


def _records(log_dir, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def _assert_same_run(run, reference, *, rtol: float) -> None:
    steps, reference_steps = _records(run, "step"), _records(reference, "step")
    assert [r["step"] for r in steps] == [r["step"] for r in reference_steps] == list(range(1, 11))
    losses, reference_losses = [r["loss"] for r in steps], [r["loss"] for r in reference_steps]
    assert torch.allclose(torch.tensor(losses), torch.tensor(reference_losses), rtol=rtol, atol=0), (losses, reference_losses)
    epochs, reference_epochs = _records(run, "epoch"), _records(reference, "epoch")
    assert [r["val_accuracy"] for r in epochs] == [r["val_accuracy"] for r in reference_epochs]
    val_losses = torch.tensor([r["val_loss"] for r in epochs])
    assert torch.allclose(val_losses, torch.tensor([r["val_loss"] for r in reference_epochs]), rtol=rtol, atol=0)
    weights, reference_weights = load_checkpoint(run / "last.pt")["model_state"], load_checkpoint(reference / "last.pt")["model_state"]
    assert weights.keys() == reference_weights.keys()
    for name, tensor in weights.items():
        assert type(tensor) is torch.Tensor and tensor.device.type == "cpu"  # whole weights, not shards
        assert torch.allclose(tensor, reference_weights[name], rtol=rtol, atol=1e-6), name


@pytest.mark.slow  # `runs`: eight torchrun launches, about two minutes
@pytest.mark.parametrize("sharding", ["fsdp", "ddp", "hsdp"])
def test_several_processes_give_the_single_process_loss_curve(runs, sharding):
    """Global batch 8 = 2 ranks x micro-batch 2 x 2 steps (HSDP: 2 nodes x 2 ranks x micro-batch 2), checkpointed, vs
    3+3+2 on one process: same curve and weights."""
    root, outputs = runs
    _assert_same_run(root / sharding, root / "one", rtol=1e-5)
    # Only rank 0 logs and prints.
    assert outputs[sharding].stdout.count("epoch 1/2: train loss") == 1
    ranks = "4 processes (hsdp) x micro-batch 2 x 1" if sharding == "hsdp" else f"2 processes ({sharding}) x micro-batch 2 x 2"
    assert ranks in outputs[sharding].stdout
    assert json.loads((root / sharding / "run_plan.json").read_text())["sharding"] == sharding
    assert (root / sharding / "best.pt").is_file() and (root / sharding / "last_sharded" / ".metadata").is_file()


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
@pytest.mark.parametrize(("resumed", "whole"), [("resumed", "whole"), ("hsdp_resumed", "hsdp")])
def test_a_resumed_run_ends_as_an_uninterrupted_one(runs, resumed, whole):
    """Stopped after step 3, then new processes resume: losses, validation and exactly the weights as if never stopped.
    FSDP2 on 2 processes with dropout, so each rank's RNG must come back too; HSDP on 4 as 2 nodes of 2, whose sharded
    checkpoint is over a 2 x 2 mesh."""
    root, outputs = runs
    assert "resuming from" in outputs[resumed].stdout and "after step 3" in outputs[resumed].stdout
    _assert_same_run(root / resumed, root / whole, rtol=1e-6)
    weights = load_checkpoint(root / whole / "last.pt")["model_state"]
    again = load_checkpoint(root / resumed / "last.pt")["model_state"]
    assert all(torch.equal(weights[name], again[name]) for name in weights)


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_dropout_draws_differ_per_rank(runs):
    """The dropout runs' 2-process curve is not the plain model's: each rank draws its own masks."""
    root, _ = runs
    assert _records(root / "whole", "step")[0]["loss"] != _records(root / "fsdp", "step")[0]["loss"]


def test_a_multi_process_plan_without_torchrun_prints_the_command(tmp_path, run_cli, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    model_file = tmp_path / "model.py"
    _write_model(model_file, dropout=0.0)
    plan_path = save_plan(_plan(model_file, world_size=2, sharding="fsdp", micro_batch_size=2), tmp_path / "plan.json")
    code, out, err = run_cli("train", "--plan", plan_path, "--epochs", "3")
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0, err
    assert f"start it with: torchrun --nproc-per-node 2 -m autofit train --plan {plan_path} --epochs 3" in err
    assert not (tmp_path / "runs").exists()


def test_a_single_process_plan_under_torchrun_with_two_is_one_line(tmp_path, run_cli, monkeypatch):
    model_file = tmp_path / "model.py"
    _write_model(model_file, dropout=0.0)
    plan_path = save_plan(_plan(model_file, world_size=1, sharding="none", micro_batch_size=2), tmp_path / "plan.json")
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's variable, read before any process group is joined
    code, out, err = run_cli("train", "--plan", plan_path)
    assert code == 2 and err.strip().count("\n") == 0, err
    assert "this plan is for 1 process(es) but torchrun started 2; use --nproc-per-node 1" in err


def test_out_of_memory_on_one_of_several_ranks_is_refused_with_advice():
    """One rank cannot halve its micro-batch alone (the others wait in the step's collectives)."""
    split = BatchSplit(BatchSplitConfig(global_batch_size=8, micro_batch_size=2))
    precision = Precision(PrecisionConfig(), device_type="cpu")
    applied = AppliedPlan(
        config=TrainingConfig(global_batch_size=8, micro_batch_size=2, world_size=2, sharding="ddp"), model=torch.nn.Linear(2, 2),
        precision=precision, split=split, strategies=(precision, split),
        device=torch.device("cpu"), env=DistributedEnv(rank=1, world_size=2, local_rank=1, device=torch.device("cpu")),
    )
    with pytest.raises(UserError, match=r"out of memory on rank 1 of 2 at micro-batch 2.*lower --budget.*more --gpus") as error:
        applied.halve_micro_batch()
    assert "\n" not in str(error.value) and applied.split is split
