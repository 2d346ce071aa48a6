"""Block boundaries: callbacks as named modules' forwards start and return.

The block profiles (``measure.blocks``), the memory traces
(``planning.memory.traces``), the speed model's block timings and its FLOP
estimate of selective recompute (``planning.speed``) and checkpointing's
discovery of the blocks a forward calls (``strategies.checkpointing``) each
need to know which block's forward is running. This is the one place that
hooks a forward's start and end; each caller records its own thing.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from torch import nn

from strategies.per_call import split_call

Enter = Callable[[str, tuple], None]
"""(name, args) -> None: a named module's forward is about to run on ``args``."""
Leave = Callable[[str, tuple, dict, object], None]
"""(name, args, kwargs, output) -> None: a named module's forward returned ``output``."""


@contextmanager
def block_boundaries(model: nn.Module, names: Iterable[str], *, enter: Enter | None = None, leave: Leave | None = None) -> Iterator[None]:
    """Within the block, call ``enter`` as each named module's forward starts and ``leave`` as it returns.

    Args:
        model: the model whose modules ``names`` names ("" is the model itself).
        names: module names, as ``model.named_modules()`` gives them; a name with a call
            (``encoder.layer#2``, ``strategies.per_call``) is that call only, counted from the
            start of each forward of ``model``.
        enter: called with the name and the forward's positional inputs before it runs (nothing when None).
        leave: called with the name, the forward's positional and keyword inputs and its output (nothing when None).

    The hooks are removed when the block is left, also on an exception.

    Example:
        >>> import torch
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> seen = []
        >>> with block_boundaries(model, ["0", "1"], enter=lambda name, args: seen.append(name)):
        ...     _ = model(torch.ones(1, 2))
        >>> seen
        ['0', '1']
    """
    # Module -> its call (None: every call) -> the name the callbacks hear.
    named: dict[str, dict[int | None, str]] = {}
    for name in names:
        module_name, call = split_call(name)
        named.setdefault(module_name, {})[call] = name
    calls: dict[str, int] = {}
    """Calls of each module since the model's forward began."""
    running: dict[str, list[int]] = {}
    """Each module's calls that have begun and not returned, innermost last."""

    def model_begins(module, args) -> None:
        calls.clear()

    # A hook that returns a value replaces the forward's inputs or output: these return None whatever the callbacks do.
    def pre_hook(module_name: str):
        by_call = named[module_name]

        def hook(module, args) -> None:
            call = calls.get(module_name, 0)
            calls[module_name] = call + 1
            running.setdefault(module_name, []).append(call)
            if enter is not None:
                for name in (by_call.get(None), by_call.get(call)):
                    if name is not None:
                        enter(name, args)
        return hook

    def post_hook(module_name: str):
        by_call = named[module_name]

        def hook(module, args, kwargs, output) -> None:
            call = running[module_name].pop()
            if leave is not None:
                for name in (by_call.get(call), by_call.get(None)):
                    if name is not None:
                        leave(name, args, kwargs, output)
        return hook

    modules = dict(model.named_modules())
    handles = []
    try:
        if enter is not None or leave is not None:
            handles.append(model.register_forward_pre_hook(model_begins))  # first: the model's own hooks come after
            for module_name in named:
                handles.append(modules[module_name].register_forward_pre_hook(pre_hook(module_name)))
                handles.append(modules[module_name].register_forward_hook(post_hook(module_name), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
