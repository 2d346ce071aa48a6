"""The memory levers in the memory model: what the step in backward, host optimizer state, NF4 weights and offload free.

The plain trace (``memory.traces.trace_memory``) records, beside each
segment's peak, what the levers need (``LeverRecorder``, kept by the trace's
tracker), so that the step in backward and host state cost no traced run:

- **gradients**: each parameter's gradient is labelled when backward has
  accumulated it (a post-accumulate-grad hook, where the levers act); each
  segment keeps its peak of live bytes less the gradients alive, the same at
  its opening, and for every gradient labelled in it the live bytes less the
  other gradients at that moment (where the step in backward steps it).
- **optimizer state**: its bytes, and what one parameter's step alone holds
  beyond them (``optimizer_bytes``: one step per distinct parameter shape
  over fake tensors, not per micro-batch size); the same of 8-bit state when
  asked (``add_eight_bit``).
- **saved tensors**: each storage saved for backward in the forward, its
  bytes, the blocks that saved it, whether an op outside every block did,
  whether it is an input of a block that saved it (a checkpoint keeps those)
  and whether an op selective checkpointing keeps made it.
- where backward begins inside a segment, the peaks before and after apart.

From these, for any configuration (``lever_peak_bytes``):

- **optimizer step in backward** (one micro-step): each gradient is freed
  once its parameter has stepped, so a segment holds its peak less the
  gradients, or a parameter's level at its step plus that step's
  temporaries; the optimizer step after backward finds no gradient.
- **optimizer state on the host**: the gradients leave the device as they
  are accumulated (with or without accumulation), the state is never there,
  and the update runs on the host: the optimizer step holds on the device
  only what was alive when it began.
- **8-bit optimizer state** (torchao's, with ``--allow-lossy-optimizer``;
  its record made only when asked, ``add_eight_bit``): every segment holds
  the 8-bit state instead of the optimizer's (the difference is
  ``optimizer_bytes`` of both), and the optimizer step holds what was alive
  when it began plus the largest one parameter's 8-bit step makes (torchao
  steps them one at a time; the meters run its compiled step eagerly); with
  the step in backward, each parameter's 8-bit step at its gradient.
- **frozen weights in NF4** (``--allow-lossy-base``; its record made only when
  asked, ``add_nf4``, per the weights' dtype: ``memory.nf4``): every segment
  holds the same less the weights' dense bytes beyond their NF4 tensors', plus
  the most one product's dequantization holds (an upper bound).
- **activation offload** (a GPU lever; traced only when asked,
  ``add_offloaded``): the step is traced once more with every block
  offloaded. Where an offloaded block runs (its forward, its backward) the
  segment is that trace's: its saved tensors leave as soon as nothing else
  holds them and come back one backward node at a time, which no sum over
  the plain trace gives. Elsewhere a saved storage is off the device in a
  segment when every block that saved it and still holds it there is
  offloaded, no op outside the blocks saved it, and the all-offloaded trace
  had freed it before (Python frames and autocast's cache of parameters'
  casts hold some storages until the forward returns or backward begins). A
  storage brought back for an offloaded block's backward while the device
  still holds it counts twice. The knapsack counts, per block, only the
  storages it alone saved (``offload_drops``: additive, a lower bound).

Every value is linear in the micro-batch size, as the rest of the model
(``costs.MemoryCosts``); a saved tensor under ``MIN_OFFLOAD_BYTES``
stays on the device and keeps its storage there, which is linear only
piecewise (a few hundred bytes off on the test models).
"""
from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, field, replace

import torch

from autofit._torch_private import in_autograd_backward, tree_leaves
from strategies.batch_split import BatchSplitConfig
from strategies.checkpointing import selective_saves
from autofit.planning.memory.nf4 import Nf4Record
from autofit.planning.memory.optimizer import EightBitRecord, optimizer_bytes
from autofit.planning.memory.segments import FIRST_MICRO, LATER_MICRO, labelled_segments
from strategies.offload import MIN_OFFLOAD_BYTES

"""The traced micro-steps (as in ``memory.traces``)."""


class LeverRecorder:
    """Follows gradients and saved tensors during a traced step (``memory.traces._TimelineTracker.levers``).

    Args:
        tracker: the timeline tracker whose live bytes and marks it follows.
    """

    def __init__(self, tracker) -> None:
        self.tracker = tracker
        self.gradient_bytes = 0
        """Live bytes of the parameters' gradients (labelled when accumulated)."""
        self._gradients: dict[int, int] = {}
        self._peak = 0
        self._grown = False
        self._rest: list[int] | None = None
        self._after: list[int] | None = None
        self.peaks: list[int] = []
        """Per segment (as the tracker's ``segment_peaks``): the peak of live bytes less gradients."""
        self.openings: list[tuple[int, int]] = []
        """Per mark: (live bytes, gradient bytes) at it."""
        self._steps: list[list[int]] = []
        self.steps: list[list[list[int]]] = []
        """Per segment: [parameter index, live bytes less the other gradients] for each gradient labelled in it."""
        self._in_backward = False
        self.rests: list[list[int] | None] = []
        """Per segment: [peak, peak less gradients] past its opening and before backward begins (None: no growth)."""
        self.afters: list[list[int] | None] = []
        """Per segment where backward begins: [peak, peak less gradients] after that (None elsewhere)."""
        self.items: dict[tuple[int, int], dict] = {}
        """(micro-step, storage id) -> what ``LeverTrace.items`` says of a saved storage, while it is made."""
        self._micro = -1
        self._made = 0
        self._ordinals: dict[int, tuple[int, int]] = {}
        """Record id -> (micro-step, how many device storages that micro-step made before it)."""
        self.freed_in: dict[tuple[int, int], list] = {}
        """(micro-step, ordinal) -> [the segment position where that storage was freed, whether before anything
        grew there (a block's input its caller drops once the block returns)]."""
        self._backward_begun: bool | None = None
        """Set in the segment where backward begins."""
        self._forward_starts: dict[tuple[int, int], int] = {}
        """(micro-step, block) -> the tracker's clock where the block's forward began."""
        self._policy_outputs: set[int] = set()
        """Records (``id``) of the storages made by ops selective checkpointing keeps."""
        self.counts: list[tuple[int, int]] = []
        """Per mark: (micro-step, device storages it had made) just before it: a storage's ordinal says which
        segment made it (``memory.repeats``)."""

    def follow_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Label each trainable parameter's gradient when backward has accumulated it."""
        for index, param in enumerate(params):
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._accumulated(index))

    def _accumulated(self, index: int):
        def hook(param) -> None:
            if param.grad is None:  # another hook took it (optimizer state on the host)
                return
            key = id(param.grad.untyped_storage())
            if key in self._gradients:  # accumulated into the gradient of an earlier micro-step
                return
            nbytes = self.tracker.counted_bytes(param.grad)
            self._steps.append([index, self.tracker.current_bytes - self.gradient_bytes])
            self._gradients[key] = nbytes
            self.gradient_bytes += nbytes
        return hook

    def saved(self, tensor: torch.Tensor, *, block: int | None, micro: int) -> None:
        """A tensor saved for backward by ``block`` (None: outside every block) in micro-step ``micro``."""
        key = id(tensor.untyped_storage())
        record = self.tracker._live.get(key)
        if record is None or record.category == "parameters" or record.host:
            return  # parameters (and views of them) and buffers stay where they are
        item = self.items.setdefault((micro, key), {
            "bytes": record.nbytes, "holders": [], "inputs_of": [], "outside": False, "small": False,
            "policy": id(record) in self._policy_outputs, "ordinal": list(self._ordinals.get(id(record), (micro, -1))),
        })
        if block is None:
            item["outside"] = True
        elif block not in item["holders"]:
            item["holders"].append(block)
            if record.born < self._forward_starts.get((micro, block), 0):
                item["inputs_of"].append(block)  # made before the block began: its input, which a checkpoint keeps
        if tensor.numel() * tensor.element_size() < MIN_OFFLOAD_BYTES:
            item["small"] = True

    def made(self, op, outputs) -> None:
        """After every op: remember the storages of the ops selective checkpointing keeps."""
        if selective_saves(op):
            for tensor in tree_leaves(outputs):
                if isinstance(tensor, torch.Tensor):
                    record = self.tracker._live.get(id(tensor.untyped_storage()))
                    if record is not None:
                        self._policy_outputs.add(id(record))

    def created(self, record) -> None:
        """A new storage (its tracker record)."""
        if not record.host:
            self._ordinals[id(record)] = (self._micro, self._made)
            self._made += 1

    def freed(self, key: int, record) -> None:
        """The storage ``key`` (its tracker record) was freed."""
        nbytes = self._gradients.pop(key, None)
        if nbytes is not None:
            self.gradient_bytes -= nbytes
        ordinal = self._ordinals.pop(id(record), None)
        if ordinal is not None:
            self.freed_in[ordinal] = [len(self.tracker.marks), not self._grown]

    def grown(self) -> None:
        level = self.tracker.current_bytes - self.gradient_bytes
        self._peak = max(self._peak, level)
        self._grown = True
        backward = in_autograd_backward()
        if backward and not self._in_backward and self._backward_begun is None:
            # Backward begins: the forward's Python frames and autocast's cache of casts are gone.
            self._backward_begun = True
        self._in_backward = backward
        if self._backward_begun:
            self._after = _higher(self._after, [self.tracker.current_bytes, level])
        else:
            self._rest = _higher(self._rest, [self.tracker.current_bytes, level])

    def mark(self, event: tuple) -> None:
        self.counts.append((self._micro, self._made))
        if event[0] == "micro":
            self._micro, self._made = event[1], 0
        elif event[0] == "fwd_start":
            self._forward_starts[event[2], event[1]] = self.tracker._clock + 1  # storages born from here on are the block's
        self.peaks.append(self._peak)
        self.openings.append((self.tracker.current_bytes, self.gradient_bytes))
        self.steps.append(self._steps)
        self.rests.append(self._rest)
        self.afters.append(self._after if self._backward_begun else None)
        self._peak = self.tracker.current_bytes - self.gradient_bytes
        self._steps, self._rest, self._after, self._grown, self._backward_begun = [], None, None, False, None

    def record(self, *, freed: bool) -> LeverRecord:
        """What it recorded, per mark and per saved storage (what a trace worker sends back, ``memory.workers``);
        where each storage was freed only with ``freed`` (read of the all-offloaded run only, ``with_offloaded``)."""
        # Copies: storages the run leaves behind are freed later, and would still be recorded.
        return LeverRecord(
            peaks=list(self.peaks), openings=list(self.openings), steps=list(self.steps), rests=list(self.rests),
            afters=list(self.afters), items={key: dict(item) for key, item in self.items.items()},
            freed_in=dict(self.freed_in) if freed else {}, counts=list(self.counts),
        )


@dataclass(kw_only=True, slots=True)
class LeverRecord:
    """What a ``LeverRecorder`` recorded in one traced run (its fields' meanings are the recorder's)."""

    peaks: list[int]
    openings: list[tuple[int, int]]
    steps: list[list[list[int]]]
    rests: list[list[int] | None]
    afters: list[list[int] | None]
    items: dict[tuple[int, int], dict]
    freed_in: dict[tuple[int, int], list]
    counts: list[tuple[int, int]]


def _higher(peaks: list[int] | None, levels: list[int]) -> list[int]:
    return levels if peaks is None else [max(a, b) for a, b in zip(peaks, levels)]


@dataclass(frozen=True, kw_only=True, slots=True)
class SavedStorage:
    """A storage saved for backward in the forward (``LeverTrace.items``)."""

    micro: int
    """The traced micro-step it was saved in."""
    bytes: float
    """Its bytes (0 when a small saved tensor keeps it on the device)."""
    holders: list[int]
    """The blocks that saved it."""
    outside: bool
    """An op outside the blocks saved it."""
    inputs_of: list[int]
    """The holders it is an input of (a checkpoint keeps it)."""
    policy: bool
    """Made by an op selective checkpointing keeps."""
    ordinal: list[int]
    """[the micro-step it was made in, how many device storages that one made before it]: the same tensor in
    another trace of the same step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SizedStorage(SavedStorage):
    """A saved storage at one micro-batch size (``lever_segments``), with where the all-offloaded trace freed it."""

    freed_in: list | None = None
    """[the segment position where the all-offloaded trace freed it, whether before anything grew there]; None:
    never, or offload not traced."""


_structure_keys: dict[int, tuple[weakref.ref, str]] = {}
"""``LeverTrace.structure_key`` by the trace's id: a weak reference to it (the entry goes with it) and its key."""

_sized_items: dict[tuple, tuple[tuple[weakref.ref, ...], list[SizedStorage]]] = {}
"""``_LeverReader.items`` by its traces' ids and the size: weak references to the traces (the entry goes with any of
them) and the storages. Read only: a trace is not changed once made (``structure_key`` relies on it too)."""


@dataclass(kw_only=True, slots=True, weakref_slot=True)
class LeverTrace:
    """What the levers change in one plain trace; lists per plain segment, in ``MemoryTrace.segments``' order
    (the plain segments come first there)."""

    position: list[int]
    """The segment's position among the trace's marks (segment i lies between marks i-1 and i)."""
    without_gradients: list[int]
    """The segment's peak of live bytes less the gradients alive."""
    opening_without_gradients: list[int]
    """Live bytes less gradients where the segment begins."""
    opening_gradients: list[int]
    """Gradient bytes alive where the segment begins."""
    micro: list[int]
    """The traced micro-step the segment lies in."""
    forward_of: list[int | None]
    """The block whose forward is the segment (None: another mark opens it)."""
    backward_of: list[int | None]
    """The block whose backward opens the segment (None: another mark opens it)."""
    in_backward: list[bool]
    """The segment lies in its micro-step's backward (some block's backward has begun)."""
    steps: list[list[list[int]]]
    """[parameter index, live bytes less the other gradients] where each gradient is accumulated."""
    rests: list[list[int] | None]
    """[peak, peak less gradients] past the segment's opening and before backward begins in it (None: nothing grew)."""
    afters: list[list[int] | None]
    """Where backward begins inside the segment: [peak, peak less gradients] after that; else None."""
    items: list[SavedStorage]
    """Storages saved for backward in the forward, in the order the step made them."""
    state_bytes: int = 0
    """The optimizer's state on the device (every trainable parameter's)."""
    step_temporaries: list[int] = field(default_factory=list)
    """Per parameter (``model.parameters()`` order): what stepping it alone holds beyond its state."""
    eight_bit: EightBitRecord | None = None
    """torchao's 8-bit AdamW in place of the optimizer (``add_eight_bit``). None when not made: 8-bit state is then
    not modelled."""
    nf4: Nf4Record | None = None
    """Frozen weights in NF4 (``add_nf4``; ``memory.nf4.nf4_record`` for the trace's precision), the same in every
    segment. None when not made: NF4 is then not modelled."""
    offloaded: dict | None = None
    """The step traced again with every block offloaded (``add_offloaded``): per plain segment "peak_bytes",
    "without_gradients", "opening_without_gradients", "steps"; per item "freed_in" ([the segment position where
    that trace freed it, whether before anything grew there]; None: never). None when not traced: offload is then not modelled."""

    def structure(self) -> tuple:
        """What must agree between two traces for their values to interpolate."""
        return (
            self.position, self.micro, self.forward_of, self.backward_of, self.in_backward,
            [[step[0] for step in steps] for steps in self.steps], [r is None for r in self.rests], [a is None for a in self.afters],
            [(i.micro, i.holders, i.outside, i.inputs_of, i.policy) for i in self.items],
            None if self.offloaded is None else [[step[0] for step in steps] for steps in self.offloaded["steps"]],
        )

    def structure_key(self) -> str:
        """``repr(structure())``, made once per trace: a trace is not changed once made, and the search compares
        the keys of every trace of a precision for each configuration it scores."""
        entry = _structure_keys.get(id(self))
        if entry is None or entry[0]() is not self:
            key = id(self)
            entry = (weakref.ref(self, lambda _, key=key: _structure_keys.pop(key, None)), repr(self.structure()))
            _structure_keys[key] = entry
        return entry[1]

    def to_dict(self) -> dict:
        return asdict(self)


def lever_trace(recorder: LeverRecord | None, marks: list[tuple], peaks: list[int], *, spec, device_type: str) -> LeverTrace | None:
    """The plain trace's lever record, per plain segment (``segments.labelled_segments``' order)."""
    if recorder is None:
        return None
    num_blocks = 1 + max((m[1] for m in marks if m[0] in ("fwd_end", "bwd_start")), default=-1)
    trace = LeverTrace(
        position=[], without_gradients=[], opening_without_gradients=[], opening_gradients=[], micro=[], forward_of=[],
        backward_of=[], in_backward=[], steps=[], rests=[], afters=[], items=[],
    )
    for segment, opener, position in labelled_segments(marks, peaks, num_blocks):
        micro = next(m[1] for m in reversed(marks[:position]) if m[0] == "micro")
        live, gradients = recorder.openings[position - 1]
        trace.position.append(position)
        trace.without_gradients.append(recorder.peaks[position])
        trace.opening_without_gradients.append(live - gradients)
        trace.opening_gradients.append(gradients)
        trace.micro.append(micro)
        trace.forward_of.append(opener[1] if opener[0] == "fwd_start" else None)
        trace.backward_of.append(opener[1] if opener[0] == "bwd_start" else None)
        trace.in_backward.append(any(m[0] == "bwd_start" and m[2] == micro for m in marks[:position]) and segment.phase != "optimizer")
        trace.steps.append(recorder.steps[position])
        trace.rests.append(recorder.rests[position])
        trace.afters.append(recorder.afters[position])
    # In the order the step made them (a trace expanded from shorter ones, ``memory.repeats``, lists them so too).
    for (micro, _), item in sorted(recorder.items.items(), key=lambda entry: (entry[0][0], entry[1]["ordinal"])):
        if micro in (FIRST_MICRO, LATER_MICRO) and item["holders"]:
            trace.items.append(SavedStorage(
                micro=micro, bytes=0 if item["small"] else item["bytes"], holders=sorted(item["holders"]),
                outside=item["outside"], inputs_of=sorted(item["inputs_of"]), policy=item["policy"], ordinal=item["ordinal"],
            ))
    trace.state_bytes, trace.step_temporaries = optimizer_bytes(spec, device_type=device_type)
    return trace


def with_offloaded(trace, raw):
    recorder = raw.levers
    found = {"peak_bytes": [], "without_gradients": [], "opening_without_gradients": [], "steps": []}
    positions = []
    for segment, _, position in labelled_segments(raw.marks, raw.peaks, len(trace.blocks)):
        positions.append((position, segment.dropped, segment.phase))
        live, gradients = recorder.openings[position - 1]
        found["peak_bytes"].append(raw.peaks[position])
        found["without_gradients"].append(recorder.peaks[position])
        found["opening_without_gradients"].append(live - gradients)
        found["steps"].append(recorder.steps[position])
    levers = trace.levers
    plain = [(p, s.dropped, s.phase) for p, s in zip(levers.position, trace.segments)]
    if positions != plain:
        return trace
    # The same tensors are made in the same order in both forwards: a saved storage is known by its ordinal.
    found["freed_in"] = [recorder.freed_in.get(tuple(item.ordinal)) for item in levers.items]
    return replace(trace, levers=replace(levers, offloaded=found))


def add_eight_bit(trace, record: EightBitRecord):
    """``trace`` (a ``MemoryTrace``) with 8-bit state's record (``LeverTrace.eight_bit``; ``eight_bit_record``)."""
    if trace is None or trace.levers is None or trace.levers.eight_bit == record:
        return trace
    return replace(trace, levers=replace(trace.levers, eight_bit=record))


def add_nf4(trace, record: Nf4Record):
    """``trace`` (a ``MemoryTrace``) with NF4's record for its precision (``LeverTrace.nf4``)."""
    if trace is None or trace.levers is None or trace.levers.nf4 == record:
        return trace
    return replace(trace, levers=replace(trace.levers, nf4=record))


def trace_from_dict(data: dict | None) -> LeverTrace | None:
    """A ``LeverTrace`` from its ``to_dict`` (a study or the cache keeps it so), its records typed again."""
    if data is None:
        return None
    eight_bit, nf4 = data.get("eight_bit"), data.get("nf4")
    return LeverTrace(**{
        **data, "eight_bit": None if eight_bit is None else EightBitRecord(**eight_bit), "nf4": None if nf4 is None else Nf4Record(**nf4),
        "items": [SavedStorage(**item) for item in data["items"]],
    })


@dataclass(frozen=True, kw_only=True, slots=True)
class LeverChoice:
    """The memory levers of one configuration, as the memory model takes them."""

    offload: frozenset[int] = frozenset()
    """Indices of the offloaded blocks."""
    optimizer_in_backward: bool = False
    optimizer_state: str = "device"
    """"device", "host" or "8bit" (modelled where the traces hold its record, ``add_eight_bit``)."""
    loss_chunks: int = 1
    """The chunked output layer and loss's chunks (modelled where the traces hold its run, ``traces.add_chunk_deltas``)."""
    frozen_nf4: bool = False
    """Frozen linear weights in NF4 (modelled where the traces hold its record, ``add_nf4``)."""

    def only_chunks(self) -> bool:
        """No lever but (perhaps) the chunked loss, which the plain segments model alone (``MemoryCosts.at``)."""
        return replace(self, loss_chunks=1) == LeverChoice()

    @property
    def frees_gradients(self) -> bool:
        """Each gradient leaves the device once accumulated."""
        return self.optimizer_in_backward or self.optimizer_state == "host"


@dataclass(kw_only=True, slots=True)
class LeverSegment:
    """One segment at one micro-batch size, its bytes stated with the gradient and state levers applied."""

    peak_bytes: float
    dropped: list[int]
    phase: str
    recomputes: int | None
    selective: bool
    micro: int
    position: int
    """The plain segment's position among the trace's marks (for a recomputation: that of its block's backward)."""
    running: int | None
    """The block whose forward or backward runs in the segment (None: none)."""
    in_backward: bool
    stated_offloaded: bool = False
    """The bytes are the all-offloaded trace's: with every dropped block offloaded too."""
    stage: int = 0
    """Which part of the segment: 0 its opening, 1 past it (before backward begins), 2 after backward began in it."""


def lever_segments(memory, micro_batch_size: int, *, global_batch_size: int, choice: LeverChoice):
    """The segments that bound the peak at this size with ``choice``'s gradient and state levers, and the
    saved storages at this size; None when the traces hold no lever record (or none of offload, when asked).

    Args:
        memory: a ``costs.MemoryCosts``.

    Returns:
        (segments, items): ``LeverSegment`` list (checkpointing's and offload's drops not yet applied), and the
        saved storages with their bytes at this size.
    """
    reader = _LeverReader(memory, global_batch_size=global_batch_size, choice=choice)
    if reader.low is None or (choice.offload and reader.low.offloaded is None):
        return None
    terms = reader.terms(micro_batch_size)
    if terms is None:
        return None
    m, accumulating = micro_batch_size, micro_batch_size < global_batch_size
    last = BatchSplitConfig(global_batch_size=global_batch_size, micro_batch_size=m).last_size  # the step follows the last micro-batch
    found = []
    for i, segment in enumerate(memory.low.segments):
        if not accumulating and segment.phase == "later":
            continue
        size = last if segment.phase == "optimizer" else m
        if i >= len(reader.low.micro):  # a recomputation (checkpointing's traces): it runs in its block's backward
            found.append(reader.recomputation(i, segment, size, terms))
        else:
            found += reader.plain(i, segment, size, terms)
    return found, reader.items(m)


@dataclass(frozen=True, kw_only=True, slots=True)
class _LeverTerms:
    """What the state, NF4 and chunked-loss levers change at one micro-batch size, the same in every segment."""

    state_freed: float
    """What the state frees in every segment: all of it on the host; 8-bit state keeps its codes, scales and maps."""
    nf4_added: float
    """NF4 frees the same bytes in every segment and holds one weight's dequantization at most (``memory.nf4``)."""
    eight_bit: bool
    temporaries: list[int]
    """Per parameter: what its step alone holds beyond the state (the 8-bit step's with 8-bit state)."""
    stepping: bool
    """The optimizer steps in backward on the device."""
    chunk_deltas: list[list[int]] | None
    """Per trace, per segment: what the chunked loss changes (None: not chunked)."""


class _LeverReader:
    """One precision's traces' lever records, read at one size: each lever's change to a segment's bytes."""

    def __init__(self, memory, *, global_batch_size: int, choice: LeverChoice) -> None:
        self.memory, self.global_batch_size, self.choice = memory, global_batch_size, choice
        self.traces = memory.traces()
        self.records = [t.levers for t in self.traces]
        usable = not any(r is None for r in self.records) and len({r.structure_key() for r in self.records}) == 1
        self.low: LeverTrace | None = self.records[0] if usable else None

    def level(self, values: list[float], size: int) -> float:
        """Absolute bytes of a whole step."""
        return self.memory.interpolate(values, size, global_batch_size=self.global_batch_size, at_least=None)

    def delta(self, values: list[float], size: int) -> float:
        return self.memory.interpolate(values, size, at_least=0.0)

    def terms(self, m: int) -> _LeverTerms | None:
        """The choice's size-wide terms; None where the traces hold no record of a lever it asks for."""
        choice, records, low = self.choice, self.records, self.low
        eight_bit = choice.optimizer_state == "8bit"
        if eight_bit and any(r.eight_bit is None for r in records):
            return None
        state = 0.0
        if choice.optimizer_state == "host":
            state = self.delta([r.state_bytes for r in records], m)
        elif eight_bit:
            state = self.memory.interpolate([r.state_bytes - r.eight_bit.state_bytes for r in records], m, at_least=None)
        chunk_deltas = self.memory.chunk_deltas() if choice.loss_chunks > 1 else None
        if choice.loss_chunks > 1 and chunk_deltas is None:
            return None
        if choice.frozen_nf4 and any(r.nf4 is None for r in records):
            return None
        return _LeverTerms(
            state_freed=state, nf4_added=low.nf4.transient_bytes - low.nf4.saved_bytes if choice.frozen_nf4 else 0.0,
            eight_bit=eight_bit, temporaries=low.eight_bit.step_temporaries if eight_bit else low.step_temporaries,
            stepping=choice.optimizer_in_backward and choice.optimizer_state in ("device", "8bit"), chunk_deltas=chunk_deltas,
        )

    def recomputation(self, i: int, segment, size: int, terms: _LeverTerms) -> LeverSegment:
        """A block's recomputation, placed at its block's backward in the plain trace."""
        low, count = self.low, len(self.low.micro)
        plain = next(
            j for j in range(count) if low.backward_of[j] == segment.recomputes and self.memory.low.segments[j].phase == segment.phase
        )
        peak = self.level([t.segments[i].peak_bytes for t in self.traces], size)
        if self.choice.frees_gradients:  # its trace has no gradient record: those alive when its block's backward begins
            peak -= self.delta([r.opening_gradients[plain] for r in self.records], size)
        return LeverSegment(
            peak_bytes=peak - terms.state_freed + terms.nf4_added, micro=low.micro[plain], position=low.position[plain],
            running=segment.recomputes, in_backward=True, dropped=segment.dropped, phase=segment.phase,
            recomputes=segment.recomputes, selective=segment.selective,
        )

    def plain(self, i: int, segment, size: int, terms: _LeverTerms) -> list[LeverSegment]:
        """A plain segment, in up to three stages (``LeverSegment.stage``), with every lever applied but offload's drops."""
        low = self.low
        running = low.backward_of[i] if low.backward_of[i] is not None else low.forward_of[i]
        offloaded = running is not None and running in self.choice.offload
        parts = self.stages(i, segment, size, terms, offloaded=offloaded)
        if terms.stepping and segment.phase != "optimizer":
            parts = self.with_steps_in_backward(parts, i, size, terms, offloaded=offloaded)
        if terms.chunk_deltas is not None:
            parts = self.with_chunks(parts, i, size, terms)
        return [
            LeverSegment(
                peak_bytes=bytes_ - terms.state_freed + terms.nf4_added, micro=low.micro[i], position=low.position[i], running=running,
                in_backward=low.in_backward[i], stated_offloaded=offloaded, stage=stage, dropped=segment.dropped, phase=segment.phase,
                recomputes=segment.recomputes, selective=segment.selective,
            )
            for bytes_, stage in parts
        ]

    def values(self, name: str, i: int, *, offloaded: bool) -> list:
        """Each trace's value of a segment: where an offloaded block runs, the all-offloaded trace's."""
        if offloaded:
            return [r.offloaded[name][i] for r in self.records]
        if name == "peak_bytes":
            return [t.segments[i].peak_bytes for t in self.traces]
        return [getattr(r, name)[i] for r in self.records]

    def stages(self, i: int, segment, size: int, terms: _LeverTerms, *, offloaded: bool) -> list[tuple[float, int]]:
        """(bytes, stage) of the segment with the gradient and state levers."""
        frees_gradients = self.choice.frees_gradients
        if offloaded:  # one peak, its storages taken as at the segment's opening
            name = "without_gradients" if frees_gradients else "peak_bytes"
            return [(self.level(self.values(name, i, offloaded=True), size), 0)]
        # The opening, what grew past it, and what grew after backward began: a block's input its caller drops
        # once the block returns, and autocast's cache of casts, are gone from the second and the third.
        opening = [r.opening_without_gradients[i] + (0 if frees_gradients else r.opening_gradients[i]) for r in self.records]
        parts = [(self.level(opening, size), 0)]
        if segment.phase == "optimizer" and terms.eight_bit and not frees_gradients:
            # torchao steps one parameter at a time: the opening, and the largest parameter's step on top of it.
            parts.append((parts[0][0] + max(terms.temporaries, default=0), 1))
        elif segment.phase != "optimizer" or not frees_gradients:  # with them, nothing grows in the step
            gradients = 1 if frees_gradients else 0
            for stage, name in ((1, "rests"), (2, "afters")):
                if getattr(self.low, name)[i] is not None:
                    parts.append((self.level([getattr(r, name)[i][gradients] for r in self.records], size), stage))
        return parts

    def with_steps_in_backward(self, parts, i: int, size: int, terms: _LeverTerms, *, offloaded: bool) -> list[tuple[float, int]]:
        """The last stage holds at least each parameter's level at its step in backward, plus that step's temporaries."""
        steps = self.values("steps", i, offloaded=offloaded)
        at_steps = max(
            (self.level([s[n][1] for s in steps], size) + terms.temporaries[param] for n, (param, _) in enumerate(steps[0])),
            default=0.0,
        )
        bytes_, stage = parts[-1]
        return parts[:-1] + [(max(bytes_, at_steps), stage)]

    def with_chunks(self, parts, i: int, size: int, terms: _LeverTerms) -> list[tuple[float, int]]:
        """The chunked loss changes what grows in the segment (one chunk's logits), not its opening."""
        change = self.memory.interpolate([d[i] for d in terms.chunk_deltas], size, at_least=None)
        opening = parts[0][0]
        return [
            (bytes_ + change if len(parts) == 1 else bytes_ if stage == 0 else max(opening, bytes_ + change), stage)
            for bytes_, stage in parts
        ]

    def items(self, m: int) -> list[SizedStorage]:
        """The saved storages with their bytes at ``m`` (and, where offload was traced, where that trace freed each).

        Made once per set of traces and size (``_sized_items``): the search asks for them at every point it scores,
        and an 8B model's step saves about 1,500 storages (most of a warm capacity answer's search, profiled).
        """
        records = self.records
        key = (*map(id, records), *(t.micro_batch_size for t in self.traces), m)  # the sizes ``delta`` interpolates between
        entry = _sized_items.get(key)
        if entry is not None and all(ref() is record for ref, record in zip(entry[0], records)):
            return entry[1]
        found = [
            SizedStorage(
                micro=item.micro, bytes=self.delta([r.items[n].bytes for r in records], m), holders=item.holders, outside=item.outside,
                inputs_of=item.inputs_of, policy=item.policy, ordinal=item.ordinal, freed_in=self.freed_in(n),
            )
            for n, item in enumerate(self.low.items)
        ]
        # The entry goes with any of its traces (a weak reference each), so that a record made for one answer
        # (a length's fitted record) does not stay alive for the cache.
        refs = tuple(weakref.ref(record, lambda _, key=key: _sized_items.pop(key, None)) for record in records)
        _sized_items[key] = (refs, found)
        return found

    def freed_in(self, n: int) -> list | None:
        """Where the all-offloaded traces freed the ``n``-th saved storage (None: never, or not traced)."""
        if self.low.offloaded is None:
            return None
        # Where the traces disagree (a tensor offloaded at one size only, under MIN_OFFLOAD_BYTES at the other), the later.
        freed_in = [r.offloaded["freed_in"][n] for r in self.records]
        latest = None if None in freed_in else max(f[0] for f in freed_in)
        return None if latest is None else [latest, all(f[1] for f in freed_in if f[0] == latest)]


def offload_drops(items: list[SavedStorage], num_blocks: int) -> list[float]:
    """Per block: the bytes of the storages it alone saved (``micro`` 1's), which offloading it frees where it is
    dropped, whatever the other blocks do (the knapsack's additive term; Python's and autocast's holds aside)."""
    drops = [0.0] * num_blocks
    for item in items:
        if item.micro == LATER_MICRO and not item.outside and len(item.holders) == 1:
            drops[item.holders[0]] += item.bytes
    return drops


def offload_change(segment: LeverSegment, items: list[SizedStorage], offload, *, checkpoint=frozenset(), selective=frozenset()) -> float:
    """Bytes offloading ``offload`` (block indices) frees in ``segment`` (negative where copies brought back for
    backward duplicate storages still held on the device).

    A storage leaves the device where an offloaded block that saved it is dropped and no one else holds it: not
    an op outside the blocks, not a block still to run its forward or running its backward, not a dropped block
    that is not offloaded (a checkpointed one keeps only its inputs; a selective one also the outputs of the ops
    its policy keeps), and not what held it in the all-offloaded trace (a Python frame, autocast's cache).
    """
    if not offload:
        return 0.0
    dropped = set(segment.dropped)

    def holds(item, h) -> bool:
        if h in dropped:
            if h in offload:
                return False
            if h in checkpoint:
                return h in item.inputs_of
            if h in selective:
                return h in item.inputs_of or item.policy
            return True
        return not segment.in_backward or h == segment.running  # still to run its forward, or running its backward

    freed = 0.0
    for item in items:
        if item.micro != segment.micro:
            continue
        holders = item.holders
        freed_in = item.freed_in
        gone = freed_in is not None and (
            freed_in[0] < segment.position
            or (freed_in[0] == segment.position and (segment.stage == 2 or (segment.stage == 1 and freed_in[1])))
        )
        if gone and dropped.intersection(holders, offload) and not item.outside and not any(holds(item, h) for h in holders):
            freed += item.bytes
        if segment.in_backward and segment.running in offload and segment.running in holders and (
            item.outside or any(h != segment.running and holds(item, h) for h in holders)
        ):
            freed -= item.bytes  # brought back while the original is still on the device
    return freed


def lever_peak_bytes(
    memory, micro_batch_size: int, *, global_batch_size: int, drops: list[float], selective_drops: list[float] | None,
    checkpoint, selective, choice: LeverChoice,
) -> float | None:
    """The model's peak with checkpointing and the levers (None: the traces hold no lever record for them).

    Args:
        memory: a ``costs.MemoryCosts``.
        drops, selective_drops: what each block's full and selective checkpointing frees (``MemoryCosts.at``).
        checkpoint, selective: indices of the blocks checkpointed fully and selectively.
        choice: the levers.
    """
    found = lever_segments(memory, micro_batch_size, global_batch_size=global_batch_size, choice=choice)
    if found is None:
        return None
    segments, items = found
    everything = frozenset(range(len(memory.low.blocks)))
    peak = 0.0
    for segment in segments:
        if segment.recomputes is not None and segment.recomputes not in (selective if segment.selective else checkpoint):
            continue
        freed = sum(drops[b] if b in checkpoint else selective_drops[b] if b in selective else 0.0 for b in segment.dropped)
        change = offload_change(segment, items, choice.offload, checkpoint=checkpoint, selective=selective)
        if segment.stated_offloaded:  # stated with every block offloaded: what the others keep comes back
            change -= offload_change(segment, items, everything)
        peak = max(peak, segment.peak_bytes - freed - change)
    return peak
