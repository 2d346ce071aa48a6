"""Checkpoints of a model trained on several processes: ``torch.distributed.checkpoint``, each rank its shards.

``save_sharded_checkpoint`` / ``load_sharded_checkpoint`` write and read
model and optimizer (the folder is replaced only once complete);
``full_model_state_dict`` gathers plain weights on rank 0 for a single file.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from autofit.errors import UserError
from autofit.distributed import barrier, is_rank0
from autofit.training.weights import disk_full
from strategies import unwrap_model

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

    Raises:
        OSError: ENOSPC when the disk fills, whether torch.save or DCP's writers report it.
    """
    directory = Path(directory)
    try:
        return _save_sharded(directory, model=model, optimizer=optimizer, extra=extra, rank_extra=rank_extra)
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        full = disk_full(error, directory)
        if full is None:
            raise
        raise full from error


def _save_sharded(directory: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, extra, rank_extra) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

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
