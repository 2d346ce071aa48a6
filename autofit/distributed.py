"""Training one plan on several processes: joining torchrun's process group, and collectives.

- ``init_distributed()`` reads torchrun's environment and joins the process
  group (gloo on the CPU, NCCL on CUDA); outside torchrun it is a no-op.
- ``check_launch`` refuses a plan started on another number of processes.
- ``mean_across_ranks`` / ``sum_across_ranks`` / ``any_rank`` /
  ``same_on_all_ranks``: what the loop agrees on across ranks.

The model itself is sharded by ``strategies.sharding.Sharding`` (through
``autofit.apply.apply_config``); checkpoints of a sharded model are in
``autofit.training.sharded_checkpoints``; a rank's memory is simulated by
``autofit.planning.memory.per_rank``.

Example (run with ``torchrun --nproc-per-node 2 script.py``)::

    applied = apply_plan(model, plan)           # joins the group, shards the model
    optimizer = torch.optim.AdamW(applied.model.parameters())
    result = train_step(applied, inputs, targets, loss_fn=loss_fn, optimizer=optimizer)
    loss = mean_across_ranks(result.loss)       # the global batch's mean loss, on every rank
    cleanup()
"""
from __future__ import annotations

import os
import shlex
import sys
from typing import NamedTuple

import torch

from autofit.errors import UserError
from strategies.sharding import ShardingConfig


def default_backend(device_type: str) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device_type == "cuda" else "gloo"


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


def end_rank(exit_code: int) -> None:
    """End a torchrun rank whose work is done and saved, without the interpreter's teardown; a no-op outside torchrun.

    After ``cleanup()`` a rank has nothing left to do, yet the interpreter's
    teardown still destroys torch's C++ objects in whatever order it meets
    them, and once in a few dozen CI runs a rank aborted there ("terminate
    called without an active exception", SIGABRT), after its run had trained
    and saved; torchrun then reported the whole run as failed. So a rank
    flushes its output and leaves with its exit code, as a process that has
    finished. Files were closed and fsynced by the loop; nothing is pending.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said on it
            pass
    os._exit(exit_code)


NODE0_ADDRESS = "NODE0_ADDRESS"
"""What the per-node commands name the first node by: the user puts its address (host name or IP) there."""


def torchrun_commands(config: ShardingConfig, *, args: list[str]) -> list[str]:
    """The command lines that start ``autofit ARGS`` on the plan's processes: one on this machine, or one per node,
    each said as "on node K: ..." (with its ``--node-rank``, all meeting at the first node's address, ``NODE0_ADDRESS``)."""
    tail = ["-m autofit", *map(shlex.quote, args)]
    if config.nodes == 1:
        return [" ".join(["torchrun", f"--nproc-per-node {config.world_size}", *tail])]
    return [
        f"on node {rank}: " + " ".join([
            "torchrun", f"--nnodes {config.nodes}", f"--node-rank {rank}", f"--nproc-per-node {config.per_node}",
            f"--master-addr {NODE0_ADDRESS}", "--master-port 29500", *tail,
        ])
        for rank in range(config.nodes)
    ]


def check_launch(config: ShardingConfig, *, args: list[str] | None = None) -> None:
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
            f"this plan trains on {config.world_size} processes ({config.sharding}"
            f"{f', {config.nodes} nodes' if config.nodes > 1 else ''}); start it with: {'; '.join(torchrun_commands(config, args=args))}"
        )
    started = f"--nproc-per-node {config.world_size}" if config.nodes == 1 else f"--nnodes {config.nodes} --nproc-per-node {config.per_node}"
    raise UserError(
        f"this plan is for {config.world_size} process(es) but torchrun started {launched}; use "
        f"{started}, or re-plan with `autofit plan ... --gpus {launched}`"
    )


def mean_across_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of ``value`` over the ranks (a collective: every rank must call it).

    With ``BatchSplit``'s weights, each rank's step loss is ``world_size / G``
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
