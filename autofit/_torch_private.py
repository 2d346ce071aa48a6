"""Every private PyTorch API autofit uses, in one place.

A PyTorch release that moves one of these can only break this file.
"""
from __future__ import annotations

import collections
import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.utils.checkpoint as _checkpoint
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves, tree_map

__all__ = [
    "FAKE_TENSOR_LIMITS",
    "FakeTensor",
    "FakeTensorMode",
    "NORM_AND_DROPOUT_TYPES",
    "TorchDispatchMode",
    "call_when_backward_ends",
    "copy_tensors",
    "fake_mode_active",
    "fake_mode_for",
    "failed_fake_kernel",
    "fake_process_group_store",
    "flop_counter",
    "grad_scaler_tensors",
    "inner_tensors",
    "new_fake_mode",
    "op_flops",
    "optimizers_step_as_on_cuda",
    "quiet_fake_kernel_failures",
    "register_list_type",
    "reset_grad_scaler_step",
    "RNN_LAYER",
    "RNN_LAYER_BACKWARD",
    "rnn_workspace_bytes",
    "expandable_segments_in_use",
    "selective_checkpoint_contexts",
    "set_cuda_allocator_settings",
    "storage_resizes",
    "tree_leaves",
    "tree_map",
    "versions",
    "without_dispatch_modes",
]


NORM_AND_DROPOUT_TYPES = (torch.nn.modules.batchnorm._NormBase, torch.nn.modules.dropout._DropoutNd)
"""Modules whose train mode changes state or draws randomness: batch and instance norms (running statistics), dropout."""


def register_list_type(cls: type) -> type:
    """Make a ``list`` subclass a pytree node, so ``tree_map`` and ``tree_leaves`` go into it and rebuild it as ``cls``
    (a plain subclass is a leaf to them)."""
    from torch.utils import _pytree

    _pytree.register_pytree_node(
        cls, lambda items: (list(items), None), lambda items, _: cls(items),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
    )
    return cls


def without_dispatch_modes():
    """A context in which no dispatch mode (fake tensors, trackers) is active: tensors made in it are real."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


RNN_LAYER = torch.ops.aten.mkldnn_rnn_layer
"""oneDNN's RNN layer (an LSTM's on the CPU): its fake kernel returns an empty workspace (output 3) where the
CPU kernel allocates one for backward."""
RNN_LAYER_BACKWARD = torch.ops.aten.mkldnn_rnn_layer_backward
"""Its backward: the fake kernel returns one tensor as both bias gradients (outputs 3 and 4), the CPU kernel two."""


def rnn_workspace_bytes(args: tuple) -> int:
    """Bytes of the workspace oneDNN's RNN layer (``mkldnn_rnn_layer``) allocates for a call with these arguments.

    Its size follows oneDNN's layout (page-aligned regions for the gates and the layer, iteration and cell
    states, each with padded leading dimensions), which changes with the oneDNN build; so the real kernel is
    asked, once per shape, on zero tensors of the arguments' shapes and dtypes outside every mode.
    """
    signature = tuple(
        ("tensor", tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else tuple(a) if isinstance(a, list) else a
        for a in args
    )
    return _rnn_workspace_bytes(signature)


@functools.cache
def _rnn_workspace_bytes(signature: tuple) -> int:
    with without_dispatch_modes():  # not under no_grad: the kernel makes its workspace only when grad mode is on
        args = [
            torch.zeros(a[1], dtype=a[2]) if isinstance(a, tuple) and a[:1] == ("tensor",)
            else list(a) if isinstance(a, tuple) else a
            for a in signature
        ]
        return RNN_LAYER.default(*args)[3].untyped_storage().nbytes()


def to_empty_quickly(module: torch.nn.Module, *, device: str) -> torch.nn.Module:
    """``module.to_empty(device=device)``, each tensor made by shape rather than ``empty_like`` of a meta tensor.

    Under a fake-tensor mode ``empty_like`` first converts its meta argument (about 1 ms a tensor: 0.2 s of
    every ResNet-50 build); a constructor from the shape does not. A tensor that is not contiguous keeps
    ``empty_like``'s layout. ``Module._apply`` is what ``to_empty`` itself calls (modules such as RNNs hook it).
    """
    def empty(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_contiguous():
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        return torch.empty_like(tensor, device=device)

    return module._apply(empty)


def modes_active() -> bool:
    """Whether any torch function mode (``torch.device(...)`` as a context) or dispatch mode (fake tensors, a tracker) is on."""
    return bool(torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack())


def fake_mode_active() -> bool:
    """Whether a fake-tensor mode is on: what is computed now, even from real tensors, has no values."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


FAKE_TENSOR_LIMITS = (
    DataDependentOutputException,  # .item(), a Python branch on a tensor's value
    DynamicOutputShapeException,  # nonzero, masked_select: the output's shape depends on values
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
"""What a model that fake tensors cannot run raises (a value or an operator they do not have)."""


def versions(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's version counter: it grows with every in-place change (an optimizer's update, a BatchNorm's statistics)."""
    return [t._version for t in tensors]


def copy_tensors(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``target.copy_(source)`` for every pair, in a few grouped kernels rather than one launch each."""
    if targets:
        torch._foreach_copy_(targets, sources)


def grad_scaler_tensors(scaler: torch.amp.GradScaler) -> list[torch.Tensor]:
    """The tensors a GradScaler's ``update`` changes in place: its scale and growth tracker (none before its first use)."""
    return [t for t in (getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)) if t is not None]


def reset_grad_scaler_step(scaler: torch.amp.GradScaler) -> None:
    """Forget a step the scaler began but never finished (``unscale_`` done, ``update`` not reached).

    GradScaler keeps, per optimizer, whether this step's gradients were
    unscaled; a step redone after an error would otherwise skip unscaling its
    new gradients and apply them times the loss scale. ``update`` resets the
    same state, but also moves the scale, which a redone step must not.
    """
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    scaler._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)


@functools.cache
def count_cpu_attention() -> None:
    """Give ``torch.utils.flop_counter`` formulas for the CPU's fused attention, which it has none for:
    ``scaled_dot_product_attention`` over CPU (and fake CPU) tensors runs ``_scaled_dot_product_flash_attention_for_cpu``
    and its backward, and counted 0 FLOPs, so every estimate made from a CPU trace (a simulated GPU's speeds) left
    attention out: about a tenth of a Llama-3 1B's FLOPs at 2,048 tokens. Counted as torch counts the CUDA flash kernel
    (``sdpa_flop_count``: both matmuls, in full whatever the mask; grouped key/value heads broadcast).
    Registered through torch's own ``register_flop_formula``, once; a torch that has its own formula keeps it."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

    forward, backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    if forward not in flop_registry:
        register_flop_formula(forward)(
            lambda query, key, value, *args, out_shape=None, **kwargs: sdpa_flop_count(query, key, value)
        )
    if backward not in flop_registry:
        register_flop_formula(backward)(
            lambda grad_out, query, key, value, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(grad_out, query, key, value)
        )


def flop_counter():
    """A ``torch.utils.flop_counter.FlopCounterMode`` (no display) that counts the CPU's fused attention too
    (``count_cpu_attention``): what every FLOP count autofit makes is taken with."""
    from torch.utils.flop_counter import FlopCounterMode

    count_cpu_attention()
    return FlopCounterMode(display=False)


def op_flops(op, args, kwargs, out) -> int:
    """The FLOPs ``torch.utils.flop_counter`` counts for one ATen op call (0 for an op it has no formula for:
    pointwise ops, norms, copies)."""
    from torch.utils.flop_counter import flop_registry

    count_cpu_attention()
    formula = flop_registry.get(op.overloadpacket)
    return 0 if formula is None else int(formula(*args, **(kwargs or {}), out_val=out))


def new_fake_mode() -> FakeTensorMode:
    """A fake-tensor mode that accepts real tensors (they are converted on use); torch's log of a fake kernel that
    raises is kept off the screen (``quiet_fake_kernel_failures``)."""
    quiet_fake_kernel_failures()
    return FakeTensorMode(allow_non_fake_inputs=True)


_FAKE_KERNEL_ATTRIBUTE = "autofit_fake_kernel"
"""The attribute ``quiet_fake_kernel_failures``'s filter sets on an exception a fake kernel raised: the op's name."""


class _FakeKernelFailures(logging.Filter):
    """Drops torch's "failed while attempting to run meta for OP" record (a traceback per call), naming OP on its
    exception instead: the one line autofit prints says it, the user's screen gets no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("failed while attempting to run meta for"):
            return True
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and record.args:
            setattr(error, _FAKE_KERNEL_ATTRIBUTE, str(record.args[0]))
        return False


def quiet_fake_kernel_failures() -> None:
    """From now on, a fake kernel that raises (grouped_mm's takes only bf16 and fp16, its CPU kernel fp32 too) logs
    nothing; ``failed_fake_kernel`` names its op from the exception, which propagates as before.

    Installed by ``new_fake_mode``, so by every fake mode autofit makes, and kept: fake modes are entered in forked
    trace workers and in FLOP counts as well, and the record dropped only repeats an exception that is raised anyway.
    """
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    if not any(isinstance(f, _FakeKernelFailures) for f in logger.filters):
        logger.addFilter(_FakeKernelFailures())


def failed_fake_kernel(error: BaseException) -> str | None:
    """The op whose fake kernel raised ``error`` (or the error it caused), e.g. "aten._grouped_mm.default"; None
    where no fake kernel raised it (``quiet_fake_kernel_failures`` names it)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        op = getattr(error, _FAKE_KERNEL_ATTRIBUTE, None)
        if op is not None:
            return op
        error = error.__cause__ or error.__context__
    return None


def fake_mode_for(inputs) -> AbstractContextManager:
    """A context that runs ops on ``inputs`` over fake tensors: the fake mode already at work, or a new one."""
    from torch._guards import detect_fake_mode

    return nullcontext() if detect_fake_mode(inputs) is not None else new_fake_mode()


def inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """The plain tensors a wrapper subclass (e.g. torchao's 8-bit optimizer state) holds; None for a plain tensor.

    A wrapper's own storage is a placeholder of its logical size: its bytes are its inner tensors'.
    """
    if not is_traceable_wrapper_subclass(tensor):
        return None
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]  # a DTensor also names its (non-tensor) device_mesh
    return [t for i in inner if isinstance(i, torch.Tensor) for t in (inner_tensors(i) or [i])]


def fake_process_group_store():
    """A store for ``init_process_group("fake", ...)``: this process plays one rank, nothing is sent.

    Importing the module registers the "fake" backend.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


@contextmanager
def storage_resizes(callback: Callable[[torch.UntypedStorage], None]) -> Iterator[None]:
    """Call ``callback(storage)`` after every ``UntypedStorage.resize_`` while the context is open.

    FSDP2 frees and re-allocates each unit's unsharded parameters by resizing
    their storage, which reaches no ATen op and so no dispatch mode. PyTorch's
    own ``torch.distributed._tools.mem_tracker.MemTracker`` wraps the method
    the same way; here the wrapper lives only inside this context, is put back
    on exit (also after an error), and chains to whatever was installed before.
    """
    original = torch.UntypedStorage.resize_

    def resize_(storage, size):
        result = original(storage, size)
        callback(storage)
        return result

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


def call_when_backward_ends(callback) -> None:
    """Run ``callback`` once the backward pass now running has finished (call it from a backward hook)."""
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(callback)


def in_autograd_backward() -> bool:
    """Whether the autograd engine is running a backward node now (also inside a dispatch mode's ``__torch_dispatch__``)."""
    return torch._C._current_autograd_node() is not None


@contextmanager
def optimizers_step_as_on_cuda(*, unless: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """Inside, PyTorch's optimizers left to choose (``foreach=None``, ``fused=None``) pick the kernels they pick for
    CUDA tensors (``torch.optim.optimizer._default_to_fused_or_foreach``): foreach, one operator over every
    parameter of a group. Over the simulated meter's fake CPU tensors they would step one parameter at a time,
    which holds one parameter's temporaries at the step where a card holds all of them (AdamW: a copy of every
    parameter, ``bench/RESULTS.md``). Where ``unless()`` is true (an optimizer stepping on the host), they choose
    as for CPU tensors: one parameter at a time."""
    import importlib
    import pkgutil

    import torch.optim

    modules = [importlib.import_module(f"torch.optim.{m.name}") for m in pkgutil.iter_modules(torch.optim.__path__)]
    patched = [(m, m._default_to_fused_or_foreach) for m in modules if hasattr(m, "_default_to_fused_or_foreach")]
    as_on_cpu = importlib.import_module("torch.optim.optimizer")._default_to_fused_or_foreach

    def as_on_cuda(params, differentiable: bool, use_fused: bool = False) -> tuple[bool, bool]:
        if unless():
            return as_on_cpu(params, differentiable, use_fused)
        if torch.jit.is_scripting() or differentiable:
            return False, False
        return use_fused, not use_fused

    for module, _ in patched:
        module._default_to_fused_or_foreach = as_on_cuda
    try:
        yield
    finally:
        for module, original in patched:
            module._default_to_fused_or_foreach = original


def selective_checkpoint_contexts(policy_fn) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """``torch.utils.checkpoint.create_selective_checkpoint_contexts(policy_fn)``, except that the recomputation
    runs again every op whose kept output was changed in place after the op made it.

    A convolution followed by ``nn.ReLU(inplace=True)``: the policy keeps the convolution's output, the ReLU then
    overwrites it, and torch's recomputation refuses the changed tensor ("Tensor cached during selective
    activation checkpoint has been mutated"); it cannot hand it out, since the recomputed ReLU would apply itself
    a second time. Rerun on its recomputed inputs, the op gives the value the forward first made, so the
    gradients are plain training's. The changed tensor is still held until then (the bytes the policy meant to
    keep), and only the ops whose output was changed are computed again.
    """
    caching, cached = _checkpoint.create_selective_checkpoint_contexts(policy_fn)
    if not _SAC_INTERNALS:  # an older torch keys its storage otherwise: its own mode, which refuses a changed output
        return caching, cached
    return caching, _RecomputeChanged(cached.storage)


_SAC_INTERNALS = all(hasattr(_checkpoint, name) for name in ("_sac_storage_key", "_CONSUMED", "_RECOMPUTE", "SAC_IGNORED_OPS"))
"""Whether this torch's selective checkpointing has the internals ``_RecomputeChanged`` reads (torch 2.14 has)."""


class _RecomputeChanged(_checkpoint._CachedTorchDispatchMode):
    """torch's recomputing mode of selective checkpointing, which reruns an op whose kept output was changed."""

    def __init__(self, storage) -> None:
        super().__init__(None, storage, False)  # (policy_fn, storage, allow_cache_entry_mutation): a mutated entry is refused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _checkpoint.SAC_IGNORED_OPS:
            key = _checkpoint._sac_storage_key(func, args)
            index = self.func_counter[key]
            entry = self.storage.get(key, {}).get(index)
            if entry not in (None, _checkpoint._CONSUMED, _checkpoint._RECOMPUTE) and _changed_since_kept(entry):
                self.func_counter[key] += 1
                self.storage[key][index] = _checkpoint._CONSUMED  # and the changed tensor is let go
                return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _changed_since_kept(entry) -> bool:
    """Whether a kept op output (torch's ``_VersionWrapper``, one per output tensor) changed in place after it was kept."""
    return any(
        isinstance(getattr(wrapper, "val", None), torch.Tensor) and wrapper.version is not None
        and wrapper.val._version != wrapper.version
        for wrapper in tree_leaves(entry)
    )


def compile_failures() -> tuple[type[Exception], ...]:
    """What a model torch.compile cannot handle raises, at its first forward or backward (imported when asked:
    Inductor takes most of a second to import)."""
    import torch._dynamo.exc
    import torch._inductor.exc

    return torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` was called on it (``nn.Module`` keeps the compiled call in a private field)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def cpu_allocation_peak(run: Callable[[], object]) -> int:
    """Most bytes the CPU allocator held at once during ``run()`` beyond what it held before, by its own count.

    Every CPU allocation and free is reported to the profiler when it records
    memory (``profile_memory``), including those of compiled code, which no
    dispatch mode sees; the raw events carry each one's signed size.
    """
    from torch.profiler import ProfilerActivity, profile

    recorded = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _stderr_silenced():  # the profiler's library logs its start and stop there
        recorded.start()
    try:
        run()
    finally:
        with _stderr_silenced():
            recorded.stop()
    events = recorded.profiler.kineto_results.events()
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    held = peak = 0
    for _, nbytes in changes:
        held += nbytes
        peak = max(peak, held)
    return peak


@contextmanager
def _stderr_silenced() -> Iterator[None]:
    """File descriptor 2 goes to /dev/null inside (what C++ libraries print there too)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def set_cuda_allocator_settings(settings: str) -> None:
    """Change the CUDA caching allocator's settings in this process (``PYTORCH_CUDA_ALLOC_CONF``'s syntax).

    Takes effect for the segments the allocator reserves from now on; set it
    before the first CUDA allocation for all of them."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before the accelerator-wide allocator config
        setter = torch.cuda.memory._set_allocator_settings
    setter(settings)


def expandable_segments_in_use(device: torch.device) -> bool:
    """Whether the allocator holds any expandable segment on ``device`` now (its memory snapshot says so)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return any(segment.get("is_expandable", False) for segment in torch.cuda.memory_snapshot() if segment.get("device", index) == index)
