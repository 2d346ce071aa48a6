"""torch.compile: the model's forward (and so its backward) compiled by TorchInductor, a speed choice.

Compiled in place (``nn.Module.compile``): the module, its parameter names
and its state_dict stay what they were, so checkpoints, the optimizer and
every other strategy see the same model. The arithmetic is the model's own,
with Inductor's fused kernels: results agree with eager ones to rounding
(tests/strategies/test_compile.py), not bit for bit. Compilation happens at
the first forward (and again at a new input shape or for eval mode).

The planner records ``compile`` only where it measured the compiled step
both to fit the budget and to be faster (``autofit.planning.verify.compiled``).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from autofit._torch_private import is_compiled
from strategies.base import Strategy


@dataclass(kw_only=True, slots=True)
class CompileConfig:
    enabled: bool = False


class Compile(Strategy):
    """Off: the model as it is. On: ``model.compile()`` (default Inductor backend and mode), last of the strategies,
    so that what it compiles is the forward every other strategy shaped (checkpointing, the chunked loss, hooks)."""

    def __init__(self, config: CompileConfig) -> None:
        self.config = config

    def apply(self, model: nn.Module) -> nn.Module:
        if self.config.enabled and not is_compiled(model):  # applied again (a warm-up, a smaller micro-batch): once
            model.compile()
        return model
