"""The learning-rate schedule: an optional linear warm-up, then cosine, linear or constant, per optimizer step.

Each is a ``torch.optim.lr_scheduler.LambdaLR`` stepped once per optimizer
step (a step fp16's GradScaler skipped does not count); its state (the step
count) is saved in last.pt, so ``--resume`` continues the schedule.

Example:
    >>> import torch
    >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> scheduler = lr_schedule(optimizer, kind="linear", warmup_steps=2, total_steps=12)
    >>> [round(scheduler.lr_lambdas[0](step), 2) for step in range(5)]  # the factor of the peak at steps 0..4
    [0.0, 0.5, 1.0, 0.91, 0.82]
"""
from __future__ import annotations

import math

import torch

from autofit.errors import UserError

SCHEDULES = ("cosine", "linear", "constant")
"""--schedule: after the warm-up, the rate falls along half a cosine or a line to a tenth of the peak, or stays."""
FINAL_FRACTION = 0.1
"""Where cosine and linear end, as a fraction of the peak rate."""


def check_schedule(kind: str, warmup_steps: int) -> None:
    """Refuse an unknown ``--schedule`` or a negative ``--warmup-steps`` (one line each)."""
    if kind not in SCHEDULES:
        raise UserError(f"--schedule {kind!r} is unknown; choose {'|'.join(SCHEDULES)}")
    if warmup_steps < 0:
        raise UserError(f"--warmup-steps {warmup_steps} must be 0 or more")


def lr_schedule(
    optimizer: torch.optim.Optimizer, *, kind: str = "cosine", warmup_steps: int = 0, total_steps: int,
) -> torch.optim.lr_scheduler.LambdaLR:
    """The rate rises linearly to its peak over ``warmup_steps`` (step/warmup, the transformers convention), then
    follows ``kind`` until ``total_steps``: "cosine" and "linear" fall to a tenth of the peak, "constant" stays."""
    check_schedule(kind, warmup_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(step - warmup_steps, total_steps - warmup_steps) / max(total_steps - warmup_steps, 1)
        if kind == "linear":
            return 1.0 - (1.0 - FINAL_FRACTION) * progress
        return FINAL_FRACTION + (1.0 - FINAL_FRACTION) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def cosine_schedule(optimizer: torch.optim.Optimizer, *, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The rate falls from its peak to a tenth of it along half a cosine over ``total_steps`` (no warm-up)."""
    return lr_schedule(optimizer, kind="cosine", total_steps=total_steps)
