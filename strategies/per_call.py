"""Blocks named per call: a module one forward calls several times is one block per call.

ALBERT runs one layer N times in every forward; a Universal Transformer or a
weight-tied refinement loop does the same. Each call saves its own
activations, so each call is a block of its own: ``encoder.layer#2`` is the
third call (counted from 0) of ``encoder.layer`` in a forward of the model.
Calls are counted from the start of each forward of the model (the root
module's forward pre-hook sets the count back to 0), so every micro-step,
and an evaluation forward, numbers them the same way.

A checkpoint's recomputation runs the module's original forward directly,
not through ``module(...)``: it is never counted as a call. A call outside
any forward of the model (a loop that calls a submodule itself) has no
number: it runs as it is, after one warning naming the module.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import nn

from autofit.errors import UserError

CALL_MARK = "#"
"""Between a module's name and the call's number: ``encoder.layer#2``."""


def split_call(name: str) -> tuple[str, int | None]:
    """A block's module name and its call (None: every call).

    Example:
        >>> split_call("encoder.layer#2"), split_call("layers.0")
        (('encoder.layer', 2), ('layers.0', None))
    """
    module, mark, call = name.rpartition(CALL_MARK)
    if not mark or not call.isdigit():
        return name, None
    return module, int(call)


def call_name(module_name: str, call: int) -> str:
    """The block that is ``module_name``'s ``call``-th call (from 0) in a forward: ``call_name("a.b", 2) == "a.b#2"``."""
    return f"{module_name}{CALL_MARK}{call}"


Wrap = Callable[..., object]
"""(forward, *args, **kwargs) -> output: runs a module's forward in some way (checkpointed, offloaded)."""


class PerCallForward:
    """A module's forward that runs ``wraps[k]`` around the plain forward at the k-th call of each forward of the model.

    Installed by ``patch_calls``; ``role`` says which strategy installed it
    (a module may hold one per strategy, the later wrapping the earlier).
    """

    def __init__(self, *, forward: Callable, wraps: dict[int, Wrap], module_name: str, role: str) -> None:
        self.forward = forward
        self.wraps = wraps
        self.module_name = module_name
        self.role = role
        self.calls = 0
        """Calls of the module so far in the model's current forward."""
        self.in_model_forward = False
        self.warned = False

    def __call__(self, *args, **kwargs):
        if not self.in_model_forward:
            # Called outside the model's forward (a loop that calls a submodule itself): no call number to go by.
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"{self.module_name} ran outside a forward of the model its {self.role} plan was applied to: its "
                    "calls are numbered from the start of that forward, so it runs as it is (apply the plan to the "
                    "module the loop calls, e.g. AutofitCallback(plan, module=...))",
                    stacklevel=2,
                )
            return self.forward(*args, **kwargs)
        call = self.calls
        self.calls += 1
        wrap = self.wraps.get(call)
        return self.forward(*args, **kwargs) if wrap is None else wrap(self.forward, *args, **kwargs)

    def names(self) -> list[str]:
        """The blocks this forward wraps: ``module#call`` for each wrapped call."""
        return [call_name(self.module_name, call) for call in sorted(self.wraps)]

    def model_forward_begins(self, model, args) -> None:
        self.calls = 0
        self.in_model_forward = True

    def model_forward_ends(self, model, args, output) -> None:
        """Refuse a named call the forward never made (a plan or ``--checkpoint`` for another model's call count)."""
        self.in_model_forward = False
        missing = [call for call in self.wraps if call >= self.calls]
        if self.calls and missing:
            raise UserError(
                f"{self.role} block {call_name(self.module_name, min(missing))}: {self.module_name} runs "
                f"{self.calls} time(s) in a forward ({call_name(self.module_name, 0)} to #{self.calls - 1}); "
                "name one of those (autofit probe --list-blocks lists them)"
            )


def patch_calls(model: nn.Module, module_name: str, wraps: dict[int, Wrap], *, role: str) -> PerCallForward:
    """Make ``module_name``'s k-th call in every forward of ``model`` run through ``wraps[k]``; other calls run as before.

    Args:
        model: the model whose forward the calls are counted in (its forward pre-hook starts each count).
        module_name: the module, as ``model.named_modules()`` names it.
        wraps: call (from 0) -> how that call runs (``Wrap``).
        role: the strategy's name for its blocks ("checkpoint", "offload"), for ``applied_calls`` and errors.
    """
    module = model.get_submodule(module_name)
    patched = PerCallForward(forward=module.forward, wraps=dict(wraps), module_name=module_name, role=role)
    model.register_forward_pre_hook(patched.model_forward_begins)
    model.register_forward_hook(patched.model_forward_ends)
    module.forward = patched
    return patched


def applied_calls(module: nn.Module, *, role: str) -> dict[int, Wrap]:
    """What ``patch_calls`` with ``role`` installed on ``module``: call -> its wrap ({} where it installed nothing)."""
    forward = module.__dict__.get("forward")
    while isinstance(forward, PerCallForward):
        if forward.role == role:
            return forward.wraps
        forward = forward.forward
    return {}
