"""Models people bring, as they come: each is planned, its plan re-measured by ``probe --plan``, and trained a few steps.

The grid of issue #26: an in-place-ReLU CNN, squeezenet, an LSTM and a GRU language model, Faster R-CNN (lists of
images and target dicts, a dict of losses), DeepLabV3 (``{"out": ...}`` and the default loss), a nanoGPT-style model
((B, T, V) logits and the default loss), a batch built with a Python loop, and Qwen2 and Llama through ``hf:``.
For each: no traceback, the plan re-measured within its budget, and the simulated meter equal to the cpu meter
within 1% at the plan's configuration, or the plan says it used the cpu meter.
"""
import json

import pytest
import torch

from autofit.config import TrainingConfig
from autofit.measure.probe import measure
from autofit.plan_file import load_plan
from autofit.planning.memory.traces import simulation_spec
from autofit.spec import load_spec
from tests.helpers import EXAMPLES

pytestmark = pytest.mark.slow  # every case plans, probes and trains a model: seconds to a minute each

COMMON = '''
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset


def train_dataset():
    inputs, targets = example_batch(8)
    return TensorDataset(inputs, targets)
'''

INPLACE_RELU_CNN = COMMON + '''
INPUT_SHAPE = (3, 32, 32)


def build_model():
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(inplace=True),
        nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )


def example_batch(n):
    return torch.randn(n, *INPUT_SHAPE), torch.randint(0, 10, (n,))
'''

RNN_LM = COMMON + '''
VOCAB, LENGTH = 64, 8


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.rnn = nn.{rnn}(32, 48, num_layers=2, batch_first=True)
        self.head = nn.Linear(48, VOCAB)

    def forward(self, tokens):  # (B, T) -> (B, T, V)
        return self.head(self.rnn(self.embed(tokens))[0])


def build_model():
    return LM()


def example_batch(n):
    tokens = torch.randint(0, VOCAB, (n, LENGTH + 1))
    return tokens[:, :-1], tokens[:, 1:]
'''

DEEPLAB = COMMON + '''
INPUT_SHAPE = (3, 64, 64)


def build_model():
    from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large

    return deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=4)


def example_batch(n):
    return torch.randn(n, *INPUT_SHAPE), torch.randint(0, 4, (n, 64, 64))
'''

NANOGPT = COMMON + '''
VOCAB, LENGTH, WIDTH = 96, 32, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.register_buffer("mask", torch.triu(torch.ones(LENGTH, LENGTH, dtype=torch.bool), 1), persistent=False)

    def forward(self, x):  # (B, T, C)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(LENGTH, WIDTH)
        self.h = nn.ModuleList(Block() for _ in range(3))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx):  # (B, T) -> (B, T, V)
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model():
    return GPT()


def example_batch(n):
    tokens = torch.randint(0, VOCAB, (n, LENGTH + 1))
    return tokens[:, :-1], tokens[:, 1:]
'''

PYTHON_LOOP_BATCH = COMMON + '''
VOCAB, LENGTH = 32, 12


def build_model():
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, VOCAB))


def example_batch(n):
    tokens = torch.randint(1, VOCAB, (n, LENGTH))
    # seq2seq-style labels built sample by sample: each row's length read as a Python int
    labels = torch.full((n, LENGTH), -100)
    for row in range(n):
        stop = int(tokens[row, 0]) % LENGTH + 1
        labels[row, :stop] = tokens[row, :stop]
    return tokens, labels
'''

DETECTION = (EXAMPLES / "detection.py").read_text().replace("SIZE = 128", "SIZE = 64").replace(
    "Rectangles(64, seed=0)", "Rectangles(8, seed=0)").replace("Rectangles(16, seed=1)", "Rectangles(4, seed=1)")


def _hf_dir(tmp_path, kind: str) -> str:
    transformers = pytest.importorskip("transformers")
    config_class = getattr(transformers, f"{kind}Config")
    config = config_class(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, architectures=[f"{kind}ForCausalLM"],
    )
    config.save_pretrained(tmp_path / kind)
    return f"hf:{tmp_path / kind}"


# (id, model file text or a function of tmp_path giving the source, extra plan flags, budget)
CASES = [
    ("inplace-relu-cnn", INPLACE_RELU_CNN, [], "6MB"),
    ("squeezenet", "torchvision:squeezenet1_1", ["--input-shape", "3x64x64", "--num-classes", "2"], "60MB"),
    ("lstm-lm", RNN_LM.replace("{rnn}", "LSTM"), [], "4MB"),
    ("gru-lm", RNN_LM.replace("{rnn}", "GRU"), [], "4MB"),
    ("faster-rcnn", DETECTION, [], "500MB"),
    ("deeplabv3", DEEPLAB, [], "200MB"),
    ("nanogpt", NANOGPT, [], "4MB"),
    ("python-loop-batch", PYTHON_LOOP_BATCH, [], "2MB"),
    ("qwen2", lambda tmp_path: _hf_dir(tmp_path, "Qwen2"), ["--task", "causal-lm", "--seq-len", "32"], "6MB"),
    ("llama", lambda tmp_path: _hf_dir(tmp_path, "Llama"), ["--task", "causal-lm", "--seq-len", "32"], "6MB"),
]


@pytest.mark.parametrize("name, model, flags, budget", CASES, ids=[case[0] for case in CASES])
def test_plan_probe_and_train(name, model, flags, budget, tmp_path, run_cli, monkeypatch, one_thread):
    if callable(model):
        source = model(tmp_path)
    elif model.startswith("torchvision:"):
        source = model
    else:
        source = tmp_path / f"{name.replace('-', '_')}.py"
        source.write_text(model)
    plan_path = tmp_path / "plan.json"
    code, out, err = run_cli(
        "plan", source, "--batch-size", "4", "--budget", budget, "--precisions", "fp32", *flags, "--out", plan_path,
    )
    assert code == 0, err
    assert "Traceback" not in err
    plan, plan_said = load_plan(plan_path), out + err

    code, out, err = run_cli("probe", "--plan", plan_path, "--json")
    assert code == 0, err
    assert json.loads(out)["peak_bytes"] <= plan.budget_bytes

    spec = load_spec(str(source), **_spec_options(flags))
    config = TrainingConfig(global_batch_size=4, micro_batch_size=plan.config.micro_batch_size)
    real = measure(spec, config, device="cpu", simulate=False, steps=1)
    simulated = measure(simulation_spec(spec), config, device="cpu", simulate=True, steps=1)
    if simulated.meter == "cpu":  # fake tensors cannot run it: the planner said so, and measured with the cpu meter
        assert "fake tensors cannot run this model" in plan_said
    else:
        assert abs(simulated.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes, (simulated.peak_bytes, real.peak_bytes)

    monkeypatch.chdir(tmp_path)
    data = ["--data", _image_folder(tmp_path / "images")] if str(source).startswith("torchvision:") else []
    code, out, err = run_cli("train", "--plan", plan_path, "--max-steps", "2", *data)
    assert code == 0, err
    assert "Traceback" not in err
    assert "stopped at --max-steps 2" in out + err
    if name == "faster-rcnn":  # its val_dataset batched by its collate, scored by its losses
        best = next((tmp_path / "runs").glob("*/best.pt"))
        code, out, err = run_cli("val", "--weights", best)
        assert code == 0, err
        assert "loss" in out


def _image_folder(root) -> str:
    """train/ and val/ with two classes of four small RGB images each."""
    from PIL import Image

    for split in ("train", "val"):
        for label in ("a", "b"):
            folder = root / split / label
            folder.mkdir(parents=True)
            for index in range(4):
                pixels = torch.randint(0, 256, (16, 16, 3), dtype=torch.uint8).numpy()
                Image.fromarray(pixels).save(folder / f"{index}.png")
    return str(root)


def _spec_options(flags: list[str]) -> dict:
    options = dict(zip(flags[::2], flags[1::2]))
    names = {"--input-shape": "input_shape", "--num-classes": "num_classes", "--task": "task", "--seq-len": "seq_len"}
    converted = {names[flag]: value for flag, value in options.items()}
    for key in ("num_classes", "seq_len"):
        if key in converted:
            converted[key] = int(converted[key])
    return converted


def test_fit_takes_a_collate_for_samples_that_do_not_stack(tmp_path, one_thread):
    """The Python API: torchvision detection's (image, target) samples, its collate, and validation by its losses."""
    import autofit
    from tests.helpers.detection import EvalDetections, detection_batch

    (images, targets), _ = detection_batch(8)
    samples = list(zip(images, targets))

    def collate(batch):
        images, targets = zip(*batch)
        return (list(images), list(targets)), None

    torch.manual_seed(0)
    result = autofit.fit(
        EvalDetections(), train_data=samples, val_data=samples[:3], batch_size=4, budget="20MB", collate=collate,
        epochs=1, log_dir=tmp_path / "run", verbose=False,
    )
    assert result.plan.config.global_batch_size == 4
    assert result.history[-1]["val_loss"] is not None and result.history[-1]["val_perplexity"] is None
