"""Activation checkpointing of chosen blocks, by module name: full or selective.

A block is in one of three modes:

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
gradients are those of the block without checkpointing. A kept output that a
later op changes in place (``nn.ReLU(inplace=True)`` after a convolution, in the
block or after it) no longer holds the op's value: selective recomputation
runs that op again instead of using it.

Blocks are found in the module tree (``checkpoint_granularities``): the
children of a ModuleList, Sequential or ModuleDict whose children all have one
type (transformer layers, ResNet blocks), the children of a mixed container
whose type is a composite module that occurs there at least twice (a U-Net
decoder alternating up-convolutions and blocks), and any other module of such
a block type (a U-Net's lone bottleneck). Blocks that hold blocks in a
Sequential (ConvNeXt or Swin stages) give a choice of granularity: the stages,
or the blocks inside them. Given example inputs, one forward over fake tensors
(no arithmetic) drops the blocks it never calls and puts the rest in the order
it calls them; a module it calls several times (ALBERT's shared layer) gives a
finer granularity still, one block per call (``module#k``, ``strategies.per_call``),
each checkpointed at its own call only.
"""
from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from autofit._torch_private import selective_checkpoint_contexts
from autofit.errors import UserError
from strategies.base import Strategy
from strategies.per_call import Wrap, applied_calls, call_name, patch_calls, split_call


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    blocks: list[str] = field(default_factory=list)
    """Module names whose whole forward recomputes in backward; [] turns full checkpointing off."""
    selective_blocks: list[str] = field(default_factory=list)
    """Module names that keep their matmul, convolution and attention outputs and recompute the rest."""


def checkpoint_candidates(model: nn.Module, *, example_inputs=None) -> list[str]:
    """Names of the blocks the planner and "all" checkpoint: the finest granularity.

    For a model with one level of blocks (transformer layers, ResNet blocks)
    these are those blocks; for stages that hold blocks, the blocks inside.

    Args:
        model: the model.
        example_inputs: a batch of inputs as the training step passes them to
            ``model``; when given, blocks the forward never calls are left out
            and the rest come in the order the forward calls them.

    Returns:
        Names in forward order (in definition order without example inputs);
        none lies inside another.
    """
    return checkpoint_granularities(model, example_inputs=example_inputs)[-1]


def checkpoint_granularities(model: nn.Module, *, example_inputs=None) -> list[list[str]]:
    """Every way of cutting the model into blocks, coarsest first.

    A model with one level of blocks has one granularity. Blocks that hold at
    least two composite blocks of one type in a Sequential (a ConvNeXt stage's
    blocks) add a finer one, where each such block is replaced by those inside
    it. Within a granularity no block lies inside another, in the module tree
    or (with example inputs) at run time. A model without blocks offers its
    top-level children that hold parameters and are not containers.

    Example:
        >>> checkpoint_granularities(timm.create_model("convnext_atto"))
        [['stages.0', ..., 'stages.3'], ['stages.0.blocks.0', ..., 'stages.3.blocks.1']]
    """
    blocks = _structural_blocks(model)
    if not blocks:
        blocks = {name: [] for name, child in model.named_children() if _holds_parameters(child) and not _never_called(child)}
    levels = [[name for name in blocks if not _inside_any(name, blocks)]]
    while True:
        finer = [inner for name in levels[-1] for inner in (blocks[name] or [name])]
        if finer == levels[-1]:
            break
        levels.append(finer)
    if example_inputs is None:
        return levels
    names = {n for level in levels for n in level}
    calls = _forward_calls(model, example_inputs, sorted(names | {n for n, m in model.named_modules() if _may_be_shared(m)}))
    if calls is None:  # the forward cannot run over fake tensors: keep what the module tree says
        return levels
    order = {name: sequence[0] for name, sequence in calls.sequence.items()}
    inside = calls.inside
    called = []
    for level in levels:
        kept = [n for n in level if n in order and not any(outer in inside.get(n, ()) for outer in level)]
        kept.sort(key=order.__getitem__)
        if kept and kept not in called:
            called.append(kept)
    per_call = None if _per_sample(example_inputs) else _per_call_level(called[-1] if called else [], calls)
    if per_call is not None and per_call not in called:
        called.append(per_call)
    return called or [[]]


def _per_sample(inputs) -> bool:
    """Whether the inputs hold lists (one entry per sample: torchvision detection's images). A forward over them calls
    its layers once per sample, a count that follows the micro-batch, not the model: no layer is named per call."""
    values = inputs.values() if isinstance(inputs, dict) else inputs if isinstance(inputs, tuple) else ()
    return isinstance(inputs, list) or any(isinstance(value, list) for value in values)


def _may_be_shared(module: nn.Module) -> bool:
    """Whether a module called several times in one forward is offered per call: a composite module holding
    parameters (a shared layer), not a container (its children are the blocks) nor a leaf (a tied norm)."""
    return (
        any(True for _ in module.children()) and _holds_parameters(module)
        and not isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict))
    )


def _per_call_level(level: list[str], calls: _Calls) -> list[str] | None:
    """``level`` with its modules that one forward calls several times named once per call (``module#k``).

    A block of ``level`` called several times is split into its calls; a block called once that holds a
    module called several times (ALBERT's backbone and its shared layer) is replaced by that module's calls,
    where every one of them runs inside it; such a module outside every block is added by its calls, where
    none runs inside a block. None when no module is called twice.
    """
    repeated = [name for name, sequence in calls.sequence.items() if len(sequence) >= 2]
    if not repeated:
        return None
    split = [b for b in level if b in repeated]
    shared = [
        s for s in repeated
        if s not in level and not any(_within(b, s) for b in level) and not any(_within(s, b) for b in split)
    ]
    shared = [s for s in shared if not any(_within(s, other) for other in shared)]  # the outermost ones

    def each_call(name: str) -> list[tuple[str, int]]:
        return [(name, k) for k in range(len(calls.sequence[name]))]

    finer: list[tuple[str, int | None]] = []
    for block in level:
        inner = [s for s in shared if _within(s, block) and all(block in calls.stacks[s, k] for k in range(len(calls.sequence[s])))]
        if block in split:
            finer += each_call(block)
        elif inner:
            finer += [c for s in inner for c in each_call(s)]
        else:
            finer.append((block, None))
    for s in shared:
        if not any(_within(s, b) for b in level) and not any(b in calls.stacks[c] for c in each_call(s) for b in level):
            finer += each_call(s)
    if all(call is None for _, call in finer):
        return None
    finer.sort(key=lambda c: calls.sequence[c[0]][c[1] or 0])
    return [name if call is None else call_name(name, call) for name, call in finer]


def _within(name: str, outer: str) -> bool:
    """Whether module ``name`` lies inside module ``outer`` (not itself); "" is the model."""
    return name != outer and (outer == "" or name.startswith(outer + "."))


def _structural_blocks(model: nn.Module) -> dict[str, list[str]]:
    """Every block in definition order, each with the blocks a finer granularity puts in its place."""
    found: set[str] = set()
    chained: set[str] = set()  # composite blocks of one type in a Sequential: they can stand in for the block around them
    block_types: set[type] = set()
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue
        children = [(f"{name}.{child_name}" if name else child_name, child) for child_name, child in module.named_children()]
        counts = Counter(type(child) for _, child in children)
        one_type = len(counts) == 1 and len(children) >= 2
        for child_name, child in children:
            if counts[type(child)] < 2 or not _holds_parameters(child) or _never_called(child):
                continue
            composite = any(True for _ in child.children()) and type(child) not in (nn.Sequential, nn.ModuleList, nn.ModuleDict)
            if one_type or composite:
                found.add(child_name)
            if composite:
                block_types.add(type(child))
                if one_type and isinstance(module, nn.Sequential):
                    chained.add(child_name)
    # A module of a block type outside every block (a U-Net's lone bottleneck) is a block too.
    for name, module in model.named_modules():
        if name and type(module) in block_types and name not in found and not _inside_any(name, found):
            found.add(name)
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    blocks: dict[str, list[str]] = {name: [] for name in sorted(found, key=order.__getitem__)}
    for name in blocks:
        outer = _enclosing(name, blocks)
        if name in chained and outer is not None:
            blocks[outer].append(name)
    return blocks


def _never_called(module: nn.Module) -> bool:
    # ModuleList and ModuleDict only hold modules: their forward is never called.
    return isinstance(module, (nn.ModuleList, nn.ModuleDict))


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _inside_any(name: str, names) -> bool:
    return _enclosing(name, names) is not None


def _enclosing(name: str, names) -> str | None:
    """The nearest of ``names`` that ``name`` lies inside (not itself), or None."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        outer = ".".join(parts[:cut])
        if outer in names:
            return outer
    return None


@dataclass(frozen=True, slots=True)
class _Calls:
    """What one forward called, of the modules it watched."""

    sequence: dict[str, list[int]]
    """Module -> the position of each of its calls among all the watched calls, in call order."""
    inside: dict[str, set[str]]
    """Module -> the watched modules running at any of its calls."""
    stacks: dict[tuple[str, int], frozenset[str]]
    """(module, call) -> the watched modules running at that call."""


def _forward_calls(model: nn.Module, example_inputs, names: list[str]) -> _Calls | None:
    """Run one forward over fake tensors; say which of the modules ``names`` it called, when, and inside which.

    None when the forward fails over fake tensors (a data-dependent branch).
    """
    from autofit._torch_private import fake_mode_for, tree_map
    from autofit.model_io import call_model

    modules = dict(model.named_modules())
    sequence: dict[str, list[int]] = {}
    inside: dict[str, set[str]] = {}
    stacks: dict[tuple[str, int], frozenset[str]] = {}
    stack: list[str] = []
    made = [0]

    def pre_hook(name):
        def hook(module, args):
            calls = sequence.setdefault(name, [])
            stacks[name, len(calls)] = frozenset(stack)
            calls.append(made[0])
            made[0] += 1
            inside.setdefault(name, set()).update(stack)
            stack.append(name)
        return hook

    def post_hook(module, args, output):
        stack.pop()

    handles = []
    for name in names:
        handles.append(modules[name].register_forward_pre_hook(pre_hook(name)))
        handles.append(modules[name].register_forward_hook(post_hook))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    # Fake ops leave real tensors alone, except Python-side updates (BatchNorm counts its batches).
    buffers = [(buffer, buffer.clone()) for buffer in model.buffers()]
    try:
        with fake_mode_for(example_inputs), torch.no_grad():
            # As the step calls it (a dict is keyword inputs: a Hugging Face model's input_ids, labels).
            call_model(model, tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, example_inputs))
    except Exception:  # the user's model: any failure means "no run-time information"
        return None
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return _Calls(sequence=sequence, inside=inside, stacks=stacks)


def resolve_blocks(model: nn.Module, spec: str | Sequence[str] | None, *, what: str = "checkpoint") -> list[str]:
    """Turn "all", "none", "a,b" or a list (["all"] too) into validated block names.

    "all" is every block of the finest granularity the module tree shows; named
    blocks may come from any granularity, as long as none lies inside another.
    A call of a module that one forward calls several times is named
    ``module#k`` (``strategies.per_call``): which calls there are, only a
    forward says (``checkpoint_granularities`` with example inputs, as
    ``autofit probe --list-blocks`` lists them); a call the forward never makes
    is refused when it runs (``PerCallForward.model_forward_ends``).

    Args:
        what: the setting the names come from, for the error message.

    Raises:
        UserError: a name is not a block (the message lists them), or one
            named block lies inside another.
    """
    names = [n.strip() for n in spec.split(",")] if isinstance(spec, str) else list(spec or [])
    if names in ([], ["none"]):
        return []
    levels = checkpoint_granularities(model)
    if names == ["all"]:
        return levels[-1]
    known = {name for level in levels for name in level}
    modules = dict(model.named_modules())
    unknown = [n for n in names if n not in known and not _a_call_of_a_block(n, modules)]
    if unknown:
        coarser = "".join(f"; or coarser: {', '.join(level)}" for level in reversed(levels[:-1]))
        raise UserError(
            f"{what} block(s) {', '.join(unknown)} not found; candidates are: {', '.join(levels[-1])}{coarser} "
            "(or 'all' / 'none'; a layer called several times in a forward is named per call, LAYER#0, LAYER#1, ...: "
            "autofit probe --list-blocks lists them)"
        )
    named: dict[str, str] = {}
    """Module -> the name naming it: the whole module where it is named so, else one of its calls."""
    for name in names:
        module, call = split_call(name)
        if call is None or module not in named:
            named[module] = name
    for name in names:
        module, call = split_call(name)
        # A call lies inside its whole module, and inside every module around that module.
        outer = module if call is not None and named[module] == module else _enclosing(module, named)
        if outer is not None:
            raise UserError(f"{what} blocks {named[outer]} and {name} nest ({name} lies inside {named[outer]}); name one of them")
    return names


def _a_call_of_a_block(name: str, modules: dict[str, nn.Module]) -> bool:
    """Whether ``name`` is ``module#k`` for a module that may be called several times (``_may_be_shared``)."""
    module_name, call = split_call(name)
    return call is not None and module_name in modules and _may_be_shared(modules[module_name])


def _share_a_call(one: str, other: str) -> bool:
    """Whether two blocks run at a common call: the same module, and one names every call or both the same."""
    module, call = split_call(one)
    other_module, other_call = split_call(other)
    return module == other_module and (call is None or other_call is None or call == other_call)


def check_one_mode_per_block(modes: dict[str, list[str]]) -> None:
    """Refuse a block named in two exclusive modes, e.g. {"checkpoint": [...], "offload": [...]}.

    A module named whole in one mode and by a call in another is refused too.

    Raises:
        UserError: one line naming the block and both modes.
    """
    seen: dict[str, dict[str, str]] = {}
    """Module -> its blocks named so far (whole, or a call) -> their mode."""
    for mode, names in modes.items():
        for name in names:
            named = seen.setdefault(split_call(name)[0], {})
            clash = next((other for other, other_mode in named.items() if other_mode != mode and _share_a_call(name, other)), None)
            if clash is not None:
                block = name if clash == name else f"{clash} / {name}"
                raise UserError(
                    f"block {block} is both in {named[clash]} and in {mode}; a block takes one of them, drop it from one"
                )
            named[name] = mode


class Checkpointing(Strategy):
    """Wrap the configured blocks' forward in ``torch.utils.checkpoint``, fully or selectively."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config

    @staticmethod
    def applied_blocks(model: nn.Module) -> list[str]:
        """Names of the blocks of ``model`` whose whole forward this strategy made recompute in backward."""
        return _applied(model, flag="_autofit_checkpointed", wrap=_checkpointed_forward)

    @staticmethod
    def applied_selective_blocks(model: nn.Module) -> list[str]:
        """Names of the blocks of ``model`` this strategy checkpointed selectively."""
        return _applied(model, flag="_autofit_selective", wrap=_selectively_checkpointed_forward)

    def apply(self, model: nn.Module) -> nn.Module:
        """Patch the forward of every configured block; a block named by a call (``module#k``) only at that call.

        Raises:
            UserError: an unknown block, or a block in both modes.
        """
        full = resolve_blocks(model, self.config.blocks)
        selective = resolve_blocks(model, self.config.selective_blocks, what="selective checkpoint")
        check_one_mode_per_block({"checkpoint": full, "selective_checkpoint": selective})
        if full or selective:
            _turn_off_kv_cache(model)
        modules = dict(model.named_modules())
        per_call: dict[str, dict[int, Wrap]] = {}
        for names, patched, flag in ((full, _checkpointed_forward, "_autofit_checkpointed"),
                                     (selective, _selectively_checkpointed_forward, "_autofit_selective")):
            for name in names:
                module_name, call = split_call(name)
                if call is not None:
                    per_call.setdefault(module_name, {})[call] = patched
                    continue
                module = modules[name]
                if getattr(module, "_autofit_checkpointed", False) or getattr(module, "_autofit_selective", False):
                    continue
                module.forward = functools.partial(patched, module.forward)
                setattr(module, flag, True)
        for module_name, wraps in per_call.items():
            if not applied_calls(modules[module_name], role="checkpoint"):  # applied once (a warm-up applies again)
                patch_calls(model, module_name, wraps, role="checkpoint")
        return model


def _applied(model: nn.Module, *, flag: str, wrap: Wrap) -> list[str]:
    """The blocks checkpointed one way: whole modules flagged ``flag``, and calls whose wrap is ``wrap``."""
    names = []
    for name, module in model.named_modules():
        if getattr(module, flag, False):
            names.append(name)
        names += [call_name(name, call) for call, how in sorted(applied_calls(module, role="checkpoint").items()) if how is wrap]
    return names


def _turn_off_kv_cache(model: nn.Module) -> None:
    """Set ``config.use_cache = False`` on every module whose config has it on (Hugging Face models).

    With the cache on, each forward appends its keys and values to it; a
    recomputed block would append them a second time. Hugging Face's own
    gradient checkpointing turns it off for training in the same way.
    """
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False


def _checkpointed_forward(forward, *args, **kwargs):
    with _without_autocast_cache():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


@contextmanager
def _without_autocast_cache() -> Iterator[None]:
    """Autocast as it is, less its weight cache, for one checkpointed block.

    Autocast keeps every low-precision copy of a weight it makes until the
    outermost autocast exits, so inside a checkpointed block the cache keeps
    alive exactly what checkpointing drops (the copies the block's backward
    needs): a bf16 ViT-tiny held 103.7 MiB where the memory model predicted
    96.5 MiB. Turned off here, the block frees them, and its recomputation runs
    with the same setting (checkpoint restores the autocast state). The rest of
    the model keeps the cache: a layer applied many times per step is cast once,
    not once per use (turned off everywhere, an ALBERT-style shared block in a
    loop held 18% more).
    """
    with ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                dtype = torch.get_autocast_dtype(device_type)
                stack.enter_context(torch.autocast(device_type=device_type, dtype=dtype, cache_enabled=False))
        yield



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


def selective_saves(op) -> bool:
    """Whether a selectively checkpointed block keeps this ATen op's outputs (one of ``SAVED_OPS``) rather than
    recomputing it: the policy below, and the planner's memory and speed models of it, ask this one question."""
    return op.overloadpacket in SAVED_OPS


def changed_in_place(op, args, kwargs) -> list[torch.Tensor]:
    """The tensors an ATen op writes into (``relu_``'s input, an ``out=`` argument), by its schema.

    A kept output among them no longer holds its op's value: selective
    recomputation runs that op again (the planner's speed model counts it so).
    """
    written = []
    for index, argument in enumerate(op._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else (kwargs or {}).get(argument.name)
        written += [t for t in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(t, torch.Tensor)]
    return written


def _save_compute_heavy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective policy: keep the outputs of ``SAVED_OPS``, recompute every other op."""
    return CheckpointPolicy.MUST_SAVE if selective_saves(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    # An output the policy keeps and a later op changes in place (a convolution, then ReLU(inplace=True)) is
    # computed again in backward rather than refused: see ``selective_checkpoint_contexts``.
    return selective_checkpoint_contexts(_save_compute_heavy)


def _selectively_checkpointed_forward(forward, *args, **kwargs):
    with _without_autocast_cache():
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)
