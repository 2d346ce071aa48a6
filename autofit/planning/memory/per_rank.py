"""One rank's memory on several processes, known without N devices.

- ``simulate_fsdp_peak_bytes`` runs FSDP2 in one process on a fake process
  group over fake tensors, through the one strategy owner: one rank's peak
  (what a plan records).
- ``estimate_fsdp_peak_bytes`` is a quick conservative formula for searching
  (and for the floor's advice, ``floor.sharded_floor``).
- ``ShardAwareTracker`` measures a real rank on the CPU.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from autofit._torch_private import fake_process_group_store, new_fake_mode, storage_resizes
from autofit.apply import apply_config
from autofit.config import TrainingConfig
from autofit.errors import UserError
from autofit.measure.meters import Measurement
from autofit.measure.tracker import StorageTracker
from autofit.distributed import DistributedEnv
from autofit.step import train_step
from strategies.precision import precision_dtype
from strategies.sharding import fsdp_units


class ShardAwareTracker(StorageTracker):
    """``StorageTracker`` for a rank of a sharded model on the CPU.

    Two things FSDP2 does that a dispatch mode alone does not see: it frees
    and re-allocates each unit's unsharded parameters by resizing their
    storage (``UntypedStorage.resize_``, no ATen op), and its parameters are
    DTensors whose bytes live in a local shard. This tracker counts storage
    resizes while active and tracks DTensors by their local tensors.
    """

    def __enter__(self):
        self._resizes = storage_resizes(lambda storage: self._track_one(_StorageView(storage)))
        self._resizes.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._resizes.__exit__(*exc)

    def _track_one(self, tensor, *, widen: int = 1, nbytes: int | None = None):
        return super()._track_one(_local(tensor), widen=widen, nbytes=nbytes)


class _StorageView:
    """What ``StorageTracker`` reads of a tensor (its storage), for a bare storage."""

    __slots__ = ("_storage",)

    def __init__(self, storage) -> None:
        self._storage = storage

    def untyped_storage(self):
        return self._storage


def _local(tensor):
    from torch.distributed.tensor import DTensor  # loads torch.distributed: only when a rank is tracked

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(kw_only=True, slots=True)
class FSDPLayout:
    """How ``shard_model`` groups a model's parameters, in elements (dim 0 padded to the world size)."""

    unit_numels: dict[str, int]
    """Elements of each unit (block), gathered one at a time."""
    root_numel: int
    """Elements left to the root (embeddings, norms, heads): gathered from its forward to the end of backward."""

    @property
    def largest_unit_numel(self) -> int:
        return max(self.unit_numels.values(), default=0)


def fsdp_layout(model: nn.Module, *, world_size: int, units: list[str] | None = None) -> FSDPLayout:
    """The units ``shard_model`` makes of ``model`` (a model on the meta device will do)."""
    names = fsdp_units(model) if units is None else list(units)
    modules = dict(model.named_modules())
    claimed: set[int] = set()
    unit_numels = {}
    for name in names:
        params = [p for p in modules[name].parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in params)
        unit_numels[name] = sum(_padded_numel(p, world_size) for p in params)
    root_numel = sum(_padded_numel(p, world_size) for p in model.parameters() if id(p) not in claimed)
    return FSDPLayout(unit_numels=unit_numels, root_numel=root_numel)


def _padded_numel(param: torch.Tensor, world_size: int) -> int:
    if param.dim() == 0:
        return world_size
    rows = -(-param.shape[0] // world_size) * world_size
    return rows * (param.numel() // max(param.shape[0], 1))


@dataclass(kw_only=True, slots=True)
class ShardedMemoryEstimate:
    """Per-rank peak bytes of an FSDP2 plan, by cause."""

    peak_bytes: int
    state_bytes: int
    """This rank's parameters, gradients and optimizer state."""
    activation_bytes: int
    """Activations of this rank's micro-batch."""
    buffer_bytes: int
    """Gathered parameters, unsharded gradients and the reduce-scatter input: what backward holds."""
    forward_buffer_bytes: int = 0
    """What forward holds of them: the root's and two units' gathered parameters (no gradient yet)."""

    def to_dict(self) -> dict:
        return asdict(self)


def estimate_fsdp_peak_bytes(
    *,
    parameter_bytes: int,
    gradient_bytes: int,
    optimizer_state_bytes: int,
    activation_bytes: int,
    layout: FSDPLayout,
    world_size: int,
    precision: str,
    grad_accum_steps: int = 1,
    defer_gradient_sync: bool = True,
) -> ShardedMemoryEstimate:
    """A quick, conservative per-rank peak of FSDP2 over ``world_size`` ranks.

    It adds up what a rank holds in the worst moment of a backward, as if
    everything peaked at once:

    - parameters, gradients and optimizer state of the whole model, a 1/N
      share each; gradients whole while they accumulate unsynced
      (``defer_gradient_sync`` and more than one micro-batch: every unit
      keeps its unsharded gradients until the last micro-batch);
    - the micro-batch's activations, whole (each rank runs its own);
    - the root's gathered parameters, the largest unit gathered twice (the
      one in use and the next one prefetched) and its unsharded gradients,
      all in the parameter dtype of ``precision``, plus one unit's fp32
      reduce-scatter input (``forward_buffer_bytes``: forward's share, the
      gathered parameters only).

    For searching and for "how many GPUs would fit"; a plan is checked with
    ``simulate_fsdp_peak_bytes``, which runs FSDP2 itself.

    Args:
        parameter_bytes: the whole model's parameters (and buffers).
        gradient_bytes: the whole model's gradients.
        optimizer_state_bytes: the whole model's optimizer state.
        activation_bytes: one micro-batch's activations at their peak (a
            single-process probe's peak less its parameters, gradients and
            optimizer state there).
        layout: ``fsdp_layout(model, world_size=N)``.
        world_size: ranks.
        precision: "fp32", "bf16" or "fp16".
        grad_accum_steps: micro-batches per step on each rank.
        defer_gradient_sync: ``RankSplit`` reduces gradients after the last micro-batch only.

    Returns:
        The per-rank peak and its parts.

    Example:
        >>> layout = fsdp_layout(model, world_size=4)
        >>> estimate_fsdp_peak_bytes(parameter_bytes=p, gradient_bytes=p, optimizer_state_bytes=2 * p,
        ...                          activation_bytes=a, layout=layout, world_size=4, precision="bf16").peak_bytes
    """
    n = world_size
    param_bytes = torch.empty(0, dtype=precision_dtype(precision) or torch.float32).element_size()
    whole_gradients = defer_gradient_sync and grad_accum_steps > 1
    state = _share(parameter_bytes, n) + _share(optimizer_state_bytes, n) + (
        gradient_bytes if whole_gradients else _share(gradient_bytes, n)
    )
    largest = layout.largest_unit_numel
    buffers = (layout.root_numel + 3 * largest) * param_bytes + largest * 4
    return ShardedMemoryEstimate(
        peak_bytes=state + activation_bytes + buffers, state_bytes=state, activation_bytes=activation_bytes, buffer_bytes=buffers,
        forward_buffer_bytes=(layout.root_numel + 2 * largest) * param_bytes,
    )


def _share(nbytes: int, world_size: int) -> int:
    return -(-nbytes // world_size)


def simulate_fsdp_peak_bytes(
    spec,
    *,
    world_size: int,
    micro_batch_size: int,
    grad_accum_steps: int = 1,
    precision: str = "fp32",
    checkpoint: list[str] | None = None,
    steps: int = 2,
    defer_gradient_sync: bool = True,
    backend: str = "nccl",
):
    """One rank's peak bytes under FSDP2, by running FSDP2 in this one process.

    A fake process group (no communication) makes this process rank 0 of
    ``world_size``, and fake tensors (no arithmetic) stand in for data, so
    FSDP2 allocates exactly what one rank would: its shards, the gathered
    units, the reduce-scatter buffers, the micro-batch's activations. Rank 0
    holds the largest shards (FSDP2 pads at the end), so this is the highest
    rank. For a GPU it is an estimate like the simulated meter's.

    gloo's reduce-scatter (the CPU backend) makes a full-size copy of its
    input inside itself, which a fake process group does not: with
    ``backend="gloo"`` one such copy of the largest unit (fp32) is added, as
    it may be alive at the peak. Measured on the CPU, a real rank's peak lies
    between the simulation without it and with it.

    Nothing else may use torch.distributed in this process meanwhile.

    Args:
        spec: the model, its example batches, loss and optimizer.
        world_size: ranks to simulate.
        micro_batch_size: samples per micro-batch on one rank.
        grad_accum_steps: micro-batches per optimizer step on one rank.
        precision: "fp32", "bf16" or "fp16".
        checkpoint: block names recomputed in backward.
        steps: optimizer steps; the peak is over all but the first.
        defer_gradient_sync: reduce gradients after the last micro-batch only.
        backend: "nccl" (CUDA) or "gloo" (CPU).

    Returns:
        An ``autofit.measure.meters.Measurement``: peak bytes and the breakdown at the peak
        (with "gloo_reduce_scatter_copy" for gloo).

    Raises:
        UserError: torch.distributed is already in use in this process.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise UserError("simulating a sharded plan needs a process without torch.distributed; run `autofit plan` outside torchrun")
    dist.init_process_group("fake", store=fake_process_group_store(), rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))  # outside the fake mode: it reads real values
        config = TrainingConfig(
            global_batch_size=micro_batch_size * grad_accum_steps * world_size, micro_batch_size=micro_batch_size,
            precision=precision, checkpoint=list(checkpoint or []), sharding="fsdp", world_size=world_size,
        )
        tracker, layout = _tracked_fsdp_steps(spec, config, mesh=mesh, steps=steps, defer_gradient_sync=defer_gradient_sync)
        # (Storages FSDP2 resizes count in the breakdown at their last size, not their size at the peak.)
        breakdown = tracker.breakdown_at_peak()
        peak_bytes = tracker.peak_bytes
        if backend == "gloo":
            breakdown["gloo_reduce_scatter_copy"] = layout.largest_unit_numel * 4  # reduce dtype: fp32
            peak_bytes += breakdown["gloo_reduce_scatter_copy"]
        return Measurement(peak_bytes=peak_bytes, breakdown=breakdown)
    finally:
        dist.destroy_process_group()


def _tracked_fsdp_steps(spec, config: TrainingConfig, *, mesh, steps: int, defer_gradient_sync: bool) -> tuple[ShardAwareTracker, FSDPLayout]:
    """Rank 0's training steps under FSDP2 over fake tensors, tracked after the first (which makes the optimizer
    state); the tracker, and the model's FSDP2 layout."""
    torch.manual_seed(0)
    with new_fake_mode():
        model = spec.build_model()
        model.train()
        env = DistributedEnv(rank=0, world_size=config.world_size, local_rank=0, device=torch.device("cpu"))
        applied = apply_config(
            model, config, device="cpu", env=env, mesh=mesh, defer_gradient_sync=defer_gradient_sync, use_scaler=False,
        )
        model = applied.model
        optimizer = applied.build_optimizer(spec.build_optimizer)
        inputs, targets = spec.example_batch(config.global_batch_size)

        def step() -> None:
            train_step(applied, inputs, targets, loss_fn=spec.loss_fn, optimizer=optimizer)

        step()  # makes the optimizer state, as training's first step does
        tracker = ShardAwareTracker()
        tracker.track(model.parameters(), "parameters")
        tracker.track(model.buffers(), "parameters")
        tracker.track(_optimizer_tensors(optimizer), "optimizer_state")
        with tracker:
            for _ in range(steps - 1):
                step()
        tracker.label(_optimizer_tensors(optimizer), "optimizer_state")
        return tracker, fsdp_layout(model, world_size=config.world_size)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
