"""Peak live tensor bytes, counted as storages are created and freed.

A dispatch mode sees every ATen op's outputs (forward, backward and optimizer
alike, also over fake tensors); each new storage is counted once, and a
finalizer subtracts it when PyTorch frees it. This is the CPU analogue of
``torch.cuda.max_memory_allocated``.

Storages created inside ``autofit.measure.host.host_allocation()`` (a
strategy's host copies, when the host is this same CPU) are counted apart, as
host bytes: they are not in ``peak_bytes``, as pinned host memory is not in a
GPU's.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from autofit._torch_private import RNN_LAYER, RNN_LAYER_BACKWARD, FakeTensor, TorchDispatchMode, inner_tensors, rnn_workspace_bytes, tree_leaves
from autofit.measure.host import allocating_on_host

ACTIVATIONS = "activations"
CATEGORIES = ("parameters", "gradients", "optimizer_state", ACTIVATIONS)

_aten = torch.ops.aten
# Normalisations that save their statistics (outputs 1 and 2) for backward. The CPU
# kernels keep them in the widest dtype among the input and its weight, bias and running
# statistics (fp32 for a bf16 input to an fp32 BatchNorm, as under autocast); the fake
# (meta) kernels return them in the input's dtype. They are counted as the real kernels
# hold them, so that the simulated meter equals the cpu meter.
_FP32_STATISTICS = {
    _aten.native_batch_norm,
    _aten._native_batch_norm_legit,
    _aten._native_batch_norm_legit_functional,
    _aten.native_group_norm,
    _aten.native_layer_norm,
}
# oneDNN's RNN layer (an LSTM's on the CPU) returns the workspace its backward reads as output 3; the
# fake kernel returns it empty. Its backward's fake kernel returns one tensor as both bias gradients,
# where the real one allocates two. Over fake tensors both are counted as the real kernels allocate them.


@dataclass(slots=True)
class _Record:
    nbytes: int
    born: int
    died: int | None = None
    category: str = ACTIVATIONS
    widen: int = 1
    """Counted bytes per stored byte (2 for statistics a fake kernel returns in half precision)."""
    host: bool = False
    """Made inside ``host_allocation()``: host memory, not in the device peak."""
    fixed: bool = False
    """Counted at bytes given when it was made (a fake kernel's empty workspace), whatever its storage says."""


class StorageTracker(TorchDispatchMode):
    """Counts live storage bytes while active.

    Args:
        round_bytes: round each storage up to a multiple of this (1 on the CPU;
            512 mimics the CUDA caching allocator's block size).

    Example:
        >>> tracker = StorageTracker()
        >>> tracker.track(model.parameters())   # tensors that existed before
        >>> with tracker:
        ...     loss = model(x).sum(); loss.backward()
        >>> tracker.peak_bytes
    """

    def __init__(self, *, round_bytes: int = 1) -> None:
        super().__init__()
        self.round_bytes = round_bytes
        self.current_bytes = 0
        self.peak_bytes = 0
        self.host_current_bytes = 0
        self.host_peak_bytes = 0
        """Live and peak bytes of host storages (see the module docstring)."""
        self._clock = 0
        self._peak_clock = 0
        self._live: dict[int, _Record] = {}
        self._records: list[_Record] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _FP32_STATISTICS:
            widest = max(a.element_size() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.is_floating_point())
            for statistic in out[1:3]:
                self._track_one(statistic, widen=max(widest // statistic.element_size(), 1))
        if func.overloadpacket is RNN_LAYER and isinstance(out[3], FakeTensor):
            self._track_one(out[3], nbytes=rnn_workspace_bytes(args))
        if func.overloadpacket is RNN_LAYER_BACKWARD and isinstance(out[3], FakeTensor) and _same_storage(out[3], out[4]):
            self._track_one(out[3], nbytes=2 * out[3].untyped_storage().nbytes())
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out

    def track(self, tensors: Iterable[torch.Tensor], category: str = ACTIVATIONS) -> None:
        """Count tensors made outside the mode (parameters, inputs) and label them."""
        for tensor in tensors:
            if tensor is not None:
                for record in self._track(tensor):
                    record.category = category

    def label(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Name what already-counted tensors are, for the breakdown."""
        self.track(tensors, category)

    def counted_bytes(self, tensor: torch.Tensor) -> int:
        """The bytes counted for ``tensor``'s storage (rounded, as the real kernel holds it); for a wrapper subclass
        (torchao's 8-bit state, an NF4 weight), its inner tensors', as ``track`` counts it."""
        inner = inner_tensors(tensor)
        if inner is not None:
            return sum(self.counted_bytes(t) for t in inner)
        record = self._live.get(id(tensor.untyped_storage()))
        if record is None:
            return _round_up(tensor.untyped_storage().nbytes(), self.round_bytes)
        return record.nbytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes
        self._peak_clock = self._clock

    def breakdown_at_peak(self) -> dict[str, int]:
        """Bytes by category of the storages that were live at the peak."""
        totals = dict.fromkeys(CATEGORIES, 0)
        for record in self._records:
            if record.host:
                continue
            if record.born <= self._peak_clock and (record.died is None or record.died > self._peak_clock):
                totals[record.category] += record.nbytes
        return totals

    def _track(self, tensor: torch.Tensor) -> list[_Record]:
        """Count a tensor's storage; a wrapper subclass's inner tensors' storages instead."""
        inner = inner_tensors(tensor)
        if inner is None:
            return [self._track_one(tensor)]
        return [self._track_one(t) for t in inner]

    def _track_one(self, tensor: torch.Tensor, *, widen: int = 1, nbytes: int | None = None) -> _Record:
        """Count one storage; ``nbytes`` fixes its counted size (before rounding) instead of its own."""
        storage = tensor.untyped_storage()
        key = id(storage)
        record = self._live.get(key)
        if record is not None and record.fixed:
            return record
        fixed = nbytes is not None
        if nbytes is None:
            nbytes = storage.nbytes() * (record.widen if record is not None else widen)
        nbytes = _round_up(nbytes, self.round_bytes)
        if record is not None:
            if record.nbytes != nbytes:  # resized in place
                self._grow_on(record, nbytes - record.nbytes)
                record.nbytes = nbytes
            return record
        self._clock += 1
        record = _Record(nbytes=nbytes, born=self._clock, widen=widen, host=allocating_on_host(), fixed=fixed)
        self._live[key] = record
        self._records.append(record)
        weakref.finalize(storage, self._free, key)
        self._grow_on(record, nbytes)
        return record

    def _grow_on(self, record: _Record, nbytes: int) -> None:
        if record.host:
            self.host_current_bytes += nbytes
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_current_bytes)
        else:
            self._grow(nbytes)

    def _grow(self, nbytes: int) -> None:
        """Device bytes: ``nbytes`` more (or fewer) live."""
        self.current_bytes += nbytes
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self._peak_clock = self._clock

    def _free(self, key: int) -> None:
        record = self._live.pop(key, None)
        if record is None:
            return
        self._clock += 1
        record.died = self._clock
        if record.host:
            self.host_current_bytes -= record.nbytes
        else:
            self.current_bytes -= record.nbytes


def _same_storage(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.untyped_storage() is b.untyped_storage()


def _round_up(nbytes: int, multiple: int) -> int:
    return -(-nbytes // multiple) * multiple
