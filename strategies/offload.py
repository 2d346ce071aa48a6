"""Activation offload: the tensors chosen blocks save for backward wait in host memory.

A chosen block's forward runs under ``torch.autograd.graph.saved_tensors_hooks``:
each activation it saves for backward is copied to the host when it is saved
(pack) and back to the device when backward needs it (unpack), so between its
forward and its backward the block keeps no activation bytes on the device.
It is ``torch.autograd.graph.save_on_cpu`` with three changes: parameters
(and views of them) stay where they are, since they are alive anyway; tensors
under ``MIN_OFFLOAD_BYTES`` stay, since a copy costs more than they save; and
a storage saved twice in one forward (an op's output that the next op saves
as its input) is copied once, and brought back once.

On CUDA the host buffers are pinned and the device-to-host copies run on a
side stream, overlapping the forward's compute: the side stream first waits
for the work that made the tensor, and the tensor's device memory is not
reused before its copy is done (``Tensor.record_stream``). Backward waits for
a tensor's copy to have finished, then copies it back on its own stream.

On the CPU the host is the device: the copy is a second CPU tensor made
inside ``host_allocation()``, which the cpu and simulated meters count as host
memory, not in the device peak; backward gets a fresh copy counted on the
device. Backward reads exact copies, so the gradients are those without
offloading.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from autofit.measure.host import host_allocation
from strategies.base import Strategy
from strategies.checkpointing import resolve_blocks
from strategies.per_call import Wrap, applied_calls, call_name, patch_calls, split_call

MIN_OFFLOAD_BYTES = 1024
"""Saved tensors smaller than this stay on the device."""


@dataclass(kw_only=True, slots=True)
class OffloadConfig:
    blocks: list[str] = field(default_factory=list)
    """Module names whose saved activations go to host memory between forward and backward; [] turns offload off."""


class ActivationOffload(Strategy):
    """Patch the configured blocks' forward so that what they save for backward waits on the host.

    Args:
        config: which blocks.
        device: where the model trains; saved tensors elsewhere (already on the host) stay.
    """

    def __init__(self, config: OffloadConfig, *, device: torch.device | str) -> None:
        self.config = config
        self.device = torch.device(device)
        self._stream: torch.cuda.Stream | None = None

    @staticmethod
    def applied_blocks(model: nn.Module) -> list[str]:
        """Names of the blocks of ``model`` whose saved activations this strategy offloads (``module#k``: one call)."""
        names = []
        for name, module in model.named_modules():
            if getattr(module, "_autofit_offloaded", False):
                names.append(name)
            names += [call_name(name, call) for call in sorted(applied_calls(module, role="offload"))]
        return names

    def apply(self, model: nn.Module) -> nn.Module:
        """Raises: UserError for a name that is not a block candidate."""
        modules = dict(model.named_modules())
        per_call: dict[str, dict[int, Wrap]] = {}
        for name in resolve_blocks(model, self.config.blocks, what="offload"):
            module_name, call = split_call(name)
            if call is not None:
                per_call.setdefault(module_name, {})[call] = self._offloaded_forward
                continue
            module = modules[name]
            if getattr(module, "_autofit_offloaded", False):
                continue
            module.forward = functools.partial(self._offloaded_forward, module.forward)
            module._autofit_offloaded = True
        for module_name, wraps in per_call.items():
            if not applied_calls(modules[module_name], role="offload"):  # applied once
                patch_calls(model, module_name, wraps, role="offload")
        return model

    def _offloaded_forward(self, forward, *args, **kwargs):
        copies = _OneForward(self)  # what this call saved, so a storage saved twice is copied once
        with torch.autograd.graph.saved_tensors_hooks(copies.pack, _unpack):
            return forward(*args, **kwargs)

    def copy_stream(self) -> torch.cuda.Stream:
        """The side stream the device-to-host copies run on (CUDA only), made on first use."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream


class _HostCopy:
    """One saved activation on the host, and the device tensor backward last restored from it."""

    __slots__ = ("host", "device", "copied", "restored", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, copied: torch.cuda.Event | None) -> None:
        self.host = host
        self.device = device
        self.copied = copied
        """CUDA: recorded on the side stream after the copy; backward waits for it."""
        self.restored: weakref.ref | None = None


class _OneForward:
    """The pack hook of one forward call of one offloaded block."""

    def __init__(self, strategy: ActivationOffload) -> None:
        self.strategy = strategy
        # (storage id, offset, shape, strides, dtype) -> (weakref to the storage, weakref to its copy)
        self.copies: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}

    def pack(self, tensor: torch.Tensor):
        if (
            tensor.device != self.strategy.device
            or tensor.layout != torch.strided
            or tensor.numel() * tensor.element_size() < MIN_OFFLOAD_BYTES
            or isinstance(tensor, nn.Parameter)
            or isinstance(tensor._base, nn.Parameter)
        ):
            return tensor
        storage = tensor.untyped_storage()
        key = (id(storage), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        seen = self.copies.get(key)
        if seen is not None and seen[0]() is storage and seen[1]() is not None:
            return seen[1]()
        copy = _to_host_cuda(tensor, self.strategy.copy_stream()) if tensor.is_cuda else _to_host_cpu(tensor)
        self.copies[key] = (weakref.ref(storage), weakref.ref(copy))
        return copy


def _to_host_cpu(tensor: torch.Tensor) -> _HostCopy:
    with host_allocation():
        host = tensor.detach().clone()
    return _HostCopy(host, tensor.device, None)


def _to_host_cuda(tensor: torch.Tensor, stream: torch.cuda.Stream) -> _HostCopy:
    stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the op that made it has run
    with torch.cuda.stream(stream):
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        copied = stream.record_event()
    tensor.record_stream(stream)  # its memory is not reused before the copy is done
    return _HostCopy(host, tensor.device, copied)


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    restored = packed.restored() if packed.restored is not None else None
    if restored is None:
        if packed.copied is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.copied)
            restored = packed.host.to(packed.device, non_blocking=True)
        else:
            restored = packed.host.clone()  # on the CPU "device": counted on the device, as a GPU copy would be
        packed.restored = weakref.ref(restored)
    return restored
