"""Identical blocks traced once: a run of identical blocks traced at two short lengths, and the whole trace inferred.

A language model's layers are one block over and over: a 70B Llama's 80
layers differ only in their weights. A traced step (``memory.traces.run_trace``)
costs time per op, so it grows with the layers although every layer adds the
same. Every number the trace records is affine in how many of the run's blocks
a point lies among: live bytes at a mark (each block before it adds what it
saved, every block its weights, gradients and state), a mark's block index and
position, a storage's ordinal (how many storages its micro-step made before
it), a gradient's parameter index. So the model is traced with its run cut to
5 blocks and to 6, and the trace of all N blocks is made from the two
(``expand``). The two blocks at each end of the run are the run's edges (the
stretch after the first block is not like the others': with one block at each
end, the all-offloaded trace's stretches between two forwards came out 4 KiB
a block high): a value there, or outside the run, is
``v5 + (N - 5) (v6 - v5)``. The blocks between are the core, the same each:
at the j-th (1 <= j <= N - 4) a value is
``v5 + (j - 1) (v6'' - v6') + (N - 5) (v6' - v5)``, where v6' and v6'' are
the longer trace's two core blocks' values.

A segment's peak is the highest of its moments, each affine in N: where a
moment that grows faster with N overtakes the one that peaked in the short
traces, the inferred peak falls short of the whole trace's (a GPT-2-shaped
model of 18 layers: one segment 14 KiB, 0.07%, under). The planner measures
the configuration it chooses on the whole model in the simulated meter, so
this moves a prediction, never a plan past its budget.

Blocks are identical when their modules, parameters, buffers and plain
attributes are (``find_repeat``; an attribute equal to the block's own index,
such as a layer's ``layer_idx``, counts as the same). Where the two short
traces do not line up as the rule needs (a block behaves by its position in
ways its attributes do not show), the model is traced whole.
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, replace

import torch
from torch import nn

from autofit.measure.meters import simulated_meter

EDGE = 2
"""Blocks at each end of a run that are traced as they are (the first and last, and each one's neighbour)."""
SHORT_LENGTHS = (2 * EDGE + 1, 2 * EDGE + 2)
"""The run's lengths in the two short traces: one core block, then two."""
SHORTEN_FROM = 16
"""Runs of fewer blocks are traced whole: the two short traces trace 11 blocks, and the rest of the model twice."""


@dataclass(frozen=True, slots=True)
class Repeat:
    """A run of identical blocks: consecutive children of one ModuleList or Sequential, each a checkpoint candidate."""

    container: str
    """The ModuleList's or Sequential's name in the model ("model.layers"; "" for the model itself)."""
    first: int
    """The run's first block's index in the container."""
    length: int
    """Blocks in the run."""
    start: int
    """The run's first block's index among the checkpoint candidates."""

    def shorten(self, model: nn.Module, length: int) -> None:
        """Cut the run in ``model`` (a fresh copy of the model it was found in) to its first ``length - EDGE`` blocks
        and its last ``EDGE``; the container's later children move up."""
        container = model.get_submodule(self.container)
        children = list(container._modules.values())
        run = children[self.first:self.first + self.length]
        kept = children[:self.first] + run[:length - EDGE] + run[-EDGE:] + children[self.first + self.length:]
        container._modules.clear()
        for index, child in enumerate(kept):
            container._modules[str(index)] = child

    def short_names(self, names: list[str], length: int) -> list[str]:
        """``names`` (module names in the whole model) as ``shorten(model, length)`` names them; the blocks it cuts left out."""
        prefix = f"{self.container}." if self.container else ""
        short = []
        for name in names:
            head, _, rest = name[len(prefix):].partition(".")
            if not name.startswith(prefix) or not head.isdigit():
                short.append(name)
                continue
            index = int(head)
            position = index - self.first
            if 0 <= position < self.length:
                if length - EDGE <= position < self.length - EDGE:
                    continue
                index = self.first + (position if position < length - EDGE else position - (self.length - length))
            elif position >= self.length:
                index -= self.length - length
            short.append(prefix + str(index) + ("." + rest if rest else ""))
        return short

    def widen(self, short_names: list[str], values: list, length: int) -> list:
        """Per-block ``values`` of the model cut to ``length`` (its candidates ``short_names``, forward order) as
        the whole model's candidates would have them: each core block takes the first kept core block's values
        (the blocks are identical), the blocks after the core and the rest of the model theirs."""
        prefix = f"{self.container}." if self.container else ""

        def position(name: str) -> int | None:
            head = name[len(prefix):].partition(".")[0]
            if not name.startswith(prefix) or not head.isdigit():
                return None
            return int(head) - self.first

        places = [position(name) for name in short_names]
        core = [i for i, p in enumerate(places) if p is not None and EDGE <= p < length - EDGE]
        if not core:
            return list(values)
        first = [values[i] for i in core if places[i] == EDGE]
        return values[:core[0]] + first * (self.length - 2 * EDGE) + values[core[-1] + 1:]


def shortened(spec, repeat: Repeat, length: int):
    """``spec`` (a ``ModelSpec``) building its model with ``repeat`` cut to ``length`` blocks (``Repeat.shorten``):
    cut where it is built, so a meter materializes the short model only."""
    build = spec.build_model

    def build_short() -> nn.Module:
        model = build()
        repeat.shorten(model, length)
        return model

    return dataclasses.replace(spec, build_model=build_short)


_found: tuple | None = None
"""The last ``repeat_in``: (spec, (candidates, ``SHORTEN_FROM``), its Repeat); one process's runs over one spec
find it once."""


def repeat_in(spec, names: list[str]) -> Repeat | None:
    """``find_repeat`` over ``spec``'s model, built by the simulated meter, with candidates ``names``."""
    global _found
    key = (list(names), SHORTEN_FROM)
    if _found is not None and _found[0] is spec and _found[1] == key:
        return _found[2]
    meter = simulated_meter(spec, for_device="cpu")
    torch.manual_seed(0)
    with meter.environment():
        repeat = find_repeat(meter.build_model(spec.build_model), names)
    _found = (spec, key, repeat)
    return repeat


def find_repeat(model: nn.Module, names: list[str]) -> Repeat | None:
    """The longest run of identical blocks among the checkpoint candidates ``names`` (forward order), when it
    holds at least ``SHORTEN_FROM`` blocks; else None."""
    modules = dict(model.named_modules())
    best: Repeat | None = None
    i = 0
    while i < len(names):
        container, _, head = names[i].rpartition(".")
        parent = modules.get(container)
        if not head.isdigit() or not _numbered(parent):
            i += 1
            continue
        first = int(head)
        signature = _signature(parent._modules[head])
        j = i + 1
        while (
            j < len(names) and names[j] == (f"{container}." if container else "") + str(first + j - i)
            and str(first + j - i) in parent._modules
            and _same(signature, first, _signature(parent._modules[str(first + j - i)]), first + j - i)
        ):
            j += 1
        if j - i >= SHORTEN_FROM and (best is None or j - i > best.length):
            best = Repeat(container=container, first=first, length=j - i, start=i)
        i = j
    return best


def _numbered(module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.Sequential)) and list(module._modules) == [str(n) for n in range(len(module._modules))]


def _signature(block: nn.Module) -> list:
    """What makes two blocks identical (``_same``): module types, parameters' and buffers' shapes, dtypes and
    trainability, and plain attributes."""
    parts = []
    for name, module in block.named_modules():
        attributes = sorted(
            (key, _plain(value)) for key, value in vars(module).items()
            if not key.startswith("_") and key != "training" and _is_plain(value)
        )
        parts.append((
            name, type(module), attributes,
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters(recurse=False)),
            tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers(recurse=False)),
        ))
    return parts


def _same(one: list, index: int, other: list, other_index: int) -> bool:
    """Whether two blocks' signatures agree, an integer attribute that is each block's own index (a layer's
    ``layer_idx``) counting as the same."""
    if len(one) != len(other):
        return False
    for (name, kind, attributes, params, buffers), (name2, kind2, attributes2, params2, buffers2) in zip(one, other):
        if (name, kind, params, buffers) != (name2, kind2, params2, buffers2) or len(attributes) != len(attributes2):
            return False
        for (key, value), (key2, value2) in zip(attributes, attributes2):
            if key != key2 or (value != value2 and not (value == index and value2 == other_index and type(value) is int)):
                return False
    return True


def _is_plain(value) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def _plain(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _plain(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value


class _Mismatch(Exception):
    """The two short traces do not line up as the affine rule needs."""


def expand(short, longer, *, repeat: Repeat, names: list[str]):
    """The whole model's traced run (a ``memory.traces._RawTrace``) from its runs with ``repeat`` cut to
    ``SHORT_LENGTHS`` (``short`` and ``longer``); None where the two do not line up."""
    try:
        return _Expansion(short, longer, repeat).trace(names)
    except _Mismatch:
        return None


@dataclass(frozen=True, slots=True)
class _Source:
    """Where one value of the whole trace comes from: its index in the short trace and in the longer one, and
    for a core block's, the longer trace's second core block's index and the block's position j in the core."""

    short: int
    longer: int
    second: int | None = None
    j: int = 0


class _Expansion:
    def __init__(self, short, longer, repeat: Repeat) -> None:
        self.short, self.longer, self.repeat = short, longer, repeat
        self.n = repeat.length
        if short.host_bytes != longer.host_bytes or short.output_shape != longer.output_shape:
            raise _Mismatch
        if (short.levers is None) != (longer.levers is None):
            raise _Mismatch
        self.marks = self._mark_sources()

    def value(self, source: _Source, short, longer, second=None):
        """``short``, ``longer`` (and ``second``): one value at ``source`` in the traces; the whole trace's value."""
        if isinstance(short, bool) or short is None or isinstance(short, str):
            if longer != short or (source.second is not None and second != short):
                raise _Mismatch
            return short
        if isinstance(short, (int, float)):
            if isinstance(longer, bool) or not isinstance(longer, (int, float)):
                raise _Mismatch
            grown = (self.n - SHORT_LENGTHS[0]) * (longer - short)
            if source.second is None:
                return short + grown
            return short + (source.j - 1) * (second - longer) + grown
        if isinstance(short, (list, tuple)):
            if not isinstance(longer, type(short)) or len(longer) != len(short) or (
                source.second is not None and (not isinstance(second, type(short)) or len(second) != len(short))
            ):
                raise _Mismatch
            seconds = second if source.second is not None else [None] * len(short)
            return type(short)(self.value(source, a, b, c) for a, b, c in zip(short, longer, seconds))
        if isinstance(short, dict):
            if not isinstance(longer, dict) or longer.keys() != short.keys() or (
                source.second is not None and (not isinstance(second, dict) or second.keys() != short.keys())
            ):
                raise _Mismatch
            return {k: self.value(source, short[k], longer[k], second[k] if source.second is not None else None) for k in short}
        raise _Mismatch

    def values(self, sources: list[_Source], short: list, longer: list) -> list:
        return [
            self.value(s, short[s.short], longer[s.longer], longer[s.second] if s.second is not None else None)
            for s in sources
        ]

    def _slot(self, block: int, length: int):
        """A block of a trace whose run has ``length`` blocks: ("core", j) for the j-th core block, else what it is."""
        start = self.repeat.start
        if block < start:
            return ("before", block)
        if block >= start + length:
            return ("after", block - start - length)
        position = block - start
        if position < EDGE:
            return ("head", position)
        if position >= length - EDGE:
            return ("tail", length - 1 - position)
        return ("core", position - EDGE + 1)

    def _tokens(self, marks: list[tuple], length: int) -> list[tuple]:
        return [(m[0], self._slot(m[1], length), *m[2:]) if m[0] in ("fwd_start", "fwd_end", "bwd_start") else m for m in marks]

    def _mark_sources(self) -> list[_Source]:
        """The whole trace's marks, each as a ``_Source`` in the two short traces' marks."""
        short = self._tokens(self.short.marks, SHORT_LENGTHS[0])
        longer = self._tokens(self.longer.marks, SHORT_LENGTHS[1])

        def core(token) -> int | None:
            return token[1][1] if len(token) > 1 and isinstance(token[1], tuple) and token[1][0] == "core" else None

        sources, i, k = [], 0, 0
        while k < len(longer):
            if core(longer[k]) is None:
                if i >= len(short) or short[i] != longer[k]:
                    raise _Mismatch
                sources.append(_Source(i, k))
                i, k = i + 1, k + 1
                continue
            end = k
            while end < len(longer) and core(longer[end]) is not None:
                end += 1
            stretch = list(range(k, end))
            one = [x for x in stretch if core(longer[x]) == 1]
            two = [x for x in stretch if core(longer[x]) == 2]
            ascending = one == stretch[:len(one)]
            if len(one) != len(two) or (one + two if ascending else two + one) != stretch:
                raise _Mismatch
            if short[i:i + len(one)] != [longer[x] for x in one] or [longer[x][0] for x in one] != [longer[x][0] for x in two]:
                raise _Mismatch
            blocks = self.n - 2 * EDGE
            order = range(1, blocks + 1) if ascending else range(blocks, 0, -1)
            for j in order:
                sources += [_Source(i + q, a, b, j) for q, (a, b) in enumerate(zip(one, two))]
            i, k = i + len(one), end
        if i != len(short):
            raise _Mismatch
        return sources

    def _block_sources(self) -> list[_Source]:
        start, n = self.repeat.start, self.n
        short, longer = SHORT_LENGTHS
        sources = []
        for block in range(len(self.short.names) + n - short):
            position = block - start
            if position < EDGE:
                sources.append(_Source(block, block))
            elif position < n - EDGE:
                sources.append(_Source(start + EDGE, start + EDGE, start + EDGE + 1, position - EDGE + 1))
            else:
                sources.append(_Source(block - n + short, block - n + longer))
        return sources

    def trace(self, names: list[str]):
        short, longer = self.short, self.longer
        marks = self.marks
        blocks = self._block_sources()
        if len(blocks) != len(names):
            raise _Mismatch
        levers = None
        if short.levers is not None:
            a, b = short.levers, longer.levers
            levers = replace(
                a,
                peaks=self.values(marks, a.peaks, b.peaks),
                openings=self.values(marks, a.openings, b.openings),
                steps=self.values(marks, a.steps, b.steps),
                rests=self.values(marks, a.rests, b.rests),
                afters=self.values(marks, a.afters, b.afters),
                counts=self.values(marks, a.counts, b.counts),
                items=self._storages(a, b, {k: _as_ranges(v) for k, v in a.items.items()}, {k: _as_ranges(v) for k, v in b.items.items()}, items=True),
                freed_in=self._storages(a, b, a.freed_in, b.freed_in, items=False),
            )
        return replace(
            short,
            names=list(names),
            marks=self.values(marks, short.marks, longer.marks),
            peaks=self.values(marks, short.peaks, longer.peaks),
            drop_bytes=self.values(blocks, short.drop_bytes, longer.drop_bytes),
            selective_drop_bytes=self.values(blocks, short.selective_drop_bytes, longer.selective_drop_bytes),
            shared_call_bytes=self.values(blocks, short.shared_call_bytes, longer.shared_call_bytes),
            levers=levers,
            cpu_seconds=short.cpu_seconds + longer.cpu_seconds,
            flops=short.flops + (len(names) - len(short.names)) * (longer.flops - short.flops),
        )

    def _storages(self, a, b, short: dict, longer: dict, *, items: bool) -> dict:
        """Per-storage records (``LeverRecord.items`` by (micro-step, key), ``freed_in`` by ordinal), each placed
        by the mark its storage was made before (its ordinal and the marks' ``counts``) and expanded there."""
        def by_mark(record, marks: list[tuple], entries: dict) -> dict[int, list]:
            # Storages made before the first mark (the optimizer state's creation) or in the optimizer step are
            # left out: as many as the parameters, and no saved tensor (what ``items`` and ``freed_in`` serve) is one.
            step = next((position for position, mark in enumerate(marks) if mark[0] == "optimizer"), len(marks))
            starts: dict[int, list] = {}
            for position, (micro, made) in enumerate(record.counts):
                starts.setdefault(micro, []).append((made, position))
            grouped: dict[int, list] = {}
            for key, entry in entries.items():
                micro, made = entry["ordinal"] if items else key
                made_at = starts.get(micro)
                if not made_at:
                    raise _Mismatch
                found = bisect.bisect_right([m for m, _ in made_at], made)
                if found == len(made_at):
                    raise _Mismatch
                if 0 < made_at[found][1] <= step:
                    grouped.setdefault(made_at[found][1], []).append((key, entry))
            for group in grouped.values():
                group.sort(key=lambda pair: pair[1]["ordinal"] if items else pair[0])
            return grouped

        short_at, longer_at = by_mark(a, self.short.marks, short), by_mark(b, self.longer.marks, longer)
        expanded: dict = {}
        for source in self.marks:
            group = short_at.get(source.short, [])
            first = longer_at.get(source.longer, [])
            second = longer_at.get(source.second, []) if source.second is not None else None
            if len(first) != len(group) or (second is not None and len(second) != len(group)):
                raise _Mismatch
            for q, (key, entry) in enumerate(group):
                other = second[q] if second is not None else None
                if items:
                    value = self.value(source, entry, first[q][1], other[1] if other else None)
                    expanded[(key[0], len(expanded))] = _from_ranges(value)
                else:
                    both = self.value(source, [key, entry], list(first[q]), list(other) if other else None)
                    expanded[tuple(both[0])] = both[1]
        return expanded


def _as_ranges(item: dict) -> dict:
    """A saved storage's record with its block lists as [first, past-last] ranges (a storage every block saves,
    such as rotary embeddings, has as many holders as the run has blocks: its range's end is affine)."""
    return {**item, "holders": _ranges(item["holders"]), "inputs_of": _ranges(item["inputs_of"])}


def _from_ranges(item: dict) -> dict:
    return {
        **item, "holders": [b for lo, hi in item["holders"] for b in range(lo, hi)],
        "inputs_of": [b for lo, hi in item["inputs_of"] for b in range(lo, hi)],
    }


def _ranges(blocks: list[int]) -> list[list[int]]:
    ranges: list[list[int]] = []
    for block in sorted(set(blocks)):
        if ranges and ranges[-1][1] == block:
            ranges[-1][1] = block + 1
        else:
            ranges.append([block, block + 1])
    return ranges
