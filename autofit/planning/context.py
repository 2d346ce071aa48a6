"""What one planning run is about, fixed before anything is measured, and the points it searches.

``plan_context`` checks the arguments (device, batch, budget, precisions) and
returns a frozen ``PlanContext`` that every step of the run receives: the
model's spec, the device, the budget in bytes, the global batch, the
precisions to search, where the study is kept, the threads that time, and
the progress log.

The study is the user's ``--study``, else the cache: an Optuna SQLite study
under ``cache_dir()`` keyed by everything a cost model depends on (the model's
parameters and code, its example batch, loss and optimizer, the device, the
meter, the batch, the precisions, and the versions of Python, PyTorch and
autofit's own code), so that a plan of the same model at another budget
measures only what it has not measured before.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from pathlib import Path

import torch

from autofit._torch_private import set_cuda_allocator_settings
from autofit.errors import UserError
from autofit.device import DeviceInfo, check_device, device_info, host_memory_bytes, steady_host_allocations
from autofit.measure.kernels import precision_failures
from autofit.measure.meters import checked_for_simulation
from autofit.measure.other_work import other_work, usable_cores
from autofit.plan_file import DEFAULT_SEGMENTS, EXPANDABLE_SEGMENTS
from autofit.planning.memory.headroom import Headroom
from autofit.planning.memory.repeats import SHORT_LENGTHS, Repeat, find_repeat, shortened
from autofit.planning.memory.traces import simulation_spec
from autofit.planning.request import PlanRequest
from autofit.planning.policy import POLICY
from autofit.planning.speed.estimated import UNKNOWN_GPU_NAME, GPU_PEAKS, gpu_kind, gpu_peaks
from autofit.planning.search.space import Study
from autofit.planning.memory.workers import TracePool, configured_trace_workers
from autofit.progress import QUIET, Progress, as_progress
from autofit.spec import ModelSpec, model_fingerprint
from autofit.units import format_bytes, parse_budget
from strategies import MASTER_WEIGHTS, PRECISIONS, PURE_BF16, checkpoint_candidates, precision_dtype

HOST_SPEED_GIVEN = "at --host-speed"
"""How ``PlanContext.host_speed_source`` begins where ``--host-speed`` gave the rate."""

CACHE_FILE = "plans.db"
"""The cache's SQLite file in ``cache_dir()``."""


@dataclass(kw_only=True, slots=True)
class TimingThreads:
    """The intra-op threads a plan times with. They are decided where the plan starts (``timing_threads``) and may
    only fall during it (``PlanContext.cut_threads``): samples timed with different counts are never compared."""

    count: int
    note: str = ""
    """Why they are fewer than PyTorch's, when they are."""
    given: bool = False
    """``--threads`` chose them: kept whatever the machine or the timings show."""

    def may_cut(self, device: str) -> bool:
        """Whether the run may time with fewer threads from here on (on the CPU, more than one, not given)."""
        return device == "cpu" and self.count > 1 and not self.given


@dataclass(frozen=True, kw_only=True)
class PlanContext:
    """One planning run's fixed inputs, shared by its steps."""

    spec: ModelSpec
    device: str
    """"cpu" or "cuda"."""
    info: DeviceInfo
    simulate: bool
    """Plan with the simulated meter and FLOP-based speeds (the plan is marked estimated)."""
    budget_bytes: int
    global_batch_size: int
    precisions: list[str]
    """The precisions searched, in the order the user gave them."""
    host_budget_bytes: int | None
    """Host memory a GPU plan may spend (``--host-memory``, else this machine's); None on the CPU (the host is the device)."""
    host_budget_note: str
    host_speed: float | None
    """Parameter elements per second the training machine's host updates with the optimizer: ``--host-speed``, else
    for a GPU that is not here its kind's typical host (``GpuPeaks.host_update_per_s``); None: timed on this CPU (the
    device is here, so its host is this machine)."""
    host_speed_source: str = ""
    """``host_speed`` and where it comes from, as the notes say it ("at ... elements/s", given, or assumed with the
    flag that gives the training machine's)."""
    excluded_precisions: dict[str, str]
    """Precision -> why it is not searched."""
    num_classes: int | None
    study: Study
    meta_model: torch.nn.Module
    """The model on the meta device, built once for the run (its fingerprint, identity and the plan's model info)."""
    progress: Progress = QUIET
    """Receives the progress lines (``log``) and what runs now (``progress.doing``), for its heartbeat."""
    started: float = field(default_factory=time.perf_counter)
    """``time.perf_counter()`` when the run started."""
    thread_choice: TimingThreads = field(default_factory=lambda: TimingThreads(count=1))
    """The intra-op threads the run measures with, and why when fewer than PyTorch's: decided at the start, and
    cut again where the timing begins on a busier machine or its rounds on several threads repeat too poorly."""
    compile: bool = False
    """Measure the chosen configuration compiled too (``PlanRequest.compile``, decided for the device)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds spent so far per step of the run ("memory", "floor", "speed", "search", "verify", "write")."""
    trace_pool: TracePool = field(default_factory=TracePool)
    """Workers for the memory traces, started with ``sim_spec``, before the run's first backward pass."""

    @cached_property
    def sim_spec(self) -> ModelSpec:
        """The same model for the simulated meter (``simulation_spec``), made on first use: a plan whose
        costs all come from a stored study never needs it (nor the fake-tensor machinery's imports).
        A model fake tensors cannot run measures with the cpu meter, after one line saying why.

        The trace workers start here, before the check's backward pass (a process forked after one cannot
        run autograd); they are closed again when the check falls back to the cpu meter."""
        spec = simulation_spec(self.spec)
        with self.progress.paused():  # a worker forked while the heartbeat writes could copy its half-written line
            self.trace_pool.start(spec)
        checked = checked_for_simulation(spec, stand_in=self.stand_in(spec), for_device=self.device)
        if checked is not spec:
            self.trace_pool.close()
        return checked

    @cached_property
    def repeat(self) -> Repeat | None:
        """The model's longest run of identical blocks (``memory.repeats.find_repeat``), None where none is long
        enough to trace short."""
        return find_repeat(self.meta_model, checkpoint_candidates(self.meta_model))

    def stand_in(self, spec: ModelSpec) -> ModelSpec | None:
        """``spec`` with its run of identical blocks cut to ``SHORT_LENGTHS[0]`` blocks: what runs that only ask
        whether the model runs, or what each kind of block does, are made on (None: the model has no such run)."""
        return None if self.repeat is None else shortened(spec, self.repeat, SHORT_LENGTHS[0])

    @cached_property
    def cpu_rates(self) -> tuple[float, float]:
        """(FLOP/s, bytes/s) a CPU step is estimated at before any is timed: a matmul's rate measured here, once
        (``speed.estimated.roofline_rates``)."""
        from autofit.planning.speed.estimated import roofline_rates

        flops_per_s, bytes_per_s = roofline_rates("cpu", "")
        return flops_per_s["fp32"]["matmul"], bytes_per_s

    @property
    def trace_meter(self) -> str:
        """How the memory traces measure, as the progress lines say it: "simulated", or the cpu meter after the
        simulated one could not run the model (``sim_spec``)."""
        return "cpu meter: fake tensors cannot run this model" if self.sim_spec.simulation_fallback else "simulated"

    @property
    def threads(self) -> int:
        """Intra-op threads the run measures with now (``TimingThreads.count``): the plan's ``measured.threads``."""
        return self.thread_choice.count

    @property
    def threads_note(self) -> str:
        """Why they are fewer than PyTorch's, when they are (one line: the progress's and the summary's)."""
        return self.thread_choice.note

    @property
    def clock(self) -> Callable[[], float]:
        """What steps are timed by: on the CPU with one intra-op thread, that thread's CPU time (every operator then
        runs on it, so a quiet machine's wall time and it agree), else the wall clock.

        On a busy CPU the time other work holds the thread off its core is not the step's, and it is not even: a
        long step is held off more often than a short one, so the fastest of a few rounds favours the configuration
        with the shorter steps. The digits CNN at 64x1, 32x2 and 22x3 (bf16, one thread, 12 interleaved rounds,
        two busy processes on 2 cores): fastest wall times 242, 173 and 181 ms, by CPU time 154, 141 and 138 ms,
        where the quiet machine's are 153, 143 and 145 ms."""
        return step_clock(self.device, self.threads)

    @property
    def tie(self) -> float:
        """Speeds this close are a tie in this run: ``POLICY.busy_tie_share`` where other work kept the machine busy (the
        threads were cut, ``threads_note``), else ``POLICY.tie_share``."""
        return POLICY.busy_tie_share if self.threads_note else POLICY.tie_share

    @property
    def host_speed_given(self) -> bool:
        """Whether ``host_speed`` is the training machine's as ``--host-speed`` gave it (else assumed, or None)."""
        return self.host_speed_source.startswith(HOST_SPEED_GIVEN)

    @property
    def assumptions(self) -> str:
        """What the plan takes the training machine to be, said before anything is traced: the device and its memory,
        and for a GPU the host's memory and update rate, each with where it comes from."""
        if self.device != "cuda":
            return f"assuming the machine that trains is this one: {self.info.name}, {format_bytes(self.info.total_bytes)}"
        rate = (
            self.host_speed_source if self.host_speed is not None
            else "timed on this machine's CPU, the GPU's host"
        )
        note = self.host_budget_note
        host = f"{format_bytes(self.host_budget_bytes)}" + (f" ({note})" if note.startswith("--") else f", {note}")
        return (
            f"assuming {self.info.name}{'' if self.simulate else ' (here)'} with {format_bytes(self.info.total_bytes)}; "
            f"host memory {host}; host update rate {rate}"
        )

    def headroom(self, *, context_bytes: int | None = None) -> Headroom:
        """The budget's headroom on this run's device: the CUDA context as ``context_bytes`` measured it, else as
        assumed (``POLICY.estimated_cuda_context_bytes``; none on the CPU)."""
        assumed = POLICY.estimated_cuda_context_bytes if self.device == "cuda" else 0
        return Headroom(
            device_type=self.device, estimated=self.simulate, budget_bytes=self.budget_bytes,
            context_bytes=assumed if context_bytes is None else context_bytes,
            expandable_segments=self.info.allocator_settings == EXPANDABLE_SEGMENTS,
        )

    def recheck_threads(self) -> None:
        """Where timing begins, read the other work again (``timing_threads``): a machine that has become busy since
        the plan started times with the threads it leaves free from here on, said in one line."""
        if not self.thread_choice.may_cut(self.device):
            return
        count, note = timing_threads(self.device)
        if count < self.threads:
            self.cut_threads(count, note)

    def cut_threads(self, count: int, note: str) -> None:
        """Time with ``count`` intra-op threads from here on, saying ``note`` once (the progress's line, the summary's
        and the plan's ``measured.threads``, which training uses). The planner puts PyTorch's setting back after."""
        self.thread_choice.count, self.thread_choice.note = count, note
        torch.set_num_threads(count)
        self.log(note)

    def log(self, line: str) -> None:
        """A progress line (stamped by ``progress``: ``autofit.progress.as_progress``)."""
        self.progress.say(line)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the time inside towards the step ``name`` (for the summary's split)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start


def plan_context(spec: ModelSpec, request: PlanRequest, *, log: Callable[[str], None] | None = None) -> PlanContext:
    """Check a planning run's request (one process: ``request.gpus`` is for the pipeline) and fix what the run is about.

    Args:
        log: receives the run's progress lines: a ``Progress`` (the command's heartbeat), else a callable that
            receives them stamped with the seconds since this call.

    Raises:
        UserError: an unknown device, a bad batch size or budget, no CUDA device
            for ``device="cuda"`` without ``simulate``, or no precision left to search.
    """
    started = time.perf_counter()
    configured_trace_workers()  # a bad AUTOFIT_TRACE_WORKERS is refused even where the cache leaves nothing to trace
    steady_host_allocations()  # steps timed as training will run them
    budget, batch_size, device, simulate = request.budget, request.batch_size, request.device, request.simulate
    device_memory, study, precisions, threads = request.device_memory, request.study, request.precisions, request.threads
    check_device(device, simulate=simulate)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise UserError(f"--batch-size {batch_size!r} must be a whole number of samples, at least 1")
    kind = _device_kind(request.device_kind, device=device, simulate=simulate)
    if device_memory is None and kind is not None:
        device_memory = f"{GPU_PEAKS[kind].memory_gib}GiB"
    total = parse_budget(device_memory) if device_memory is not None else None
    info = device_info(device, total_bytes=total)
    if kind is not None:
        info = replace(info, name=f"simulated {kind}")
    if device == "cuda":
        info = replace(info, allocator_settings=EXPANDABLE_SEGMENTS if request.expandable_segments else DEFAULT_SEGMENTS)
        if not simulate:  # the probes measure the allocator the plan names (its segments from here on)
            set_cuda_allocator_settings(info.allocator_settings)
    budget_bytes = parse_budget(budget, device_total_bytes=info.total_bytes)
    if budget_bytes > info.total_bytes:
        where = "this machine's memory" if device == "cpu" and total is None else f"the {info.name}'s memory"
        raise UserError(
            f"budget {format_bytes(budget_bytes)} is more than {where}, {format_bytes(info.total_bytes)}; give at most that "
            "(or, with --simulate, --device-memory for a device that is not here)"
        )
    host_budget, host_note = _host_budget(request.host_memory, device=device, simulate=simulate)
    precisions, lossy = kept_weights_dtype(request, spec)
    kept, excluded = usable_precisions(device, simulate=simulate, wanted=precisions, lossy=lossy)
    if not simulate:  # the simulated meter runs no kernel; a model it plans may be too large to run here
        kept = _with_kernels(spec, precisions=kept, excluded=excluded, device=device)
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise UserError(f"--threads {threads!r} must be a whole number of threads, at least 1")
    meta_model = meta_model_of(spec)
    fingerprint = model_fingerprint(meta_model)
    # One prefix per model, device, meter, batch and precisions: a study of another budget shares its cost model.
    kind = "simulated" if simulate else "measured"
    identity = model_identity(spec, meta_model, device_name=info.name)
    allocator = f"{info.allocator_settings}:" if device == "cuda" and not simulate else ""  # a card's peaks depend on it
    prefix = f"autofit:{fingerprint}:{identity}:{device}:{kind}:{allocator}batch{batch_size}:{','.join(kept)}:"
    name = f"{prefix}budget{budget_bytes}"
    if study is not None:
        where = Study(storage=study, prefix=prefix, name=name, precisions=tuple(kept))
    elif request.cache:
        where = Study(storage=cache_storage(), prefix=prefix, name=name, precisions=tuple(kept), keep_trials=False, strict=False)
    else:
        where = Study(storage=None, prefix=prefix, name=name, precisions=tuple(kept))
    if request.compile and simulate:
        raise UserError("--compile is measured on the device, and --simulate runs nothing there; drop one of them")
    count, note = (threads, "") if threads is not None else timing_threads(device)
    host_speed, host_speed_source = _host_speed(request.host_speed, device=device, info=info)
    return PlanContext(
        spec=spec, device=device, info=info, simulate=simulate, budget_bytes=budget_bytes,
        global_batch_size=batch_size, precisions=kept, excluded_precisions=excluded, num_classes=request.num_classes,
        host_budget_bytes=host_budget, host_budget_note=host_note, host_speed=host_speed,
        host_speed_source=host_speed_source,
        study=where, progress=as_progress(log, started_s=started), started=started,
        thread_choice=TimingThreads(count=count, note=note, given=threads is not None), meta_model=meta_model,
        compile=request.compile if request.compile is not None else device == "cuda" and not simulate,
    )


def _host_speed(host_speed: float | None, *, device: str, info: DeviceInfo) -> tuple[float | None, str]:
    """The host's update rate for a GPU plan, and where it comes from: ``--host-speed``; else, for a GPU that is not
    here (simulated), its kind's typical host from the device table (``GpuPeaks.host_update_per_s``, an A100's for a
    GPU the table does not name), stated as assumed: this machine's CPU is not that host; else None (timed here).

    Raises:
        UserError: given for a CPU plan (on the CPU the host is the device: nothing is moved to it).
    """
    if host_speed is not None and device != "cuda":
        raise UserError(f"--host-speed {host_speed:g} is the host of a GPU plan (--device cuda); on the CPU the host is the device")
    if host_speed is not None:
        return host_speed, f"{HOST_SPEED_GIVEN} {host_speed:g} elements/s, the training machine's host as given, not measured"
    if device != "cuda" or not info.name.startswith("simulated "):
        return None, ""
    peaks, known = gpu_peaks(info.name)
    kind = info.name.removeprefix("simulated ") if known else f"{UNKNOWN_GPU_NAME} (the GPU is not in the table)"
    return peaks.host_update_per_s, (
        f"at {peaks.host_update_per_s:g} elements/s, assumed for a typical {kind} host (the device table, docs/planner.md), "
        "not timed on this machine; --host-speed gives the training machine's"
    )


def _device_kind(kind: str | None, *, device: str, simulate: bool) -> str | None:
    """``--device-kind``'s GPU, in the table's spelling; None when not given.

    Raises:
        UserError: given without simulating a GPU (a GPU here is its own kind), or a GPU the table does not hold.
    """
    if kind is None:
        return None
    if device != "cuda" or not simulate:
        raise UserError(f"--device-kind {kind} names a GPU that is not here: use it with --simulate --device cuda (a GPU here is measured as it is)")
    return gpu_kind(kind)


def _host_budget(host_memory: str | int | None, *, device: str, simulate: bool) -> tuple[int | None, str]:
    """The host memory a plan may spend, and how it was found ("--host-memory", "available on this machine", ...)."""
    if host_memory is not None:
        try:
            given = parse_budget(host_memory, device_total_bytes=host_memory_bytes(available=False))
        except UserError as error:
            raise UserError(f"--host-memory: {error}") from None
        if device != "cuda":
            raise UserError(
                f"--host-memory {host_memory} is for a GPU plan (--device cuda): on the CPU the host is the device, and "
                "--budget is its memory"
            )
        return given, "--host-memory"
    if device != "cuda":
        return None, ""
    if simulate and not torch.cuda.is_available():
        return host_memory_bytes(available=False), "assumed: this machine's memory (give --host-memory for the machine that will train)"
    return host_memory_bytes(available=True), "available on this machine now"


def meta_model_of(spec: ModelSpec) -> torch.nn.Module:
    """The model on the meta device (names, shapes and code; no memory)."""
    build = simulation_spec(spec).build_model if spec.source.startswith("python:") else spec.build_model
    with torch.device("meta"):  # a copy of a Python object is made from a meta template (simulation_spec)
        return build()


def cache_dir() -> Path:
    """Where plans keep their cost models: $AUTOFIT_CACHE_DIR, else $XDG_CACHE_HOME/autofit, else ~/.cache/autofit."""
    explicit = os.environ.get("AUTOFIT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autofit"


def cache_storage() -> str:
    """The cache as an Optuna storage URL (its folder is made on first use)."""
    folder = cache_dir()
    return f"sqlite:///{folder / CACHE_FILE}"


def step_clock(device: str, threads: int) -> Callable[[], float]:
    """``PlanContext.clock``'s rule: the thread's CPU time on the CPU with one intra-op thread, else the wall clock."""
    return time.thread_time if device == "cpu" and threads == 1 else time.perf_counter


@contextmanager
def intra_op_threads(count: int) -> Iterator[int]:
    """Run inside with ``count`` intra-op threads (``torch.set_num_threads``); PyTorch's setting is put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(before)


def timing_threads(device: str) -> tuple[int, str]:
    """Intra-op threads to measure with, and why when fewer than PyTorch's.

    On a CPU that other work keeps busy, a step on N threads waits at every
    parallel region for the slowest thread, which the other work holds off the
    core: steps then slow down many times over and by very different amounts
    (5x and more, seen on 2 cores at load 5). The run then measures with the
    threads the other work leaves free (at least 1), so that timings rank
    configurations as a quiet machine would; the summary says so. The other
    work is what runs now (``measure.other_work``).
    """
    current = torch.get_num_threads()
    if device != "cpu" or current == 1:
        return current, ""
    cores, seen = usable_cores(), other_work()
    if seen is None:
        return current, ""
    others, how = seen
    free = max(1, min(current, int(cores - others + 0.5)))
    if free >= current:
        return current, ""
    clock = ", steps timed by its CPU time" if free == 1 else ""  # ``PlanContext.clock``
    return free, f"the machine was busy ({how} on {cores} cores): measured with {free} of {current} threads{clock}"


def model_identity(spec: ModelSpec, meta_model: torch.nn.Module, *, device_name: str) -> str:
    """A hash of what a cost model depends on beyond the parameters' names and shapes (the fingerprint).

    The model's code (its file, an ``hf:`` config.json, or its class and module tree), the example
    batch's shapes and dtypes, the loss and the optimizer, the device's name
    (the CPU's model on a CPU) and the versions of Python, PyTorch and
    autofit's own code. A model file's imports are not followed: ``--no-cache``
    after changing only those.
    """
    parts = {
        "source": spec.source,
        "code": _source_hash(spec.source) or _object_code(meta_model),
        "example": _example_signature(spec),
        "loss": _qualified_name(spec.loss_fn),
        "optimizer": _optimizer_signature(spec, meta_model),
        "device": device_name if device_name != "cpu" else _cpu_name(),
        "python": list(sys.version_info[:2]),
        "torch": torch.__version__,
        "autofit": _own_code_hash(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _source_hash(source: str) -> str | None:
    """The bytes behind a source: a model file's, or an ``hf:`` source's config.json (edited in place, it is
    another model, whatever its layers' shapes say); None for a source of code only (torchvision:, python:)."""
    if source.startswith("hf:"):
        from autofit.library_models import hf_config_file

        path = hf_config_file(source)
    else:
        path = Path(source)
    if source.startswith(("torchvision:", "python:", "timm:")) or not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _object_code(model: torch.nn.Module) -> str:
    try:
        code = inspect.getsource(type(model))
    except (OSError, TypeError):  # defined in a notebook or compiled
        code = type(model).__qualname__
    return hashlib.sha256((code + repr(model)).encode()).hexdigest()


def _example_signature(spec: ModelSpec) -> list:
    from autofit._torch_private import tree_leaves

    inputs, targets = spec.example_batch(2)
    return [[str(t.dtype), list(t.shape)] if isinstance(t, torch.Tensor) else repr(t) for t in tree_leaves((inputs, targets))]


def _qualified_name(function) -> str:
    return f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', repr(function))}"


def _optimizer_signature(spec: ModelSpec, meta_model: torch.nn.Module) -> str:
    try:
        optimizer = spec.build_optimizer(meta_model.parameters())
    except Exception:  # an optimizer that refuses meta parameters: its builder's name stands for it
        return _qualified_name(spec.build_optimizer)
    defaults = {k: v for k, v in optimizer.defaults.items() if k != "lr"}  # the learning rate changes no cost
    return f"{type(optimizer).__qualname__}:{sorted(defaults.items(), key=lambda kv: kv[0])}"


@lru_cache(maxsize=1)
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def _own_code_hash() -> str:
    """autofit's and the strategies' source: a change to either can change what is measured."""
    import strategies

    autofit_root = Path(__file__).resolve().parents[1]  # autofit/, found from here, not by importing the package
    digest = hashlib.sha256()
    for root in (autofit_root, Path(strategies.__file__).parent):
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _with_kernels(spec: ModelSpec, *, precisions: list[str], excluded: dict[str, str], device: str) -> list[str]:
    """The precisions whose kernels run the model on the device; each other one goes to ``excluded`` with why.

    Raises:
        UserError: none is left (the user asked only for ones that cannot run); the way out is another precision.
    """
    failures = precision_failures(spec, precisions=precisions, device=device)
    for precision, why in failures.items():
        excluded[precision] = f"an op of the model has no {precision} kernel on {device} ({why})"
    kept = [p for p in precisions if p not in failures]
    if not kept:
        names = " and ".join(failures)
        others = " or ".join(p for p in ("fp32", "bf16") if p not in failures)
        raise UserError(
            f"{names} cannot train this model on {device}: an op has no {names} kernel there "
            f"({next(iter(failures.values()))}); plan with --precisions {others}"
        )
    return kept


def kept_weights_dtype(request: PlanRequest, spec: ModelSpec) -> tuple[tuple[str, ...] | None, bool]:
    """The precisions to search and whether bf16-pure's lossy update may be among them, after ``--weights-dtype``:
    ``config`` with a config that names bf16 keeps bf16 weights, which is bf16-pure alone (declared by the flag).

    Raises:
        UserError: an unknown value; ``config`` for a model whose config names no dtype, or one (fp16) no precision
            trains as it is; ``config`` with ``--precisions`` other than bf16-pure.
    """
    wanted, lossy, dtype = request.precisions, request.allow_lossy_optimizer, spec.config_dtype
    if request.weights_dtype == "fp32":
        return wanted, lossy
    if request.weights_dtype != "config":
        raise UserError(
            f"--weights-dtype {request.weights_dtype!r} is unknown; choose fp32 (the default: fp32 weights, the precision "
            "sets the arithmetic) or config (the dtype the model's config.json names)"
        )
    if dtype is None:
        raise UserError(f"--weights-dtype config keeps the dtype a model's config.json names, and {spec.source} names none; leave it out (fp32 weights)")
    if dtype == "fp32":
        return wanted, lossy
    if dtype != "bf16":
        raise UserError(
            f"--weights-dtype config: {spec.source}'s config.json names {dtype}, and no precision here trains {dtype} "
            "weights as they are (bf16-pure keeps bf16 ones); leave it out (fp32 weights, any precision)"
        )
    if wanted is not None and tuple(wanted) != (PURE_BF16,):
        raise UserError(
            f"--weights-dtype config keeps config.json's bf16 weights, which is precision {PURE_BF16} alone; drop "
            f"--precisions {','.join(wanted)} or --weights-dtype"
        )
    return (PURE_BF16,), True


def usable_precisions(
    device: str, *, simulate: bool, wanted: Sequence[str] | None, lossy: bool = False,
) -> tuple[list[str], dict[str, str]]:
    """The precisions to search, and why any were left out. bf16-pure changes the optimizer's arithmetic: only with
    ``lossy`` (``--allow-lossy-optimizer``)."""
    # bf16 weights with their masters on the host are a GPU's choice: on the CPU the host is the device.
    offered = [p for p in PRECISIONS if (device == "cuda" or p != MASTER_WEIGHTS) and (lossy or p != PURE_BF16)]
    wanted = list(wanted) if wanted else list(offered)
    unknown = [p for p in wanted if p not in PRECISIONS]
    if unknown:
        raise UserError(f"precision {unknown[0]!r} is unknown; choose from {', '.join(PRECISIONS)}")
    excluded = {p: "not asked for (--precisions)" for p in offered if p not in wanted}
    if not lossy and PURE_BF16 in wanted:  # asked for: said why not
        wanted.remove(PURE_BF16)
        excluded[PURE_BF16] = "rounds its bf16 updates stochastically (lossy): allow it with --allow-lossy-optimizer"
    if device != "cuda" and MASTER_WEIGHTS in wanted:  # asked for: said why not
        wanted.remove(MASTER_WEIGHTS)
        excluded[MASTER_WEIGHTS] = "a GPU choice (--device cuda): on the CPU the host it moves the weights to is the device"
    if device == "cuda" and torch.cuda.is_available() and not simulate:
        if not torch.cuda.is_bf16_supported():
            major, minor = torch.cuda.get_device_capability()
            for precision in [p for p in wanted if precision_dtype(p) == torch.bfloat16]:
                excluded[precision] = f"this GPU (compute capability {major}.{minor}) does not support bf16"
                wanted.remove(precision)
    if not wanted:
        raise UserError("no precision is left to search; allow fp32 with --precisions fp32")
    return wanted, excluded
