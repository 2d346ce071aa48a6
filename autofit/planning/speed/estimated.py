"""The speed half of the cost model estimated from FLOPs and bytes moved (``--simulate``): nothing runs on the device.

A micro-step costs its forward FLOPs at each operator family's throughput class
on the planned GPU (``GPU_PEAKS``) or a measured CPU rate, and selective
checkpointing's share of each block's forward is estimated per op
(``selective_shares``).
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

from autofit.errors import UserError

from autofit.apply import AppliedPlan, apply_config
from autofit.config import TrainingConfig
from autofit.measure.blocks import profile_blocks
from autofit.measure.boundaries import block_boundaries
from autofit.measure.meters import simulated_meter
from autofit.model_io import call_model
from autofit._torch_private import TorchDispatchMode, flop_counter, op_flops, tree_leaves
from autofit.planning.costs import SpeedCosts
from autofit.planning.memory.repeats import SHORT_LENGTHS, Repeat, shortened
from autofit.planning.memory.workers import call
from autofit.spec import ModelSpec
from strategies import changed_in_place, checkpoint_candidates, selective_saves


def flop_speed_costs(
    spec: ModelSpec, *, precisions: list[str], sizes: list[int], device_type: str, device_name: str, pool=None,
    repeat: Repeat | None = None,
) -> dict[str, SpeedCosts]:
    """Times estimated from FLOPs (``--simulate``): nothing runs on the device.

    A micro-step costs 3x its forward FLOPs (forward + backward) plus a fixed
    launch cost. On a GPU each operator family runs at its precision's
    throughput class (``GpuPeaks``: convolutions in fp32 on TF32 tensor cores,
    matmuls in fp32 on CUDA cores, both in bf16/fp16 on half-precision tensor
    cores) times the share of it training reaches, which falls for a
    micro-step too small to fill the GPU (``gpu_forward_seconds``). The
    optimizer step reads and writes its state at an assumed memory bandwidth.

    With ``repeat`` (a run of identical blocks, ``memory.repeats``), every count is made on the model with the run
    cut short: the FLOPs at two lengths (they grow by one block's each block), each block's FLOPs and
    selective share at one (a block cut counts as the identical block kept).
    """
    size = max(sizes)
    cpu = None if device_type == "cuda" else _cpu_throughput()
    flops_per_s, share_bytes_per_s = roofline_rates(device_type, device_name, cpu=cpu)
    # The blocks' FLOPs and each precision's shares in the pool's workers (``pool``) while this process counts the FLOPs.
    block_flops = call(pool, _block_flops, spec, micro_batch_size=size, repeat=repeat)
    shares = {
        name: call(
            pool, _simulated_selective_shares, spec, repeat=repeat,
            micro_batch_size=min(sizes), precision=name, flops_per_s=flops_per_s[name], bytes_per_s=share_bytes_per_s,
        )
        for name in precisions
    }
    flops = forward_flops_of(spec, size, repeat=repeat)
    block_flops = block_flops()
    total_flops = max(sum(flops.values()), 1)
    param_bytes = _parameter_bytes(spec)
    results = {}
    for name in precisions:
        step, forward, per_block = [], [], []
        if device_type == "cuda":
            gpu, known = gpu_peaks(device_name)
            launch_s, bytes_per_s = GPU_LAUNCH_SECONDS, gpu.bandwidth * 0.5
            note = "estimated from FLOPs" + (
                f" for the {device_name.removeprefix('simulated ')}" if known
                else f" for an {UNKNOWN_GPU_NAME}-class GPU ({device_name!r} is not in the table; --device-kind names one)"
            )
        else:
            cpu_flops_per_s, launch_s, bytes_per_s = cpu
            note = "estimated from FLOPs"
        for s in sizes:
            scaled = {family: n * s / size for family, n in flops.items()}
            if device_type == "cuda":
                seconds = gpu_forward_seconds(scaled, gpu=gpu, precision=name)
            else:
                seconds = sum(scaled.values()) / cpu_flops_per_s
            forward.append(seconds + launch_s)
            step.append(3 * (seconds + launch_s))
            per_block.append([n / total_flops * seconds for n in block_flops])  # each block's share of the forward
        results[name] = SpeedCosts(
            sizes=list(sizes),
            step_seconds=step,
            forward_seconds=forward,
            block_seconds=per_block,
            optimizer_seconds=4 * param_bytes / bytes_per_s,
            note=note,
            # The policy's saved ops (their FLOPs) are not recomputed: the rest, mostly bytes moved, is.
            selective_shares=shares[name](),
        )
    return results


def roofline_rates(
    device_type: str, device_name: str, *, cpu: tuple[float, float, float] | None = None,
) -> tuple[dict[str, dict[str, float]], float]:
    """What ``selective_shares`` costs ops at: per precision, FLOP/s by operator family ("conv", "matmul"); and bytes/s.

    On a GPU, the table's throughput class of each family in each precision times the share training reaches
    (as ``gpu_forward_seconds``), and half the memory bandwidth; on the CPU, a measured matmul's rate
    (``_cpu_throughput``, or ``cpu`` when already measured).
    """
    from strategies import PRECISIONS

    if device_type == "cuda":
        gpu, _ = gpu_peaks(device_name)
        efficiency = {"conv": CONV_EFFICIENCY, "matmul": MATMUL_EFFICIENCY}
        rates = {
            precision: {family: getattr(gpu, kind) * efficiency[family][kind] for family, kind in _gpu_classes(precision).items()}
            for precision in PRECISIONS
        }
        return rates, gpu.bandwidth * 0.5
    flops_per_s, _, bytes_per_s = cpu or _cpu_throughput()
    return {precision: {"conv": flops_per_s, "matmul": flops_per_s} for precision in PRECISIONS}, bytes_per_s


class _OpSeconds(TorchDispatchMode):
    """Per block, the estimated seconds of the forward ops selective checkpointing keeps and of those it recomputes.

    An op costs its FLOPs at its family's rate plus the bytes it reads and writes at the bandwidth; a view moves
    nothing. Ops outside every block are not counted. A kept op whose output a later op changes in place (a
    convolution, then ``ReLU(inplace=True)``) is recomputed after all (``strategies.checkpointing.changed_in_place``).
    """

    def __init__(self, *, flops_per_s: dict[str, float], bytes_per_s: float) -> None:
        super().__init__()
        self.flops_per_s, self.bytes_per_s = flops_per_s, bytes_per_s
        self.block: int | None = None
        self.kept: dict[int, float] = {}
        self.recomputed: dict[int, float] = {}
        self._kept_outputs: dict[int, tuple[weakref.ref, int, float]] = {}  # id of a kept output's storage -> (it, block, seconds)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in changed_in_place(func, args, kwargs):
            storage = tensor.untyped_storage()
            kept_storage, block, seconds = self._kept_outputs.pop(id(storage), (None, None, 0.0))
            if kept_storage is not None and kept_storage() is storage:
                self.kept[block] -= seconds
                self.recomputed[block] = self.recomputed.get(block, 0.0) + seconds
        if self.block is not None:
            seconds = self._seconds(func, args, kwargs, out)
            into = self.kept if selective_saves(func) else self.recomputed
            into[self.block] = into.get(self.block, 0.0) + seconds
            if into is self.kept:
                for tensor in tree_leaves(out):
                    if isinstance(tensor, torch.Tensor):
                        storage = tensor.untyped_storage()
                        self._kept_outputs[id(storage)] = (weakref.ref(storage), self.block, seconds)
                        break
        return out

    def _seconds(self, func, args, kwargs, out) -> float:
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs or all(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            return 0.0  # a view, or a query (a fake tensor's device)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        moved = sum(t.numel() * t.element_size() for t in inputs + outputs)
        family = "conv" if "convolution" in str(func) else "matmul"
        return op_flops(func, args, kwargs, out) / self.flops_per_s[family] + moved / self.bytes_per_s


def selective_shares(
    applied: AppliedPlan, inputs, *, blocks: list[str], flops_per_s: dict[str, float], bytes_per_s: float
) -> list[float]:
    """Per block: the share of its forward's estimated time that selective checkpointing recomputes.

    One forward of ``inputs`` (real or fake tensors) under the configuration's
    precision; each op costed by ``_OpSeconds``. The policy's saved ops
    (``strategies.checkpointing.selective_saves``: matmuls, convolutions,
    attention) are not recomputed; the rest (norms, activations, adds, casts)
    are. The device's timing calibrates the estimate (``SpeedCosts.selective_factor``).
    """
    meter = _OpSeconds(flops_per_s=flops_per_s, bytes_per_s=bytes_per_s)
    index = {name: i for i, name in enumerate(blocks)}

    def enter(name, args):
        meter.block = index[name]

    def leave(name, args, kwargs, output):
        meter.block = None

    with block_boundaries(applied.model, blocks, enter=enter, leave=leave), meter, applied.forward_context():
        call_model(applied.model, inputs)
    shares = []
    for index in range(len(blocks)):
        kept, recomputed = meter.kept.get(index, 0.0), meter.recomputed.get(index, 0.0)
        shares.append(recomputed / (kept + recomputed) if kept + recomputed > 0 else 0.0)
    return shares


def _simulated_selective_shares(
    spec: ModelSpec, *, micro_batch_size: int, precision: str, flops_per_s, bytes_per_s, repeat: Repeat | None = None,
) -> list[float]:
    """``selective_shares`` over fake tensors (nothing runs), for the memory model's blocks; with ``repeat``, made on
    the model with the run cut short and widened to every block (``Repeat.widen``)."""
    short = spec if repeat is None else shortened(spec, repeat, SHORT_LENGTHS[0])
    meter = simulated_meter(short, for_device="cpu")
    torch.manual_seed(0)
    with meter.environment():
        model = meter.build_model(short.build_model)
        model.train()
        inputs, _ = short.example_batch(micro_batch_size)
        blocks = checkpoint_candidates(model, example_inputs=inputs)
        applied = apply_config(model, one_micro_batch(micro_batch_size, precision=precision), device=meter.device, use_scaler=False)
        shares = selective_shares(applied, inputs, blocks=blocks, flops_per_s=flops_per_s, bytes_per_s=bytes_per_s)
    return shares if repeat is None else repeat.widen(blocks, shares, SHORT_LENGTHS[0])


def _block_flops(spec: ModelSpec, *, micro_batch_size: int, repeat: Repeat | None = None) -> list[int]:
    """Each checkpoint candidate's forward FLOPs at ``micro_batch_size`` (``profile_blocks``, simulated); with
    ``repeat``, made on the model with the run cut short and widened to every block."""
    if repeat is None:
        return [p.forward_flops for p in profile_blocks(spec, micro_batch_size=micro_batch_size, simulate=True)]
    profiles = profile_blocks(shortened(spec, repeat, SHORT_LENGTHS[0]), micro_batch_size=micro_batch_size, simulate=True)
    return repeat.widen([p.name for p in profiles], [p.forward_flops for p in profiles], SHORT_LENGTHS[0])


def forward_flops_of(spec: ModelSpec, size: int, *, repeat: Repeat | None = None) -> dict[str, int]:
    """Forward FLOPs of a micro-batch of ``size``, by operator family: "conv" and "matmul" (everything else counted).

    With ``repeat``, counted with the run cut to its two short lengths and carried on to its whole length: each
    block adds the same FLOPs."""
    if repeat is not None:
        short, longer = (forward_flops_of(shortened(spec, repeat, n), size) for n in SHORT_LENGTHS)
        more = repeat.length - SHORT_LENGTHS[0]
        return {family: short[family] + more * (longer[family] - short[family]) for family in short}
    meter = simulated_meter(spec, for_device="cpu")
    with meter.environment():
        model = meter.build_model(spec.build_model)
        inputs, _ = spec.example_batch(size)
        counter = flop_counter()
        with counter:
            call_model(model, inputs)
    families = {"conv": 0, "matmul": 0}
    for op, count in counter.get_flop_counts().get("Global", {}).items():
        families["conv" if "convolution" in str(op) else "matmul"] += int(count)
    if not any(families.values()):
        families["matmul"] = 1
    return families


def _parameter_bytes(spec: ModelSpec) -> int:
    with torch.device("meta"):
        model = spec.build_model()
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)  # frozen ones are not stepped


@dataclass(frozen=True, slots=True)
class GpuPeaks:
    """A GPU's dense peak rates (vendor data sheets, without sparsity), for estimates only."""

    fp32: float
    """FLOP/s on CUDA cores: fp32 matmuls (PyTorch leaves TF32 off for them by default)."""
    tf32: float
    """FLOP/s on TF32 tensor cores: fp32 convolutions (cuDNN uses TF32 by default)."""
    half: float
    """FLOP/s on bf16/fp16 tensor cores (autocast)."""
    bandwidth: float
    """Memory bytes/s."""
    memory_gib: int = 0
    """The card's memory (the common model of it: an A100 is also sold with 40 GiB), the default of ``--device-kind``."""
    host_update_per_s: float = 0.0
    """Parameter elements per second a typical host of this card updates with AdamW (bf16-master's fp32 masters, host
    state), assumed for a GPU that is not here unless ``--host-speed`` gives it: the host's practical memory bandwidth
    over the bytes the update moves per element (docs/planner.md, "The host of a GPU that is not here")."""


GPU_PEAKS = {
    "H200": GpuPeaks(fp32=67e12, tf32=495e12, half=989e12, bandwidth=4.8e12, memory_gib=141, host_update_per_s=2e9),
    "H100": GpuPeaks(fp32=67e12, tf32=495e12, half=989e12, bandwidth=3.35e12, memory_gib=80, host_update_per_s=2e9),
    "A100": GpuPeaks(fp32=19.5e12, tf32=156e12, half=312e12, bandwidth=2.0e12, memory_gib=80, host_update_per_s=1e9),
    "L40S": GpuPeaks(fp32=91.6e12, tf32=183e12, half=362e12, bandwidth=0.86e12, memory_gib=48, host_update_per_s=1e9),
    "A10": GpuPeaks(fp32=31.2e12, tf32=62.5e12, half=125e12, bandwidth=0.6e12, memory_gib=24, host_update_per_s=2.5e8),
    "L4": GpuPeaks(fp32=30.3e12, tf32=60e12, half=121e12, bandwidth=0.3e12, memory_gib=24, host_update_per_s=2.5e8),
    "RTX 4090": GpuPeaks(fp32=82.6e12, tf32=82.6e12, half=165e12, bandwidth=1.0e12, memory_gib=24, host_update_per_s=5e8),
    "RTX 3090": GpuPeaks(fp32=35.6e12, tf32=35.6e12, half=71e12, bandwidth=0.94e12, memory_gib=24, host_update_per_s=4e8),
    "V100": GpuPeaks(fp32=15.7e12, tf32=15.7e12, half=125e12, bandwidth=0.9e12, memory_gib=32, host_update_per_s=5e8),
    "T4": GpuPeaks(fp32=8.1e12, tf32=8.1e12, half=65e12, bandwidth=0.32e12, memory_gib=16, host_update_per_s=2.5e8),
}
UNKNOWN_GPU_NAME = "A100"
"""The table row assumed for a GPU that is not named in it (e.g. --simulate with no GPU here)."""

# The share of a throughput class's peak that training reaches on a micro-step large enough to
# fill the GPU, by operator family. Convolutions: fitted to bench/RESULTS.md's H200 rows
# (torchvision ResNet-18 and ResNet-50 at 224x224, batch 128: 39-50 TFLOP/s, fp16 only 1.27x
# fp32); matmuls: what large transformer layers commonly reach (not yet measured here).
CONV_EFFICIENCY = {"tf32": 0.085, "half": 0.055, "fp32": 0.5}
MATMUL_EFFICIENCY = {"tf32": 0.45, "half": 0.45, "fp32": 0.6}
GPU_FILL_SECONDS = 4.2e-4
"""A micro-step whose FLOPs take this long at the class's peak runs at half the efficiency above;
small micro-steps leave a large GPU idle (fitted on the same rows: ResNet-18 reaches 0.87x of ResNet-50's rate)."""
GPU_LAUNCH_SECONDS = 5e-4
"""Launch overhead per forward (x3 per micro-step with the backward)."""


def gpu_kind(kind: str) -> str:
    """The table's name for ``--device-kind``'s value ("rtx4090", "RTX 4090", "h100" ...).

    Raises:
        UserError: a GPU the table does not hold (the line lists those it does).
    """
    wanted = kind.upper().replace(" ", "").replace("-", "").replace("_", "")
    for key in GPU_PEAKS:
        if key.replace(" ", "") == wanted:
            return key
    raise UserError(f"--device-kind {kind!r} is not a GPU autofit knows; give one of {', '.join(GPU_PEAKS)} (or leave it out: an A100 is assumed)")


def gpu_peaks(device_name: str) -> tuple[GpuPeaks, bool]:
    """The table row for a GPU name ("NVIDIA H200", ...), and whether it was found (else an A100's)."""
    name = device_name.upper()
    for key, peaks in GPU_PEAKS.items():
        if key in name:
            return peaks, True
    return GPU_PEAKS[UNKNOWN_GPU_NAME], False


def gpu_forward_seconds(flops: dict[str, float], *, gpu: GpuPeaks, precision: str) -> float:
    """Estimated seconds of a forward with these FLOPs by family ("conv", "matmul") on ``gpu`` in ``precision``.

    Each family runs at its throughput class for the precision: bf16/fp16 on
    half-precision tensor cores; fp32 convolutions on TF32 tensor cores and
    fp32 matmuls on CUDA cores (TF32 when ``torch.backends.cuda.matmul.allow_tf32``).
    """
    classes = _gpu_classes(precision)
    efficiency = {"conv": CONV_EFFICIENCY, "matmul": MATMUL_EFFICIENCY}
    step_at_peak = 3 * sum(n / getattr(gpu, classes[family]) for family, n in flops.items())  # forward + backward
    fill = step_at_peak / (step_at_peak + GPU_FILL_SECONDS)  # a small micro-step cannot keep a large GPU busy
    return sum(
        n / (getattr(gpu, classes[family]) * efficiency[family][classes[family]] * fill) for family, n in flops.items() if n
    )


def _gpu_classes(precision: str) -> dict[str, str]:
    """The throughput class ("fp32", "tf32", "half") each operator family runs at in ``precision``."""
    if precision == "fp32":
        conv_tf32 = torch.backends.cudnn.allow_tf32
        return {"conv": "tf32" if conv_tf32 else "fp32", "matmul": "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"}
    return {"conv": "half", "matmul": "half"}


def _cpu_throughput() -> tuple[float, float, float]:
    """(FLOP/s, seconds of launch overhead per forward, bytes/s) assumed for a CPU estimate."""
    # Measure a matmul's fp32 throughput (a tenth of a second, not the model).
    a = torch.randn(512, 512)
    start = time.perf_counter()
    for _ in range(8):
        a @ a
    fp32 = 8 * 2 * 512**3 / (time.perf_counter() - start)
    return fp32 * 0.5, 1e-3, 5e9


def one_micro_batch(
    size: int, *, precision: str, checkpoint: list[str] | None = None, selective_checkpoint: list[str] | None = None
) -> TrainingConfig:
    """A configuration whose global batch is one micro-batch: the timings run its hooks by hand."""
    return TrainingConfig(
        global_batch_size=size, micro_batch_size=size, precision=precision, checkpoint=checkpoint or [],
        selective_checkpoint=selective_checkpoint or [],
    )
