"""Sharding over processes: FSDP2, HSDP or DDP under torchrun, or none (one process).

``Sharding.apply`` distributes the model: ``fully_shard`` on each block, then
the root, with a ``MixedPrecisionPolicy`` from the plan's precision (FSDP2;
HSDP is FSDP2 over a two-dimensional mesh: sharded over the processes of one
node, replicated across nodes), or a ``DistributedDataParallel`` wrapper (DDP). ``gradient_sync`` tells the batch
split how to defer the gradient reduction to a step's last micro-batch.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from autofit.errors import UserError
from strategies.base import Strategy
from strategies.checkpointing import checkpoint_candidates
from strategies.precision import PRECISIONS, precision_dtype

ShardingChoice = Literal["none", "ddp", "fsdp", "hsdp"]
"""How a plan spreads over processes: the closed set the plan file, ``TrainingConfig`` and the CLI share."""
SHARDINGS: tuple[ShardingChoice, ...] = get_args(ShardingChoice)


@dataclass(kw_only=True, slots=True)
class ShardingConfig:
    """How a plan spreads over processes: the plan file's ``world_size`` and ``sharding``."""

    world_size: int = 1
    """Processes (one per GPU) that train together."""
    sharding: ShardingChoice = "none"
    """"none" (one process), "ddp" (every rank holds the whole model), "fsdp" (FSDP2: parameters,
    gradients and optimizer state divided over the ranks) or "hsdp" (FSDP2 within each node, replicated across nodes)."""
    nodes: int = 1
    """Machines the processes span, ``world_size / nodes`` on each; "hsdp" shards within one and replicates across them."""
    backend: str | None = None
    """torch.distributed backend; None picks "nccl" on CUDA and "gloo" on the CPU."""

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise UserError(f"sharding {self.sharding!r} is unknown; choose one of {', '.join(SHARDINGS)}")
        if self.world_size < 1:
            raise UserError(f"--gpus {self.world_size} must be at least 1")
        if self.world_size > 1 and self.sharding == "none":
            raise UserError(
                f"world size {self.world_size} needs a sharding; use sharding 'ddp' or 'fsdp' (or --gpus 1)"
            )
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1 or self.world_size % self.nodes:
            raise UserError(
                f"--nodes {self.nodes!r} must be a whole number of machines, at least 1, that divides the {self.world_size} "
                "processes (the same number of GPUs on each)"
            )
        if self.sharding == "hsdp" and (self.nodes < 2 or self.world_size // self.nodes < 2):
            raise UserError(
                f"sharding 'hsdp' shards within a node and replicates across nodes: it needs 2 nodes or more of 2 GPUs or "
                f"more (here {self.nodes} of {self.world_size // self.nodes}); use 'fsdp' or 'ddp'"
            )

    @property
    def per_node(self) -> int:
        """Processes on each machine."""
        return self.world_size // self.nodes

    @property
    def sharded(self) -> bool:
        """Each rank holds only a shard of the parameters, gradients and optimizer state (FSDP2, HSDP)."""
        return self.sharding in ("fsdp", "hsdp")


def mixed_precision_policy(precision: str):
    """FSDP2's policy for a plan precision: compute and all-gather in bf16/fp16, reduce gradients in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision not in PRECISIONS:
        raise UserError(f"precision {precision!r} is unknown; choose one of {', '.join(PRECISIONS)}")
    param_dtype = precision_dtype(precision)
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def fsdp_units(model: nn.Module) -> list[str]:
    """The modules FSDP2 shards as one unit each, before the root: the checkpoint candidates.

    A unit's parameters are all-gathered together right before its forward
    (and again before its backward) and freed after, so the largest unit sets
    the all-gather buffer.
    """
    return checkpoint_candidates(model)


class GradientSync:
    """When gradients are reduced across ranks; this base reduces after every backward (one process)."""

    def deferred(self) -> AbstractContextManager:
        """Context for a micro-batch whose gradients only accumulate on this rank."""
        return nullcontext()


class DDPSync(GradientSync):
    """DDP: ``no_sync()`` for every micro-batch but the last, which all-reduces the sum."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def deferred(self) -> AbstractContextManager:
        return self.model.no_sync()


class FSDPSync(GradientSync):
    """FSDP2: ``set_requires_gradient_sync(False)`` for every micro-batch but the last.

    While deferred, each unit keeps its unsharded gradients (in the reduce
    dtype, fp32) until the last micro-batch reduce-scatters their sum: one
    reduce-scatter per step instead of one per micro-batch, for gradients
    the size of the whole model on every rank meanwhile.
    ``estimate_fsdp_peak_bytes(defer_gradient_sync=...)`` counts them.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)


class Sharding(Strategy):
    """Distribute a model over the process group (nothing for one process).

    Checkpointing must already be applied: it finds blocks by name and patches
    their ``forward`` on the instance. ``fully_shard`` keeps the instance (it
    only changes its class and adds hooks around ``__call__``), so the patched
    forward still runs under ``torch.utils.checkpoint``, and the recompute in
    backward finds the parameters that FSDP2's pre-backward hook gathered.
    The optimizer must be built afterwards, over the sharded parameters.

    Args:
        config: which sharding, over how many processes.
        precision: the plan's precision; for FSDP it sets the
            ``MixedPrecisionPolicy`` (bf16/fp16 parameters in compute and
            all-gather, fp32 gradient reduction). Autocast stays the step's job.
        device: this rank's device.
        units: module names to shard one by one before the root (FSDP only);
            default ``fsdp_units(model)``.
        mesh: the ``DeviceMesh`` to shard over (FSDP only); default all ranks.
        defer_gradient_sync: reduce gradients once per step, after the last
            micro-batch (False reduces after every micro-batch).
    """

    def __init__(
        self,
        config: ShardingConfig,
        *,
        precision: str,
        device: torch.device | str,
        units: list[str] | None = None,
        mesh=None,
        defer_gradient_sync: bool = True,
    ) -> None:
        self.config = config
        self.precision = precision
        self.device = torch.device(device)
        self.units = units
        self.mesh = mesh
        self.defer_gradient_sync = defer_gradient_sync
        self.sync = GradientSync()

    @property
    def sharded(self) -> bool:
        """True when each rank holds only a shard of the gradients (FSDP2, HSDP)."""
        return self.config.sharded

    def apply(self, model: nn.Module) -> nn.Module:
        """Return the module to train: the same instance for "fsdp", "hsdp" and "none", a DDP wrapper for "ddp".

        Raises:
            UserError: no process group (not under torchrun), or an unknown unit name.
        """
        sharding = self.config.sharding
        if sharding == "none":
            return model
        import torch.distributed as dist

        if not dist.is_initialized():
            raise UserError(f"sharding {sharding!r} needs torchrun; start training with `torchrun --nproc-per-node N -m autofit train ...`")
        if sharding == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            wrapped = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
            self.sync = DDPSync(wrapped) if self.defer_gradient_sync else GradientSync()
            return wrapped
        self._fully_shard(model)
        self.sync = FSDPSync(model) if self.defer_gradient_sync else GradientSync()
        return model

    def _fully_shard(self, model: nn.Module) -> None:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        mesh = self.mesh or self._mesh()
        # Each rank keeps its slice of its own tensors: they must start equal, as
        # DDP makes them by broadcasting from rank 0 (a model built without a seed differs per rank).
        _broadcast_from_rank0(model, group=mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD)
        policy = mixed_precision_policy(self.precision)
        names = fsdp_units(model) if self.units is None else list(self.units)
        modules = dict(model.named_modules())
        unknown = [name for name in names if name not in modules or name == ""]
        if unknown:
            raise UserError(f"FSDP unit(s) {', '.join(unknown)} not found in the model; use names from `autofit probe --list-blocks`")
        # Blocks first, then the root: fully_shard groups the parameters not yet
        # claimed by a unit below, so the root keeps only embeddings, norms, heads.
        for name in names:
            fully_shard(modules[name], mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)

    def _mesh(self):
        """Every rank in one dimension (FSDP2); for HSDP nodes x processes per node, replicated over the first
        dimension and sharded over the second (torchrun numbers a node's processes consecutively)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if self.config.sharding == "hsdp":
            if dist.get_world_size() != self.config.world_size:
                raise UserError(f"the plan is for {self.config.world_size} processes but {dist.get_world_size()} joined")
            return init_device_mesh(
                self.device.type, (self.config.nodes, self.config.per_node), mesh_dim_names=("replicate", "shard"),
            )
        return init_device_mesh(self.device.type, (dist.get_world_size(),))


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module, *, group) -> None:
    import torch.distributed as dist

    if dist.get_backend(group) == "fake":  # the simulation: no data to send
        return
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside a DDP wrapper (the model itself otherwise): its names, its fingerprint."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model
