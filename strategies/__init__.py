"""One module per strategy; each changes the model or the step, never the loop.

The protocol is small (see ``base.Strategy``): ``apply(model)`` rewrites the
model, ``forward_context()`` wraps each micro-batch's forward; precision adds
``backward`` and ``optimizer_step``, the batch split ``micro_batches``. "Off"
is an object whose hooks do nothing, never a branch in the loop. Only
``autofit.apply.apply_config`` constructs strategies.
"""
from strategies.base import Strategy
from strategies.batch_split import BatchSplit, BatchSplitConfig, micro_batch_count, rank_slice
from strategies.checkpointing import CheckpointConfig, Checkpointing, checkpoint_candidates
from strategies.precision import PRECISIONS, Precision, PrecisionConfig, precision_dtype
from strategies.sharding import SHARDINGS, Sharding, ShardingConfig, unwrap_model

__all__ = [
    "BatchSplit",
    "BatchSplitConfig",
    "CheckpointConfig",
    "Checkpointing",
    "PRECISIONS",
    "Precision",
    "PrecisionConfig",
    "SHARDINGS",
    "Sharding",
    "ShardingConfig",
    "Strategy",
    "checkpoint_candidates",
    "micro_batch_count",
    "precision_dtype",
    "rank_slice",
    "unwrap_model",
]
