"""Meters: how many bytes one training configuration needs.

- ``cuda``: the caching allocator's peaks plus what the process holds on the
  card beyond them (CUDA context, library workspaces), from NVML.
- ``cpu``: peak bytes of live tensor storages (``StorageTracker``).
- ``simulated``: the same tracker over fake tensors: no arithmetic runs, so a
  model far larger than this machine can be measured. On the CPU it equals
  the ``cpu`` meter; against a GPU it is an estimate.

Each meter builds the model where it measures and reports a breakdown:
parameters, gradients, optimizer state, activations (and, on cuda, the
allocator's cache and the context).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from autofit._torch_private import (
    FAKE_TENSOR_LIMITS, cpu_allocation_peak, failed_fake_kernel, fake_mode_active, new_fake_mode,
    optimizers_step_as_on_cuda, to_empty_quickly, tree_map, without_dispatch_modes,
)
from autofit.errors import UserError
from autofit.measure.hf_masks import masks_as_in_real_runs, note_example_batch
from autofit.measure.host import allocating_on_host, host_allocation, host_tensors
from autofit.measure.tracker import StorageTracker
from autofit.device import check_device, host_memory_bytes
from autofit.units import format_bytes

CUDA_BLOCK_BYTES = 512
"""The CUDA caching allocator rounds every block up to this."""


@dataclass(kw_only=True, slots=True)
class Measurement:
    peak_bytes: int = 0
    """The number a budget is compared with."""
    breakdown: dict[str, int] = field(default_factory=dict)
    host_peak_bytes: int = 0
    """Peak bytes strategies kept in host memory (offloaded activations, host optimizer state); not in peak_bytes."""


class Meter:
    """Builds the model where it measures, and measures a region of training."""

    name: str
    device: torch.device

    def environment(self):
        """Context inside which the model, batches and optimizer are made."""
        return nullcontext()

    def build_model(self, build: Callable[[], nn.Module]) -> nn.Module:
        return build().to(self.device)

    @contextmanager
    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[Measurement]:
        raise NotImplementedError


class TrackedMeter(Meter):
    """Peak live storage bytes, counted by ``StorageTracker`` on the CPU.

    Compiled functions (torchao's 8-bit optimizer step) run eagerly here: a
    dispatch mode cannot look inside compiled code, and ``torch.compile``
    refuses to run under one. Eager code holds at least the temporaries that
    compiled code does, so the count errs high, never low.
    """

    name = "cpu"

    def __init__(self, *, round_bytes: int = 1) -> None:
        self.device = torch.device("cpu")
        self.round_bytes = round_bytes

    def environment(self):
        return torch.compiler.set_stance("force_eager")

    @contextmanager
    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[Measurement]:
        measurement = Measurement()
        tracker = StorageTracker(round_bytes=self.round_bytes)
        params = [p for p in model.parameters()]
        tracker.track(params, "parameters")
        tracker.track(model.buffers(), "parameters")
        with host_allocation():  # optimizer state on the host, made before the measurement: host bytes
            tracker.track(host_tensors(optimizer), "optimizer_state")
        tracker.track(_optimizer_state(optimizer), "optimizer_state")
        hooks = [
            p.register_post_accumulate_grad_hook(lambda p: tracker.label([p.grad], "gradients"))
            for p in params
            if p.requires_grad
        ]
        try:
            with tracker:
                yield measurement
        finally:
            for hook in hooks:
                hook.remove()
        tracker.label(_optimizer_state(optimizer), "optimizer_state")
        measurement.peak_bytes = tracker.peak_bytes
        measurement.breakdown = tracker.breakdown_at_peak()
        measurement.host_peak_bytes = tracker.host_peak_bytes


class SimulatedMeter(TrackedMeter):
    """The tracker over fake tensors: shapes and bytes without arithmetic.

    Args:
        for_device: "cpu" (exact: equals the cpu meter) or "cuda" (an estimate:
            CPU autocast rules stand in for CUDA's, blocks round to 512 bytes).
    """

    name = "simulated"

    def __init__(self, *, for_device: str = "cpu") -> None:
        super().__init__(round_bytes=CUDA_BLOCK_BYTES if for_device == "cuda" else 1)
        self.for_device = for_device
        self._fake_mode = new_fake_mode()

    def environment(self):
        stack = ExitStack()
        stack.enter_context(self._fake_mode)
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        stack.enter_context(masks_as_in_real_runs())  # transformers' masks as the real batch has them
        if self.for_device == "cuda":  # the optimizer's step holds what it holds on a card
            stack.enter_context(optimizers_step_as_on_cuda(unless=allocating_on_host))  # a host optimizer: as on the CPU
            stack.enter_context(attention_as_on_cuda())
        return stack

    def build_model(self, build: Callable[[], nn.Module]) -> nn.Module:
        """The model with fake parameters and buffers, built without allocating them.

        Three ways, the first that works: everything on the meta device; only
        parameters on meta, other tensors real (timm computes drop-path rates
        with ``linspace(...).tolist()`` while constructing); under the fake mode
        (a model whose construction needs real parameters). Building under the
        fake mode first would fail on data-dependent init (``trunc_normal_``).
        The first two build outside the fake mode and the trackers: their
        initializers would run through them op by op (ResNet-50's construction:
        0.09 s against 0.035 s), only for tensors ``to_empty`` replaces.
        """
        try:
            with without_dispatch_modes(), torch.device("meta"):
                model = build()
            return to_empty_keeping_ties(model)
        except Exception:  # construction reads a value: build again with only the parameters empty
            pass
        try:
            with without_dispatch_modes(), parameters_on_meta():
                model = build()
            return to_empty_keeping_ties(model)
        except Exception:  # a model whose construction needs real parameters
            with torch.device("cpu"), self._fake_mode:
                return build()


@contextmanager
def attention_as_on_cuda() -> Iterator[None]:
    """Attention with dropout kept as a card keeps it: inside, ``F.scaled_dot_product_attention`` given a
    ``dropout_p`` runs without it (under fake tensors nothing is computed: only what is kept matters).

    On the CPU, torch runs attention with dropout by its math path, which keeps the attention probabilities, the
    dropout mask and the dropped probabilities for backward. A card's fused kernels (memory-efficient, flash) draw
    the dropout inside and keep only the output and its log-sum-exp, as the CPU's fused kernel does without
    dropout. On an H200 (bench/RESULTS.md, gpu_truth's meters), a transformers GPT-2 with attention dropout 0.1
    (d512, 6 layers, 512 tokens, micro-batch 8, fp32) allocated 2.23 GiB; simulated with the dropout it was 3.32
    GiB, without it 2.24. Attention written out by hand (a softmax, then ``F.dropout``) keeps its tensors on a card
    too, and is counted as it runs.
    """
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def as_a_fused_kernel(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        return original(query, key, value, attn_mask, 0.0, *args, **kwargs)

    functional.scaled_dot_product_attention = as_a_fused_kernel
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


def to_empty_keeping_ties(model: nn.Module, *, device: str = "cpu") -> nn.Module:
    """``model.to_empty(device=...)``, with parameters shared by several modules still shared.

    ``to_empty`` gives every module its own new tensor, so tied weights (GPT-2's
    embedding and output layer) would come back as two: counted twice, and
    trained as two.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    model = to_empty_quickly(model, device=device)
    for places in owners.values():
        first_module, first_name = places[0]
        shared = first_module._parameters[first_name]
        for module, name in places[1:]:
            module._parameters[name] = shared
    return model


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers goes to the meta device; other tensors stay real.

    What ``accelerate.init_empty_weights`` does: a model's construction may
    compute with real tensors, while its parameters take no memory.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


class CudaMeter(Meter):
    """Allocator peaks plus the rest of the process's footprint on the card."""

    name = "cuda"

    def __init__(self) -> None:
        check_device("cuda")
        self.device = torch.device("cuda", torch.cuda.current_device())

    @contextmanager
    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[Measurement]:
        measurement = Measurement()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        torch.cuda.reset_peak_host_memory_stats()
        yield measurement
        torch.cuda.synchronize(self.device)
        # Pinned host memory (offloaded activations, host optimizer state), from the host allocator.
        measurement.host_peak_bytes = torch.cuda.host_memory_stats().get("active_bytes.peak", 0)
        allocated_peak = torch.cuda.max_memory_allocated(self.device)
        reserved_peak = torch.cuda.max_memory_reserved(self.device)
        outside_allocator = max(process_cuda_bytes(self.device) - torch.cuda.memory_reserved(self.device), 0)
        param_bytes = sum(_nbytes(t) for t in list(model.parameters()) + list(model.buffers()))
        grad_bytes = sum(_nbytes(p) for p in model.parameters() if p.requires_grad)
        state_bytes = sum(_nbytes(t) for t in _optimizer_state(optimizer) if t.is_cuda)  # host-side state is not on the card
        measurement.peak_bytes = reserved_peak + outside_allocator
        measurement.breakdown = {
            "parameters": param_bytes,
            "gradients": grad_bytes,
            "optimizer_state": state_bytes,
            "activations": max(allocated_peak - param_bytes - grad_bytes - state_bytes, 0),
            "allocator_cache": reserved_peak - allocated_peak,
            "context": outside_allocator,
        }


def process_cuda_bytes(device: torch.device) -> int:
    """Bytes this process holds on the card: NVML's per-process count, else used memory."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return int(proc.usedGpuMemory)
    except Exception:  # NVML missing or not permitted (containers): fall back below
        pass
    free, total = torch.cuda.mem_get_info(device)
    return total - free


CPU_COLLECT_SHARE = 0.02
"""On the CPU, a model whose training state (``held_bytes``) is under this share of the free memory is left to Python's
own collections when released: a full collection in a plan's process takes tens of milliseconds (a ResNet-18 plan
made eight, 0.7 s), and that much garbage left a while harms nothing."""


def release_device_memory(device_type: str, *, held_bytes: int | None = None) -> None:
    """Free what dead tensors left behind: Python's cycles, then the CUDA allocator's cache. ``held_bytes``: what the
    model released held in training (``state_bytes``), where known; a small one on the CPU is left to Python."""
    import gc

    if device_type == "cpu" and held_bytes is not None and held_bytes < CPU_COLLECT_SHARE * host_memory_bytes(available=True):
        return
    gc.collect()
    if device_type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def state_bytes(model: nn.Module) -> int:
    """About what ``model`` holds training with AdamW: its parameters, their gradients and two moments each."""
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def make_meter(*, device_type: str, simulate: bool, spec=None) -> Meter:
    """The meter for a device; with ``simulate``, the simulated meter (or the cpu meter for a ``spec``
    whose model fake tensors cannot run, see ``checked_for_simulation``)."""
    if simulate:
        return simulated_meter(spec, for_device=device_type)
    if device_type == "cuda":
        return CudaMeter()
    if device_type == "cpu":
        return TrackedMeter()
    raise UserError(f"device {device_type!r} is unknown; use cpu or cuda")


def frozen_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters that do not train (``requires_grad=False``: LoRA's base model, a frozen backbone).

    Every meter counts them as parameters, with no gradients and no optimizer state.
    """
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


def frozen_note(spec) -> str:
    """" (99.50% of them frozen: no gradients or optimizer state)" for a model with frozen parameters, else "".

    A share of the parameters, not bytes: the bytes at the floor are in the floor's precision (bf16 weights under
    bf16-master), the model is built in fp32."""
    params = _meta_parameters(spec)
    if params is None:  # a model that cannot be built on meta: the note is cosmetic
        return ""
    total = sum(p.numel() for p in params)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    return f" ({frozen / total:.2%} of them frozen: no gradients or optimizer state)" if frozen else ""


def simulated_meter(spec=None, *, for_device: str = "cpu") -> Meter:
    """The simulated meter, or the cpu meter (real tensors) for a model that fake tensors cannot run.

    Args:
        spec: the ModelSpec measured; its ``simulation_fallback`` says whether it falls back.
        for_device: the device the simulation stands for ("cuda" rounds like its allocator).
    """
    if spec is not None and spec.simulation_fallback:
        return TrackedMeter(round_bytes=CUDA_BLOCK_BYTES if for_device == "cuda" else 1)
    return SimulatedMeter(for_device=for_device)


def checked_for_simulation(spec, *, log: Callable[[str], None] | None = None, stand_in=None, for_device: str = "cpu"):
    """``spec``, or a copy that measures with the cpu meter when fake tensors cannot run one training step of it.

    One simulated step of a micro-batch of 2 (2 optimizer micro-steps' worth of
    nothing: no arithmetic) finds out; a model whose forward reads values
    (``.item()``, a Python ``if`` on a tensor, ``nonzero``) cannot run on fake
    tensors, nor one calling an op whose fake kernel is narrower than its real one (torch's ``grouped_mm`` fake
    kernel takes only bf16 and fp16). Then one line (on stderr, or ``log``) says why and which meter is used.
    Any other failure that one real step of the same batch does not repeat is fake tensors' too; errors of the
    model itself are left for the real measurement to report.

    ``stand_in``: the same model with its identical blocks cut short (``memory.repeats.shortened``), stepped
    instead; where it fails, the whole model is stepped to say why.
    ``for_device``: the device the simulation stands for (``fall_back_from_simulation``).

    Raises:
        UserError: ``fall_back_from_simulation``'s.
    """
    if spec.simulation_fallback:
        return spec
    try:
        if stand_in is None:
            _one_simulated_step(spec)
        else:
            try:
                _one_simulated_step(stand_in)
            except Exception:  # fake tensors, or a forward that counts on every block: the whole model says which
                _one_simulated_step(spec)
    except FAKE_TENSOR_LIMITS as error:
        return fall_back_from_simulation(spec, error, log=log, for_device=for_device)
    except Exception as error:
        if fails_only_on_fake_tensors(spec):
            return fall_back_from_simulation(spec, error, log=log, for_device=for_device)
        return spec  # the model's own problem, or a batch size it refuses: the measurements report it
    return spec


def fails_only_on_fake_tensors(spec) -> bool:
    """Whether one real training step of ``example_batch(2)`` runs on this machine's CPU, where a simulated one
    failed: the failure is then fake tensors' alone. A model this machine cannot hold is not tried (False)."""
    if not trains_here(spec):
        return False
    try:
        with without_dispatch_modes():
            _one_step(spec, TrackedMeter())
    except Exception:  # the model fails for real too: its own error, reported by whoever measures it
        return False
    return True


def fall_back_from_simulation(
    spec, error: BaseException, *, log: Callable[[str], None] | None = None, for_device: str = "cpu",
):
    """A copy of ``spec`` that measures with the cpu meter, after one line saying why.

    Raises:
        UserError: measuring for real would not fit this machine's memory; or an op's fake kernel refused
            (``failed_fake_kernel``) for a plan for a card: the CPU's kernel, which ran, does not say what the card's does.
    """
    import dataclasses
    import sys

    detail = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
    why = f"{type(error).__name__}{': ' + detail if detail else ''}"
    op = None if isinstance(error, FAKE_TENSOR_LIMITS) else failed_fake_kernel(error)  # not a value fake tensors lack
    if op is not None:
        why = f"torch's fake kernel for {op} refuses what its CPU kernel runs: {why}"
        if for_device != "cpu":
            raise UserError(
                f"the simulated meter cannot run {op} for {spec.source} ({type(error).__name__}: {detail}: torch's fake kernel "
                f"refuses what its CPU kernel runs), and the cpu meter cannot stand in for {for_device}'s kernel; plan on the "
                f"{for_device} machine itself (without --simulate), or for --device cpu"
            ) from error
    needs, available = _real_training_bytes(spec), host_memory_bytes(available=True)
    if needs is not None and needs > available:
        raise UserError(
            f"the simulated meter cannot run {spec.source} on fake tensors ({why}), and measuring it for real would need "
            f"about {format_bytes(needs)} of this machine's memory ({format_bytes(available)} available: its fp32 weights, "
            "gradients and AdamW state); make its forward run without reading tensor values, or plan where that memory is"
        )
    line = (
        f"autofit: the simulated meter cannot run {spec.source} on fake tensors ({why}); "
        "measuring it with the cpu meter instead (real tensors, in this machine's memory)"
    )
    (log or (lambda text: print(text, file=sys.stderr, flush=True)))(line)
    return dataclasses.replace(spec, simulation_fallback=why)


def check_model_runs_simulated(spec) -> None:
    """``model_checks.check_model_runs`` on fake tensors, for a plan or probe with the simulated meter: a model file
    is never built for real here (an 8B model would need its 32 GB of this machine). A model that fake tensors
    cannot run is checked for real, as the cpu meter will measure it so.

    Raises:
        UserError: as ``check_model_runs``.
    """
    import dataclasses

    from autofit.model_checks import check_model_runs

    meter = SimulatedMeter(for_device="cpu")
    try:
        check_model_runs(
            dataclasses.replace(spec, example_batch=made_of_real_tensors(spec.example_batch)),
            build=meter.build_model, environment=meter.environment,
        )
    except UserError as error:
        if not isinstance(error.__cause__, FAKE_TENSOR_LIMITS) and not trains_here(spec):
            raise  # too large to check for real: the fake check's word stands
        # Values fake tensors lack, or an op whose fake kernel is narrower than the real one (grouped_mm's takes
        # only bf16): a real check says whether the model takes its batch, and the meters fall back if it does.
        check_model_runs(spec)


def made_of_real_tensors(example_batch):
    """``example_batch`` run outside every dispatch mode, so any Python in it works (a loop over samples, ``int(t)``,
    a dataset's ``__getitem__``: fake tensors have no values to give); under a fake mode its tensors are then made
    again there, empty, of the same shapes, strides, dtypes and shared storages: they are fake, and a tracker on
    counts them as it counts a batch made in the mode."""
    if getattr(example_batch, "made_real", False):
        return example_batch

    def made_real(n: int):
        with without_dispatch_modes():
            batch = example_batch(n)
        if not fake_mode_active():
            return batch
        storages = {}  # views of one storage (``tokens[:, :-1]``, ``tokens[:, 1:]``) stay views of one storage

        def remade(t: torch.Tensor) -> torch.Tensor:
            key = (t.untyped_storage().data_ptr(), t.device)
            if key not in storages:
                storages[key] = torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8, device=t.device)
            view = storages[key].view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
            return view.requires_grad_() if t.requires_grad else view

        return tree_map(lambda t: remade(t) if isinstance(t, torch.Tensor) else t, batch)

    made_real.made_real = True
    return made_real


def noting_padding(example_batch):
    """``example_batch`` that first says whether its attention mask pads (``hf_masks.note_example_batch``), from a
    batch made of real tensors outside every mode (fake tensors have no values to tell), then makes the batch as
    before, under whatever mode is on."""
    if getattr(example_batch, "notes_padding", False):
        return example_batch

    def noted(n: int):
        try:
            with without_dispatch_modes():
                note_example_batch(example_batch(n))
        except Exception:  # a batch that cannot be made outside the modes: transformers' cautious path stays
            note_example_batch(None)
        return example_batch(n)

    noted.notes_padding = True
    return noted


def check_fits_this_machine(spec, *, device: str) -> None:
    """Refuse, before building it, a model this machine's memory cannot hold for what comes next: on the CPU, training
    it for real (its weights, and for what trains gradients and AdamW's two moments); for a GPU here, its weights (it
    is built on the host first). Nothing is said for a model that cannot be built on the meta device.

    Raises:
        UserError: naming the bytes needed, those available, and ``--simulate``.
    """
    params = _meta_parameters(spec)
    if params is None:
        return
    weights = sum(p.numel() * p.element_size() for p in params)
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    needs = weights + 3 * trainable if device == "cpu" else weights
    available = host_memory_bytes(available=True)
    if needs > available:
        what = "train it for real: its weights, gradients and AdamW state" if device == "cpu" else "build it: its weights"
        raise UserError(
            f"{spec.source} is too big for this machine: it would need at least {format_bytes(needs)} to {what}, and "
            f"{format_bytes(available)} is available; plan it with --simulate (--device cuda --device-memory for the GPU that trains)"
        )


def trains_here(spec) -> bool:
    """Whether this machine's free memory holds ``spec``'s model training for real (``_real_training_bytes``; a model
    that cannot be built on the meta device is taken to: it was built for real already)."""
    needs = _real_training_bytes(spec)
    return needs is None or needs <= host_memory_bytes(available=True)


def meta_parameter_count(spec) -> int | None:
    """Parameters of ``spec``'s model, built on the meta device (no memory); None where it cannot be built there."""
    params = _meta_parameters(spec)
    return None if params is None else sum(p.numel() for p in params)


def _real_training_bytes(spec) -> int | None:
    """About what training ``spec``'s model for real takes at least: 16 bytes per parameter (fp32 weights, gradients
    and AdamW's two moments); None where its model cannot be built on the meta device."""
    params = _meta_parameters(spec)
    return None if params is None else 16 * sum(p.numel() for p in params)


def _meta_parameters(spec) -> list[nn.Parameter] | None:
    """The parameters of ``spec``'s model built on the meta device (names, shapes, dtypes; no memory); None where
    it cannot be built there (a Python object's copy is built only for real)."""
    try:
        with without_dispatch_modes(), torch.device("meta"):
            return list(spec.build_model().parameters())
    except Exception:
        return None


def _one_simulated_step(spec) -> None:
    _one_step(spec, SimulatedMeter())


def _one_step(spec, meter: Meter) -> None:
    """One training step of ``example_batch(2)`` under ``meter`` (its tensors, fake or real; nothing measured)."""
    from autofit.apply import apply_config
    from autofit.config import TrainingConfig
    from autofit.measure.optimizer_state import stepping_at_once
    from autofit.step import train_step

    with meter.environment():
        model = meter.build_model(spec.build_model)
        model.train()
        config = TrainingConfig(global_batch_size=2, micro_batch_size=2)
        applied = apply_config(model, config, device=meter.device, use_scaler=False)
        optimizer = spec.build_optimizer(applied.model.parameters())
        inputs, targets = spec.example_batch(2)
        with stepping_at_once(optimizer):  # whether fake tensors run the step, in fewer operators
            train_step(applied, inputs, targets, loss_fn=spec.loss_fn, optimizer=optimizer)


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def compiled_step_on_cpu(step: Callable[[], object]) -> tuple[int, float]:
    """A compiled model's step on the CPU: how its peak differs from the eager step's, and its seconds.

    The cpu meter's tracker runs compiled code eagerly (``TrackedMeter``): a
    dispatch mode cannot look inside it. The CPU allocator's own count
    (``cpu_allocation_peak``) sees both, so the tracker's peak of the eager
    step plus the difference of the two allocator peaks is the compiled
    step's. Inductor's fused kernels save what its partitioner chose, which
    may be less or (rarely) more than eager code holds.

    Returns:
        (compiled peak - eager peak in bytes, seconds of one compiled step after the one that compiles).
    """
    with torch.compiler.set_stance("default"):
        step()  # compiles
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
        compiled = cpu_allocation_peak(step)
    with torch.compiler.set_stance("force_eager"):
        eager = cpu_allocation_peak(step)
    return compiled - eager, seconds
