"""The protocol every strategy follows: hooks that do nothing by default."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

OptimizerBuilder = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
"""params -> Optimizer, e.g. a model file's ``build_optimizer``."""


class Strategy:
    """One way of changing how a model trains; every hook's default leaves training as it is.

    ``autofit.apply.apply_config`` is the one place that builds strategies and
    calls ``apply`` in a fixed order; the step calls the step hooks of all of
    them, so "off" is a strategy whose hooks do nothing, never a branch.
    """

    def apply(self, model: nn.Module) -> nn.Module:
        """Rewrite ``model`` (in place where possible) for this strategy and return it."""
        return model

    def forward_context(self) -> AbstractContextManager:
        """A context each micro-batch's forward and loss run in (autocast, saved-tensor hooks)."""
        return nullcontext()

    def wrap_optimizer_builder(self, build: OptimizerBuilder) -> OptimizerBuilder:
        """How this strategy changes the optimizer ``build`` makes (where its state lives, when it steps)."""
        return build
