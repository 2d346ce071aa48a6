"""The default loss (no loss_fn, no loss of the model's own): token-level logits, segmentation dicts, one-line errors."""
import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autofit.apply import apply_config
from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.model_io import IGNORE_INDEX, Loss, Scores, call_model, logits_of
from autofit.step import train_step


class TokenModel(nn.Module):
    """nanoGPT's shape of output: (B, T, V) logits from (B, T) tokens."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


class Segmenter(nn.Module):
    """torchvision segmentation's shape of output: {"out": (B, C, H, W), "aux": ...}."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, classes, 3, padding=1)
        self.aux = nn.Conv2d(2, classes, 1)

    def forward(self, images):
        return {"out": self.conv(images), "aux": self.aux(images)}


class Recorder(torch.optim.SGD):
    def step(self, closure=None):
        self.grads = [
            torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for group in self.param_groups for p in group["params"]
        ]
        return super().step(closure)


def split_gradients(model, inputs, targets, *, micro_batch_size):
    config = TrainingConfig(global_batch_size=len(targets), micro_batch_size=micro_batch_size, precision="fp32")
    applied = apply_config(copy.deepcopy(model), config, device="cpu")
    optimizer = Recorder(applied.model.parameters(), lr=0.0)
    train_step(applied, inputs, targets, loss_fn=None, optimizer=optimizer)
    return optimizer.grads


def token_batch():
    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (4, 6))
    targets = torch.randint(0, 11, (4, 6))
    targets[0, 1:] = IGNORE_INDEX  # padding, unevenly over the samples: the mean is over tokens, not samples
    targets[3, 4:] = IGNORE_INDEX
    return tokens, targets


def test_token_logits_take_a_token_mean_and_accumulate_exactly():
    torch.manual_seed(0)
    model, (tokens, targets) = TokenModel(), token_batch()
    plain = copy.deepcopy(model)
    F.cross_entropy(plain(tokens).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX).backward()
    expected = [p.grad for p in plain.parameters()]
    assert Loss(None).count(tokens, targets) == int((targets != IGNORE_INDEX).sum())
    for micro in (4, 2, 3):  # 4x1, 2x2 (1 + 5 and 6 + 4 tokens), 3 + 1
        for ours, theirs in zip(split_gradients(model, tokens, targets, micro_batch_size=micro), expected):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_token_logits_report_perplexity_whatever_the_batch_calls_its_labels():
    model, (tokens, targets) = TokenModel(), token_batch()
    scores = Scores(None)
    with torch.no_grad():
        scores.add(call_model(model, tokens), tokens, targets)
    assert scores.perplexity is not None and scores.accuracy is None
    assert scores.perplexity == pytest.approx(torch.exp(torch.tensor(scores.loss)).item())


def test_a_segmentation_dict_is_scored_per_pixel_on_its_out():
    torch.manual_seed(0)
    model = Segmenter()
    images, masks = torch.randn(4, 2, 5, 5), torch.randint(0, 3, (4, 5, 5))
    output = model(images)
    assert logits_of(output) is output["out"]
    plain = copy.deepcopy(model)
    F.cross_entropy(plain(images)["out"], masks).backward()
    expected = [p.grad if p.grad is not None else torch.zeros_like(p) for p in plain.parameters()]
    for ours, theirs in zip(split_gradients(model, images, masks, micro_batch_size=2), expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_shapes_that_fit_no_way_are_one_line_naming_both():
    with pytest.raises(UserError, match=r"logits of shape \(2, 96, 11\) against targets of shape \(2, 64\).*loss_fn"):
        Loss(None)(torch.randn(2, 96, 11), torch.randint(0, 11, (2, 64)))
