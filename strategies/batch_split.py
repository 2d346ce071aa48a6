"""Batch split: a global batch G cut over the ranks, then into micro-batches of at most m on each.

One process is rank 0 of 1. Each rank takes its contiguous slice of the
global batch (``rank_slice``) and cuts it into micro-batches. A micro-batch
of ``s`` samples gets loss weight ``world_size * s / G``; DDP and FSDP average
gradients over the ranks, so one optimizer step sees exactly the gradient of
the mean loss over all G samples, also when m or the rank count does not
divide G (e.g. 8 = 3 + 3 + 2 on one process). For a loss that averages over
other items (tokens that are not padding), ``count`` counts them and the
weights are ``world_size * items / items of the global batch`` instead.

Inputs and targets may be tensors or pytrees of them (a tuple, a dict of
``input_ids`` and ``attention_mask``; targets may be None when the labels
ride with the inputs): every tensor leaf is sliced along its first dimension,
and a ``model_io.Samples`` list (one entry per sample) by entry.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

from autofit.errors import UserError
from autofit.model_io import batch_size_of, sliced
from strategies.base import Strategy
from strategies.sharding import GradientSync


@dataclass(kw_only=True, slots=True)
class BatchSplitConfig:
    global_batch_size: int
    """Samples per optimizer step over all ranks; a plan never changes it."""
    micro_batch_size: int
    """Samples per forward/backward on one rank; at most global_batch_size."""

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
        """Micro-batches per step on one process."""
        return micro_batch_count(self.global_batch_size, world_size=1, micro_batch_size=self.micro_batch_size)

    def sizes(self) -> list[int]:
        """Micro-batch sizes of one step on one process, e.g. G=8, m=3 -> [3, 3, 2]."""
        return [size for size, count in self.size_counts() for _ in range(count)]

    def size_counts(self) -> list[tuple[int, int]]:
        """The micro-batch sizes of one step with how many of each, at most two pairs: G=8, m=3 -> [(3, 2), (2, 1)].

        Costs summed over a step's micro-batches use these, so a batch of a billion samples costs two terms, not a
        billion.
        """
        full, rest = divmod(self.global_batch_size, self.micro_batch_size)
        return [(self.micro_batch_size, full)] + ([(rest, 1)] if rest else [])

    @property
    def last_size(self) -> int:
        """The size of a step's last micro-batch, which the optimizer step follows."""
        return self.global_batch_size % self.micro_batch_size or self.micro_batch_size


def rank_slice(batch_len: int, *, rank: int, world_size: int) -> slice:
    """This rank's contiguous share of a global batch of ``batch_len`` samples.

    The first ``batch_len % world_size`` ranks take one sample more, e.g.
    7 samples on 2 ranks: [0:4] and [4:7].
    """
    base, extra = divmod(batch_len, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def micro_batch_count(batch_len: int, *, world_size: int, micro_batch_size: int) -> int:
    """Micro-batches each rank runs for a global batch of ``batch_len``: set by the largest rank share."""
    largest_share = -(-batch_len // world_size)
    return max(1, -(-largest_share // micro_batch_size))


class BatchSplit(Strategy):
    """Cuts a global batch into this rank's weighted micro-batches.

    Every rank runs the same number of micro-batches (FSDP gathers parameters
    in each forward, a collective all ranks must join). A rank that has fewer
    samples (G not divisible, or a short last batch of an epoch) pads with a
    one-sample micro-batch of weight 0: it runs, and adds nothing to the
    gradient (a BatchNorm's running statistics do see that sample).

    Gradient reduction is deferred (``sync.deferred()``) on every micro-batch
    but the last, so a step communicates once.

    Args:
        config: the global batch and the per-rank micro-batch size.
        rank: this process's rank.
        world_size: processes training together.
        sync: when gradients are reduced (``Sharding.sync``); one process has nothing to defer.
    """

    def __init__(self, config: BatchSplitConfig, *, rank: int = 0, world_size: int = 1, sync: GradientSync | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.sync = sync or GradientSync()

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per step on every rank, for a full global batch."""
        return micro_batch_count(
            self.config.global_batch_size, world_size=self.world_size, micro_batch_size=self.config.micro_batch_size
        )

    def micro_batches(self, inputs, targets, *, count: Callable | None = None) -> Iterator[tuple[object, object, float]]:
        """Yield (inputs, targets, loss_weight) for this rank's micro-batches of one global batch.

        ``inputs`` and ``targets`` are the whole global batch (tensors or pytrees
        of tensors whose first dimension is the batch; every rank gets the same
        one); its length may be smaller than the configured global batch (the
        last batch of an epoch), weights then follow it. Micro-batches are
        views, also when one micro-batch is the whole batch: through the view
        the cpu meter sees the host batch, as the planner's memory model counts it.

        Args:
            count: ``(inputs, targets) -> items`` the loss averages over (``Loss.count``);
                None weights by samples.
        """
        total = batch_size_of(inputs, targets)
        share = rank_slice(total, rank=self.rank, world_size=self.world_size)
        steps = micro_batch_count(total, world_size=self.world_size, micro_batch_size=self.config.micro_batch_size)
        # Every rank sees the whole global batch, so each knows the total without communicating.
        total_items = count(inputs, targets) if count is not None else None
        pieces = []
        start = share.start
        for _ in range(steps):
            stop = min(start + self.config.micro_batch_size, share.stop)
            if stop > start:
                pieces.append((slice(start, stop), self.world_size * (stop - start) / total))
            else:
                # A rank with fewer samples still joins every forward's collectives.
                pieces.append((slice(0, 1), 0.0))
            start = stop
        for index, (piece, weight) in enumerate(pieces):
            context = nullcontext() if index == len(pieces) - 1 else self.sync.deferred()
            micro_inputs, micro_targets = sliced(inputs, piece), sliced(targets, piece)
            if total_items is not None and weight:
                weight = self.world_size * count(micro_inputs, micro_targets) / total_items if total_items else 0.0
            # The caller's forward and backward of this micro-batch run while the
            # generator waits here, so they run inside the context.
            with context:
                yield micro_inputs, micro_targets, weight
