"""Activation checkpointing of chosen blocks, by module name: full or selective.

Candidates are the children of ModuleLists/Sequentials whose children all have
one type (ResNet stages' blocks, transformer layers). A block is in one of
three modes:

- none: it saves for backward what its ops save;
- full: its forward runs under ``torch.utils.checkpoint`` (non-reentrant): it
  keeps only its inputs, and backward recomputes its whole forward;
- selective: the same, with a policy (``create_selective_checkpoint_contexts``)
  that keeps the outputs of the compute-heavy ops (matmuls, convolutions,
  attention) from the forward and recomputes only the cheap rest (norms,
  activations, adds), so backward repeats little arithmetic for part of the
  saving.

The forward is patched on the instance, so parameter names and state_dict keys
do not change. Recomputation repeats the same ops on the same values, so the
gradients are those of the block without checkpointing.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autofit.errors import UserError
from strategies.base import Strategy


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    blocks: list[str] = field(default_factory=list)
    """Module names whose whole forward recomputes in backward; [] turns full checkpointing off."""
    selective_blocks: list[str] = field(default_factory=list)
    """Module names that keep their matmul, convolution and attention outputs and recompute the rest."""


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


def resolve_blocks(model: nn.Module, spec: str | list[str] | None, *, what: str = "checkpoint") -> list[str]:
    """Turn "all", "none", "a,b" or a list into validated candidate names.

    Args:
        what: the setting the names come from, for the error message.

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
            f"{what} block(s) {', '.join(unknown)} not found; candidates are: {', '.join(candidates)} "
            "(or 'all' / 'none')"
        )
    return names


def check_one_mode_per_block(modes: dict[str, list[str]]) -> None:
    """Refuse a block named in two exclusive modes, e.g. {"checkpoint": [...], "offload": [...]}.

    Raises:
        UserError: one line naming the block and both modes.
    """
    seen: dict[str, str] = {}
    for mode, names in modes.items():
        for name in names:
            if name in seen and seen[name] != mode:
                raise UserError(
                    f"block {name} is both in {seen[name]} and in {mode}; a block takes one of them, drop it from one"
                )
            seen[name] = mode


class Checkpointing(Strategy):
    """Wrap the configured blocks' forward in ``torch.utils.checkpoint``, fully or selectively."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config

    @staticmethod
    def applied_blocks(model: nn.Module) -> list[str]:
        """Names of the blocks of ``model`` whose whole forward this strategy made recompute in backward."""
        return [name for name, module in model.named_modules() if getattr(module, "_autofit_checkpointed", False)]

    @staticmethod
    def applied_selective_blocks(model: nn.Module) -> list[str]:
        """Names of the blocks of ``model`` this strategy checkpointed selectively."""
        return [name for name, module in model.named_modules() if getattr(module, "_autofit_selective", False)]

    def apply(self, model: nn.Module) -> nn.Module:
        """Patch the forward of every configured block.

        Raises:
            UserError: an unknown block, or a block in both modes.
        """
        full = resolve_blocks(model, self.config.blocks)
        selective = resolve_blocks(model, self.config.selective_blocks, what="selective checkpoint")
        check_one_mode_per_block({"checkpoint": full, "selective_checkpoint": selective})
        modules = dict(model.named_modules())
        for names, patched, flag in ((full, _checkpointed_forward, "_autofit_checkpointed"),
                                     (selective, _selectively_checkpointed_forward, "_autofit_selective")):
            for name in names:
                module = modules[name]
                if getattr(module, "_autofit_checkpointed", False) or getattr(module, "_autofit_selective", False):
                    continue
                module.forward = functools.partial(patched, module.forward)
                setattr(module, flag, True)
        return model


def _checkpointed_forward(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


# Ops whose outputs a selectively checkpointed block keeps: they hold most of a
# block's arithmetic (recomputing them would cost about a second forward) and
# their outputs are few. ``linear`` usually decomposes into addmm/mm before the
# policy sees it; it is listed for the backends where it does not.
_aten = torch.ops.aten
SAVED_OPS = frozenset({
    _aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.linear, _aten.convolution,
    _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_cudnn_attention, _aten._scaled_dot_product_flash_attention_for_cpu,
    _aten._scaled_dot_product_fused_attention_overrideable,
})


def _save_compute_heavy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective policy: keep the outputs of ``SAVED_OPS``, recompute every other op."""
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_save_compute_heavy)


def _selectively_checkpointed_forward(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)
