"""Validation after each epoch: mean loss and accuracy (or perplexity) over the val set, split over the ranks."""
from __future__ import annotations

import torch
from torch import nn

from autofit._torch_private import NORM_AND_DROPOUT_TYPES
from autofit.apply import AppliedPlan
from autofit.errors import UserError
from autofit.model_io import Loss, Scores, call_model
from autofit.training.data import collate_pairs, collate_readable, make_loader
from autofit.distributed import sum_across_ranks
from autofit.step import to_device
from strategies import micro_batch_count, rank_slice


@torch.no_grad()
def evaluate(
    model: nn.Module, dataset, *, loss_fn, applied: AppliedPlan, num_workers: int, collate=None,
    on_unreadable=lambda sample: None,
) -> Scores:
    """Mean loss (over the items the loss counts), and accuracy or perplexity, over ``dataset`` in micro-batches.

    Samples that fail to decode are left out, each passed to ``on_unreadable``. ``collate`` makes the batches
    (a model file's; default ``collate_pairs``).

    A model whose output in eval mode holds neither a loss nor logits (torchvision detection returns its
    detections, and its losses only when training) is scored in ``loss_mode``.

    On several processes each rank evaluates its contiguous share and the sums
    are added over the ranks. Every rank runs as many forwards (FSDP gathers
    parameters in each, a collective): a rank one batch short runs one on a
    sample it does not count.

    Accuracy is None unless the output (or its ``.logits``) is (B, classes) and
    the labels (B,); perplexity is set for a language model's loss. Without a
    dataset all three are None.
    """
    scores = Scores(loss_fn)
    if dataset is None:
        return scores
    model.eval()
    env = applied.env
    share = rank_slice(len(dataset), rank=env.rank, world_size=env.world_size)
    batches = micro_batch_count(len(dataset), world_size=env.world_size, micro_batch_size=applied.micro_batch_size)
    loader = make_loader(
        dataset, batch_size=applied.micro_batch_size, order=range(share.start, share.stop), num_workers=num_workers,
        collate=collate,
    )
    padding = _padded_batches(loader, batches=batches, dataset=dataset, collate=collate, on_unreadable=on_unreadable)
    for inputs, targets, counted in padding:
        inputs, targets = to_device(inputs, applied.device), to_device(targets, applied.device)
        with applied.forward_context():
            scores.add(scored_output(model, inputs, loss=scores.loss_fn), inputs, targets, counted=counted)
    model.train()
    totals = torch.tensor(scores.totals(), dtype=torch.float64, device=applied.device)
    scores.set_totals(sum_across_ranks(totals).tolist())
    return scores


def scored_output(model: nn.Module, inputs, *, loss: Loss):
    """The model's output on ``inputs``, one ``loss`` can score: in eval mode, or, where that output holds neither a
    loss nor logits (detections), in ``loss_mode``, which then stays for the batches after."""
    output = call_model(model, inputs)
    if not loss.scores(output) and not model.training:
        loss_mode(model)
        output = call_model(model, inputs)
    return output


def loss_mode(model: nn.Module) -> None:
    """Train mode for the model's own control flow (torchvision detection computes its losses only when training),
    eval mode for the modules training would change or randomise: norms' running statistics, dropout."""
    model.train()
    for module in model.modules():
        if isinstance(module, NORM_AND_DROPOUT_TYPES):
            module.eval()


def _padded_batches(loader, *, batches: int, dataset, collate, on_unreadable):
    """Yield (inputs, targets, 1) per batch of ``loader``, then padding (a sample counted 0) up to ``batches``.

    A batch with no readable sample is padding too: every rank runs as many forwards.
    """
    done = 0
    for inputs, targets, unreadable in loader:
        for sample in unreadable:
            on_unreadable(sample)
        done += 1
        yield (inputs, targets, 1) if inputs is not None else (*_padding(dataset, collate), 0)
    for _ in range(batches - done):
        yield (*_padding(dataset, collate), 0)


def _padding(dataset, collate) -> tuple:
    """The first readable sample of ``dataset``, as a batch of one."""
    for index in range(len(dataset)):
        inputs, targets, _ = collate_readable([dataset[index]], collate=collate or collate_pairs)
        if inputs is not None:
            return inputs, targets
    raise UserError("no sample of the validation data can be read; replace its files")
