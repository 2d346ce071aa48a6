"""Per-block costs: the bytes each checkpoint candidate saves for backward and
its share of forward time. This is what checkpointing a block trades.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from autofit._torch_private import flop_counter, tree_leaves
from autofit.apply import apply_config
from autofit.config import TrainingConfig
from autofit.measure.boundaries import block_boundaries
from autofit.measure.meters import make_meter
from autofit.model_io import call_model
from autofit.spec import ModelSpec
from autofit.step import to_device
from strategies import checkpoint_candidates
from strategies.per_call import split_call


@dataclass(kw_only=True, slots=True)
class BlockProfile:
    name: str
    saved_bytes: int
    """Bytes of non-parameter tensors autograd saves inside the block (what checkpointing drops, less its input)."""
    input_bytes: int
    """Bytes of the block's input: checkpointing keeps these."""
    forward_seconds: float | None
    """Wall time of the block's forward (None when simulated)."""
    forward_flops: int
    forward_share: float
    """The block's share of the whole forward: of time when measured, of FLOPs when simulated."""

    def to_dict(self) -> dict:
        return asdict(self)


def profile_blocks(
    spec: ModelSpec,
    *,
    micro_batch_size: int,
    precision: str = "fp32",
    device: str = "cpu",
    simulate: bool = False,
    seed: int = 0,
) -> list[BlockProfile]:
    """Measure every checkpoint candidate during one forward of a micro-batch."""
    meter = make_meter(device_type=device, simulate=simulate, spec=spec)
    torch.manual_seed(seed)
    with meter.environment():
        model = meter.build_model(spec.build_model)
        model.train()
        inputs, targets = spec.example_batch(micro_batch_size)
        inputs, targets = to_device(inputs, meter.device), to_device(targets, meter.device)
        names = checkpoint_candidates(model, example_inputs=inputs)
        config = TrainingConfig(global_batch_size=micro_batch_size, micro_batch_size=micro_batch_size, precision=precision)
        forward_context = apply_config(model, config, device=meter.device, use_scaler=False).forward_context
        watch = _BlockWatch(model, names, device=meter.device, timed=not simulate)
        with block_boundaries(model, names, enter=watch.enter, leave=watch.leave):
            # Warm up once so that one-time costs (allocator, kernels) stay out of the times.
            if not simulate:
                with forward_context():
                    call_model(model, inputs)
                watch.restart()
            watch.sync()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(watch.pack, lambda t: t), forward_context():
                call_model(model, inputs)
            watch.sync()
            total_seconds = time.perf_counter() - start
        # FLOPs in a pass of their own: the counter's overhead must not distort the times.
        counter = flop_counter()
        with torch.no_grad(), counter, forward_context():
            call_model(model, inputs)
        flops_by_module = counter.get_flop_counts()
        total_flops = sum(flops_by_module.get("Global", {}).values()) or 1
    profiles = []
    calls = Counter(split_call(name)[0] for name in names)
    for name in names:
        stat = watch.stats[name]
        module_name = split_call(name)[0]
        # FLOPs are counted per module, over all its calls: a call's share is an equal one (the same layer, the same shapes).
        flops = _module_flops(flops_by_module, module_name) // calls[module_name]
        profiles.append(
            BlockProfile(
                name=name,
                saved_bytes=stat.saved_bytes,
                input_bytes=stat.input_bytes,
                forward_seconds=None if simulate else stat.seconds,
                forward_flops=flops,
                forward_share=(flops / total_flops) if simulate else (stat.seconds / total_seconds),
            )
        )
    return profiles


@dataclass(slots=True)
class _BlockStats:
    """What one block's forward held and took."""

    saved: set[int] = field(default_factory=set)
    """Ids of the storages it saved for backward."""
    saved_bytes: int = 0
    input_bytes: int = 0
    seconds: float = 0.0


class _BlockWatch:
    """The hooks of a profiled forward: each block's inputs and time at its boundaries, what it saves as autograd packs it."""

    def __init__(self, model: torch.nn.Module, names: list[str], *, device: torch.device, timed: bool) -> None:
        self.device, self.timed = device, timed
        self.stats = {name: _BlockStats() for name in names}
        self.active: list[str] = []
        # Parameters are saved by reference and stay alive anyway: not activations.
        self.persistent = {id(t.untyped_storage()) for t in list(model.parameters()) + list(model.buffers())}
        self.starts: dict[str, float] = {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def restart(self) -> None:
        """Forget the inputs and times of a warm-up forward."""
        for stat in self.stats.values():
            stat.input_bytes = 0
            stat.seconds = 0.0

    def enter(self, name, args) -> None:
        self.active.append(name)
        self.stats[name].input_bytes += sum(_nbytes(t) for t in tree_leaves(args) if isinstance(t, torch.Tensor))
        if self.timed:
            self.sync()
            self.starts[name] = time.perf_counter()

    def leave(self, name, args, kwargs, output) -> None:
        if self.timed:
            self.sync()
            self.stats[name].seconds += time.perf_counter() - self.starts[name]
        self.active.pop()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.active:
            block = self.stats[self.active[-1]]
            storage = tensor.untyped_storage()
            if id(storage) not in block.saved and id(storage) not in self.persistent:
                block.saved.add(id(storage))
                block.saved_bytes += storage.nbytes()
        return tensor


def _module_flops(flops_by_module: dict, name: str) -> int:
    # FlopCounterMode names modules by their dotted path below the root's class name.
    for key, counts in flops_by_module.items():
        if key.endswith("." + name) or key == name:
            return int(sum(counts.values()))
    return 0


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()
