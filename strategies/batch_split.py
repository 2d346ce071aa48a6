"""Batch split: a global batch G as micro-batches of at most m, gradients accumulated.

Each micro-batch's mean loss is weighted by its share of the global batch
(size / G), so one optimizer step sees exactly the gradient of the mean loss
over all G samples, also when m does not divide G (e.g. 8 = 3 + 3 + 2).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map

from autofit.errors import UserError
from strategies.base import Strategy


@dataclass(kw_only=True, slots=True)
class BatchSplitConfig:
    global_batch_size: int
    """Samples per optimizer step; a plan never changes it."""
    micro_batch_size: int
    """Samples per forward/backward; at most global_batch_size."""

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise UserError(f"batch size {self.global_batch_size} must be at least 1")
        if self.micro_batch_size < 1:
            raise UserError(f"micro-batch size {self.micro_batch_size} must be at least 1")
        if self.micro_batch_size > self.global_batch_size:
            raise UserError(
                f"micro-batch size {self.micro_batch_size} is larger than the batch size {self.global_batch_size}; "
                "lower --micro-batch-size or raise --batch-size"
            )

    @property
    def grad_accum_steps(self) -> int:
        return math.ceil(self.global_batch_size / self.micro_batch_size)

    def sizes(self) -> list[int]:
        """Micro-batch sizes of one step, e.g. G=8, m=3 -> [3, 3, 2]."""
        full, rest = divmod(self.global_batch_size, self.micro_batch_size)
        return [self.micro_batch_size] * full + ([rest] if rest else [])


class BatchSplit(Strategy):
    """Cuts a global batch into weighted micro-batches."""

    def __init__(self, config: BatchSplitConfig) -> None:
        self.config = config

    def micro_batches(self, inputs, targets) -> Iterator[tuple[object, object, float]]:
        """Yield (inputs, targets, loss_weight) per micro-batch of the global batch.

        ``inputs`` and ``targets`` are tensors (or pytrees of tensors) whose first
        dimension is the batch; its length may be smaller than the configured
        global batch (the last batch of an epoch), weights then follow it.
        """
        total = _batch_len(targets)
        # Sliced even when one micro-batch is the whole batch: through the view the
        # cpu meter sees the host batch, as the planner's memory model counts it.
        start = 0
        while start < total:
            stop = min(start + self.config.micro_batch_size, total)
            piece = slice(start, stop)
            yield tree_map(lambda t: t[piece], inputs), tree_map(lambda t: t[piece], targets), (stop - start) / total
            start = stop


def _batch_len(tree) -> int:
    for leaf in torch.utils._pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            return leaf.shape[0]
    raise UserError("a batch holds no tensor; example_batch/datasets must return tensors")
