"""Where a run is and what it has seen so far: what last.pt saves so that ``--resume`` continues it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from autofit.errors import UserError


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
    epoch_seconds: float = 0.0
    skipped_images: int = 0
    """Samples of the current epoch left out because their file failed to decode."""

    def advance(self, *, samples: int, loss: float, seconds: float) -> None:
        """Count one global batch of ``samples`` done in ``seconds`` (a loss that is not finite adds no loss)."""
        self.step_in_epoch += 1
        self.global_step += 1
        self.epoch_seconds += seconds
        self.epoch_samples += samples
        self.epoch_loss_sum += loss * samples if math.isfinite(loss) else 0.0

    def skip_batch(self) -> None:
        """Count a global batch none of whose samples could be read: passed in the epoch's order, no optimizer step."""
        self.step_in_epoch += 1

    @property
    def train_loss(self) -> float:
        """Mean loss per sample over the epoch so far (nan before its first sample)."""
        return self.epoch_loss_sum / self.epoch_samples if self.epoch_samples else math.nan

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


class NonFiniteStreak:
    """Steps in a row whose loss is inf or nan; ``limit`` of them stop the run with advice."""

    def __init__(self, *, limit: int, precision: str) -> None:
        self.limit, self.precision = limit, precision
        self.count = 0

    def check(self, loss: float, *, epoch: int, step: int) -> None:
        """Count ``loss``.

        Raises:
            UserError: this is the ``limit``-th step in a row whose loss is not finite.
        """
        self.count = 0 if math.isfinite(loss) else self.count + 1
        if self.count >= self.limit:
            raise UserError(
                f"the loss was not finite for {self.count} steps in a row (epoch {epoch}, step "
                f"{step}, precision {self.precision}); re-plan with bf16 or fp32 precision, "
                f"or lower --lr (last.pt keeps the last good save)"
            )
