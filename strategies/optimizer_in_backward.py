"""Optimizer step in backward: each parameter steps as soon as its gradient is complete.

The model file's optimizer is built once per parameter, and each parameter's
``register_post_accumulate_grad_hook`` steps it and frees its gradient the
moment backward has accumulated it (PyTorch's "optimizer step in backward"
recipe; torchtune's optimizer-in-backward). Gradients then never all exist at
once: the peak loses about the gradients' bytes.

It needs the whole gradient of a step in one backward, so one micro-batch per
optimizer step (an accumulated gradient would be stepped after its first
micro-batch), one process (DDP and FSDP reduce gradients after the hook), and
no fp16 GradScaler (it must see every gradient for inf/nan before any step).

The step's own ``optimizer_step`` then finds no gradient left and steps
nothing; a learning-rate schedule and ``state_dict()`` act on the
per-parameter optimizers through ``OptimizerInBackward``.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from autofit.errors import UserError
from autofit.measure.host import host_tensors
from strategies.base import OptimizerBuilder, Strategy


@dataclass(kw_only=True, slots=True)
class OptimizerInBackwardConfig:
    enabled: bool = False
    """Step each parameter from its gradient hook during backward."""


class StepInBackward(Strategy):
    """Builds ``OptimizerInBackward`` when on (``TrainingConfig`` refuses it with more than one micro-batch per step)."""

    def __init__(self, config: OptimizerInBackwardConfig) -> None:
        self.config = config

    def wrap_optimizer_builder(self, build: OptimizerBuilder) -> OptimizerBuilder:
        if not self.config.enabled:
            return build
        return lambda params: OptimizerInBackward(params, build=build)


class OptimizerInBackward(torch.optim.Optimizer):
    """One optimizer per parameter, stepped by that parameter's gradient hook.

    ``param_groups`` lists the per-parameter optimizers' own group dicts, so a
    learning-rate scheduler over this object sets every one of them.
    ``step()`` steps the parameters that still hold a gradient (none after a
    backward; all of them after gradients set by hand), so calling it after
    backward, as every loop does, is harmless.

    Args:
        params: the parameters; those without ``requires_grad`` are left alone.
        build: params -> Optimizer (the model file's), called with one parameter at a time.
    """

    def __init__(self, params: Iterable[nn.Parameter], *, build: OptimizerBuilder) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.optimizers = [build([p]) for p in self.params]
        super().__init__(self.params, dict(self.optimizers[0].defaults) if self.optimizers else {})
        self._share_groups_and_state()
        self._hooks = [p.register_post_accumulate_grad_hook(_stepper(o)) for p, o in zip(self.params, self.optimizers)]

    def _share_groups_and_state(self) -> None:
        self.param_groups = [group for optimizer in self.optimizers for group in optimizer.param_groups]
        self.state = _States(self.params, self.optimizers)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise UserError("the optimizer steps in backward; it takes no closure")
        for param, optimizer in zip(self.params, self.optimizers):
            if param.grad is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        return None

    def host_tensors(self) -> list[torch.Tensor]:
        """What the per-parameter optimizers keep in host memory (optimizer state on the host), for the meters."""
        return [tensor for optimizer in self.optimizers for tensor in host_tensors(optimizer)]

    def state_dict(self) -> dict:
        return {"per_parameter": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("per_parameter")
        if saved is None or len(saved) != len(self.optimizers):
            raise UserError("this optimizer state was not saved with optimizer step in backward over this model; resume with the plan it was saved with")
        for optimizer, state in zip(self.optimizers, saved):
            optimizer.load_state_dict(state)
        self._share_groups_and_state()

    def remove_hooks(self) -> None:
        """Stop stepping in backward (the parameters keep their gradients again)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class _States(Mapping):
    """Every per-parameter optimizer's state, read as one optimizer's ``state`` (param -> dict)."""

    def __init__(self, params: list[nn.Parameter], optimizers: list[torch.optim.Optimizer]) -> None:
        self._optimizer_of = {param: optimizer for param, optimizer in zip(params, optimizers)}

    def __getitem__(self, param):
        optimizer = self._optimizer_of.get(param)
        if optimizer is None or param not in optimizer.state:  # `in`: a defaultdict lookup would add it
            raise KeyError(param)
        return optimizer.state[param]

    def __iter__(self) -> Iterator:
        return (param for param, optimizer in self._optimizer_of.items() if param in optimizer.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _stepper(optimizer: torch.optim.Optimizer):
    # A weak reference: the parameter holds its hooks where the garbage collector cannot follow them, so a hook
    # holding the optimizer (which holds the parameter) would keep both, and the model, alive for good. The
    # optimizer lives as long as the one training with it; once it is gone, backward steps nothing.
    reference = weakref.ref(optimizer)

    def step_and_free(param: nn.Parameter) -> None:
        optimizer = reference()
        if optimizer is None:
            return
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step_and_free
