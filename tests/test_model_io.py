"""Inputs that are tuples or dicts, outputs with their own loss, and micro-batch weights by counted tokens."""
import copy
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autofit.apply import apply_config
from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.model_io import (
    IGNORE_INDEX, Loss, Samples, Scores, batch_size_of, call_model, count_labels, logits_of, own_loss, per_sample, sliced,
)
from autofit.training.data import collate_pairs
from autofit.step import to_device, train_step
from tests.helpers.detection import EvalDetections, ListDetector, detection_batch

VOCAB, SEQ = 11, 6


@dataclass
class Output:
    """Like transformers' ModelOutput: attributes, some of them None."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class TinyLM(nn.Module):
    """Next-token model over (B, T) tokens with a padding mask; returns its own loss when given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.embed(input_ids)  # (B, T, C)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        logits = self.head(torch.tanh(self.mix(h)).cumsum(dim=1))  # (B, T, V)
        loss = None
        if labels is not None:  # shifted, as transformers' causal LMs do
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)
        return Output(logits=logits, loss=loss)


def padded_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Sequences of very different lengths: samples weigh very differently in a token mean."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
    lengths = torch.tensor([2, 6, 3, 6, 2, 5, 6, 4][:n])
    mask = (torch.arange(SEQ) < lengths[:, None]).long()
    return {"input_ids": tokens * mask, "attention_mask": mask, "labels": tokens.masked_fill(mask == 0, IGNORE_INDEX)}


class GradRecorder(torch.optim.SGD):
    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for group in self.param_groups for p in group["params"]]
        return super().step(closure)


def step_gradients(model, inputs, targets, *, micro_batch_size, loss_fn):
    model = copy.deepcopy(model)
    config = TrainingConfig(global_batch_size=8, micro_batch_size=micro_batch_size)
    applied = apply_config(model, config, device="cpu")
    optimizer = GradRecorder(applied.model.parameters(), lr=0.0)
    result = train_step(applied, inputs, targets, loss_fn=loss_fn, optimizer=optimizer)
    return optimizer.grads, result.loss


def full_batch_gradients(model, loss):
    model = copy.deepcopy(model)
    loss(model).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def assert_same(ours, theirs):
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def token_loss_sum(output, targets):
    """A per-token loss returned as (sum, count)."""
    logits = output.logits[:, :-1]
    labels = targets[:, 1:]
    total = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return total, (labels != IGNORE_INDEX).sum()


def test_call_model_passes_tensors_tuples_and_dicts():
    seen = []

    def model(*args, **kwargs):
        seen.append((len(args), sorted(kwargs)))
        return args[0] if args else kwargs["x"]

    x = torch.ones(2, 3)
    call_model(model, x)
    call_model(model, (x, x))
    call_model(model, [x, x, x])
    call_model(model, {"x": x, "mask": x})
    assert seen == [(1, []), (2, []), (3, []), (0, ["mask", "x"])]


def test_logits_and_own_loss_of_model_outputs():
    logits, loss = torch.randn(2, 3), torch.tensor(1.5)
    assert logits_of(logits) is logits and own_loss(logits) is None
    assert logits_of(Output(logits=logits, loss=loss)) is logits and own_loss(Output(logits=logits, loss=loss)) is loss
    assert own_loss(Output(logits=logits)) is None
    assert logits_of({"loss": loss, "logits": logits}) is logits and own_loss({"loss": loss}) is loss
    assert logits_of((logits, loss)) is logits


@pytest.mark.parametrize("micro_batch_size", [8, 4, 3])  # 8 = 4 + 4 = 3 + 3 + 2
def test_own_loss_weighted_by_tokens_gives_the_full_batch_gradient(micro_batch_size):
    torch.manual_seed(0)
    model = TinyLM()
    batch = padded_batch(8)
    expected = full_batch_gradients(model, lambda m: m(**batch).loss)
    loss = Loss(None, count_items=count_labels(shift=True))
    grads, step_loss = step_gradients(model, batch, None, micro_batch_size=micro_batch_size, loss_fn=loss)
    assert_same(grads, expected)
    torch.testing.assert_close(step_loss, model(**batch).loss.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("micro_batch_size", [4, 3])
def test_sum_and_count_loss_gives_the_full_batch_gradient(micro_batch_size):
    torch.manual_seed(0)
    model = TinyLM()
    batch = padded_batch(8)
    labels = batch.pop("labels")
    inputs = (batch["input_ids"], batch["attention_mask"])  # a tuple: model(*inputs)

    def mean_loss(m):
        total, count = token_loss_sum(m(*inputs), labels)
        return total / count

    expected = full_batch_gradients(model, mean_loss)
    loss = Loss(token_loss_sum, count_items=count_labels(shift=True))
    grads, _ = step_gradients(model, inputs, labels, micro_batch_size=micro_batch_size, loss_fn=loss)
    assert_same(grads, expected)


def test_sample_weights_are_not_exact_for_padded_tokens():
    """What the item counts fix: the same mean loss weighted by samples gives another gradient."""
    torch.manual_seed(0)
    model = TinyLM()
    batch = padded_batch(8)
    expected = full_batch_gradients(model, lambda m: m(**batch).loss)
    grads, _ = step_gradients(model, batch, None, micro_batch_size=3, loss_fn=None)
    assert max((a - b).abs().max().item() for a, b in zip(grads, expected)) > 1e-4


def test_a_micro_batch_without_counted_tokens_adds_nothing():
    torch.manual_seed(0)
    model = TinyLM()
    batch = padded_batch(8)
    batch["labels"][:4] = IGNORE_INDEX  # the first micro-batch of 4 has no token to predict
    expected = full_batch_gradients(model, lambda m: m(**batch).loss)
    grads, step_loss = step_gradients(model, batch, None, micro_batch_size=4, loss_fn=Loss(None, count_items=count_labels(shift=True)))
    assert_same(grads, expected)
    assert torch.isfinite(step_loss)


def test_sum_and_count_without_count_items_is_one_line():
    torch.manual_seed(0)
    batch = padded_batch(8)
    labels = batch.pop("labels")
    with pytest.raises(UserError, match="count_items"):
        step_gradients(TinyLM(), batch, labels, micro_batch_size=4, loss_fn=token_loss_sum)


def test_no_loss_and_no_targets_is_one_line():
    batch = padded_batch(8)
    batch.pop("labels")
    with pytest.raises(UserError, match="without a loss"):
        step_gradients(TinyLM(), batch, None, micro_batch_size=4, loss_fn=None)


def test_dict_samples_collate_to_inputs_without_targets():
    samples = [{"input_ids": torch.arange(3), "labels": torch.arange(3)} for _ in range(2)]
    inputs, targets = collate_pairs(samples)
    assert targets is None and inputs["input_ids"].shape == (2, 3)
    inputs, targets = collate_pairs([((torch.zeros(2), torch.ones(1)), 3), ((torch.zeros(2), torch.ones(1)), 4)])
    assert isinstance(inputs, (tuple, list)) and inputs[0].shape == (2, 2) and targets.tolist() == [3, 4]


def test_scores_give_accuracy_for_classes_and_perplexity_for_tokens():
    classifier = Scores(None)
    classifier.add(Output(logits=torch.tensor([[2.0, 0.0], [0.0, 2.0]])), torch.zeros(2, 3), torch.tensor([0, 0]))
    assert classifier.accuracy == 0.5 and classifier.perplexity is None
    torch.manual_seed(0)
    model, batch = TinyLM(), padded_batch(8)
    tokens = Scores(Loss(None, count_items=count_labels(shift=True)))
    with torch.no_grad():
        tokens.add(model(**{k: v[:4] for k, v in batch.items()}), {k: v[:4] for k, v in batch.items()}, None)
        tokens.add(model(**{k: v[4:] for k, v in batch.items()}), {k: v[4:] for k, v in batch.items()}, None)
        whole = model(**batch).loss.item()
    assert tokens.accuracy is None
    assert tokens.loss == pytest.approx(whole, rel=1e-6)
    assert tokens.perplexity == pytest.approx(torch.tensor(whole).exp().item(), rel=1e-6)


def test_scores_of_in_batch_similarities_or_a_loss_alone_are_the_loss_only():
    similarities = Scores(None)  # a two-tower model's (B, B) matrix, sample i matching sample i: not classes
    similarities.add(torch.eye(4) * 3, (torch.zeros(4, 2), torch.zeros(4, 2)), torch.arange(4))
    assert similarities.loss > 0 and similarities.accuracy is None and similarities.perplexity is None
    contrastive = Scores(None)  # CLIP's output: its own loss and no token labels
    contrastive.add({"loss": torch.tensor(2.1), "logits_per_image": torch.zeros(4, 4)}, {"input_ids": torch.zeros(4, 3)}, None)
    assert contrastive.loss == pytest.approx(2.1) and contrastive.perplexity is None


def test_token_weights_over_two_ranks_average_to_the_full_batch_gradient():
    """What DDP/FSDP do with each rank's gradient (the mean over ranks), done by hand: 8 = 4 + 4 on two ranks, 3 + 1 each."""
    from strategies import BatchSplit, BatchSplitConfig

    torch.manual_seed(0)
    model = TinyLM()
    batch = padded_batch(8)
    expected = full_batch_gradients(model, lambda m: m(**batch).loss)
    loss = Loss(None, count_items=count_labels(shift=True))
    per_rank = []
    for rank in range(2):
        copy_ = copy.deepcopy(model)
        split = BatchSplit(BatchSplitConfig(global_batch_size=8, micro_batch_size=3), rank=rank, world_size=2)
        for inputs, targets, weight in split.micro_batches(batch, None, count=loss.count):
            loss.weighted(copy_(**inputs), targets, weight=weight).backward()
        per_rank.append([p.grad for p in copy_.parameters()])
    assert_same([(a + b) / 2 for a, b in zip(*per_rank)], expected)


@pytest.mark.parametrize("micro_batch_size", [8, 3, 1])  # 8 = 3 + 3 + 2
def test_per_sample_lists_split_by_entry_give_the_full_batch_gradient(micro_batch_size):
    torch.manual_seed(0)
    model = ListDetector()
    inputs, targets = detection_batch(8)
    expected = full_batch_gradients(model, lambda m: own_loss(call_model(m, inputs)))
    grads, step_loss = step_gradients(model, inputs, targets, micro_batch_size=micro_batch_size, loss_fn=None)
    assert_same(grads, expected)
    torch.testing.assert_close(step_loss, own_loss(call_model(model, inputs)).detach(), rtol=1e-6, atol=1e-6)


def test_per_sample_batches_count_entries_not_tensor_dimensions():
    inputs, targets = detection_batch(3)
    assert isinstance(inputs[0], Samples) and isinstance(inputs[1], Samples) and targets is None
    assert batch_size_of(inputs, targets) == 3  # each image's first dimension is its 3 channels
    first_two = sliced(inputs, slice(0, 2))
    assert isinstance(first_two[0], Samples) and len(first_two[0]) == 2 and first_two[0][1] is inputs[0][1]
    moved = to_device(inputs, "cpu")
    assert isinstance(moved[1], Samples) and moved[1][2]["labels"].tolist() == [1, 2]


def test_a_loss_dict_is_summed_and_is_no_language_model():
    losses = {"loss_classifier": torch.tensor(1.0), "loss_box_reg": torch.tensor(0.5)}
    assert own_loss(losses).item() == 1.5
    assert own_loss({"loss": torch.tensor(2.0), "aux": torch.tensor(1.0)}).item() == 2.0
    assert own_loss({"boxes": torch.zeros(()), "scores": torch.zeros(())}) is None  # not named losses
    scores = Scores(None)
    inputs, targets = detection_batch(2)
    scores.add(losses, inputs, targets)
    assert scores.loss == 1.5 and scores.perplexity is None and scores.accuracy is None


def test_lists_that_are_not_declared_per_sample_are_one_line_naming_collate():
    from autofit.model_checks import check_batch

    images = [torch.randn(3, 8, 8) for _ in range(2)]
    with pytest.raises(UserError, match="define collate"):
        check_batch(((images, [{"boxes": torch.zeros(1, 4)}] * 2), None), batch_size=2, where="example_batch(2)")
    check_batch(per_sample(((images, [{"boxes": torch.zeros(1, 4)}] * 2), None)), batch_size=2, where="example_batch(2)")


def test_validation_scores_a_model_that_computes_its_losses_only_when_training():
    from autofit.training.validation import evaluate

    torch.manual_seed(0)
    model = EvalDetections()
    applied = apply_config(model, TrainingConfig(global_batch_size=4, micro_batch_size=2), device="cpu")
    samples = [((image, target),) for image, target in zip(*detection_batch(4)[0])]

    def collate(batch):
        images, targets = zip(*(sample[0] for sample in batch))
        return per_sample(((list(images), list(targets)), None))

    statistics = model.norm.running_mean.clone()
    scores = evaluate(model, samples, loss_fn=None, applied=applied, num_workers=0, collate=collate)
    assert model.training and model.norm.training and model.drop.training  # evaluate left the model training
    model.norm.eval(), model.drop.eval()  # what the losses were computed with: running statistics, no dropout
    inputs, _ = collate(samples)
    with torch.no_grad():
        expected = torch.stack([own_loss(model(*sliced(inputs, slice(i, i + 2)))) for i in (0, 2)]).mean()
    assert scores.loss == pytest.approx(expected.item(), rel=1e-6)
    assert torch.equal(model.norm.running_mean, statistics)  # validation left them alone


def test_a_collate_that_raises_or_miscounts_is_one_line():
    from autofit.model_checks import CheckedCollate

    def broken(samples):
        return 1 / 0

    with pytest.raises(UserError, match=r"fit\(\): collate\(\) of 2 sample\(s\) raised ZeroDivisionError"):
        CheckedCollate(broken, owner="fit()")([1, 2])
    with pytest.raises(UserError, match=r"returned inputs of 1 sample\(s\).*not 2"):
        CheckedCollate(lambda samples: (([torch.zeros(3)],), None), owner="fit()")([1, 2])
