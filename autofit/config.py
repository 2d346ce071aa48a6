"""``TrainingConfig``: one point of the search space, every strategy's choice for one model.

It is the only spelling of a configuration: the planner searches these and
keys its measurements by them, the probe measures one, ``compare`` lists its
rows as them, a plan file holds one (``Plan.config``) and ``apply_config``
builds the strategies from one. Values that follow from the choices (the
accumulation steps, whether the optimizer step in backward can run) are
computed here and nowhere else. It is frozen: a change while training (a
smaller micro-batch after an out-of-memory error) is a new configuration.

Example:
    >>> config = TrainingConfig(global_batch_size=64, micro_batch_size=16, precision="bf16")
    >>> config.grad_accum_steps
    4
    >>> config.with_micro_batch(8).grad_accum_steps
    8
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from autofit.errors import UserError
from autofit.keywords import for_caller
from strategies.batch_split import BatchSplitConfig, micro_batch_count
from strategies.optimizer_state import OptimizerStateChoice, OptimizerStateConfig
from strategies.precision import MASTER_WEIGHTS, PRECISIONS, PURE_BF16, PrecisionChoice, PrecisionConfig
from strategies.sharding import ShardingChoice, ShardingConfig

__all__ = [
    "BLOCK_MODES", "DeviceChoice", "MAX_LOSS_CHUNKS", "OptimizerStateChoice", "PrecisionChoice", "ShardingChoice",
    "TrainingConfig", "WeightsDtypeChoice", "block_names", "step_in_backward_refusal",
]

DeviceChoice = Literal["cpu", "cuda"]
"""The device a plan is for (``--device``)."""
WeightsDtypeChoice = Literal["fp32", "config"]
"""The weights' dtype on the device (``--weights-dtype``): fp32 whatever the model's config names, or the config's."""

MAX_LOSS_CHUNKS = 1024
"""The most chunks a loss may be cut into (more only adds per-chunk overhead)."""

BLOCK_MODES = ("checkpoint", "selective_checkpoint", "offload")
"""The fields that name blocks; a block is in at most one of them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingConfig:
    """Every strategy's choice for one model, and what follows from them."""

    global_batch_size: int
    """Samples per optimizer step over all processes; a plan never changes it."""
    micro_batch_size: int
    """Samples per forward/backward in one process."""
    precision: PrecisionChoice = "fp32"
    """"fp32", "bf16" (autocast), "fp16" (autocast + GradScaler), "bf16-master" (bf16 weights on the device, their fp32
    master and the optimizer's state on the host) or "bf16-pure" (bf16 weights and state, stochastic rounding; lossy)."""
    checkpoint: tuple[str, ...] = ()
    """Block names whose whole forward recomputes in backward (("all",) for every candidate)."""
    selective_checkpoint: tuple[str, ...] = ()
    """Block names that keep their matmul, convolution and attention outputs and recompute the rest
    in backward (("all",) for every candidate)."""
    offload: tuple[str, ...] = ()
    """Block names whose saved activations wait in host memory between forward and backward (("all",))."""
    optimizer_in_backward: bool = False
    """Step each parameter as soon as backward has its gradient, so gradients never all exist at
    once. Needs one micro-batch per step, one process, and no fp16 (``step_in_backward_refusal``)."""
    optimizer_state: OptimizerStateChoice = "device"
    """Where the optimizer's state lives: "device", "host" (update on the host; a GPU lever: on the
    CPU its host tensors are counted apart as host bytes) or "8bit" (torchao's 8-bit AdamW; lossy,
    a declared choice)."""
    sharding: ShardingChoice = "none"
    """"none", "ddp", "fsdp" or "hsdp" (``strategies.sharding``)."""
    world_size: int = 1
    """Processes training together."""
    nodes: int = 1
    """Machines the processes span (``world_size / nodes`` GPUs each); "hsdp" shards within a node, replicates across."""
    loss_chunks: int = 1
    """Chunks of tokens a causal language model's output layer and loss run over, each recomputed in backward, so
    that its whole logits never exist (``strategies.chunked_loss``); 1: the model's own forward. Same loss."""
    compile: bool = False
    """``torch.compile`` the model (``strategies.compile``): a speed choice, the same arithmetic to rounding. The planner
    sets it only where it measured the compiled step to fit and to be faster; one process only."""
    frozen_nf4: bool = False
    """Frozen linear weights (an adapter's base) held in 4-bit NF4 and dequantized per product
    (``strategies.frozen_nf4``, torchao; QLoRA): lossy for those weights, a declared choice; one process only."""
    max_grad_norm: float | None = None
    """Clip the global norm of the step's gradients (all micro-batches', over every rank's shards) to this before
    the optimizer steps (``torch.nn.utils.clip_grad_norm_``); None clips nothing. A training choice, not a memory
    lever: it rules out the step in backward, which steps each parameter before the global norm is known."""

    def __post_init__(self) -> None:
        try:
            self._check()
        except UserError as error:  # built in Python, the caller passed keywords: its error names them (``for_caller``)
            error.args = (for_caller(str(error)),)
            raise

    def _check(self) -> None:
        """Hold the block names as tuples and refuse impossible values, one line each (in the command line's flags)."""
        for mode in BLOCK_MODES:  # "all", "a,b" or a list, as flags and files give them: held as a tuple
            names = block_names(getattr(self, mode))
            if "" in names or len(set(names)) < len(names):
                flag = "--" + mode.replace("_", "-")
                raise UserError(
                    f"{flag} {','.join(names)!r} names a block {'twice' if '' not in names else 'with no name'}; "
                    "give distinct block names, 'all' or 'none'"
                )
            object.__setattr__(self, mode, names)
        # Each strategy's own config refuses its impossible values, one line each; what is impossible only
        # together is refused below.
        BatchSplitConfig(global_batch_size=self.global_batch_size, micro_batch_size=self.micro_batch_size)
        PrecisionConfig(precision=self.precision)
        OptimizerStateConfig(optimizer_state=self.optimizer_state)
        self.sharding_config()
        if isinstance(self.loss_chunks, bool) or not isinstance(self.loss_chunks, int) or not 1 <= self.loss_chunks <= MAX_LOSS_CHUNKS:
            raise UserError(
                f"--loss-chunks {self.loss_chunks!r} must be a whole number from 1 (no chunking) to {MAX_LOSS_CHUNKS}, e.g. 8"
            )
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise UserError(f"--max-grad-norm {self.max_grad_norm} must be a positive finite number, e.g. 1.0 (or left out: no clipping)")
        if self.optimizer_in_backward:
            refusal = step_in_backward_refusal(
                precision=self.precision, global_batch_size=self.global_batch_size,
                micro_batch_size=self.micro_batch_size, world_size=self.world_size, max_grad_norm=self.max_grad_norm,
            )
            if refusal:
                raise UserError(f"optimizer step in backward {refusal}")
        if self.precision == MASTER_WEIGHTS and (self.optimizer_state != "device" or self.world_size > 1):
            raise UserError(
                f"precision {MASTER_WEIGHTS} keeps the fp32 master and the optimizer's state on the host itself, on one "
                f"process: leave --optimizer-state at device and train on one GPU (or choose bf16 for "
                f"{'--gpus' if self.world_size > 1 else '--optimizer-state ' + self.optimizer_state})"
            )
        if self.precision == PURE_BF16 and (self.optimizer_state == "host" or self.world_size > 1):
            raise UserError(
                f"precision {PURE_BF16} keeps its bf16 weights and state on the one device: leave --optimizer-state at "
                "device (or 8bit) and train on one GPU, or choose bf16-master"
            )
        if self.compile and self.world_size > 1:
            raise UserError(
                "compile on several processes has not been measured (DDP and FSDP2 compile differently); "
                "leave compile off in the plan, or train on one process"
            )
        if self.frozen_nf4 and self.world_size > 1:
            raise UserError(
                "frozen weights in NF4 run on one process only (their sharding has not been measured); "
                "leave them dense in the plan, or train on one process"
            )
        if self.world_size > 1 and self.optimizer_state == "host":
            raise UserError(
                "optimizer state on the host runs on one process only (DDP and FSDP reduce gradients after it would "
                "step); turn it off or train on one GPU"
            )

    def sharding_config(self) -> ShardingConfig:
        """How the processes share the model (``strategies.sharding``)."""
        return ShardingConfig(world_size=self.world_size, sharding=self.sharding, nodes=self.nodes)

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step in each process: ceil(ceil(global / world_size) / micro)."""
        return micro_batch_count(self.global_batch_size, world_size=self.world_size, micro_batch_size=self.micro_batch_size)

    @property
    def updates_on_host(self) -> bool:
        """Whether the optimizer's update runs on the host: with its state there, or with bf16-master's fp32 masters."""
        return self.optimizer_state == "host" or self.precision == MASTER_WEIGHTS

    @property
    def rank_batch_size(self) -> int:
        """Samples the largest process's share of a global batch holds: ceil(global / world_size)."""
        return math.ceil(self.global_batch_size / self.world_size)

    def with_micro_batch(self, micro_batch_size: int) -> TrainingConfig:
        """The same choices at another micro-batch size (the global batch stays)."""
        return dataclasses.replace(self, micro_batch_size=micro_batch_size)

    def rank_share(self) -> TrainingConfig:
        """One process training the largest rank's share of the global batch: how a plan for several processes is
        measured (itself for one process)."""
        share = self.rank_batch_size
        return dataclasses.replace(
            self, global_batch_size=share, micro_batch_size=min(self.micro_batch_size, share), sharding="none", world_size=1,
            nodes=1,
        )

    def key(self) -> str:
        """"fp32:4:layers.0,layers.1", and ":layers.2" after it for selective blocks, then the levers (and "compile").

        The planner keys its measurements by it, for one global batch on one
        process: a configuration without selective blocks or levers keeps the
        key it always had, so stored measurements stay found.
        """
        key = f"{self.precision}:{self.micro_batch_size}:{','.join(self.checkpoint)}"
        levers = ";".join(filter(None, [self.levers(), "compile" if self.compile else ""]))
        if self.selective_checkpoint or levers:
            key = f"{key}:{','.join(self.selective_checkpoint)}"
        return f"{key}:{levers}" if levers else key

    def levers(self) -> str:
        """"offload=a,b;step-in-backward;state=host;loss-chunks=8;base=nf4", the levers on ("" for none)."""
        parts = [f"offload={','.join(self.offload)}"] if self.offload else []
        parts += ["step-in-backward"] if self.optimizer_in_backward else []
        parts += [f"state={self.optimizer_state}"] if self.optimizer_state != "device" else []
        parts += [f"loss-chunks={self.loss_chunks}"] if self.loss_chunks != 1 else []
        parts += ["base=nf4"] if self.frozen_nf4 else []
        return ";".join(parts)

    def simplicity(self) -> tuple:
        """Order for ties: fewer micro-steps, fewer checkpointed or offloaded blocks, fewer levers, fp32 before autocast,
        uncompiled before compiled."""
        return (
            self.grad_accum_steps,
            len(self.checkpoint) + len(self.selective_checkpoint) + len(self.offload),
            int(self.optimizer_in_backward) + int(self.optimizer_state != "device") + int(self.loss_chunks != 1)
            + int(self.frozen_nf4),
            PRECISIONS.index(self.precision),
            int(self.compile),
        )


def step_in_backward_refusal(
    *, precision: str, global_batch_size: int, micro_batch_size: int, world_size: int, max_grad_norm: float | None = None,
) -> str | None:
    """Why the optimizer step in backward cannot run with these, as the rest of a sentence; None when it can.

    The one place that says when: a configuration refuses itself by it, the
    plan file names the field by it, and the search offers the lever by it.
    """
    if max_grad_norm is not None:
        return (
            f"cannot clip gradients (--max-grad-norm {max_grad_norm:g}): each parameter steps before the norm over all "
            "gradients is known; drop --max-grad-norm or turn the step in backward off"
        )
    if precision == PURE_BF16:
        return f"cannot run with {PURE_BF16} (one optimizer per parameter is not torchao's); use bf16, or turn it off"
    if precision == MASTER_WEIGHTS:
        return (
            f"cannot run with {MASTER_WEIGHTS}: its fp32 masters step on the host after backward; use bf16 or fp32, "
            "or turn the step in backward off"
        )
    if precision == "fp16":
        return (
            "cannot run with fp16: its GradScaler must see every gradient for inf/nan before any parameter steps; "
            "use bf16 or fp32, or turn the step in backward off"
        )
    if world_size > 1:
        return "runs on one process only (DDP and FSDP reduce gradients after it would step); turn it off or train on one GPU"
    steps = micro_batch_count(global_batch_size, world_size=world_size, micro_batch_size=micro_batch_size)
    if steps > 1:
        return (
            f"needs one micro-batch per optimizer step, but micro-batch {micro_batch_size} of batch {global_batch_size} "
            f"makes {steps}; use micro-batch {global_batch_size} or turn it off"
        )
    return None


def block_names(spec: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Blocks as a flag or a file names them ("all", "none", "a,b" or a list) as a tuple: ("all",), (), ("a", "b")."""
    if spec is None:
        return ()
    if isinstance(spec, str):
        spec = [name.strip() for name in spec.split(",")] if spec != "none" else []
    return tuple(spec)
