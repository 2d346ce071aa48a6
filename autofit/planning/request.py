"""``PlanRequest``: what a user asks the planner for, spelled once.

``autofit.plan``, ``make_plan``, ``plan_with_report``, the planning context,
``autofit plan`` (its flags), ``autofit.fit`` and ``autofit compare`` all take
one, so the list of what can be asked lives here and nowhere else. The model
itself and the progress callback are not requests: they are passed beside it.

Example:
    >>> request = PlanRequest(budget="16GB", batch_size=256, precisions=("bf16", "fp32"))
    >>> request.gpus, request.simulate
    (1, False)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypedDict

from autofit.config import DeviceChoice, PrecisionChoice, WeightsDtypeChoice
from autofit.errors import UserError


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRequest:
    """A planning run's arguments; each is checked where the run first uses it (``plan_context``)."""

    budget: str | int
    """"16GB", "16GiB", "512MiB", "90%" (of the device) or bytes; per GPU when ``gpus`` > 1."""
    batch_size: int
    """The global batch (samples per optimizer step); every plan keeps it."""
    device: DeviceChoice = "cpu"
    """"cpu" or "cuda"."""
    simulate: bool = False
    """Plan with the simulated meter and FLOP-based speeds (the plan is marked estimated)."""
    device_memory: str | int | None = None
    """The device's total memory when simulating a GPU that is not here (default: ``device_kind``'s)."""
    device_kind: str | None = None
    """The GPU that is not here, when simulating one ("RTX 4090", "rtx4090", "H100": ``speed.estimated.GPU_PEAKS``):
    its speeds are estimated from its rates and its memory is the default ``device_memory``. None: an A100's rates."""
    host_memory: str | int | None = None
    """Host memory a GPU plan may spend (host state, bf16 weights' masters, offload): "128GiB" or bytes. None: the
    memory available on this machine now (simulating a GPU that is not here: this machine's, stated as assumed)."""
    precisions: tuple[PrecisionChoice, ...] | None = None
    """The precisions to search; None: all the device runs."""
    gpus: int = 1
    """Processes (GPUs) to train on: DDP when the model fits unsharded, FSDP2 otherwise; on each node when ``nodes`` > 1."""
    nodes: int = 1
    """Machines of ``gpus`` GPUs each: ``nodes x gpus`` processes, sharded within a node and replicated across nodes
    (HSDP) where that fits, else sharded over all of them."""
    expandable_segments: bool = True
    """On a GPU: plan for, and train with, the CUDA allocator's expandable segments (``PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:True``, set by planning on the card and by training); False: its default segments, which
    on an H200 kept 0.35-1.25 GiB more in its cache (bench/RESULTS.md, "The CUDA allocator both ways")."""
    host_speed: float | None = None
    """Parameter elements per second the host of the machine that trains updates with the model's optimizer (its
    fp32 AdamW step on that CPU), for the host-state and bf16-master levers' time; None: timed on this machine's CPU."""
    weights_dtype: WeightsDtypeChoice = "fp32"
    """"fp32": fp32 weights on the device (bf16-master's bf16 copies aside), whatever the model's config names, the
    precision setting the arithmetic. "config": the dtype the config names (``ModelSpec.config_dtype``): bf16 there
    is precision bf16-pure alone, its stochastic rounding declared by this choice; fp32 (or none named) changes
    nothing."""
    allow_lossy_optimizer: bool = False
    """8-bit AdamW state (torchao) may be chosen; it changes the optimizer's arithmetic, so never without this."""
    allow_lossy_base: bool = False
    """Frozen linear weights (a LoRA base) may be held in 4-bit NF4 (QLoRA); it rounds them, so never without this."""
    study: str | None = None
    """An Optuna storage URL ("sqlite:///plans.db") that keeps the search, to resume and inspect it."""
    cache: bool = True
    """Without ``study``, keep the cost model and measurements in the cache (``context.cache_dir()``), so another
    budget for the same model measures only what is new; False keeps nothing."""
    threads: int | None = None
    """Intra-op threads to time with; None: PyTorch's, fewer when other work keeps the cores busy."""
    num_classes: int | None = None
    """Outputs the model file's model is built with, when it takes them (``--num-classes``)."""
    compile: bool | None = None
    """Also measure the chosen configuration under ``torch.compile`` and keep it where it fits and is faster. None:
    on a GPU, not on the CPU (Inductor's C++ build takes longer there than most CPU plans do in all); never when
    simulating (nothing runs to say whether it pays)."""
    max_grad_norm: float | None = None
    """Training clips the gradients' global norm to this (written in the plan); the optimizer step in backward,
    which cannot clip, is then not searched."""

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None and not (isinstance(self.max_grad_norm, (int, float)) and 0 < self.max_grad_norm < float("inf")):
            raise UserError(f"--max-grad-norm {self.max_grad_norm} must be a positive finite number, e.g. 1.0 (or left out: no clipping)")
        if self.host_speed is not None and not (isinstance(self.host_speed, (int, float)) and 0 < self.host_speed < float("inf")):
            raise UserError(f"--host-speed {self.host_speed} must be a positive number of parameter elements per second, e.g. 2e9")
        if self.precisions is not None and not isinstance(self.precisions, tuple):
            object.__setattr__(self, "precisions", tuple(self.precisions))


class PlanKeywords(TypedDict, total=False):
    """``PlanRequest``'s fields as ``autofit.plan``'s keywords (``**keywords: Unpack[PlanKeywords]``), so that an editor
    completes them and a type checker checks them; each is documented on ``PlanRequest`` (a test keeps the two the
    same)."""

    budget: str | int
    batch_size: int
    device: DeviceChoice
    simulate: bool
    device_memory: str | int | None
    device_kind: str | None
    host_memory: str | int | None
    precisions: tuple[PrecisionChoice, ...] | None
    gpus: int
    nodes: int
    expandable_segments: bool
    host_speed: float | None
    weights_dtype: WeightsDtypeChoice
    allow_lossy_optimizer: bool
    allow_lossy_base: bool
    study: str | None
    cache: bool
    threads: int | None
    num_classes: int | None
    compile: bool | None
    max_grad_norm: float | None


def plan_request(request: PlanRequest | None = None, /, **asks) -> PlanRequest:
    """``request`` with ``asks`` in place of its fields, or the ``PlanRequest`` of ``asks`` alone, as ``autofit.plan``
    takes them.

    Raises:
        UserError: ``request`` is not a PlanRequest, or a keyword is not a request (the line names it and lists those
            that are), or without ``request``, ``budget`` or ``batch_size`` is missing.
    """
    known = [field.name for field in dataclasses.fields(PlanRequest)]
    unknown = sorted(set(asks) - set(known))
    if unknown:
        raise UserError(f"{unknown[0]!r} is not something a plan can be asked for; give any of {', '.join(known)}")
    if request is not None:
        if not isinstance(request, PlanRequest):
            raise UserError(f"plan()'s request must be an autofit.PlanRequest, got {type(request).__name__}; or give its fields as keywords")
        return dataclasses.replace(request, **asks)
    missing = [name for name in ("budget", "batch_size") if name not in asks]
    if missing:
        raise UserError(f"a plan needs {' and '.join(missing)}, e.g. budget=\"16GB\", batch_size=256")
    return PlanRequest(**asks)
