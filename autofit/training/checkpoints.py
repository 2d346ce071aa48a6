"""last.pt and best.pt of a run: how they are saved on one process or several, and read back to resume.

The file format (what ``autofit val`` and ``export`` read) is
``autofit.training.weights``; this module decides what a run puts in it and
restores a run from it: weights, optimizer, RNG state and the training state
the loop hands over.
"""
from __future__ import annotations

import random
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from autofit.errors import UserError
from autofit.plan_file import Plan
from autofit.spec import model_fingerprint
from autofit.distributed import is_rank0
from autofit.training.sharded_checkpoints import (
    full_model_state_dict,
    load_rank_extra,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from autofit.training.state import Position, RunState
from autofit.training.weights import load_checkpoint, save_checkpoint


class RunCheckpoints:
    """What last.pt and best.pt of one run hold, saved as its processes save (``checkpoint_files``).

    Args:
        log_dir: where last.pt and best.pt go.
        world_size: processes the run trains on.
        model, optimizer, scheduler, scaler: the run's, saved and restored in place.
        about: what identifies the weights, saved in both files:
            {"model_source", "fingerprint", "classes"}.
        settings: the run's settings (``TrainSettings.record``), saved in last.pt
            so that ``--resume`` alone continues the run.
        seed: the run's seed, saved in last.pt.
    """

    def __init__(
        self, log_dir: Path, *, world_size: int, model: nn.Module, optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler, about: dict, settings: dict,
        seed: int,
    ) -> None:
        self.files = checkpoint_files(log_dir, world_size=world_size)
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.about, self.settings, self.seed = about, settings, seed

    @property
    def last_path(self) -> Path:
        return self.files.last_path

    def best_path_if_saved(self) -> Path | None:
        return self.files.best_path if self.files.best_path.exists() else None

    def save_last(self, *, plan: Plan, state: RunState) -> dict:
        """Save last.pt: everything ``--resume`` needs. Returns what was saved (best.pt reuses its weights)."""
        checkpoint = {
            **self.about,
            "plan": plan.to_dict(),
            "settings": self.settings,
            "training": {
                "scaler": self.scaler.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "position": asdict(state.position),
                "history": state.history,
                "best_score": state.best_score,
                "seed": self.seed,
            },
        }
        return self.files.save_last(checkpoint, model=self.model, optimizer=self.optimizer)

    def save_best(self, saved: dict, *, record: dict) -> None:
        """Save best.pt: the weights of ``saved`` (last.pt as just saved) and the epoch's ``record``."""
        # best.pt is for using the weights: no optimizer state, no RNG.
        self.files.save_best({**saved, "training": {"epoch": record["epoch"], "metrics": record}})

    def repair_best(self, saved: dict, state: RunState) -> None:
        """On resume: save best.pt again when it is not the best epoch's (a kill while it was written) and last.pt,
        saved just before it at that epoch's end, holds that epoch's weights; else leave it (the run says so)."""
        best = state.best_record()
        if best is None or self.best_epoch() == best["epoch"]:
            return
        position = saved["training"]["position"]
        if position["epoch"] == best["epoch"] and position["step_in_epoch"] == 0:
            self.save_best(saved, record=best)

    def best_epoch(self) -> int | None:
        """The epoch best.pt was saved at; None without a readable one."""
        if not self.files.best_path.is_file():
            return None
        try:
            return load_checkpoint(self.files.best_path, mmap=True)["training"]["epoch"]
        except (UserError, KeyError, TypeError):
            return None

    def restore(self, saved: dict) -> RunState:
        """Load weights, optimizer, scaler, schedule and RNG state from ``saved`` (last.pt as read)."""
        training = self.files.restore(saved, model=self.model, optimizer=self.optimizer)
        self.scaler.load_state_dict(training["scaler"])
        self.scheduler.load_state_dict(training["scheduler"])
        set_rng_state(training["rng"])
        return RunState(position=Position(**training["position"]), history=list(training["history"]), best_score=training["best_score"])


class LocalCheckpoints:
    """last.pt and best.pt of a run in one process: last.pt holds the weights and everything ``--resume`` needs."""

    def __init__(self, log_dir: Path) -> None:
        self.last_path, self.best_path = log_dir / "last.pt", log_dir / "best.pt"

    def save_last(self, checkpoint: dict, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Add weights, optimizer and RNG state to ``checkpoint`` and save it as last.pt.

        Returns:
            The checkpoint with its weights (best.pt reuses them).
        """
        training = {**checkpoint["training"], "optimizer": optimizer.state_dict(), "rng": rng_state()}
        checkpoint = {**checkpoint, "model_state": model.state_dict(), "training": training}
        save_checkpoint(self.last_path, checkpoint)
        return checkpoint

    def save_best(self, checkpoint: dict) -> None:
        save_checkpoint(self.best_path, checkpoint)

    def restore(self, saved: dict, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Load weights and optimizer state from ``saved`` (last.pt as read); returns its training state."""
        model.load_state_dict(saved["model_state"])
        optimizer.load_state_dict(saved["training"]["optimizer"])
        return saved["training"]


class ShardedCheckpoints(LocalCheckpoints):
    """Checkpoints of a run on several processes (each method is a collective: every rank calls it).

    ``last_sharded/`` is what ``--resume`` reads: model and optimizer saved
    with torch.distributed.checkpoint (each rank its shards), rank 0's
    training state and each rank's RNG state; it is replaced only once
    complete. Rank 0 then writes last.pt and best.pt with whole weights, as
    one process does, so ``autofit val`` and ``export`` read them (last.pt's
    optimizer state stays in ``last_sharded/``).
    """

    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir)
        self.sharded_dir = log_dir / "last_sharded"

    def save_last(self, checkpoint: dict, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        rng = rng_state()
        save_sharded_checkpoint(self.sharded_dir, model=model, optimizer=optimizer, extra=checkpoint["training"], rank_extra={"rng": rng})
        training = {**checkpoint["training"], "rng": rng, "optimizer": f"in {self.sharded_dir.name}/"}
        checkpoint = {**checkpoint, "model_state": full_model_state_dict(model), "training": training}
        if is_rank0():
            save_checkpoint(self.last_path, checkpoint)
        return checkpoint

    def save_best(self, checkpoint: dict) -> None:
        if is_rank0():
            save_checkpoint(self.best_path, checkpoint)

    def restore(self, saved: dict, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        training = load_sharded_checkpoint(self.sharded_dir, model=model, optimizer=optimizer)
        return {**training, **load_rank_extra(self.sharded_dir)}


def checkpoint_files(log_dir: Path, *, world_size: int) -> LocalCheckpoints:
    """How a run on ``world_size`` processes saves and resumes."""
    return ShardedCheckpoints(log_dir) if world_size > 1 else LocalCheckpoints(log_dir)


def load_resume_state(last_path: Path, model: nn.Module) -> dict:
    """last.pt as read, to resume ``model``'s run.

    Raises:
        UserError: last.pt is missing, holds no training state, or was saved from another model.
    """
    if not last_path.exists():
        raise UserError(f"--resume: {last_path} does not exist; give the --log-dir of a run that saved last.pt")
    saved = load_checkpoint(last_path)
    if "training" not in saved or "position" not in saved["training"]:
        raise UserError(f"--resume: {last_path} holds no training state; is it a best.pt copied over?")
    if saved.get("fingerprint") != model_fingerprint(model):
        raise UserError(
            f"--resume: {last_path} was saved from another model (parameter names or shapes differ); "
            "resume with the model file it was trained with"
        )
    return saved


def rng_state() -> dict:
    """This process's RNG states: torch (CPU and every GPU), NumPy and Python's ``random``."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(state: dict) -> None:
    """Restore the RNG states ``rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
