"""GPU truth: every meter, memory lever, plan and fault path of autofit checked on a real CUDA card, in one run.

Sections (each row is one check; a check that raises is a FAILED row with its
one-line error, never a crash):

- meters: the simulated meter's peak against the device meter's (cuda; the
  cpu meter in --dry-run) for a CNN, a ViT, the tiny transformer and a
  transformers GPT-2, in fp32/bf16/fp16, with and without checkpointing. On
  the CPU the two agree; on a card the process peak must fit in the simulated
  peak plus the headroom an estimated plan keeps (else a plan would not fit),
  and the simulated peak may over-count the allocated one by at most 15%
  (else a plan would waste budget);
- floor: #29's 1B case, bench/floor.py's 0.94B decoder in its floor
  configuration (bf16-master) with expandable segments: the card's process
  peak within the least budget an estimated plan of its simulated peak needs;
- levers: on a small decoder, each memory lever TrainingConfig has (full and
  selective recompute, activation offload, step in backward, host and 8-bit
  optimizer state, batch split) and torch.compile: peak, step time, and the
  weights after 4 AdamW steps against plain PyTorch's on the same device
  (deterministic kernels on a card; first, plain PyTorch against itself: what
  is left of the card's run-to-run difference, which a lossless lever may show);
- plans: simulated plans (``--simulate``) at three budgets for two models,
  then measured for real: measured <= budget, predicted/measured peak,
  estimated/measured speed;
- faults: an out-of-memory error injected in forward, backward and
  optimizer.step, redone at half the micro-batch with the same global batch
  and the weights of a run that used that micro-batch from the start; the
  allocator cap training uses holds the budget (cuda only);
- host link: pinned copies each way (cuda only).

It writes ``gpu_truth.json``, ``gpu_truth.md`` and the plans (``plans/*.json``)
under ``--out``, prints the table and exits 1 when any row failed. A wall-clock guard skips what is left
once ``--time-limit`` seconds have passed, with a row saying so.

    timeout 600 python bench/gpu_truth.py --out results/gpu_truth      # on a CUDA card (under 8 minutes on an H200)
    python bench/gpu_truth.py --dry-run --out /tmp/gpu_truth           # the same code paths on the CPU, tiny sizes
    bash bench/gpu_session.sh "$OUT"                                    # a lent card's one command: this, then the GPU-marked tests
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from autofit._torch_private import set_cuda_allocator_settings  # noqa: E402
from autofit.apply import apply_config, apply_plan  # noqa: E402
from autofit.config import TrainingConfig  # noqa: E402
from autofit.measure.host_speed import measure_host_link  # noqa: E402
from autofit.measure.probe import measure  # noqa: E402
from autofit.plan_file import DEFAULT_SEGMENTS, EXPANDABLE_SEGMENTS, load_plan, save_plan  # noqa: E402
from autofit.planning.memory.headroom import Headroom, persistent_bytes  # noqa: E402
from autofit.planning.planner import plan_with_report  # noqa: E402
from autofit.planning.request import PlanRequest  # noqa: E402
from autofit.planning.verify.floor import InfeasibleBudget  # noqa: E402
from autofit.spec import ModelSpec, default_optimizer, load_spec  # noqa: E402
from autofit.step import train_step  # noqa: E402
from autofit.training.gauges import BudgetWatch  # noqa: E402
from autofit.training.recovery import StepUndo, step_with_recovery  # noqa: E402
from autofit.units import format_bytes  # noqa: E402
from bench.sized_examples import example_spec  # noqa: E402

SECTIONS = ("meters", "floor", "levers", "plans", "faults", "host link")

SIMULATED_WITHIN = {"cpu": 1e-4, "cuda": 0.15}
"""How far the simulated peak may be from the measured one. On the CPU, either way: the simulated meter is the cpu
meter's count over fake tensors (exact, but for fp16's GradScaler, whose few bytes of scale the simulation leaves
out). On a card, only as an over-count of the allocator's allocated peak, which would waste budget: an under-count
is judged by whether the headroom an estimated plan keeps covers the process peak instead, because a fixed
under-count (library workspaces: 70-145 MiB on an H200) is 5-18% of the small models' peaks here (0.4-3 GiB) and
under 9% of bench/RESULTS.md's larger ones (0.913-0.991 of the allocated peak over 24 cases)."""
LOSSLESS_WITHIN = {"cpu": 0.0, "cuda": 1e-6}
"""Largest weight difference after 4 steps a lossless lever may show against plain PyTorch: none on the CPU
(tests/measure/test_levers.py holds torch.equal); on a card 1e-6, as the GPU test declares (cuBLAS and the host's
AdamW round differently from the card's), or plain PyTorch's own run-to-run difference on the card where that is
larger: some kernels have no deterministic version, and AdamW turns their rounding in a near-zero gradient into a
full-sized step (6.4e-05 between plain PyTorch and autofit with no lever on an H200, without deterministic kernels)."""
COMPILE_WITHIN = 1e-5
"""Largest weight difference after 4 steps a compiled model may show against plain PyTorch, compared under SGD as the
batch split is (AdamW turns the rounding of a near-zero gradient into a full step: 9.9e-4 after 4 steps at lr 1e-2
in the dry run): Inductor's fused kernels round differently."""
BATCH_SPLIT_WITHIN = 1e-6
"""Micro-batches summed into the global batch add the same terms in another order: fp32 rounding only. Compared
under SGD: AdamW divides by the gradients' root mean square and turns a rounding difference in a near-zero
gradient into a full-sized step."""
EIGHT_BIT_WITHIN = 0.1
"""8-bit AdamW is lossy and declared so: its 4-step weight change may differ from fp32 AdamW's by at most this
fraction of the largest change fp32 AdamW made."""
LEVER_STEPS = 4
PLAN_FRACTIONS = (0.75, 0.6)
"""The tighter budgets, as fractions of the plain configuration's peak beyond the room a plan keeps: both need
levers, and both are above the floors of the models here."""
ROOMY_EXTRA_CUDA_BYTES = 4 * 2**30
"""On a card the roomy budget adds this for the room a simulated plan keeps (context, allocator reserve)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sizes:
    """The models at the run's scale: a card's, or tiny ones for --dry-run."""

    cnn: tuple[str, str | None]
    """A CNN: its source (as `autofit plan` takes it) and input shape (None: the model file's)."""
    cnn_batch: int
    vit: dict
    vit_batch: int
    decoder: dict
    decoder_batch: int
    hf: dict
    hf_batch: int
    plan_batch: int
    floor_decoder: bool
    """The floor section's model: bench/floor.py's 0.94B decoder (True), or the tiny transformer."""


CARD = Sizes(
    cnn=("torchvision:resnet18", "3x128x128"), cnn_batch=64,
    vit=dict(image_size=64, patch_size=8, num_layers=6, num_heads=8, hidden_dim=384, mlp_dim=1536), vit_batch=64,
    decoder=dict(D_MODEL=512, N_HEADS=8, N_LAYERS=6, SEQ_LEN=512, VOCAB_SIZE=8192), decoder_batch=16,
    hf=dict(D_MODEL=512, N_HEADS=8, N_LAYERS=6, SEQ_LEN=512, VOCAB_SIZE=8192), hf_batch=8,
    plan_batch=32,
    floor_decoder=True,
)
TINY = Sizes(
    cnn=(str(ROOT / "examples/digits_cnn.py"), None), cnn_batch=4,
    vit=dict(image_size=16, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32), vit_batch=4,
    decoder=dict(D_MODEL=32, N_HEADS=2, N_LAYERS=2, SEQ_LEN=16, VOCAB_SIZE=64), decoder_batch=8,
    hf=dict(D_MODEL=32, N_HEADS=2, N_LAYERS=2, SEQ_LEN=16, VOCAB_SIZE=64), hf_batch=4,
    plan_batch=8,
    floor_decoder=False,
)


@dataclass(kw_only=True, slots=True)
class Row:
    section: str
    check: str
    status: str
    """"ok", "FAILED" or "skipped"."""
    result: str = ""
    """One line: what was measured, or why it failed or was skipped."""
    values: dict = field(default_factory=dict)
    seconds: float = 0.0


class Failed(Exception):
    """A check ran and its result is wrong: the row fails with the values it measured."""

    def __init__(self, message: str, values: dict) -> None:
        super().__init__(message)
        self.values = values


class Truth:
    """The rows so far, and the clock every check looks at before it starts."""

    def __init__(self, *, device: str, time_limit_s: float, out: Path) -> None:
        self.device, self.time_limit_s, self.out = device, time_limit_s, out
        self.started = time.perf_counter()
        self.rows: list[Row] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def check(self, section: str, name: str, run: Callable[[], tuple[str, dict]]) -> Row:
        """Run one check: ``run()`` returns (one line, values) or raises (Failed, or anything: a FAILED row)."""
        if self.elapsed() > self.time_limit_s:
            row = Row(section=section, check=name, status="skipped", result=f"skipped: past the time limit ({self.time_limit_s:.0f} s)")
            self.rows.append(row)
            return row
        start = time.perf_counter()
        try:
            line, values = run()
            row = Row(section=section, check=name, status="ok", result=line, values=values)
        except Skipped as skip:
            row = Row(section=section, check=name, status="skipped", result=str(skip))
        except Failed as failure:
            row = Row(section=section, check=name, status="FAILED", result=str(failure), values=failure.values)
        except Exception as error:  # noqa: BLE001 - one failing check is a row, not the end of the run
            row = Row(section=section, check=name, status="FAILED", result=one_line(error),
                      values={"traceback": traceback.format_exc(limit=-4)})
        row.seconds = time.perf_counter() - start
        self.rows.append(row)
        print(f"  [{row.status}] {section} / {name}: {row.result} ({row.seconds:.1f} s)", flush=True)
        release()
        return row


class Skipped(Exception):
    """A check that does not apply here (a CUDA-only check on the CPU)."""


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__


def release() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# --- the models -----------------------------------------------------------------------------------


def decoder_spec(sizes: Sizes) -> ModelSpec:
    """The tiny transformer (examples/tiny_transformer.py) with scaled-dot-product attention."""
    return example_spec("tiny_transformer.py", build=lambda module: module.TinyTransformer("sdpa"), **sizes.decoder)


def cnn_spec(sizes: Sizes) -> ModelSpec:
    source, shape = sizes.cnn
    return load_spec(source, input_shape=shape, num_classes=10) if shape else load_spec(source)


def vit_spec(sizes: Sizes) -> ModelSpec:
    """torchvision's VisionTransformer at the run's sizes, classifying 10 classes."""
    import torchvision

    config = sizes.vit
    return ModelSpec(
        source=f"torchvision VisionTransformer {config}",
        build_model=lambda: torchvision.models.VisionTransformer(num_classes=10, **config),
        example_batch=lambda n: (torch.randn(n, 3, config["image_size"], config["image_size"]), torch.randint(0, 10, (n,))),
        loss_fn=F.cross_entropy,
        build_optimizer=default_optimizer,
    )


def meter_cases(sizes: Sizes) -> list[tuple[str, Callable[[], ModelSpec], int, str, str]]:
    """(label, spec, micro-batch, precision, checkpoint): 9 configurations."""
    cnn = lambda: cnn_spec(sizes)  # noqa: E731
    cnn_name = Path(sizes.cnn[0]).stem.replace("_", " ") if sizes.cnn[0].endswith(".py") else sizes.cnn[0].split(":")[-1]
    vit = lambda: vit_spec(sizes)  # noqa: E731
    decoder = lambda: decoder_spec(sizes)  # noqa: E731
    hf = lambda: example_spec("hf_causal_lm.py", **sizes.hf)  # noqa: E731
    return [
        (cnn_name, cnn, sizes.cnn_batch, "fp32", "none"),
        (cnn_name, cnn, sizes.cnn_batch, "bf16", "all"),
        ("vit", vit, sizes.vit_batch, "bf16", "none"),
        ("decoder", decoder, sizes.decoder_batch, "fp32", "none"),
        ("decoder", decoder, sizes.decoder_batch, "bf16", "all"),
        ("decoder", decoder, sizes.decoder_batch, "fp16", "none"),
        ("hf gpt2", hf, sizes.hf_batch, "fp32", "none"),
        ("hf gpt2", hf, sizes.hf_batch, "bf16", "none"),
        ("hf gpt2", hf, sizes.hf_batch, "fp32", "all"),
    ]


# --- meters ---------------------------------------------------------------------------------------


def check_meter(truth: Truth, build_spec: Callable[[], ModelSpec], *, micro_batch_size: int, precision: str, checkpoint: str):
    spec = build_spec()
    config = TrainingConfig(global_batch_size=micro_batch_size, micro_batch_size=micro_batch_size, precision=precision, checkpoint=checkpoint)
    simulated = measure(spec, config, device=truth.device, simulate=True, steps=2)
    real = measure(spec, config, device=truth.device, steps=3)
    # The simulated meter estimates the allocator's allocated bytes; the cuda meter's peak adds its cache and the
    # context (NVML), which the plan keeps as headroom.
    allocated = real.peak_bytes - real.breakdown.get("allocator_cache", 0) - real.breakdown.get("context", 0)
    values = {
        "simulated_meter": simulated.meter, "measured_meter": real.meter, "simulated_bytes": simulated.peak_bytes,
        "measured_bytes": real.peak_bytes, "allocated_bytes": allocated, "simulated_over_allocated": ratio(simulated.peak_bytes, allocated),
        "samples_per_s": real.samples_per_s, "measured_breakdown": real.breakdown, "simulated_breakdown": simulated.breakdown,
    }
    line = (
        f"simulated {format_bytes(simulated.peak_bytes)} vs {real.meter} {format_bytes(allocated)} allocated "
        f"(x{values['simulated_over_allocated']:.3f}, {simulated.peak_bytes - allocated:+,d} B; process peak {format_bytes(real.peak_bytes)}"
    )
    if truth.device != "cuda":
        line += ")"
        within = SIMULATED_WITHIN["cpu"]
        if abs(values["simulated_over_allocated"] - 1) > within:
            raise Failed(f"{line}: off by more than {within:.2%}", values)
        return line, values
    # What a plan needs from the prediction: the whole process fits in the simulated peak and the room an estimated
    # plan keeps beside it, and the prediction does not ask for much more than the allocator used.
    headroom = estimated_headroom(simulated.peak_bytes, simulated.breakdown)
    headroom_bytes = sum(headroom.values())
    covered_by = simulated.peak_bytes + headroom_bytes - real.peak_bytes
    values.update(headroom=headroom, headroom_bytes=headroom_bytes, covered_by_bytes=covered_by)
    if covered_by >= 0:
        line += f", covered by {format_bytes(headroom_bytes)} of headroom with {format_bytes(covered_by)} to spare)"
    else:
        line += f", short by {format_bytes(-covered_by)} with {format_bytes(headroom_bytes)} of headroom)"
        raise Failed(f"{line}: a plan at this prediction would not fit", values)
    over = SIMULATED_WITHIN["cuda"]
    if values["simulated_over_allocated"] > 1 + over:
        raise Failed(f"{line}: over-counts by more than {over:.0%}: a plan would waste budget", values)
    return line, values


def estimated_headroom(peak_bytes: int, breakdown: dict) -> dict[str, int]:
    """The room an estimated plan keeps on a card beyond a simulated peak, by cause: the context, the allocator's
    reserve and fragmentation (autofit/planning/memory/headroom.py). Not its safety margin, a share of a budget:
    there is no budget here, and the margin is for what no meter sees."""
    headroom = Headroom.estimated_cuda(0)
    causes = headroom.for_peak(peak_bytes, persistent_bytes=persistent_bytes(breakdown))
    return {cause: size for cause, size in causes.items() if cause != "safety_margin"}


@contextmanager
def allocator(truth: Truth, settings: str | None) -> Iterator[None]:
    """On a card, the CUDA allocator with ``settings`` inside (None: as it is), and its default segments after, which
    the other checks measure with; nothing on the CPU."""
    if truth.device == "cuda" and settings:
        set_cuda_allocator_settings(settings)
    try:
        yield
    finally:
        if truth.device == "cuda":
            set_cuda_allocator_settings(DEFAULT_SEGMENTS)


def check_floor(truth: Truth, sizes: Sizes) -> tuple[str, dict]:
    """#29's 1B case: bench/floor.py's 0.94B decoder in its floor configuration (bf16-master, micro-batch 1 of 8,
    every block checkpointed), on a card with expandable segments as its plan sets them: the process peak within the
    least budget an estimated plan of that simulated peak needs (bench/RESULTS.md: 3.34 GiB predicted; 4.70 GiB
    measured before the weights were cast on the host and probes stopped keeping their models). In the dry run, the
    tiny transformer on the CPU, where the simulated peak is the cpu meter's."""
    if sizes.floor_decoder:
        from bench.floor import decoder_spec as floor_spec

        spec, batch = floor_spec(), 8
    else:
        spec, batch = decoder_spec(sizes), sizes.decoder_batch
    config = TrainingConfig(global_batch_size=batch, micro_batch_size=1, precision="bf16-master", checkpoint="all")
    simulated = measure(spec, config, device=truth.device, simulate=True, steps=2)
    expandable = Headroom.estimated_cuda(1, expandable_segments=True)
    budget = expandable.smallest_budget(simulated.peak_bytes, persistent_bytes=persistent_bytes(simulated.breakdown))
    with allocator(truth, EXPANDABLE_SEGMENTS):
        real = measure(spec, config, device=truth.device, steps=3)
    cache, context = real.breakdown.get("allocator_cache", 0), real.breakdown.get("context", 0)
    values = {
        "simulated_bytes": simulated.peak_bytes, "budget_bytes": budget, "measured_bytes": real.peak_bytes,
        "allocated_bytes": real.peak_bytes - cache - context, "reserved_bytes": real.peak_bytes - context,
        "host_peak_bytes": real.host_peak_bytes, "measured_breakdown": real.breakdown,
    }
    line = (
        f"simulated {format_bytes(simulated.peak_bytes)}, least budget with its headroom {format_bytes(budget)}; {real.meter} "
        f"{format_bytes(real.peak_bytes)} (allocated {format_bytes(values['allocated_bytes'])}, reserved {format_bytes(values['reserved_bytes'])}), "
        f"host {format_bytes(real.host_peak_bytes)}"
    )
    if truth.device == "cuda" and real.peak_bytes > budget:
        raise Failed(f"{line}: over the budget its plan would have", values)
    if truth.device != "cuda" and simulated.peak_bytes != real.peak_bytes:
        raise Failed(f"{line}: the simulated peak is not the cpu meter's", values)
    return line, values


def section_meters(truth: Truth, sizes: Sizes) -> None:
    for label, build_spec, micro_batch_size, precision, checkpoint in meter_cases(sizes):
        name = f"{label} m={micro_batch_size} {precision} checkpoint {checkpoint}"
        truth.check("meters", name, lambda: check_meter(
            truth, build_spec, micro_batch_size=micro_batch_size, precision=precision, checkpoint=checkpoint,
        ))


# --- levers ---------------------------------------------------------------------------------------


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def sgd(params):
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def lever_cases(batch: int) -> list[tuple[str, dict, str]]:
    """(name, TrainingConfig's choices, how the weights compare with plain PyTorch's)."""
    return [
        ("none", {}, "lossless"),
        ("full recompute", dict(checkpoint="all"), "lossless"),
        ("selective recompute", dict(selective_checkpoint="all"), "lossless"),
        ("activation offload", dict(offload="all"), "lossless"),
        ("step in backward", dict(optimizer_in_backward=True), "lossless"),
        ("host optimizer state", dict(optimizer_state="host"), "lossless"),
        ("8-bit optimizer state", dict(optimizer_state="8bit"), "8bit"),
        (f"batch split {batch // 4}x4", dict(micro_batch_size=batch // 4), "batch split"),
        ("torch.compile", dict(compile=True), "compile"),
    ]


def train_plain(model: nn.Module, data, *, device: str, build_optimizer=adamw) -> None:
    """Plain PyTorch: the whole batch per step, on the device."""
    optimizer = build_optimizer(model.parameters())
    for inputs, targets in data:
        F.cross_entropy(model(inputs.to(device)), targets.to(device)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def train_autofit(model: nn.Module, data, *, device: str, choices: dict, build_optimizer=adamw) -> None:
    """The same batches through apply_config and train_step, the way training runs them."""
    batch = len(data[0][1])
    settings = dict(micro_batch_size=batch) | choices
    applied = apply_config(model, TrainingConfig(global_batch_size=batch, **settings), device=device)
    optimizer = applied.build_optimizer(build_optimizer)
    for inputs, targets in data:
        train_step(applied, inputs, targets, loss_fn=F.cross_entropy, optimizer=optimizer)


@contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """PyTorch's deterministic kernels wherever it has them, then the previous setting back. warn_only: a kernel with
    no deterministic version warns and runs; plain PyTorch against itself measures what such kernels leave."""
    previous, previous_warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn_only)


def comparing(device: str):
    """The context weight comparisons run in: deterministic kernels on a card; the CPU's are already."""
    return deterministic_algorithms() if device == "cuda" else nullcontext()


def lever_start(spec: ModelSpec, *, batch: int) -> tuple[nn.Module, list]:
    """The start weights and LEVER_STEPS batches every lever comparison shares."""
    torch.manual_seed(0)
    start = spec.build_model()
    torch.manual_seed(1)
    return start, [spec.example_batch(batch) for _ in range(LEVER_STEPS)]


def lossless_allowance(device: str, run_to_run_floor: float | None) -> tuple[float, str]:
    """(the largest weight difference a lossless comparison allows, where it comes from): LOSSLESS_WITHIN, or plain
    PyTorch's own run-to-run difference on this device where that is larger (None: it was not measured)."""
    declared = LOSSLESS_WITHIN[device]
    if run_to_run_floor is not None and run_to_run_floor > declared:
        return run_to_run_floor, f"{run_to_run_floor:.2g}, plain PyTorch's own run-to-run difference"
    return declared, f"{declared:g}"


def weight_difference(model: nn.Module, reference: nn.Module) -> tuple[bool, float]:
    """(every tensor torch.equal, the largest absolute difference)."""
    equal, largest = True, 0.0
    for ours, theirs in zip(model.state_dict().values(), reference.state_dict().values()):
        equal = equal and torch.equal(ours, theirs)
        largest = max(largest, (ours.double() - theirs.double()).abs().max().item())
    return equal, largest


def check_run_to_run(truth: Truth, spec: ModelSpec, *, batch: int) -> tuple[str, dict]:
    """Plain PyTorch twice from the same start and batches under AdamW, as the lossless levers are compared: its
    largest weight difference is the device's run-to-run floor (0.0 on the CPU), which no lever can be held below."""
    start, data = lever_start(spec, batch=batch)
    runs = []
    with comparing(truth.device):
        for _ in range(2):
            model = copy.deepcopy(start).to(truth.device)
            train_plain(model, data, device=truth.device)
            runs.append(model)
    equal, largest = weight_difference(*runs)
    values = {
        "weights_equal": equal, "max_abs_difference": largest, "run_to_run_floor": largest,
        "deterministic_algorithms": truth.device == "cuda",
    }
    kernels = "deterministic kernels" if truth.device == "cuda" else "the CPU's kernels"
    line = f"twice, {LEVER_STEPS} AdamW steps, {kernels}: " + (
        "weights torch.equal: no run-to-run floor" if equal
        else f"weights within {largest:.2e} of each other: the floor of every lossless comparison"
    )
    return line, values


def check_lever(
    truth: Truth, spec: ModelSpec, *, batch: int, choices: dict, kind: str, baseline: dict, run_to_run_floor: float | None,
) -> tuple[str, dict]:
    if choices.get("optimizer_state") == "8bit" and importlib.util.find_spec("torchao") is None:
        raise Skipped("skipped: 8-bit optimizer state needs torchao")
    settings = dict(micro_batch_size=batch) | choices
    config = TrainingConfig(global_batch_size=batch, **settings)
    result = measure(spec, config, device=truth.device, steps=3)
    step_s = min(result.step_seconds[1:] or result.step_seconds)
    # The weights after LEVER_STEPS steps, from the same start and batches as plain PyTorch on the same device.
    start, data = lever_start(spec, batch=batch)
    build_optimizer = sgd if kind in ("batch split", "compile") else adamw
    with comparing(truth.device):
        reference = copy.deepcopy(start).to(truth.device)
        train_plain(reference, data, device=truth.device, build_optimizer=build_optimizer)
        model = copy.deepcopy(start)
        train_autofit(model, data, device=truth.device, choices=choices, build_optimizer=build_optimizer)
    equal, largest = weight_difference(model, reference)
    if kind == "8bit":
        moved = max((r.double().cpu() - s.double()).abs().max().item() for r, s in zip(reference.state_dict().values(), start.state_dict().values()))
        within, declared = EIGHT_BIT_WITHIN * moved, f"{EIGHT_BIT_WITHIN:.0%} of fp32's largest change {moved:.2e} (lossy, declared)"
    elif kind == "batch split":
        within, declared = BATCH_SPLIT_WITHIN, f"{BATCH_SPLIT_WITHIN:g} under SGD (fp32 summation order)"
    elif kind == "compile":
        within, declared = COMPILE_WITHIN, f"{COMPILE_WITHIN:g} under SGD (Inductor's fused kernels round differently)"
    else:
        within, declared = lossless_allowance(truth.device, run_to_run_floor)
    if not baseline:
        baseline.update(peak_bytes=result.peak_bytes, step_s=step_s)
    values = {
        "peak_bytes": result.peak_bytes, "host_peak_bytes": result.host_peak_bytes, "step_s": step_s,
        "peak_vs_none": ratio(result.peak_bytes, baseline["peak_bytes"]), "step_vs_none": ratio(step_s, baseline["step_s"]),
        "weights_equal": equal, "max_abs_difference": largest, "allowed_difference": within, "allowed": declared,
        "run_to_run_floor": run_to_run_floor, "breakdown": result.breakdown,
    }
    weights = "weights torch.equal plain PyTorch's" if equal else f"weights within {largest:.2e} of plain PyTorch's (allowed {declared})"
    line = (
        f"peak {format_bytes(result.peak_bytes)} (x{values['peak_vs_none']:.2f} of none), host {format_bytes(result.host_peak_bytes)}, "
        f"step {step_s * 1e3:.1f} ms (x{values['step_vs_none']:.2f} of none); {weights}"
    )
    if not equal and largest > within:
        raise Failed(line.replace("within", "off by") + ": beyond what the lever allows", values)
    return line, values


def section_levers(truth: Truth, sizes: Sizes) -> float | None:
    """Every lever against plain PyTorch; returns plain PyTorch's run-to-run floor (None when its row did not run)."""
    spec = decoder_spec(sizes)
    row = truth.check("levers", "plain PyTorch against itself", lambda: check_run_to_run(truth, spec, batch=sizes.decoder_batch))
    run_to_run_floor = row.values.get("run_to_run_floor")
    baseline: dict = {}
    for name, choices, kind in lever_cases(sizes.decoder_batch):
        truth.check("levers", name, lambda: check_lever(
            truth, spec, batch=sizes.decoder_batch, choices=choices, kind=kind, baseline=baseline, run_to_run_floor=run_to_run_floor,
        ))
    return run_to_run_floor


# --- plans ----------------------------------------------------------------------------------------


def plan_request(truth: Truth, *, budget: int, batch: int) -> PlanRequest:
    device_memory = torch.cuda.get_device_properties(0).total_memory if truth.device == "cuda" else None
    return PlanRequest(budget=budget, batch_size=batch, device=truth.device, simulate=True, device_memory=device_memory)


def check_plan(truth: Truth, spec: ModelSpec, *, name: str, budget: int | None, batch: int, plans: list) -> tuple[str, dict]:
    if budget is None:
        raise Failed("no roomy plan to take the room a plan keeps from", {})
    start = time.perf_counter()
    try:
        plan = plan_with_report(spec, plan_request(truth, budget=budget, batch=batch)).plan
    except InfeasibleBudget as refusal:
        raise Failed(f"refused at {format_bytes(budget)}: {one_line(refusal)}", {"budget_bytes": budget}) from refusal
    planned_s = time.perf_counter() - start
    # Through plan.json and back, as `autofit train --plan` reads it; the files stay beside the report.
    plan = load_plan(save_plan(plan, truth.out / "plans" / f"{name}.json"))
    plans.append((spec, plan))
    # What `autofit probe --plan` does, for real (it simulates an estimated plan again): the plan's configuration on
    # its device under the device's meter, with the allocator settings the plan names (as training sets them).
    with allocator(truth, plan.device.allocator_settings):
        real = measure(spec, plan.config.rank_share(), device=truth.device, steps=3, fingerprint=plan.model.fingerprint)
    margin = plan.headroom.get("safety_margin", 0)
    config = plan.config
    levers = config.levers()
    choice = (
        f"{config.precision} {config.micro_batch_size}x{config.grad_accum_steps} checkpoint {len(config.checkpoint)} "
        f"selective {len(config.selective_checkpoint)}" + (f" {levers}" if levers else "")
    )
    values = {
        "budget_bytes": budget, "choice": choice, "config": dataclasses.asdict(config), "planned_s": planned_s,
        "allocator_settings": plan.device.allocator_settings,
        "predicted_peak_bytes": plan.predicted.peak_bytes, "simulated_peak_bytes": plan.measured.peak_bytes,
        "headroom": dict(plan.headroom), "measured_peak_bytes": real.peak_bytes, "measured_breakdown": real.breakdown,
        "predicted_over_measured": ratio(plan.predicted.peak_bytes, real.peak_bytes),
        "estimated_samples_per_s": plan.predicted.samples_per_s, "measured_samples_per_s": real.samples_per_s,
        "estimated_over_measured_speed": ratio(plan.predicted.samples_per_s, real.samples_per_s),
        "fits": real.peak_bytes <= budget, "fits_with_safety_margin": real.peak_bytes + margin <= budget,
    }
    line = (
        f"{choice}: measured {format_bytes(real.peak_bytes)} of {format_bytes(budget)} ({real.peak_bytes / budget:.0%}); "
        f"predicted/measured peak x{values['predicted_over_measured']:.2f}; estimated/measured speed "
        f"x{values['estimated_over_measured_speed']:.2f}; planned in {planned_s:.1f} s"
    )
    if not values["fits"]:
        raise Failed(f"{line}: over the budget", values)
    return line, values


def section_plans(truth: Truth, sizes: Sizes) -> list:
    """Three budgets for each model: a roomy one, then the room the roomy plan kept besides its peak and its safety
    margin (on a card: the context and the allocator's reserve) plus PLAN_FRACTIONS of the plain configuration's peak."""
    plans: list = []
    for label, spec in (("decoder", decoder_spec(sizes)), ("cnn", cnn_spec(sizes))):
        scale: dict = {}

        def plain_peak() -> tuple[str, dict]:
            config = TrainingConfig(global_batch_size=sizes.plan_batch, micro_batch_size=sizes.plan_batch)
            scale["plain"] = measure(spec, config, device=truth.device, simulate=True, steps=2).peak_bytes
            return f"plain fp32 batch {sizes.plan_batch}: simulated peak {format_bytes(scale['plain'])}", {"plain_simulated_bytes": scale["plain"]}

        truth.check("plans", f"{label}: plain peak", plain_peak)
        if "plain" not in scale:
            continue
        roomy = int(scale["plain"] * 1.25) + (ROOMY_EXTRA_CUDA_BYTES if truth.device == "cuda" else 0)
        row = truth.check("plans", f"{label}: roomy budget", lambda: check_plan(
            truth, spec, name=f"{label}-roomy", budget=roomy, batch=sizes.plan_batch, plans=plans,
        ))
        # The safety margin is a share of the budget: the tighter budgets' own margins come out of their fraction.
        headroom = row.values.get("headroom")
        room = sum(v for k, v in headroom.items() if k != "safety_margin") if headroom is not None else None
        for fraction in PLAN_FRACTIONS:
            budget = None if room is None else room + int(scale["plain"] * fraction)
            truth.check("plans", f"{label}: room + {fraction:.0%} of plain", lambda: check_plan(
                truth, spec, name=f"{label}-{fraction:.0%}", budget=budget, batch=sizes.plan_batch, plans=plans,
            ))
    return plans


# --- faults ---------------------------------------------------------------------------------------


class OutOfMemoryOnce:
    """Raises torch.OutOfMemoryError on its ``at``-th call, once."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, *_) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected by bench/gpu_truth.py, call {self.at})")


def inject(where: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """An allocation failure in the second micro-batch's forward or backward, or in the first optimizer.step."""
    block = model.layers[-1]
    if where == "forward":
        fail = OutOfMemoryOnce(at=2)
        block.register_forward_hook(lambda module, args, output: fail())
    elif where == "backward":
        fail = OutOfMemoryOnce(at=2)

        def fail_in_backward(module, args, output) -> None:  # returns None: the output stays
            output.register_hook(fail)

        block.register_forward_hook(fail_in_backward)
    else:  # after StepUndo's own hook, which records the optimizer before its step
        optimizer.register_step_pre_hook(OutOfMemoryOnce(at=1))


def check_fault(truth: Truth, spec: ModelSpec, *, where: str, batch: int, run_to_run_floor: float | None) -> tuple[str, dict]:
    torch.manual_seed(0)
    start = spec.build_model()
    torch.manual_seed(1)
    data = [spec.example_batch(batch) for _ in range(3)]
    half = batch // 4

    def run(micro_batch_size: int, *, fault: str | None):
        model = copy.deepcopy(start)
        applied = apply_config(model, TrainingConfig(global_batch_size=batch, micro_batch_size=micro_batch_size), device=truth.device)
        optimizer = applied.build_optimizer(adamw)
        undo = StepUndo(applied.model, optimizer=optimizer, scaler=applied.scaler, device=applied.device)
        if fault:
            inject(fault, applied.model, optimizer)
        changes = []
        for inputs, targets in data:
            changes += step_with_recovery(applied, inputs, targets, loss_fn=F.cross_entropy, optimizer=optimizer, undo=undo)[1]
        return model, applied, changes

    with comparing(truth.device):
        reference, _, _ = run(half, fault=None)
        model, applied, changes = run(2 * half, fault=where)
    equal, largest = weight_difference(model, reference)
    within, declared = lossless_allowance(truth.device, run_to_run_floor)
    records = [change.record for change in changes]
    values = {
        "changes": records, "weights_equal": equal, "max_abs_difference": largest, "allowed_difference": within,
        "allowed": declared, "run_to_run_floor": run_to_run_floor,
    }
    halved = [(r["previous_micro_batch_size"], r["micro_batch_size"], r["global_batch_size"]) for r in records]
    line = f"micro-batch {2 * half} -> {applied.micro_batch_size} x {applied.grad_accum_steps} (global {applied.config.global_batch_size}); " + (
        "weights torch.equal a run at that micro-batch" if equal
        else f"weights within {largest:.2e} of a run at that micro-batch (allowed {declared})"
    )
    if halved != [(2 * half, half, batch)]:
        raise Failed(f"expected one change {2 * half} -> {half} at global {batch}, got {halved}", values)
    if not equal and largest > within:
        raise Failed(line.replace("within", "off by"), values)
    return line, values


def check_allocator_cap(truth: Truth, plans: list) -> tuple[str, dict]:
    """Training's BudgetWatch caps the allocator at the budget less the context: the plan trains under it, and a
    tensor the size of the budget does not fit."""
    if truth.device != "cuda":
        raise Skipped("skipped on cpu: the allocator cap is CUDA's (set_per_process_memory_fraction)")
    if not plans:
        raise Failed("no plan from the plans section to cap the allocator with", {})
    spec, plan = min(plans, key=lambda item: item[1].budget_bytes)
    device = torch.device("cuda", torch.cuda.current_device())
    cap = plan.budget_bytes - plan.headroom.get("context", 0)
    with BudgetWatch(plan, device=device):
        model = spec.build_model()
        applied = apply_plan(model, plan, device=device)
        optimizer = applied.build_optimizer(spec.build_optimizer)
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(3):
            inputs, targets = spec.example_batch(plan.config.global_batch_size)
            train_step(applied, inputs, targets, loss_fn=spec.loss_fn, optimizer=optimizer)
        torch.cuda.synchronize(device)
        reserved = torch.cuda.max_memory_reserved(device)
        try:
            torch.empty(plan.budget_bytes, dtype=torch.uint8, device=device)
            refused = False
        except torch.OutOfMemoryError:
            refused = True
        del model, applied, optimizer
    values = {"budget_bytes": plan.budget_bytes, "cap_bytes": cap, "reserved_peak_bytes": reserved, "budget_sized_tensor_refused": refused}
    line = (
        f"budget {format_bytes(plan.budget_bytes)}, cap {format_bytes(cap)}: 3 steps reserved {format_bytes(reserved)}; "
        f"a {format_bytes(plan.budget_bytes)} tensor {'was refused' if refused else 'was allocated'}"
    )
    if reserved > cap or not refused:
        raise Failed(f"{line}: the cap did not hold", values)
    return line, values


def section_faults(truth: Truth, sizes: Sizes, plans: list, *, run_to_run_floor: float | None) -> None:
    """Each fault redone is compared as a lossless lever is: within LOSSLESS_WITHIN or the levers' run-to-run floor."""
    spec = decoder_spec(sizes)
    for where in ("forward", "backward", "optimizer.step"):
        truth.check("faults", f"out of memory in {where}", lambda: check_fault(
            truth, spec, where=where, batch=sizes.decoder_batch, run_to_run_floor=run_to_run_floor,
        ))
    truth.check("faults", "allocator cap holds the budget", lambda: check_allocator_cap(truth, plans))


# --- host link ------------------------------------------------------------------------------------


def check_host_link(truth: Truth) -> tuple[str, dict]:
    if truth.device != "cuda":
        raise Skipped("skipped on cpu: the host link is between pinned host memory and a CUDA card")
    link = measure_host_link(truth.device)
    values = {"to_host_bytes_per_s": link.to_host_bytes_per_s, "to_device_bytes_per_s": link.to_device_bytes_per_s, "source": link.source}
    return f"to host {link.to_host_bytes_per_s / 1e9:.1f} GB/s, to device {link.to_device_bytes_per_s / 1e9:.1f} GB/s ({link.source})", values


# --- the run --------------------------------------------------------------------------------------


def markdown(rows: list[Row]) -> str:
    lines = ["| section | check | status | result | s |", "|---|---|---|---|---|"]
    for row in rows:
        result = row.result.replace("|", "\\|")
        lines.append(f"| {row.section} | {row.check} | {row.status} | {result} | {row.seconds:.1f} |")
    return "\n".join(lines) + "\n"


def run_all(*, dry_run: bool, out: Path, time_limit_s: float) -> int:
    """Every section in order; returns the exit code (1 when any row failed)."""
    device = "cpu" if dry_run else "cuda"
    if device == "cuda":
        # cuBLAS reads it when it makes its first handle: deterministic matrix products (the weight comparisons) need it.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    out.mkdir(parents=True, exist_ok=True)
    # A private cost cache: every plan here is planned from this run's measurements only.
    shutil.rmtree(out / "plan-cache", ignore_errors=True)
    os.environ["AUTOFIT_CACHE_DIR"] = str(out / "plan-cache")
    if dry_run:
        torch.set_num_threads(1)  # tiny models: one thread is fastest, and CI machines are shared
    sizes = TINY if dry_run else CARD
    truth = Truth(device=device, time_limit_s=time_limit_s, out=out)
    about = {"device": device, "dry_run": dry_run, "torch": torch.__version__, "time_limit_s": time_limit_s, "sizes": dataclasses.asdict(sizes)}
    if device == "cuda":
        about["card"] = torch.cuda.get_device_name(0)
        about["card_bytes"] = torch.cuda.get_device_properties(0).total_memory
    print(f"gpu truth on {about.get('card', 'cpu (dry run)')}, torch {torch.__version__}", flush=True)
    plans: list = []
    run_to_run_floor: float | None = None  # plain PyTorch's, measured by the levers section; the faults use it too
    for section in SECTIONS:
        if truth.elapsed() > time_limit_s:
            truth.rows.append(Row(section=section, check="(the rest of the section)", status="skipped",
                                  result=f"skipped: past the time limit ({time_limit_s:.0f} s) after {truth.elapsed():.0f} s"))
            continue
        try:  # each check is its own row; this catches what a section does between them (building its models)
            if section == "meters":
                section_meters(truth, sizes)
            elif section == "floor":
                model = "0.94B decoder" if sizes.floor_decoder else "tiny transformer"
                truth.check("floor", f"{model} at its floor configuration, expandable segments", lambda: check_floor(truth, sizes))
            elif section == "levers":
                run_to_run_floor = section_levers(truth, sizes)
            elif section == "plans":
                plans = section_plans(truth, sizes)
            elif section == "faults":
                section_faults(truth, sizes, plans, run_to_run_floor=run_to_run_floor)
            else:
                truth.check("host link", "pinned copies each way", lambda: check_host_link(truth))
        except Exception as error:  # noqa: BLE001 - the next section still runs
            truth.rows.append(Row(section=section, check="(the section itself)", status="FAILED", result=one_line(error),
                                  values={"traceback": traceback.format_exc(limit=-4)}))
            print(f"  [FAILED] {section}: {one_line(error)}", flush=True)
    failed = [row for row in truth.rows if row.status == "FAILED"]
    report = {
        **about, "elapsed_s": truth.elapsed(), "failed": len(failed),
        "sections": {section: [dataclasses.asdict(row) for row in truth.rows if row.section == section] for section in SECTIONS},
    }
    (out / "gpu_truth.json").write_text(json.dumps(report, indent=2, default=str))
    table = markdown(truth.rows)
    (out / "gpu_truth.md").write_text(f"GPU truth on {about.get('card', 'cpu (dry run)')}, torch {torch.__version__}, {truth.elapsed():.0f} s\n\n{table}")
    print()
    print(table)
    print(f"{len(truth.rows)} rows, {len(failed)} failed, {truth.elapsed():.0f} s; wrote {out / 'gpu_truth.json'} and {out / 'gpu_truth.md'}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_truth.json and gpu_truth.md")
    parser.add_argument("--dry-run", action="store_true", help="the same checks on the CPU with tiny models (the cpu meter for the cuda one)")
    parser.add_argument("--time-limit", type=float, default=420.0, help="seconds after which the checks left are skipped (default 420)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/gpu_truth.py needs a CUDA device; use --dry-run to run its checks on the CPU", file=sys.stderr)
        return 2
    return run_all(dry_run=args.dry_run, out=args.out, time_limit_s=args.time_limit)


if __name__ == "__main__":
    sys.exit(main())
