"""One module per strategy; each changes the model or the step, never the loop.

The protocol is small (see ``base.Strategy``): ``apply(model)`` rewrites the
model in place, the hooks shape one training step. "Off" is an object whose
hooks do nothing, never a branch in the loop.
"""
from strategies.base import Strategy
from strategies.batch_split import BatchSplit, BatchSplitConfig
from strategies.checkpointing import Checkpointing, CheckpointConfig, checkpoint_candidates, checkpoint_granularities
from strategies.precision import PRECISIONS, Precision, PrecisionConfig

__all__ = [
    "BatchSplit",
    "BatchSplitConfig",
    "CheckpointConfig",
    "Checkpointing",
    "PRECISIONS",
    "Precision",
    "PrecisionConfig",
    "Strategy",
    "checkpoint_candidates",
    "checkpoint_granularities",
]
