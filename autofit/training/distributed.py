"""Training one plan on several processes: FSDP2 or DDP under torchrun.

The pieces the shared loop calls when a plan has ``world_size > 1``:

- ``init_distributed()`` reads torchrun's environment and joins the process
  group (gloo on the CPU, NCCL on CUDA); outside torchrun it is a no-op.
- ``shard_model(model, ...)`` applies FSDP2 (``fully_shard`` on each block,
  then the root, with a ``MixedPrecisionPolicy`` from the plan's precision)
  or wraps the model in ``DistributedDataParallel``.
- ``RankSplit`` gives each rank its slice of every global batch as weighted
  micro-batches, so that the gradient the ranks average equals the gradient
  of the mean loss over the whole global batch, and defers the gradient
  reduction to the last micro-batch (``no_sync`` / ``set_requires_gradient_sync``).
  It has ``BatchSplit``'s interface, so ``autofit.training.step.train_step`` runs it
  unchanged.
- ``save_sharded_checkpoint`` / ``load_sharded_checkpoint`` write and read
  model and optimizer with ``torch.distributed.checkpoint`` (each rank its
  shards); ``full_model_state_dict`` gathers plain weights for best.pt.
- ``simulate_fsdp_peak_bytes`` runs FSDP2 in one process on a fake process
  group over fake tensors: one rank's peak without N devices (what a plan
  should record); ``estimate_fsdp_peak_bytes`` is a quick conservative
  formula for searching; ``ShardAwareTracker`` measures a real rank on the CPU.

Example (run with ``torchrun --nproc-per-node 2 script.py``)::

    env = init_distributed(device_type="cpu")
    model = Checkpointing(CheckpointConfig(blocks=plan.checkpoint)).apply(model).to(env.device)
    model = shard_model(model, sharding="fsdp", precision="bf16", device=env.device)
    optimizer = torch.optim.AdamW(model.parameters())
    split = RankSplit(BatchSplitConfig(global_batch_size=64, micro_batch_size=8),
                      rank=env.rank, world_size=env.world_size, sync=gradient_sync(model, sharding="fsdp"))
    precision = sharded_precision("bf16", sharding="fsdp", device_type=env.device.type)
    result = train_step(model, inputs, targets, loss_fn=loss_fn, optimizer=optimizer,
                        precision=precision, split=split, device=env.device)
    loss = mean_across_ranks(result.loss)       # the global batch's mean loss, on every rank
    cleanup()
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from autofit._torch_private import tree_map
from autofit.errors import UserError
from autofit.measure.tracker import StorageTracker
from strategies.base import Strategy
from strategies.batch_split import BatchSplitConfig
from strategies.checkpointing import checkpoint_candidates

SHARDINGS = ("none", "ddp", "fsdp")
_PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(kw_only=True, slots=True)
class DistributedConfig:
    """How a plan spreads over processes; the plan file's ``world_size`` and ``sharding``."""

    world_size: int = 1
    """Processes (one per GPU) that train together."""
    sharding: str = "none"
    """"none" (one process), "ddp" (every rank holds the whole model) or "fsdp" (FSDP2: parameters,
    gradients and optimizer state divided over the ranks)."""
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


def default_backend(device_type: str) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device_type == "cuda" else "gloo"


# ----------------------------------------------------------------------------------------------
# Processes
# ----------------------------------------------------------------------------------------------


class DistributedEnv(NamedTuple):
    """This process's place among the training processes."""

    rank: int
    world_size: int
    local_rank: int
    """Rank on this machine: the GPU index it trains on."""
    device: torch.device


def launched_world_size() -> int:
    """Processes torchrun started (its WORLD_SIZE); 1 when not started by torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(*, device_type: str = "cpu", backend: str | None = None) -> DistributedEnv:
    """Join the process group torchrun set up, and pick this rank's device.

    Outside torchrun (no RANK/WORLD_SIZE in the environment) nothing is
    initialised and the result is rank 0 of 1.

    Args:
        device_type: "cpu" or "cuda"; on CUDA each rank trains on GPU ``LOCAL_RANK``.
        backend: None picks NCCL on CUDA and gloo on the CPU.

    Returns:
        ``DistributedEnv(rank, world_size, local_rank, device)``.

    Raises:
        UserError: CUDA was asked for but this rank has no GPU of its own.
    """
    import torch.distributed as dist

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        return DistributedEnv(rank=0, world_size=1, local_rank=0, device=device)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"rank {rank} wants GPU {local_rank} but this machine shows {torch.cuda.device_count()}; "
                f"start at most {torch.cuda.device_count()} processes per node (--nproc-per-node)"
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend or default_backend(device.type), device_id=device if device.type == "cuda" else None)
    return DistributedEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def is_rank0() -> bool:
    """True in the process that logs, prints and writes single files (also when not distributed)."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    """Wait for every rank (a no-op when not distributed)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def cleanup() -> None:
    """Wait for every rank, then leave the process group (a no-op when not distributed).

    The barrier keeps a rank that finished first from closing its connections
    while another still talks to it (gloo then aborts the other process).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def torchrun_command(*, world_size: int, args: list[str]) -> str:
    """The command line that starts ``autofit ARGS`` on ``world_size`` processes of this machine."""
    return " ".join(["torchrun", f"--nproc-per-node {world_size}", "-m autofit", *map(shlex.quote, args)])


def check_launch(config: DistributedConfig, *, args: list[str] | None = None) -> None:
    """Refuse to train a plan on another number of processes than it was made for.

    Args:
        config: the plan's world size and sharding.
        args: the ``autofit`` arguments to repeat in the suggested torchrun
            command (default: this process's ``sys.argv[1:]``).

    Raises:
        UserError: naming the torchrun command to use (or the re-plan to make).
    """
    launched = launched_world_size()
    if launched == config.world_size:
        return
    args = list(sys.argv[1:] if args is None else args)
    if config.world_size > 1 and launched == 1:
        raise UserError(
            f"this plan trains on {config.world_size} processes ({config.sharding}); start it with: "
            f"{torchrun_command(world_size=config.world_size, args=args)}"
        )
    raise UserError(
        f"this plan is for {config.world_size} process(es) but torchrun started {launched}; use "
        f"--nproc-per-node {config.world_size}, or re-plan with `autofit plan ... --gpus {launched}`"
    )


def mean_across_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of ``value`` over the ranks (a collective: every rank must call it).

    With ``RankSplit``'s weights, each rank's step loss is ``world_size / G``
    times its samples' summed loss, so this mean is the mean loss over all
    G samples of the global batch.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    summed = value.detach().clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)  # gloo has no AVG
    return summed / dist.get_world_size()


def sum_across_ranks(value: torch.Tensor) -> torch.Tensor:
    """The sum of ``value`` over the ranks (a collective; ``value`` itself on one process)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    summed = value.detach().clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    return summed


def same_on_all_ranks(value):
    """Rank 0's ``value`` on every rank (a collective; ``value`` itself on one process), e.g. a folder name made from the time."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def any_rank(flag: bool, *, device: torch.device | str) -> bool:
    """True when ``flag`` is set on any rank (a collective on several processes), so that all stop together.

    Args:
        device: this rank's device (NCCL reduces tensors on the GPU only).
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    return bool(sum_across_ranks(torch.tensor([float(flag)], device=device)).item() > 0)


# ----------------------------------------------------------------------------------------------
# Sharding the model
# ----------------------------------------------------------------------------------------------


def mixed_precision_policy(precision: str):
    """FSDP2's policy for a plan precision: compute and all-gather in bf16/fp16, reduce gradients in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision not in _PARAM_DTYPES:
        raise UserError(f"precision {precision!r} is unknown; choose one of {', '.join(_PARAM_DTYPES)}")
    param_dtype = _PARAM_DTYPES[precision]
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


def shard_model(
    model: nn.Module,
    *,
    sharding: str,
    precision: str,
    device: torch.device | str,
    units: list[str] | None = None,
    mesh=None,
) -> nn.Module:
    """Distribute ``model`` over the process group.

    Checkpointing must already be applied: it finds blocks by name and patches
    their ``forward`` on the instance. ``fully_shard`` keeps the instance (it
    only changes its class and adds hooks around ``__call__``), so the patched
    forward still runs under ``torch.utils.checkpoint``, and the recompute in
    backward finds the parameters that FSDP2's pre-backward hook gathered.
    The optimizer must be built afterwards, over the sharded parameters.

    Args:
        model: on ``device`` already.
        sharding: "none" (returned unchanged), "ddp" or "fsdp".
        precision: the plan's precision; for "fsdp" it sets the
            ``MixedPrecisionPolicy`` (bf16/fp16 parameters in compute and
            all-gather, fp32 gradient reduction). Autocast stays the step's job.
        device: this rank's device.
        units: module names to shard one by one before the root (FSDP only);
            default ``fsdp_units(model)``.
        mesh: the ``DeviceMesh`` to shard over (FSDP only); default all ranks.

    Returns:
        The module to train: the same instance for "fsdp" and "none", a
        ``DistributedDataParallel`` wrapper for "ddp" (``unwrap_model`` gives
        the model back, with its own parameter names).

    Raises:
        UserError: an unknown sharding or unit name.
    """
    if sharding not in SHARDINGS:
        raise UserError(f"sharding {sharding!r} is unknown; choose one of {', '.join(SHARDINGS)}")
    if sharding == "none":
        return model
    import torch.distributed as dist

    if not dist.is_initialized():
        raise UserError(f"sharding {sharding!r} needs torchrun; start training with `torchrun --nproc-per-node N -m autofit train ...`")
    device = torch.device(device)
    if sharding == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = mesh or init_device_mesh(device.type, (dist.get_world_size(),))
    # Each rank keeps its slice of its own tensors: they must start equal, as
    # DDP makes them by broadcasting from rank 0 (a model built without a seed differs per rank).
    _broadcast_from_rank0(model, group=mesh.get_group())
    policy = mixed_precision_policy(precision)
    names = fsdp_units(model) if units is None else list(units)
    modules = dict(model.named_modules())
    unknown = [name for name in names if name not in modules or name == ""]
    if unknown:
        raise UserError(f"FSDP unit(s) {', '.join(unknown)} not found in the model; use names from `autofit probe --list-blocks`")
    # Blocks first, then the root: fully_shard groups the parameters not yet
    # claimed by a unit below, so the root keeps only embeddings, norms, heads.
    for name in names:
        fully_shard(modules[name], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


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


# ----------------------------------------------------------------------------------------------
# Gradient synchronisation during accumulation
# ----------------------------------------------------------------------------------------------


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


def gradient_sync(model: nn.Module, *, sharding: str) -> GradientSync:
    """The gradient-sync object for a model returned by ``shard_model``."""
    if sharding == "ddp":
        return DDPSync(model)
    if sharding == "fsdp":
        return FSDPSync(model)
    return GradientSync()


# ----------------------------------------------------------------------------------------------
# Rank-local batch split
# ----------------------------------------------------------------------------------------------


def rank_slice(batch_len: int, *, rank: int, world_size: int) -> slice:
    """This rank's contiguous share of a global batch of ``batch_len`` samples.

    The first ``batch_len % world_size`` ranks take one sample more, e.g.
    7 samples on 2 ranks: [0:4] and [4:7].
    """
    base, extra = divmod(batch_len, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


class RankSplit(Strategy):
    """A global batch cut over ranks, then into weighted micro-batches on each rank.

    Each rank takes its contiguous slice of the global batch (``rank_slice``)
    and cuts it into micro-batches of at most ``micro_batch_size``. A
    micro-batch of ``s`` samples gets loss weight ``world_size * s / G`` (G:
    samples in this global batch). DDP and FSDP average gradients over the
    ranks, so the reduced gradient is ``sum(s / G * grad of micro mean loss)``
    over all micro-batches of all ranks: exactly the gradient of the mean loss
    over the G samples, also when G does not divide evenly.

    Every rank runs the same number of micro-batches (FSDP gathers parameters
    in each forward, a collective all ranks must join). A rank that has fewer
    samples (G not divisible, or a short last batch of an epoch) pads with a
    one-sample micro-batch of weight 0: it runs, and adds nothing to the
    gradient (a BatchNorm's running statistics do see that sample).

    Gradient reduction is deferred (``sync.deferred()``) on every micro-batch
    but the last, so a step communicates once.

    Args:
        config: the plan's global batch and per-rank micro-batch size.
        rank: this process's rank.
        world_size: processes training together.
        sync: ``gradient_sync(model, sharding=...)``.
    """

    def __init__(self, config: BatchSplitConfig, *, rank: int, world_size: int, sync: GradientSync) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.sync = sync

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per step on every rank, for a full global batch."""
        return micro_batch_count(
            self.config.global_batch_size, world_size=self.world_size, micro_batch_size=self.config.micro_batch_size
        )

    def micro_batches(self, inputs, targets) -> Iterator[tuple[object, object, float]]:
        """Yield (inputs, targets, loss_weight) for this rank's micro-batches of one global batch.

        ``inputs``/``targets`` are the whole global batch (every rank gets the
        same one); this rank's micro-batches are views of its slice.
        """
        total = _batch_len(targets)
        share = rank_slice(total, rank=self.rank, world_size=self.world_size)
        count = micro_batch_count(total, world_size=self.world_size, micro_batch_size=self.config.micro_batch_size)
        pieces = []
        start = share.start
        for _ in range(count):
            stop = min(start + self.config.micro_batch_size, share.stop)
            if stop > start:
                pieces.append((slice(start, stop), self.world_size * (stop - start) / total))
            else:
                # A rank with fewer samples still joins every forward's collectives.
                pieces.append((slice(0, 1), 0.0))
            start = stop
        for index, (piece, weight) in enumerate(pieces):
            context = nullcontext() if index == len(pieces) - 1 else self.sync.deferred()
            # The caller's forward and backward of this micro-batch run while the
            # generator waits here, so they run inside the context.
            with context:
                yield tree_map(lambda t: t[piece], inputs), tree_map(lambda t: t[piece], targets), weight


def _batch_len(tree) -> int:
    from autofit._torch_private import tree_leaves

    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            return leaf.shape[0]
    raise UserError("a batch holds no tensor; example_batch/datasets must return tensors")


def micro_batch_count(batch_len: int, *, world_size: int, micro_batch_size: int) -> int:
    """Micro-batches each rank runs for a global batch of ``batch_len``: set by the largest rank share."""
    largest_share = -(-batch_len // world_size)
    return max(1, -(-largest_share // micro_batch_size))


def sharded_precision(precision: str, *, sharding: str, device_type: str):
    """The step's ``Precision`` for a distributed plan: autocast as on one device, ranks agreeing on fp16 skips.

    Under FSDP each rank sees only its gradient shard, so an inf on one rank
    must skip the step on all: fp16 then uses ``ShardedGradScaler``, which
    all-reduces what each rank found. DDP's gradients are identical on every
    rank already; bf16 and fp32 have no scaler.
    """
    from strategies import Precision, PrecisionConfig

    step_precision = Precision(PrecisionConfig(precision=precision), device_type=device_type)
    if precision == "fp16" and sharding == "fsdp":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        step_precision.scaler = ShardedGradScaler(device_type)
    return step_precision


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------

_EXTRA_FILE = "extra.pt"


def save_sharded_checkpoint(
    directory: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict | None = None,
    rank_extra: dict | None = None,
) -> Path:
    """Save model and optimizer with ``torch.distributed.checkpoint`` (a collective: every rank calls it).

    Each rank writes its own shards (FSDP) or rank 0 the replicated tensors
    (DDP). ``extra`` (rank 0's: position, scheduler, scaler ...) goes to
    ``extra.pt``; ``rank_extra`` (what differs per rank, e.g. its RNG state)
    to ``rank<N>.pt`` from each rank. The save goes to a sibling folder that
    replaces ``directory`` only when complete: a crash leaves the previous save.

    Returns:
        ``directory``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    directory = Path(directory)
    partial = directory.with_name(directory.name + ".partial")
    if is_rank0():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier()
    if rank_extra is not None:
        # Written before dcp.save, whose last collective every rank joins after this:
        # rank 0 renames the folder only once every rank's file is in it.
        torch.save(rank_extra, partial / _rank_file(_rank()))
    model_state, optimizer_state = get_state_dict(unwrap_model(model), optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(partial))
    if is_rank0():
        torch.save(extra or {}, partial / _EXTRA_FILE)
        previous = directory.with_name(directory.name + ".previous")
        shutil.rmtree(previous, ignore_errors=True)
        if directory.exists():
            directory.rename(previous)
        partial.rename(directory)
        shutil.rmtree(previous, ignore_errors=True)
    barrier()
    return directory


def load_sharded_checkpoint(directory: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load what ``save_sharded_checkpoint`` wrote into a sharded model and its optimizer.

    Call it after ``shard_model`` and after building the optimizer; the
    world size may differ from the save's (DCP reshards).

    Returns:
        The ``extra`` dict that was saved.

    Raises:
        UserError: ``directory`` holds no complete save.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    directory = Path(directory)
    if not (directory / ".metadata").is_file() or not (directory / _EXTRA_FILE).is_file():
        raise UserError(f"{directory} holds no complete sharded checkpoint; give the --log-dir of a run that saved one")
    model = unwrap_model(model)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return torch.load(directory / _EXTRA_FILE, map_location="cpu", weights_only=False)


def load_rank_extra(directory: str | Path) -> dict:
    """This rank's ``rank_extra`` from a ``save_sharded_checkpoint`` folder.

    Raises:
        UserError: the save holds none for this rank (it was made by fewer ranks, or without one).
    """
    path = Path(directory) / _rank_file(_rank())
    if not path.is_file():
        raise UserError(
            f"{directory} holds no state for rank {_rank()} ({path.name}); resume with as many processes as the run that saved it"
        )
    return torch.load(path, map_location="cpu", weights_only=False)


def _rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Plain, unsharded weights on the CPU in rank 0 (a collective; other ranks get ``{}``).

    Its keys are the model's own, so it is what ``model.state_dict()`` gives
    in one process: best.pt and last.pt stay readable by ``val`` and ``export``.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = unwrap_model(model)
    if not dist.is_initialized():
        return model.state_dict()
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ----------------------------------------------------------------------------------------------
# Per-rank memory
# ----------------------------------------------------------------------------------------------


class ShardAwareTracker(StorageTracker):
    """``StorageTracker`` for a rank of a sharded model on the CPU.

    Two things FSDP2 does that a dispatch mode alone does not see: it frees
    and re-allocates each unit's unsharded parameters by resizing their
    storage (``UntypedStorage.resize_``, no ATen op), and its parameters are
    DTensors whose bytes live in a local shard. This tracker counts storage
    resizes while active and tracks DTensors by their local tensors.
    """

    def __enter__(self):
        tracker = weakref.ref(self)
        original = torch.UntypedStorage.resize_

        def resize_(storage, size):
            result = original(storage, size)
            live = tracker()
            if live is not None:
                live._track_one(_StorageView(storage))
            return result

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)

    def _track_one(self, tensor):
        return super()._track_one(_local(tensor))


class _StorageView:
    """What ``StorageTracker`` reads of a tensor (its storage), for a bare storage."""

    __slots__ = ("_storage",)

    def __init__(self, storage) -> None:
        self._storage = storage

    def untyped_storage(self):
        return self._storage


def _local(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(kw_only=True, slots=True)
class FSDPLayout:
    """How ``shard_model`` groups a model's parameters, in elements (dim 0 padded to the world size)."""

    unit_numels: dict[str, int]
    """Elements of each unit (block), gathered one at a time."""
    root_numel: int
    """Elements left to the root (embeddings, norms, heads): gathered from its forward to the end of backward."""

    @property
    def largest_unit_numel(self) -> int:
        return max(self.unit_numels.values(), default=0)


def fsdp_layout(model: nn.Module, *, world_size: int, units: list[str] | None = None) -> FSDPLayout:
    """The units ``shard_model`` makes of ``model`` (a model on the meta device will do)."""
    names = fsdp_units(model) if units is None else list(units)
    modules = dict(model.named_modules())
    claimed: set[int] = set()
    unit_numels = {}
    for name in names:
        params = [p for p in modules[name].parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in params)
        unit_numels[name] = sum(_padded_numel(p, world_size) for p in params)
    root_numel = sum(_padded_numel(p, world_size) for p in model.parameters() if id(p) not in claimed)
    return FSDPLayout(unit_numels=unit_numels, root_numel=root_numel)


def _padded_numel(param: torch.Tensor, world_size: int) -> int:
    if param.dim() == 0:
        return world_size
    rows = -(-param.shape[0] // world_size) * world_size
    return rows * (param.numel() // max(param.shape[0], 1))


@dataclass(kw_only=True, slots=True)
class ShardedMemoryEstimate:
    """Per-rank peak bytes of an FSDP2 plan, by cause."""

    peak_bytes: int
    state_bytes: int
    """This rank's parameters, gradients and optimizer state."""
    activation_bytes: int
    """Activations of this rank's micro-batch."""
    buffer_bytes: int
    """Gathered parameters, unsharded gradients and the reduce-scatter input."""

    def to_dict(self) -> dict:
        return asdict(self)


def estimate_fsdp_peak_bytes(
    *,
    parameter_bytes: int,
    gradient_bytes: int,
    optimizer_state_bytes: int,
    activation_bytes: int,
    layout: FSDPLayout,
    world_size: int,
    precision: str,
    grad_accum_steps: int = 1,
    defer_gradient_sync: bool = True,
) -> ShardedMemoryEstimate:
    """A quick, conservative per-rank peak of FSDP2 over ``world_size`` ranks.

    It adds up what a rank holds in the worst moment of a backward, as if
    everything peaked at once:

    - parameters, gradients and optimizer state of the whole model, a 1/N
      share each; gradients whole while they accumulate unsynced
      (``defer_gradient_sync`` and more than one micro-batch: every unit
      keeps its unsharded gradients until the last micro-batch);
    - the micro-batch's activations, whole (each rank runs its own);
    - the root's gathered parameters, the largest unit gathered twice (the
      one in use and the next one prefetched) and its unsharded gradients,
      all in the parameter dtype of ``precision``, plus one unit's fp32
      reduce-scatter input.

    For searching and for "how many GPUs would fit"; a plan is checked with
    ``simulate_fsdp_peak_bytes``, which runs FSDP2 itself.

    Args:
        parameter_bytes: the whole model's parameters (and buffers).
        gradient_bytes: the whole model's gradients.
        optimizer_state_bytes: the whole model's optimizer state.
        activation_bytes: one micro-batch's activations at their peak (a
            single-process probe's peak less its parameters, gradients and
            optimizer state there).
        layout: ``fsdp_layout(model, world_size=N)``.
        world_size: ranks.
        precision: "fp32", "bf16" or "fp16".
        grad_accum_steps: micro-batches per step on each rank.
        defer_gradient_sync: ``RankSplit`` reduces gradients after the last micro-batch only.

    Returns:
        The per-rank peak and its parts.

    Example:
        >>> layout = fsdp_layout(model, world_size=4)
        >>> estimate_fsdp_peak_bytes(parameter_bytes=p, gradient_bytes=p, optimizer_state_bytes=2 * p,
        ...                          activation_bytes=a, layout=layout, world_size=4, precision="bf16").peak_bytes
    """
    n = world_size
    param_bytes = torch.empty(0, dtype=_PARAM_DTYPES.get(precision) or torch.float32).element_size()
    whole_gradients = defer_gradient_sync and grad_accum_steps > 1
    state = _share(parameter_bytes, n) + _share(optimizer_state_bytes, n) + (
        gradient_bytes if whole_gradients else _share(gradient_bytes, n)
    )
    largest = layout.largest_unit_numel
    buffers = (layout.root_numel + 3 * largest) * param_bytes + largest * 4
    return ShardedMemoryEstimate(
        peak_bytes=state + activation_bytes + buffers, state_bytes=state, activation_bytes=activation_bytes, buffer_bytes=buffers,
    )


def smallest_world_size(
    *,
    budget_bytes: int,
    parameter_bytes: int,
    gradient_bytes: int,
    optimizer_state_bytes: int,
    activation_bytes: int,
    layout: FSDPLayout,
    precision: str,
    max_world_size: int = 1024,
) -> int | None:
    """The fewest FSDP2 ranks whose ``estimate_fsdp_peak_bytes`` fits ``budget_bytes`` (for a floor message).

    One micro-batch per step (nothing accumulates unsynced). The estimate is
    conservative, so fewer ranks may do; None when no number fits (the
    activations and the gathered units alone exceed the budget).
    """
    for world_size in range(2, max_world_size + 1):
        estimate = estimate_fsdp_peak_bytes(
            parameter_bytes=parameter_bytes, gradient_bytes=gradient_bytes, optimizer_state_bytes=optimizer_state_bytes,
            activation_bytes=activation_bytes, layout=layout, world_size=world_size, precision=precision,
        )
        if estimate.peak_bytes <= budget_bytes:
            return world_size
        if estimate.peak_bytes - estimate.state_bytes > budget_bytes:
            return None  # what does not shrink with more ranks is already too much
    return None


def _share(nbytes: int, world_size: int) -> int:
    return -(-nbytes // world_size)


def simulate_fsdp_peak_bytes(
    spec,
    *,
    world_size: int,
    micro_batch_size: int,
    grad_accum_steps: int = 1,
    precision: str = "fp32",
    checkpoint: list[str] | None = None,
    steps: int = 2,
    defer_gradient_sync: bool = True,
    backend: str = "nccl",
):
    """One rank's peak bytes under FSDP2, by running FSDP2 in this one process.

    A fake process group (no communication) makes this process rank 0 of
    ``world_size``, and fake tensors (no arithmetic) stand in for data, so
    FSDP2 allocates exactly what one rank would: its shards, the gathered
    units, the reduce-scatter buffers, the micro-batch's activations. Rank 0
    holds the largest shards (FSDP2 pads at the end), so this is the highest
    rank. For a GPU it is an estimate like the simulated meter's.

    gloo's reduce-scatter (the CPU backend) makes a full-size copy of its
    input inside itself, which a fake process group does not: with
    ``backend="gloo"`` one such copy of the largest unit (fp32) is added, as
    it may be alive at the peak. Measured on the CPU, a real rank's peak lies
    between the simulation without it and with it.

    Nothing else may use torch.distributed in this process meanwhile.

    Args:
        spec: the model, its example batches, loss and optimizer.
        world_size: ranks to simulate.
        micro_batch_size: samples per micro-batch on one rank.
        grad_accum_steps: micro-batches per optimizer step on one rank.
        precision: "fp32", "bf16" or "fp16".
        checkpoint: block names recomputed in backward.
        steps: optimizer steps; the peak is over all but the first.
        defer_gradient_sync: reduce gradients after the last micro-batch only.
        backend: "nccl" (CUDA) or "gloo" (CPU).

    Returns:
        An ``autofit.measure.meters.Measurement``: peak bytes and the breakdown at the peak
        (with "gloo_reduce_scatter_copy" for gloo).

    Raises:
        UserError: torch.distributed is already in use in this process.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autofit._torch_private import fake_process_group_store, new_fake_mode
    from autofit.measure.meters import Measurement
    from autofit.training.step import train_step
    from strategies import CheckpointConfig, Checkpointing, Precision, PrecisionConfig

    if dist.is_initialized():
        raise UserError("simulating a sharded plan needs a process without torch.distributed; run `autofit plan` outside torchrun")
    dist.init_process_group("fake", store=fake_process_group_store(), rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))  # outside the fake mode: it reads real values
        torch.manual_seed(0)
        with new_fake_mode():
            model = spec.build_model()
            model.train()
            model = Checkpointing(CheckpointConfig(blocks=list(checkpoint or []))).apply(model)
            model = shard_model(model, sharding="fsdp", precision=precision, device="cpu", mesh=mesh)
            optimizer = spec.build_optimizer(model.parameters())
            step_precision = Precision(PrecisionConfig(precision=precision), device_type="cpu", use_scaler=False)
            sync = gradient_sync(model, sharding="fsdp") if defer_gradient_sync else GradientSync()
            global_batch_size = micro_batch_size * grad_accum_steps * world_size
            split = RankSplit(
                BatchSplitConfig(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size),
                rank=0, world_size=world_size, sync=sync,
            )
            inputs, targets = spec.example_batch(global_batch_size)

            def step() -> None:
                train_step(model, inputs, targets, loss_fn=spec.loss_fn, optimizer=optimizer, precision=step_precision, split=split, device="cpu")

            step()  # makes the optimizer state, as training's first step does
            tracker = ShardAwareTracker()
            tracker.track(model.parameters(), "parameters")
            tracker.track(model.buffers(), "parameters")
            tracker.track(_optimizer_tensors(optimizer), "optimizer_state")
            with tracker:
                for _ in range(steps - 1):
                    step()
            tracker.label(_optimizer_tensors(optimizer), "optimizer_state")
            layout = fsdp_layout(model, world_size=world_size)
        # (Storages FSDP2 resizes count in the breakdown at their last size, not their size at the peak.)
        breakdown = tracker.breakdown_at_peak()
        peak_bytes = tracker.peak_bytes
        if backend == "gloo":
            breakdown["gloo_reduce_scatter_copy"] = layout.largest_unit_numel * 4  # reduce dtype: fp32
            peak_bytes += breakdown["gloo_reduce_scatter_copy"]
        return Measurement(peak_bytes=peak_bytes, breakdown=breakdown)
    finally:
        dist.destroy_process_group()


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]

