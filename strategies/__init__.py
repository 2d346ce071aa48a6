"""One module per strategy; each changes the model or the step, never the loop.

The protocol is small (see ``base.Strategy``): ``apply(model)`` rewrites the
model, ``forward_context()`` wraps each micro-batch's forward,
``wrap_optimizer_builder(build)`` shapes the optimizer (where its state lives,
when it steps); precision adds ``backward`` and ``optimizer_step``, the batch
split ``micro_batches``. "Off" is an object whose hooks do nothing, never a
branch in the loop. Only ``autofit.apply.apply_config`` constructs strategies,
from an ``autofit.config.TrainingConfig``, which refuses choices that cannot
train together.
"""
from strategies.base import Strategy
from strategies.batch_split import BatchSplit, BatchSplitConfig, micro_batch_count, rank_slice
from strategies.chunked_loss import DEFAULT_LOSS_CHUNKS, ChunkedLoss, ChunkedLossConfig, chunkable
from strategies.clipping import ClippingConfig, GradientClipping
from strategies.compile import Compile, CompileConfig
from strategies.frozen_nf4 import FrozenNF4, FrozenNF4Config, nf4_weights
from strategies.checkpointing import (
    CheckpointConfig,
    Checkpointing,
    changed_in_place,
    check_one_mode_per_block,
    checkpoint_candidates,
    checkpoint_granularities,
    resolve_blocks,
    selective_saves,
)
from strategies.offload import ActivationOffload, OffloadConfig
from strategies.optimizer_in_backward import OptimizerInBackward, OptimizerInBackwardConfig, StepInBackward
from strategies.optimizer_state import OPTIMIZER_STATES, HostOptimizer, OptimizerState, OptimizerStateConfig, stepped_parameters
from strategies.precision import MASTER_WEIGHTS, PRECISIONS, PURE_BF16, Precision, PrecisionConfig, precision_dtype
from strategies.sharding import SHARDINGS, Sharding, ShardingConfig, unwrap_model

__all__ = [
    "ActivationOffload",
    "BatchSplit",
    "BatchSplitConfig",
    "CheckpointConfig",
    "ChunkedLoss",
    "ChunkedLossConfig",
    "DEFAULT_LOSS_CHUNKS",
    "ClippingConfig",
    "Compile",
    "CompileConfig",
    "FrozenNF4",
    "FrozenNF4Config",
    "GradientClipping",
    "Checkpointing",
    "HostOptimizer",
    "stepped_parameters",
    "MASTER_WEIGHTS",
    "PURE_BF16",
    "OPTIMIZER_STATES",
    "OffloadConfig",
    "OptimizerInBackward",
    "OptimizerInBackwardConfig",
    "OptimizerState",
    "OptimizerStateConfig",
    "PRECISIONS",
    "Precision",
    "PrecisionConfig",
    "SHARDINGS",
    "Sharding",
    "nf4_weights",
    "ShardingConfig",
    "StepInBackward",
    "Strategy",
    "check_one_mode_per_block",
    "checkpoint_candidates",
    "chunkable",
    "checkpoint_granularities",
    "micro_batch_count",
    "precision_dtype",
    "rank_slice",
    "resolve_blocks",
    "selective_saves",
    "changed_in_place",
    "unwrap_model",
]
