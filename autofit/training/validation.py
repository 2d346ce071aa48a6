"""Validation after each epoch: mean loss and accuracy (or perplexity) over the val set, split over the ranks."""
from __future__ import annotations

import torch
from torch import nn

from autofit.apply import AppliedPlan
from autofit.errors import UserError
from autofit.model_io import Scores, call_model
from autofit.training.data import collate_readable, make_loader
from autofit.distributed import sum_across_ranks
from autofit.step import to_device
from strategies import micro_batch_count, rank_slice


@torch.no_grad()
def evaluate(
    model: nn.Module, dataset, *, loss_fn, applied: AppliedPlan, num_workers: int, on_unreadable=lambda sample: None,
) -> Scores:
    """Mean loss (over the items the loss counts), and accuracy or perplexity, over ``dataset`` in micro-batches.

    Samples that fail to decode are left out, each passed to ``on_unreadable``.

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
    loader = make_loader(dataset, batch_size=applied.micro_batch_size, order=range(share.start, share.stop), num_workers=num_workers)
    for inputs, targets, counted in _padded_batches(loader, batches=batches, dataset=dataset, on_unreadable=on_unreadable):
        inputs, targets = to_device(inputs, applied.device), to_device(targets, applied.device)
        with applied.forward_context():
            scores.add(call_model(model, inputs), inputs, targets, counted=counted)
    model.train()
    totals = torch.tensor(scores.totals(), dtype=torch.float64, device=applied.device)
    scores.set_totals(sum_across_ranks(totals).tolist())
    return scores


def _padded_batches(loader, *, batches: int, dataset, on_unreadable):
    """Yield (inputs, targets, 1) per batch of ``loader``, then padding (a sample counted 0) up to ``batches``.

    A batch with no readable sample is padding too: every rank runs as many forwards.
    """
    done = 0
    for inputs, targets, unreadable in loader:
        for sample in unreadable:
            on_unreadable(sample)
        done += 1
        yield (inputs, targets, 1) if inputs is not None else (*_padding(dataset), 0)
    for _ in range(batches - done):
        yield (*_padding(dataset), 0)


def _padding(dataset) -> tuple:
    """The first readable sample of ``dataset``, as a batch of one."""
    for index in range(len(dataset)):
        inputs, targets, _ = collate_readable([dataset[index]])
        if inputs is not None:
            return inputs, targets
    raise UserError("no sample of the validation data can be read; replace its files")
