"""Sequence length as a modelled dimension: a language model's cost record at any length, from records traced at a few.

A step's bytes at sequence length T are, term by term, a polynomial in T of degree at most 2: what each token keeps
(its activations, logits, the chunked loss's pieces) grows linearly; what attention keeps of every pair of tokens
(math or eager attention's scores and probabilities, the 4-D causal mask transformers builds where it cannot see
that the mask is all ones) grows quadratically; fused kernels (SDPA's flash and memory-efficient ones) keep no
T x T tensor, and their quadratic term comes out 0. Which applies is the model's own: rather than assume it, every
term of the record (each segment's peak, each block's dropped bytes, the levers' records, each timing) is fitted
through the traced lengths, a quadratic through the three nearest (``TRACED_LENGTHS``: exact for a + bT + cT²), and a
term that does not change with the length (the parameters, the optimizer's state, the structure's indices) comes out
unchanged. Traces at lengths whose step has another structure (other segments, other saved tensors) do not fit
together: ``LengthRecords.at`` then refuses (``LengthsDiffer``) rather than guess.

``longest_sequence`` is the pure search over that record (``capacity``'s column, ``plan --seq-len max``): the longest
multiple of ``SEQ_LEN_STEP`` tokens up to the model's context length at which a global batch trains within a budget.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

SEQ_LEN_STEP = 8
"""The lengths the longest-sequence search considers are multiples of this (as tokenizers pad for tensor cores):
"one step more" is this many tokens more."""

TRACED_LENGTHS = 3
"""Records traced per answer at first (the given length and two more): the fewest a quadratic term needs."""

LONGEST_SEARCHED = 2**20
"""Where the model names no context length, the search looks no further."""


class LengthsDiffer(ValueError):
    """The records at two traced lengths differ in structure (not only in bytes and seconds): no term fits through them."""


def traced_lengths(given: int, *, context_length: int | None) -> list[int]:
    """The lengths to trace for answers anywhere from a few tokens to the context length: ``given`` (the user's,
    traced anyway), the context length, and one between them on a log scale, so that answers above ``given``
    are fitted between traced lengths, never far beyond them. With ``given`` at the context length already, a
    quarter and a half of it; with no context length known, 4 and 16 times ``given``."""
    if context_length is None:
        others = [4 * given, 16 * given]
    elif context_length > given:
        middle = round(math.sqrt(given * context_length) / SEQ_LEN_STEP) * SEQ_LEN_STEP
        others = [middle, context_length] if given < middle < context_length else [context_length]
    else:
        others = [max(2, given // 4), max(2, given // 2)]
    return sorted({given, *others})


def fit_at(values: list, lengths: list[int], length: int, *, memo: dict | None = None):
    """``values`` (one per traced length: numbers, or lists, dicts and dataclasses of them of the same shape) at
    ``length``, each number on the polynomial through its values at ``lengths`` (Lagrange's form: linear through
    two, quadratic through three). Whole numbers stay whole; equal values stay as they are; a string is the first's.

    Args:
        memo: fitted records (dataclasses) by their values' ids, kept across calls at the same ``length`` and
            ``lengths``: a record two precisions share (fp16 traced as bf16) is fitted once.

    Raises:
        LengthsDiffer: two values of other shapes (list lengths, keys, types) or other flags.
    """
    weights = [
        math.prod((length - other) / (at - other) for j, other in enumerate(lengths) if j != i)
        for i, at in enumerate(lengths)
    ]
    return _fit(values, weights, {} if memo is None else memo)


def _fit(values: list, weights: list[float], memo: dict):
    """``fit_at``'s walk: numbers fitted, containers walked (a list of numbers in one pass: the records hold long
    ones), anything else the same in every value. An 8B model's record is a few million terms."""
    first = values[0]
    kind = type(first)
    if kind is int or kind is float:
        return _number(values, weights)
    if all(v is first for v in values):
        return first
    if any(type(v) is not kind for v in values):
        raise LengthsDiffer(f"{kind.__name__} against {', '.join(type(v).__name__ for v in values[1:])}")
    if kind is list or kind is tuple:
        if any(len(v) != len(first) for v in values):
            raise LengthsDiffer(f"lists of {[len(v) for v in values]} items")
        try:  # most lists are of numbers: in one pass
            return kind([_number(column, weights) for column in zip(*values)])
        except LengthsDiffer:  # of anything else (or a number against another type, said below)
            return kind(_fit(list(items), weights, memo) for items in zip(*values))
    if kind is dict:
        if any(v.keys() != first.keys() for v in values):
            raise LengthsDiffer("dictionaries with other keys")
        return {key: _fit([v[key] for v in values], weights, memo) for key in first}
    if dataclasses.is_dataclass(first):
        key = tuple(map(id, values))  # the values outlive the walk (the records hold them): their ids stay theirs
        if key not in memo:
            changes = {f.name: _fit([getattr(v, f.name) for v in values], weights, memo) for f in dataclasses.fields(first) if f.init}
            memo[key] = replace(first, **changes)
        return memo[key]
    if kind is str:  # a note: the first length's
        return first
    if any(v != first for v in values):
        raise LengthsDiffer(f"{kind.__name__} values differ: {values}")
    return first


def _number(values, weights: list[float]):
    """One term fitted: unchanged where it is the same at every length; whole where it is whole at every length.
    One loop, no generators: an 8B model's record asks this millions of times."""
    first, same, whole = values[0], True, True
    for v in values:
        kind = type(v)
        if kind is not int:
            if kind is not float:
                raise LengthsDiffer(f"a number against {', '.join(type(v).__name__ for v in values)}")
            whole = False
        if v != first:
            same = False
    if same:
        return first
    value = 0.0
    for w, v in zip(weights, values):
        value += w * v
    return round(value) if whole else value


class FittedPrecisions(Mapping):
    """A cost model's precisions at one length, each fitted (``fit_at``) the first time it is read: the
    longest-sequence search asks most lengths of one precision only (the first that fits), and each precision of an
    8B model's record is a fit of about a third of a second."""

    def __init__(self, traced: list[dict], lengths: list[int], length: int) -> None:
        """Raises:
            LengthsDiffer: the lengths' records hold other precisions."""
        if any(p.keys() != traced[0].keys() for p in traced):
            raise LengthsDiffer(f"precisions {[sorted(p) for p in traced]}")
        self._traced, self._lengths, self._length = traced, lengths, length
        self._fitted: dict = {}
        self._memo: dict = {}

    def __getitem__(self, precision: str):
        if precision not in self._fitted:
            self._fitted[precision] = fit_at([p[precision] for p in self._traced], self._lengths, self._length, memo=self._memo)
        return self._fitted[precision]

    def __iter__(self) -> Iterator[str]:
        return iter(self._traced[0])

    def __len__(self) -> int:
        return len(self._traced[0])


@dataclass(kw_only=True)
class LengthRecords:
    """Records (``capacity.CapacityRecord``) traced at a few sequence lengths of one model, batch and device, and the
    record at any other length fitted through them (``at``)."""

    records: dict[int, object]
    """Traced length -> its ``CapacityRecord``."""
    given: int
    """The user's length: the record every answer takes its headroom, levers and precisions from."""
    context_length: int | None
    _fitted: dict[int, object] = field(default_factory=dict, init=False, repr=False)
    """Length -> the record fitted there (``at``), until another length is traced."""

    @property
    def lengths(self) -> list[int]:
        return sorted(self.records)

    def nearest(self, length: int) -> int:
        """The traced length nearest ``length`` (its distance says how far an answer rests on the fit)."""
        return min(self.lengths, key=lambda traced: (abs(traced - length), traced))

    def at(self, length: int):
        """The record at ``length``: the traced one, or its cost model fitted through the ``TRACED_LENGTHS`` traced
        lengths nearest it (the rest the given length's record).

        Raises:
            LengthsDiffer: the nearest records differ in structure.
        """
        if length in self.records:
            return self.records[length]
        if length not in self._fitted:
            near = sorted(sorted(self.lengths, key=lambda traced: (abs(traced - length), traced))[:TRACED_LENGTHS])
            models = [self.records[n].model for n in near]
            fields = {f.name: fit_at([getattr(m, f.name) for m in models], near, length) for f in dataclasses.fields(models[0]) if f.name != "precisions"}
            model = replace(models[0], **fields, precisions=FittedPrecisions([m.precisions for m in models], near, length))
            self._fitted[length] = replace(self.records[self.given], model=model)
        return self._fitted[length]

    def add(self, length: int, record) -> None:
        """A record traced at another length (what later answers fit through)."""
        self.records[length] = record
        self._fitted.clear()


def longest_sequence(fits: Callable[[int], bool], *, context_length: int | None, known: tuple[int, ...] = ()) -> int:
    """The longest multiple of ``SEQ_LEN_STEP`` tokens, up to ``context_length``, at which ``fits(length)``
    (what fits at one length fits at a shorter one): a bisection; 0 where not even ``SEQ_LEN_STEP`` tokens fit.

    Args:
        known: lengths ``fits`` answers cheaply (the traced ones: no fit to make), asked first to narrow the bisection.
    """
    top = (context_length or LONGEST_SEARCHED) // SEQ_LEN_STEP
    low, high = 0, top + 1  # in steps of SEQ_LEN_STEP: low fits (0: none asked fits), high does not
    for step in sorted({k // SEQ_LEN_STEP for k in known if k % SEQ_LEN_STEP == 0 and 1 <= k // SEQ_LEN_STEP <= top}):
        if not fits(step * SEQ_LEN_STEP):
            high = step
            break
        low = step
    if high == top + 1 and low < top:  # the context length first: where a card holds the model with room to spare
        if fits(top * SEQ_LEN_STEP):
            return top * SEQ_LEN_STEP
        high = top
    if low == 0 and high > 1 and fits(SEQ_LEN_STEP):
        low = 1
    if low == 0:
        return 0
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle * SEQ_LEN_STEP):
            low = middle
        else:
            high = middle
    return low * SEQ_LEN_STEP
