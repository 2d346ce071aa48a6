"""Activation checkpointing of chosen blocks, by module name.

Candidates are the children of ModuleLists/Sequentials whose children all have
one type (ResNet stages' blocks, transformer layers). A chosen block's forward
runs under ``torch.utils.checkpoint`` (non-reentrant): its activations are
dropped after the forward and recomputed in backward. The forward is patched
on the instance, so parameter names and state_dict keys do not change.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from torch import nn
from torch.utils.checkpoint import checkpoint

from autofit.errors import UserError
from strategies.base import Strategy


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    blocks: list[str] = field(default_factory=list)
    """Module names whose forward recomputes in backward; [] turns checkpointing off."""


def checkpoint_candidates(model: nn.Module) -> list[str]:
    """Names of the blocks that can be checkpointed, in forward order of definition.

    The children of every ModuleList/Sequential with at least two children of
    one type; a candidate never lies inside another. A model without such a
    container offers its top-level children that hold parameters.
    """
    names: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(child) for _, child in children}) != 1:
            continue
        if not any(True for _ in children[0][1].parameters()):
            continue
        if any(name == c or name.startswith(c + ".") for c in names):
            continue
        names.extend(f"{name}.{child}" if name else child for child, _ in children)
    if not names:
        names = [n for n, child in model.named_children() if any(True for _ in child.parameters())]
    return names


def resolve_blocks(model: nn.Module, spec: str | list[str] | None) -> list[str]:
    """Turn "all", "none", "a,b" or a list into validated candidate names.

    Raises:
        UserError: a name is not a candidate; the message lists them.
    """
    candidates = checkpoint_candidates(model)
    if spec is None or spec == "none" or spec == []:
        return []
    if spec == "all":
        return candidates
    names = [n.strip() for n in spec.split(",")] if isinstance(spec, str) else list(spec)
    unknown = [n for n in names if n not in candidates]
    if unknown:
        raise UserError(
            f"checkpoint block(s) {', '.join(unknown)} not found; candidates are: {', '.join(candidates)} "
            "(or 'all' / 'none')"
        )
    return names


class Checkpointing(Strategy):
    """Wrap the configured blocks' forward in ``torch.utils.checkpoint``."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config

    @staticmethod
    def applied_blocks(model: nn.Module) -> list[str]:
        """Names of the blocks of ``model`` whose forward this strategy made recompute in backward."""
        return [name for name, module in model.named_modules() if getattr(module, "_autofit_checkpointed", False)]

    def apply(self, model: nn.Module) -> nn.Module:
        blocks = resolve_blocks(model, self.config.blocks)
        if blocks and getattr(getattr(model, "config", None), "use_cache", False):
            # A transformers model's key/value cache would grow again in each recompute.
            model.config.use_cache = False
        modules = dict(model.named_modules())
        for name in blocks:
            module = modules[name]
            if getattr(module, "_autofit_checkpointed", False):
                continue
            module.forward = functools.partial(_checkpointed_forward, module.forward)
            module._autofit_checkpointed = True
        return model


def _checkpointed_forward(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
