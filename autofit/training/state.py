"""Where a run is and what it has seen so far (what last.pt saves so that ``--resume`` continues it), and the watch
that stops a run whose loss or weights are no longer finite."""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from autofit.distributed import any_rank
from autofit.errors import UserError, user_frame


@dataclass(kw_only=True, slots=True)
class Position:
    """Where the run is; saved in last.pt so a resumed run continues at the same batch."""

    epoch: int = 0
    """Epochs finished."""
    step_in_epoch: int = 0
    """Global batches done in the current epoch."""
    global_step: int = 0
    """Optimizer steps done in the whole run."""
    epoch_loss_sum: float = 0.0
    """Sum of per-sample loss over the current epoch's finite steps."""
    epoch_samples: int = 0
    epoch_nonfinite_samples: int = 0
    """Samples of the current epoch's steps whose loss was inf or nan (left out of its mean)."""
    epoch_seconds: float = 0.0
    skipped_images: int = 0
    """Samples of the current epoch left out because their file failed to decode."""

    def advance(self, *, samples: int, loss: float, seconds: float) -> None:
        """Count one global batch of ``samples`` done in ``seconds`` (a loss that is not finite adds no loss)."""
        self.step_in_epoch += 1
        self.global_step += 1
        self.epoch_seconds += seconds
        self.epoch_samples += samples
        if math.isfinite(loss):
            self.epoch_loss_sum += loss * samples
        else:
            self.epoch_nonfinite_samples += samples

    def skip_batch(self) -> None:
        """Count a global batch none of whose samples could be read: passed in the epoch's order, no optimizer step."""
        self.step_in_epoch += 1

    @property
    def train_loss(self) -> float:
        """Mean loss per sample over the epoch's finite steps so far; nan when it has none (never 0 for a run whose
        every loss was nan)."""
        finite = self.epoch_samples - self.epoch_nonfinite_samples
        return self.epoch_loss_sum / finite if finite else math.nan

    @property
    def samples_per_s(self) -> float:
        return self.epoch_samples / self.epoch_seconds if self.epoch_seconds else 0.0


@dataclass(kw_only=True, slots=True)
class RunState:
    """The position and the finished epochs' records: what the loop keeps from step to step."""

    position: Position = field(default_factory=Position)
    history: list[dict] = field(default_factory=list)
    """One record per finished epoch (metrics.jsonl's "epoch" records)."""
    best_score: float | None = None
    """``score`` of the best epoch so far (best.pt's)."""
    stopped: dict | None = None
    """The record of the stop at --max-steps, when the run ended there (not kept in last.pt)."""

    def end_epoch(self, record: dict) -> bool:
        """Keep the epoch's record and start the next epoch; True when the epoch is the best so far."""
        self.history.append(record)
        self.position = Position(epoch=record["epoch"], global_step=self.position.global_step)
        improved = self.best_score is None or score(record) > self.best_score
        if improved:
            self.best_score = score(record)
        return improved

    def best_record(self) -> dict | None:
        return max(self.history, key=score) if self.history else None


def score(record: dict) -> float:
    """Higher is better: validation accuracy, else minus the validation loss, else minus the training loss."""
    if record["val_accuracy"] is not None:
        return record["val_accuracy"]
    loss = record["val_loss"] if record["val_loss"] is not None else record["train_loss"]
    return -loss if math.isfinite(loss) else -math.inf


class NonFiniteWatch:
    """Losses and weights that are no longer finite: what stops a run that diverged, before it saves them.

    ``limit`` steps in a row whose loss is inf or nan stop the run (fp16's
    GradScaler skips such steps, so a few are no divergence); weights that are
    not finite stop it before any save (``check_weights``), so best.pt, last.pt
    and hf/ never hold them: each keeps what it held (last.pt the last good save).

    Args:
        limit: steps in a row with a non-finite loss that stop the run.
        precision: the plan's, named in the advice.
        peak_lr: the run's peak learning rate, named in the advice.
    """

    def __init__(self, *, limit: int, precision: str, peak_lr: float) -> None:
        self.limit, self.precision, self.peak_lr = limit, precision, peak_lr
        self.count = 0
        self.first_step: int | None = None
        """The first step of the current streak of non-finite losses; None while the last loss was finite."""

    def check(self, loss: float, *, epoch: int, step: int) -> None:
        """Count ``loss``.

        Raises:
            UserError: this is the ``limit``-th step in a row whose loss is not finite.
        """
        finite = math.isfinite(loss)
        self.count = 0 if finite else self.count + 1
        self.first_step = None if finite else self.first_step or step
        if self.count >= self.limit:
            raise UserError(
                f"the loss was not finite for {self.count} steps in a row (epoch {epoch}, step "
                f"{step}, precision {self.precision}); re-plan with bf16 or fp32 precision, "
                f"or lower --lr (last.pt keeps the last good save)"
            )

    def check_weights(self, model: nn.Module, *, step: int, device: torch.device) -> None:
        """Before a save at ``step``: the trainable weights must be finite (a collective on several processes).

        Raises:
            UserError: some weight is inf or nan; the line says since when, and what to try.
        """
        if any_rank(not weights_finite(model), device=device):
            since = (
                f"the loss became non-finite at step {self.first_step}" if self.first_step is not None
                else f"step {step}'s update made them so"
            )
            raise UserError(self._diverged(f"the weights are no longer finite ({since})"))

    @contextmanager
    def overflow(self, *, step: int):
        """Around step ``step``: an update too large for the weights' dtype (PyTorch's optimizer says "cannot be
        converted ... without overflow") is the run diverging, said in one line."""
        try:
            yield
        except RuntimeError as error:
            if "without overflow" not in str(error) or user_frame(error) is not None:  # the user's own code: its line
                raise
            raise UserError(self._diverged(f"an update overflowed the weights at step {step}")) from error

    def _diverged(self, what: str) -> str:
        fp16 = ", or re-plan with bf16 or fp32 precision" if self.precision == "fp16" else ""
        return (
            f"training diverged: {what}; nothing is saved from these weights (best.pt, last.pt and hf/ keep what they held); "
            f"try a --lr below {self.peak_lr:g} or --max-grad-norm 1.0{fp16}"
        )


def weights_finite(model: nn.Module) -> bool:
    """True when every trainable parameter this process holds (its shard, under FSDP) is finite; one sync."""
    tensors = [p for p in model.parameters() if p.requires_grad]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from torch.distributed.tensor import DTensor  # imported only here: it takes half a second

        tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]  # FSDP2: this rank's shard
    if not tensors:
        return True
    return bool(torch.stack([torch.isfinite(t.detach()).all() for t in tensors]).all())
