"""Model files whose inputs are a tuple or a dict, through every command: probe, plan, train, val, compare, export."""
import json

import pytest
import torch

TUPLE_MODEL = '''
import torch
from torch import nn

class TwoInputs(nn.Module):
    """Features and a mask: called as model(x, mask); returns logits (B, 3)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(2)))
        self.head = nn.Linear(8, 3)

    def forward(self, x, mask):
        return self.head(self.blocks(x * mask))

def build_model():
    return TwoInputs()

def _batch(n, seed=None):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=generator)
    return (x, torch.ones(n, 8)), (x[:, 0] > 0).long() + (x[:, 1] > 0).long()

def example_batch(n):
    return _batch(n)

class Pairs(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        (self.x, self.mask), self.y = _batch(n, seed)
    def __len__(self):
        return len(self.y)
    def __getitem__(self, i):
        return (self.x[i], self.mask[i]), self.y[i]

def train_dataset():
    return Pairs(64, 0)

def val_dataset():
    return Pairs(32, 1)
'''

DICT_MODEL = '''
import torch
from torch import nn
from torch.nn import functional as F

from autofit.model_io import count_labels

class OwnLoss(nn.Module):
    """Called as model(**batch) with tokens, a mask and labels; returns a dict with its own token loss."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2)))
        self.head = nn.Linear(16, 20)

    def forward(self, input_ids, attention_mask, labels=None):
        logits = self.head(self.blocks(self.embed(input_ids) * attention_mask.unsqueeze(-1)))  # (B, T, V)
        output = {"logits": logits}
        if labels is not None:
            output["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return output

def build_model():
    return OwnLoss()

count_items = count_labels()

def _batch(n, seed=None):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 20, (n, 6), generator=generator)
    mask = (torch.arange(6) < torch.randint(2, 7, (n, 1), generator=generator)).long()
    return {"input_ids": tokens * mask, "attention_mask": mask, "labels": ((tokens + 1) % 20).masked_fill(mask == 0, -100)}

def example_batch(n):
    return _batch(n), None

class Dicts(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.batch = _batch(n, seed)
    def __len__(self):
        return len(self.batch["input_ids"])
    def __getitem__(self, i):
        return {key: value[i] for key, value in self.batch.items()}

def train_dataset():
    return Dicts(64, 0)

def val_dataset():
    return Dicts(32, 1)
'''


@pytest.mark.slow
@pytest.mark.parametrize("form, source", [("tuple", TUPLE_MODEL), ("dict", DICT_MODEL)], ids=["tuple", "dict"])
def test_every_command_takes_the_input_form(form, source, tmp_path, run_cli, one_thread):
    model_file = tmp_path / f"{form}_model.py"
    model_file.write_text(source)
    for simulate in ((), ("--simulate",)):
        code, out, err = run_cli("probe", model_file, "-m", "4", "-k", "2", "--json", *simulate)
        assert code == 0, err
    assert json.loads(out)["meter"] == "simulated"
    code, out, err = run_cli("probe", model_file, "-m", "4", "--list-blocks", "--json")
    assert code == 0 and len(json.loads(out)) == 2, err
    plan_path = tmp_path / "plan.json"
    code, out, err = run_cli("plan", model_file, "--budget", "2MB", "--batch-size", "8", "--precisions", "fp32,bf16", "--out", plan_path)
    assert code == 0, err
    code, out, err = run_cli("train", "--plan", plan_path, "--epochs", "1", "--workers", "0", "--log-dir", tmp_path / "run")
    assert code == 0, err
    epoch = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert epoch["kind"] == "epoch" and epoch["val_loss"] > 0
    if form == "tuple":
        assert epoch["val_accuracy"] is not None and epoch["val_perplexity"] is None
    else:
        assert epoch["val_accuracy"] is None and epoch["val_perplexity"] == pytest.approx(torch.tensor(epoch["val_loss"]).exp().item())
    code, out, err = run_cli("val", "--weights", tmp_path / "run" / "best.pt", "--json")
    assert code == 0, err
    scores = json.loads(out)
    # the loop validates in the plan's precision (maybe bf16), val in fp32
    assert scores["num_samples"] == 32 and scores["loss"] == pytest.approx(epoch["val_loss"], rel=1e-2)
    code, out, err = run_cli("export", "--weights", tmp_path / "run" / "best.pt", "--out", tmp_path / "model.pt", "--json")
    assert code == 0, err
    with pytest.warns(FutureWarning):  # torch.jit is deprecated upstream; still the format asked for
        exported = torch.jit.load(str(tmp_path / "model.pt"))
    namespace = {}
    exec(compile(source, str(model_file), "exec"), namespace)
    inputs, _ = namespace["example_batch"](3)
    positional = inputs if form == "tuple" else (inputs["input_ids"], inputs["attention_mask"])
    assert exported(*positional).shape[0] == 3
    code, out, err = run_cli("compare", model_file, "--batch-size", "8", "--steps", "2", "--out-dir", tmp_path / "compare")
    assert code == 0, err
    assert "fp32" in out and "checkpoint all" in out
