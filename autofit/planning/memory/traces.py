"""The planner's memory model: one simulated training trace, cut at block boundaries.

A training step's memory over time is recorded once (over fake tensors, so no
arithmetic runs) together with where each checkpoint candidate's forward ends
and where its backward begins. Checkpointing block ``b`` drops the bytes its
forward saved for backward (less its inputs, positional and keyword, and its
output, which its checkpoint keeps) exactly between those two points, and
recomputes them in its own backward. So the peak of any checkpoint set is a
max over the trace's segments of "bytes in the segment minus the bytes of the
checkpointed blocks that are dropped there". Everything is linear in the
micro-batch size, so traces at two micro-batch sizes give the model for every
size (``costs.memory_costs``).

Selective checkpointing keeps more than the inputs and the output: the
outputs of every op its policy saves (``strategies.checkpointing.selective_saves``:
matmuls, convolutions, attention), also those plain backward would have freed
(a projection whose output only feeds a residual add). What it drops is
therefore what the block saved less all of those, and it can be nothing, or
less than nothing. The plain trace records both sets per block; a trace with
every block selective gives what each selective recomputation holds, as the
all-checkpointed trace does for full checkpointing.

The memory levers (step in backward, optimizer state on the host, activation
offload) are modelled from what the plain trace's tracker also records
(``memory.levers``: gradients, optimizer state and saved tensors over time);
offload adds one trace with every block offloaded, made only when asked.

The planner verifies what this model predicts with the exact simulated meter
and with real probes; the model only has to rank configurations well.

A plan for this CPU may make a run on real tensors with the cpu meter instead (``run_trace``'s ``real``), where a
real step costs less than a run over fake tensors (``modelling.real_trace_sizes``): the same trace, made quicker.
"""
from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Collection
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace

import torch

from autofit._torch_private import call_when_backward_ends, op_flops, tree_leaves
from autofit.apply import apply_config
from autofit.config import TrainingConfig
from autofit.measure.boundaries import block_boundaries
from autofit.measure.meters import SimulatedMeter, TrackedMeter, made_of_real_tensors, noting_padding, simulated_meter
from autofit.measure.optimizer_state import create_optimizer_state
from autofit.measure.tracker import StorageTracker
from autofit.planning.memory.levers import LeverRecord, LeverRecorder, LeverTrace, lever_trace, with_offloaded
from autofit.planning.memory.repeats import SHORT_LENGTHS, Repeat, expand, find_repeat, repeat_in, shortened
from autofit.planning.memory.segments import (
    LATER_MICRO, Segment, plain_segments, recompute_segments,
)
from autofit.planning.memory.workers import call
from autofit.progress import QUIET, Progress
from autofit.spec import ModelSpec
from autofit.step import train_step
from strategies import checkpoint_candidates, selective_saves
from strategies.per_call import split_call

@dataclass(kw_only=True, slots=True)
class MemoryTrace:
    """One simulated trace at one micro-batch size."""

    micro_batch_size: int
    blocks: list[str]
    """Checkpoint candidates in forward order."""
    drop_bytes: list[int]
    """Bytes each block's checkpointing frees between its forward and its backward."""
    segments: list[Segment]
    prefix_shaped: bool
    """True when every segment's dropped blocks are a prefix of ``blocks`` (the usual case)."""
    host_sample_bytes: int = 0
    """Bytes of one sample of the example batch: the meter counts the whole global batch once it is sliced."""
    output_shape: list[int] = field(default_factory=list)
    selective_drop_bytes: list[int] = field(default_factory=list)
    """Bytes each block's selective checkpointing frees between its forward and its backward (0 or less where it
    keeps as much as plain training); empty when it frees nothing in any block (then it is never worth choosing,
    and no selective trace was made)."""
    recomputed: bool = True
    """Whether the all-checkpointed and all-selective runs were traced: without them (``trace_memory_sizes``'
    ``recompute``) the segments are plain training's only, and say nothing of a checkpointed block's backward."""
    scaled: bool = False
    """A larger trace scaled down to this size (``costs._scaled``), not a trace of its own."""
    levers: LeverTrace | None = None
    """What the memory levers change in the plain trace's segments (``memory.levers``); None in a trace stored
    before the levers were modelled (then they are not searched)."""
    chunk_deltas: list[int] | None = None
    """Per plain segment (``recomputes`` None, in order): what the chunked output layer and loss (``loss_chunks``)
    change in its peak, from the step traced again with them (``add_chunk_deltas``); None where not traced, []
    where not modelled."""
    loss_chunks: int = 1
    """The chunks ``chunk_deltas`` were traced with."""
    shared_call_bytes: list[int] = field(default_factory=list)
    """Per block that is a call of a shared layer (``strategies.per_call``): what it saved that the layer's other
    calls saved too (autocast's cached copies of its weights), left out of its drop (``_saved_by_other_calls``);
    [] where no block is such a call."""
    flops: int = field(default=0, compare=False)
    """FLOPs its plain run counted (two micro-steps and an optimizer step): what a real run of it would compute;
    0 where not counted (a trace stored before they were)."""
    fake_cpu_seconds: float = field(default=0.0, compare=False)
    """CPU seconds its plain run took over fake tensors, what a run on real tensors is weighed against
    (``modelling.real_trace_sizes``); 0 where it ran on real tensors. What making the trace cost, not what it
    says: traces that say the same compare equal whatever it is."""

    def to_dict(self) -> dict:
        return asdict(self)

    def segment_chunk_deltas(self) -> list[int] | None:
        """``chunk_deltas`` for every segment; None where chunking is not modelled.

        A recomputation runs in its block's backward, after the loss: it takes the change of the plain segment it
        runs in (the last of its phase with the same blocks dropped), where the model's whole logits, which the
        step's output holds until the micro-step ends, are gone too.
        """
        plain = [s for s in self.segments if s.recomputes is None]
        if not self.chunk_deltas or len(self.chunk_deltas) != len(plain):
            return None
        last = {(s.phase, tuple(s.dropped)): delta for s, delta in zip(plain, self.chunk_deltas)}
        deltas = iter(self.chunk_deltas)
        return [next(deltas) if s.recomputes is None else last.get((s.phase, tuple(s.dropped)), 0) for s in self.segments]


class _TimelineTracker(StorageTracker):
    """A StorageTracker that also keeps the highest live bytes since the last mark, and shows each op's outputs to ``watch``."""

    def __init__(self, *, round_bytes: int) -> None:
        super().__init__(round_bytes=round_bytes)
        self.segment_peaks: list[int] = []
        self.marks: list[tuple] = []
        self._segment_peak = 0
        self.watch = None
        """Called with (op, outputs) after every op while set."""
        self.levers = LeverRecorder(self)
        """What the memory levers' terms need (``memory.levers``): gradients' and saved tensors' bytes over time."""
        self.flops = 0
        """FLOPs of the ops seen (``torch.utils.flop_counter``'s formulas: matmuls, convolutions, attention)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = StorageTracker.__torch_dispatch__(self, func, types, args, kwargs)
        if self.watch is not None:
            self.watch(func, out)
        self.levers.made(func, out)
        self.flops += op_flops(func, args, kwargs, out)
        return out

    def _grow(self, nbytes: int) -> None:
        StorageTracker._grow(self, nbytes)
        if self.current_bytes > self._segment_peak:
            self._segment_peak = self.current_bytes
        self.levers.grown()

    def _track_one(self, tensor, *, widen: int = 1, nbytes: int | None = None):
        made = len(self._records)
        record = StorageTracker._track_one(self, tensor, widen=widen, nbytes=nbytes)
        if len(self._records) > made:
            self.levers.created(record)
        return record

    def _free(self, key: int) -> None:
        record = self._live.get(key)
        StorageTracker._free(self, key)
        self.levers.freed(key, record)

    def mark(self, event: tuple) -> None:
        self.segment_peaks.append(self._segment_peak)
        self.marks.append(event)
        self._segment_peak = self.current_bytes
        self.levers.mark(event)


def trace_memory(
    spec: ModelSpec, *, micro_batch_size: int, precision: str, device_type: str = "cpu", pool=None,
) -> MemoryTrace:
    """Trace a simulated optimizer step of two micro-batches: plain, all-checkpointed and all-selective.

    The traced global batch is 2 x micro_batch_size; a step's memory depends on
    the global batch only through its host copy (``host_sample_bytes``). The
    plain run gives every segment and each block's dropped bytes, fully and
    selectively; a second run with every block checkpointed measures what each
    block's recomputation holds at its peak, and a third with every block
    selective the same for selective recomputation (left out when selective
    checkpointing frees nothing in any block).

    Args:
        spec: the model, its example batches, loss and optimizer.
        micro_batch_size: samples per micro-batch.
        precision: "fp32", "bf16" or "fp16".
        device_type: the device planned for ("cuda" rounds storages like its allocator).
        pool: a ``memory.workers.TracePool`` of ``spec`` whose workers run the traced runs at once (None: here, in turn).

    Returns:
        The segments of the trace and the bytes each block's checkpointing drops.
    """
    return trace_memory_sizes(spec, sizes=[micro_batch_size], precision=precision, device_type=device_type, pool=pool)[0]


def trace_memory_sizes(
    spec: ModelSpec, *, sizes: list[int], precision: str, device_type: str = "cpu", blocks: list[str] | None = None,
    pool=None, recompute: bool = True, real_sizes: Collection[int] = (), progress: Progress = QUIET,
    meanwhile: Callable[[], None] | None = None,
) -> list[MemoryTrace]:
    """``trace_memory`` at each size; with a started ``memory.workers.TracePool`` of ``spec``, its runs at once in its workers.

    The checkpoint candidates are ``blocks`` (a trace's ``blocks``), else a
    forward finds them (``traced_candidates``; without a pool, the first plain
    run); then every plain run is handed out at once, and with ``recompute``
    the all-checkpointed and all-selective runs after them (``add_recomputes``,
    which adds them later otherwise). Without a pool the same runs go one after
    another in this process. The runs at ``real_sizes`` are made on real tensors with the cpu meter (which the
    simulated one equals on the CPU), where a real step costs less than a run over fake tensors.
    ``progress`` hears which run is awaited, k of n. ``meanwhile``: this process's own work, done once the plain runs
    are handed to the pool's workers and before they are awaited (their runs leave this process's core free); not
    done without workers, where nothing would run beside it.
    """
    def start(size: int):
        return call(
            pool, run_trace, spec, micro_batch_size=size, precision=precision, device_type=device_type, mode="none", blocks=blocks,
            real=size in real_sizes,
        )

    def awaited(size: int, result):
        with progress.doing(f"tracing {precision} at micro-batch {size}", step=len(plain) + 1, of=len(sizes)):
            return result()

    plain: dict[int, object] = {}
    if blocks is None and pool is not None and pool.spec is spec:
        with progress.doing(f"finding the checkpoint candidates (a forward at micro-batch {sizes[0]})"):
            blocks = traced_candidates(spec, micro_batch_size=sizes[0], device_type=device_type)  # a forward, not a run
    if blocks is None:
        first = awaited(sizes[0], start(sizes[0]))
        blocks, plain[sizes[0]] = first.names, first
    pending = {size: start(size) for size in sizes if size not in plain}
    if meanwhile is not None and pool is not None and pool.workers and pool.spec is spec:
        meanwhile()
    for size, result in pending.items():
        plain[size] = awaited(size, result)
    traces = []
    for size in sizes:
        raw = plain[size]
        segments, prefix_shaped = plain_segments(raw.marks, raw.peaks, raw.drop_bytes)
        traces.append(MemoryTrace(
            micro_batch_size=size,
            blocks=raw.names,
            drop_bytes=raw.drop_bytes,
            segments=segments,
            prefix_shaped=prefix_shaped,
            host_sample_bytes=raw.host_bytes // (2 * size),
            output_shape=raw.output_shape,
            # Left out where selective checkpointing frees nothing in any block: then it is never traced.
            selective_drop_bytes=raw.selective_drop_bytes if blocks and any(b > 0 for b in raw.selective_drop_bytes) else [],
            recomputed=not blocks,
            levers=lever_trace(raw.levers, raw.marks, raw.peaks, spec=spec, device_type=device_type),
            shared_call_bytes=raw.shared_call_bytes if any(raw.shared_call_bytes) else [],
            flops=raw.flops, fake_cpu_seconds=0.0 if size in real_sizes else raw.cpu_seconds,
        ))
    if not recompute:
        return traces
    return add_recomputes(spec, traces, precision=precision, device_type=device_type, pool=pool, real_sizes=real_sizes, progress=progress)


_RECOMPUTED = {"full": "every block checkpointed", "selective": "every block selectively checkpointed"}
"""A recomputing run's mode, as the progress lines say it."""


def add_recomputes(
    spec: ModelSpec, traces: list[MemoryTrace], *, precision: str, device_type: str = "cpu", pool=None,
    real_sizes: Collection[int] = (), progress: Progress = QUIET,
) -> list[MemoryTrace]:
    """``traces`` (made without ``recompute``) with their all-checkpointed and all-selective runs' segments added:
    what ``trace_memory_sizes`` would have made (``real_sizes`` as there). Traces already recomputed come back as they are."""
    pending = []
    for trace in traces:
        runs = []
        if not trace.recomputed:
            for mode, drops in (("full", trace.drop_bytes), ("selective", trace.selective_drop_bytes)):
                if drops:
                    runs.append((mode, drops, call(
                        pool, run_trace, spec, micro_batch_size=trace.micro_batch_size, precision=precision,
                        device_type=device_type, mode=mode, blocks=trace.blocks, real=trace.micro_batch_size in real_sizes,
                    )))
        pending.append(runs)
    completed, done, total = [], 0, sum(map(len, pending))
    for trace, runs in zip(traces, pending):
        if trace.recomputed:
            completed.append(trace)
            continue
        segments = list(trace.segments)
        for mode, drops, result in runs:
            done += 1
            what = f"tracing {precision} at micro-batch {trace.micro_batch_size} with {_RECOMPUTED[mode]}"
            with progress.doing(what, step=done, of=total):
                recomputed = result()
            recomputations = recompute_segments(recomputed.marks, recomputed.peaks, drops, selective=mode == "selective")
            for segment in recomputations:
                segment.peak_bytes += _shared_while_calls_wait(trace, segment.dropped)
            segments += recomputations
        completed.append(replace(trace, segments=segments, recomputed=True))
    return completed


def traced_candidates(spec: ModelSpec, *, micro_batch_size: int, device_type: str = "cpu") -> list[str]:
    """The checkpoint candidates a traced run finds (one forward over fake tensors of a micro-batch)."""
    meter = simulated_meter(spec, for_device=device_type)
    torch.manual_seed(0)
    with meter.environment():
        return _candidates(meter.build_model(spec.build_model), spec, micro_batch_size=micro_batch_size)


def _candidates(model, spec: ModelSpec, *, micro_batch_size: int) -> list[str]:
    """The checkpoint candidates one forward of ``model`` (built in a meter's environment) over a micro-batch finds."""
    model.train()
    inputs, _ = spec.example_batch(2 * micro_batch_size)
    return checkpoint_candidates(model, example_inputs=inputs)


@dataclass(slots=True)
class _RawTrace:
    names: list[str]
    marks: list[tuple]
    peaks: list[int]
    drop_bytes: list[int]
    host_bytes: int
    output_shape: list[int]
    selective_drop_bytes: list[int]
    levers: LeverRecord | None = None
    shared_call_bytes: list[int] = field(default_factory=list)
    cpu_seconds: float = 0.0
    """The CPU seconds the run took (its process's: a run over fake tensors is Python on one thread)."""
    flops: int = 0
    """The FLOPs of its ops."""


def run_trace(
    spec: ModelSpec, *, micro_batch_size: int, precision: str, device_type: str, mode: str,
    blocks: list[str] | None = None, loss_chunks: int = 1, real: bool = False,
) -> _RawTrace:
    """One traced step with every block in ``mode`` ("none", "full", "selective" or "offload"); ``blocks`` are the
    candidates when already found (else one fake forward finds them); ``loss_chunks`` chunks the output layer and loss;
    ``real``: on real tensors, with the cpu meter (``device_type`` "cpu" only).

    A model with a long run of identical blocks is traced with that run cut short, twice, and its whole trace
    inferred from the two (``memory.repeats``); where they do not line up, it is traced whole.
    """
    if blocks is not None:
        names, repeat = blocks, repeat_in(spec, blocks)
    else:
        meter = simulated_meter(spec, for_device=device_type)  # the cpu meter for a model fake tensors cannot run
        torch.manual_seed(0)
        with meter.environment():
            model = meter.build_model(spec.build_model)
            names = _candidates(model, spec, micro_batch_size=micro_batch_size)
            repeat = find_repeat(model, names)
    settings = dict(micro_batch_size=micro_batch_size, precision=precision, device_type=device_type, mode=mode, loss_chunks=loss_chunks, real=real)
    if repeat is not None:
        try:
            short, longer = (_traced_run(spec, names=repeat.short_names(names, n), shorten=(repeat, n), **settings) for n in SHORT_LENGTHS)
        except Exception:  # a forward that counts on every block being there (the whole model's run says what is wrong)
            short = longer = None
        expanded = expand(short, longer, repeat=repeat, names=names) if short is not None else None
        if expanded is not None:
            return expanded
    return _traced_run(spec, names=names, **settings)


def _traced_run(
    spec: ModelSpec, *, micro_batch_size: int, precision: str, device_type: str, mode: str, names: list[str],
    loss_chunks: int, real: bool, shorten: tuple[Repeat, int] | None = None,
) -> _RawTrace:
    """``run_trace``'s one traced step over the model, with its run of identical blocks cut to ``shorten``'s length."""
    if real and device_type != "cpu":
        raise ValueError(f"a trace on real tensors measures the CPU, not {device_type}")
    started = time.process_time()
    meter = TrackedMeter() if real else simulated_meter(spec, for_device=device_type)
    torch.manual_seed(0)
    with meter.environment():
        model = meter.build_model((shortened(spec, *shorten) if shorten is not None else spec).build_model)
        model.train()
        inputs, targets = noting_padding(spec.example_batch)(2 * micro_batch_size)  # as the probe's (``measure``)
        config = TrainingConfig(
            global_batch_size=2 * micro_batch_size, micro_batch_size=micro_batch_size, precision=precision,
            checkpoint=names if mode == "full" else [], selective_checkpoint=names if mode == "selective" else [],
            offload=names if mode == "offload" else [], loss_chunks=loss_chunks,
        )
        applied = apply_config(model, config, device=meter.device, use_scaler=False)
        optimizer = applied.build_optimizer(spec.build_optimizer)
        host_bytes = sum(t.untyped_storage().nbytes() for t in tree_leaves((inputs, targets)) if isinstance(t, torch.Tensor))
        tracker = _TimelineTracker(round_bytes=meter.round_bytes)
        tracker.track(model.parameters(), "parameters")
        tracker.track(model.buffers(), "parameters")
        tracker.levers.follow_gradients(list(model.parameters()))
        persistent = {id(t.untyped_storage()) for t in list(model.parameters()) + list(model.buffers())}
        recorder = _BlockRecorder(tracker, names, persistent=persistent)
        # The checkpointed runs' blocks keep their own saved-tensor hooks: nothing to count there.
        plain = mode == "none"
        saved_hooks = torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t) if plain else nullcontext()
        tracker.watch = recorder.watch if plain else None
        step_hooks = []
        with (
            block_boundaries(model, [""], enter=recorder.micro_step_starts, leave=recorder.micro_step_ends),  # the whole model
            block_boundaries(model, names, enter=recorder.block_starts, leave=recorder.block_ends),
            tracker,
            saved_hooks,
        ):
            # Before the first micro-step's mark: what the state's creation holds at its peak is in no segment.
            create_optimizer_state(model, optimizer, at_once=True)
            step_hooks.append(optimizer.register_step_pre_hook(lambda *_: tracker.mark(("optimizer", recorder.micro))))
            step_hooks.append(optimizer.register_step_post_hook(lambda *_: tracker.mark(("optimizer_end", recorder.micro))))
            # The recomputing runs are read only until backward ends (``_recompute_segments``): no step to trace
            # (the offloading run is read to its end: ``memory.levers.add_offloaded``).
            train_step(applied, inputs, targets, loss_fn=spec.loss_fn, optimizer=optimizer if mode in ("none", "offload") else _NoStep(optimizer))
        tracker.mark(("end",))
        for hook in step_hooks:
            hook.remove()
        tracker.watch = None
        drop_bytes, selective_drop_bytes, shared = recorder.drop_bytes(LATER_MICRO)
    return _RawTrace(
        names=names, marks=tracker.marks, peaks=tracker.segment_peaks, drop_bytes=drop_bytes,
        host_bytes=host_bytes, output_shape=recorder.output_shape, selective_drop_bytes=selective_drop_bytes,
        levers=tracker.levers.record(freed=mode == "offload"), shared_call_bytes=shared, cpu_seconds=time.process_time() - started,
        flops=tracker.flops,
    )


class _BlockRecorder:
    """A traced step's hooks: they mark where micro-steps and blocks start and end on the tracker's timeline, and
    count, per block and micro-step, what its checkpoint would drop (fully or selectively) and the inputs that
    plain training frees before the block's backward while a checkpoint keeps them."""

    def __init__(self, tracker: _TimelineTracker, names: list[str], *, persistent: set[int]) -> None:
        self.tracker, self.names, self.persistent = tracker, names, persistent
        self.position = {name: index for index, name in enumerate(names)}
        self.micro = -1
        self.active: list[int] = []
        """The blocks whose forward runs now, innermost last."""
        self.output_shape: list[int] = []
        self.saved: dict[str, dict[int, dict[int, int]]] = {name: {} for name in names}
        """Block -> micro-step -> storage id -> bytes its forward saved for backward."""
        self.policy_kept: dict[str, dict[int, list]] = {name: {} for name in names}
        """Block -> micro-step -> the outputs of the ops selective checkpointing would keep, as (weak reference to
        the storage, bytes); a storage freed by plain training is kept by it."""
        self.loose: dict[tuple[int, int], list] = {}
        """(micro-step, block index) -> inputs the block does not save, as (weak reference, bytes), until its backward."""
        self.dropped: dict[tuple[int, int], int] = {}
        """(micro-step, block index) -> bytes full checkpointing drops."""
        self.selective_dropped: dict[tuple[int, int], int] = {}
        """(micro-step, block index) -> bytes selective checkpointing drops."""
        self.kept_inputs: dict[tuple[int, int], int] = {}
        """(micro-step, block index) -> input bytes plain training has freed when the block's backward begins."""
        self.dropped_keys: dict[tuple[int, int], dict[int, int]] = {}
        """(micro-step, block index) -> storage id -> bytes of what full checkpointing drops."""

    def micro_step_starts(self, name, args) -> None:
        self.micro += 1
        self.tracker.mark(("micro", self.micro))

    def micro_step_ends(self, name, args, kwargs, output) -> None:
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        if tensors:
            self.output_shape = list(tensors[0].shape)
        micro = self.micro
        for tensor in tensors:
            if tensor.requires_grad:
                # Where this micro-step's backward ends: the first block's backward and
                # recomputation lie before it, the next micro-batch's copy after it.
                tensor.register_hook(lambda grad: call_when_backward_ends(lambda: self.tracker.mark(("bwd_end", micro))))
                break

    def block_starts(self, name, args) -> None:
        index = self.position[name]
        self.active.append(index)
        self.tracker.mark(("fwd_start", index, self.micro))

    def block_ends(self, name, args, kwargs, output) -> None:
        index = self.position[name]
        self.active.pop()
        micro = self.micro
        self.tracker.mark(("fwd_end", index, micro))
        # Keyword inputs too (a Hugging Face layer's position embeddings and mask): a
        # checkpointed block keeps all its inputs until its backward.
        inputs = {id(t.untyped_storage()): t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        kept = set(inputs) | {id(t.untyped_storage()) for t in outputs}
        saved = self.saved[name].setdefault(micro, {})
        dropped = sum(n for key, n in saved.items() if key not in kept)
        self.dropped[micro, index] = dropped
        self.dropped_keys[micro, index] = {key: n for key, n in saved.items() if key not in kept}
        # An input the block's own ops do not save (a block that starts with a matmul under autocast
        # saves the input's cast, not the input) may die after the forward; kept by a checkpoint, it
        # stays: what has died when the block's backward begins is what checkpointing adds.
        self.loose[micro, index] = [
            (weakref.ref(t.untyped_storage()), self.tracker.counted_bytes(t))
            for key, t in inputs.items() if key not in saved and key not in self.persistent
        ]
        self.selective_dropped[micro, index] = dropped - self._policy_kept_bytes(name, micro, kept)
        for tensor in outputs:
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, index=index, micro=micro: self.backward_starts(index, micro))
                break

    def _policy_kept_bytes(self, name: str, micro: int, kept: set[int]) -> int:
        """Selective checkpointing keeps the policy's outputs too (each storage once; one that died is no input or output)."""
        also_kept: dict[int, int] = {}
        for ref, nbytes in self.policy_kept[name].get(micro, []):
            storage = ref()
            key = id(ref) if storage is None else id(storage)
            if storage is None or key not in kept:
                also_kept[key] = nbytes
        return sum(also_kept.values())

    def backward_starts(self, index: int, micro: int) -> None:
        self.tracker.mark(("bwd_start", index, micro))
        self.kept_inputs[micro, index] = sum(n for ref, n in self.loose.pop((micro, index), []) if ref() is None)

    def watch(self, op, outputs) -> None:
        if self.active and selective_saves(op):
            kept = self.policy_kept[self.names[self.active[-1]]].setdefault(self.micro, [])
            for tensor in tree_leaves(outputs):
                if isinstance(tensor, torch.Tensor):
                    kept.append((weakref.ref(tensor.untyped_storage()), self.tracker.counted_bytes(tensor)))

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.tracker.levers.saved(tensor, block=self.active[-1] if self.active else None, micro=self.micro)
        if self.active:
            key = id(tensor.untyped_storage())
            if key not in self.persistent:
                saved = self.saved[self.names[self.active[-1]]].setdefault(self.micro, {})
                saved[key] = self.tracker.counted_bytes(tensor)
        return tensor

    def drop_bytes(self, micro: int) -> tuple[list[int], list[int], list[int]]:
        """Per block at ``micro``: the bytes full and selective checkpointing drop, and what of them the other calls of
        a shared layer saved too (``_saved_by_other_calls``), left out of both. Both modes keep the block's inputs:
        those plain training frees by the block's backward count against them."""
        count = len(self.names)
        kept_inputs = [self.kept_inputs.get((micro, i), 0) for i in range(count)]
        shared = _saved_by_other_calls(self.names, self.saved, self.dropped_keys, micro=micro)
        full = [self.dropped.get((micro, i), 0) - kept_inputs[i] - shared[i] for i in range(count)]
        selective = [self.selective_dropped.get((micro, i), 0) - kept_inputs[i] - shared[i] for i in range(count)]
        return full, selective, shared


def _saved_by_other_calls(names: list[str], saved: dict, dropped_keys: dict, *, micro: int) -> list[int]:
    """Per block: the bytes it counted as dropped that another call of its module saved too (0 for a block that is
    no module's call, ``strategies.per_call``).

    The calls of a shared layer under autocast save the same cached low-precision copies of its weights: they
    stay alive while any call that used the cache waits for its backward, so checkpointing one call frees none
    of them (counted, one call of a 4-call layer in bf16 was predicted 2.9% under the meter). They are left out
    of every call's drop: where every call is checkpointed nothing is cached, and the model is that much over.
    """
    calls: dict[str, list[int]] = {}
    for index, name in enumerate(names):
        module_name, call = split_call(name)
        if call is not None:
            calls.setdefault(module_name, []).append(index)
    shared = [0] * len(names)
    for indices in calls.values():
        for index in indices:
            others = [saved[names[other]].get(micro, {}) for other in indices if other != index]
            shared[index] = sum(n for key, n in dropped_keys.get((micro, index), {}).items() if any(key in o for o in others))
    return shared


def _shared_while_calls_wait(trace: MemoryTrace, dropped: list[int]) -> int:
    """What a shared layer's calls saved together (``MemoryTrace.shared_call_bytes``), once per layer with a call
    among ``dropped``: a recomputation segment comes from the run with every call checkpointed, where autocast
    caches nothing; with a call of the layer not checkpointed, the cached copies stay alive until its backward.
    Where every such call is checkpointed too, this is that much over."""
    if not trace.shared_call_bytes:
        return 0
    by_layer: dict[str, int] = {}
    for index in dropped:
        layer = split_call(trace.blocks[index])[0]
        by_layer[layer] = max(by_layer.get(layer, 0), trace.shared_call_bytes[index])
    return sum(by_layer.values())


class _NoStep:
    """An optimizer whose step does nothing (its state and ``zero_grad`` are the optimizer's)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def step(self, closure=None) -> None:
        return None

    def __getattr__(self, name: str):
        return getattr(self._optimizer, name)


def simulation_spec(spec: ModelSpec) -> ModelSpec:
    """A spec whose model the simulated meter can build, and whose example batches it can make.

    Example batches are made of real tensors, then of fake ones of the same shapes (``made_of_real_tensors``).

    Models from files and torchvision build under the meta device. A model
    object from the Python API is copied by ``deepcopy``, which fails under fake tensors;
    its copy is then made from a meta template with fresh tensors of zeros
    (fake ones when built inside the simulated meter).
    """
    import copy
    import dataclasses

    from torch import nn

    spec = dataclasses.replace(spec, example_batch=made_of_real_tensors(spec.example_batch))
    meter = SimulatedMeter(for_device="cpu")
    try:
        with meter.environment():
            meter.build_model(spec.build_model)
        return spec
    except Exception:  # a copy of a real model: deepcopy refuses fake and meta storage
        pass
    template = spec.build_model().to("meta")

    def build_model() -> nn.Module:
        memo = {}
        for tensor in list(template.parameters()) + list(template.buffers()):
            # Zeros, not whatever memory held: a run on real tensors (``run_trace``'s ``real``) steps these values.
            fresh = torch.zeros(tensor.shape, dtype=tensor.dtype, device="cpu")
            memo[id(tensor)] = nn.Parameter(fresh, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else fresh
        return copy.deepcopy(template, memo)

    return dataclasses.replace(spec, build_model=build_model)


def add_chunk_deltas(
    traces: list, spec, *, precision: str, device_type: str, chunks: int, pool=None, progress: Progress = QUIET,
) -> list:
    """``traces`` (``MemoryTrace``) each with what the chunked output layer and loss change in its segments
    (``chunk_deltas``): its step traced again, plainly, with the loss in ``chunks`` chunks; one run per size, at
    once in ``pool``'s workers where it has them.

    Only the stretch after the last block's forward and before its backward changes (the logits, their fp32
    copy and their gradient, of one chunk instead of all tokens), and what is alive there besides is the same
    whatever the blocks do, so the change adds to any checkpoint set's peak. A trace whose chunked run cuts
    into other segments gets ``[]`` (chunking is then not modelled).
    """
    wanted = [t for t in traces if not t.scaled and (t.chunk_deltas is None or t.loss_chunks != chunks)]
    runs = {
        t.micro_batch_size: call(
            pool, run_trace, spec, micro_batch_size=t.micro_batch_size, precision=precision, device_type=device_type,
            mode="none", blocks=t.blocks, loss_chunks=chunks,
        )
        for t in wanted
    }
    done = {}
    for number, trace in enumerate(wanted, start=1):
        what = f"tracing {precision} at micro-batch {trace.micro_batch_size} with the loss in {chunks} chunks"
        with progress.doing(what, step=number, of=len(wanted)):
            raw = runs[trace.micro_batch_size]()
        chunked, _ = plain_segments(raw.marks, raw.peaks, raw.drop_bytes)
        plain = [s for s in trace.segments if s.recomputes is None]
        if [(s.dropped, s.phase) for s in chunked] != [(s.dropped, s.phase) for s in plain]:
            done[id(trace)] = replace(trace, chunk_deltas=[], loss_chunks=chunks)
            continue
        deltas = [c.peak_bytes - s.peak_bytes for c, s in zip(chunked, plain)]
        done[id(trace)] = replace(trace, chunk_deltas=deltas, loss_chunks=chunks)
    return [done.get(id(t), t) for t in traces]


def add_offloaded(traces: list, spec, *, precision: str, device_type: str, pool=None, progress: Progress = QUIET) -> list:
    """``traces`` (``MemoryTrace``) each with its step traced again with every block offloaded
    (``LeverTrace.offloaded``): one run per size, at once in ``pool``'s workers where it has them.

    A trace is left unchanged when the two runs' segments differ (offload is then not modelled).
    """
    wanted = [t for t in traces if t.levers is not None and t.blocks and t.levers.offloaded is None]
    runs = {
        t.micro_batch_size: call(
            pool, run_trace, spec, micro_batch_size=t.micro_batch_size, precision=precision, device_type=device_type,
            mode="offload", blocks=t.blocks,
        )
        for t in wanted
    }
    done = {}
    for number, trace in enumerate(wanted, start=1):
        what = f"tracing {precision} at micro-batch {trace.micro_batch_size} with every block offloaded"
        with progress.doing(what, step=number, of=len(wanted)):
            done[id(trace)] = with_offloaded(trace, runs[trace.micro_batch_size]())
    return [done.get(id(t), t) for t in traces]
