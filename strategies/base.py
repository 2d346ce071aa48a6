"""The protocol every strategy follows."""
from __future__ import annotations

from torch import nn


class Strategy:
    """A strategy rewrites the model once; its defaults do nothing.

    Subclasses override ``apply``; strategies that shape the step itself
    (precision, batch split) add their own narrow hooks.
    """

    def apply(self, model: nn.Module) -> nn.Module:
        """Rewrite ``model`` in place for this strategy and return it."""
        return model
