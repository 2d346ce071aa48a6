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
from collections.abc import Callable
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


def fit_at(values: list, lengths: list[int], length: int):
    """``values`` (one per traced length: numbers, or lists, dicts and dataclasses of them of the same shape) at
    ``length``, each number on the polynomial through its values at ``lengths`` (Lagrange's form: linear through
    two, quadratic through three). Whole numbers stay whole; equal values stay as they are; a string is the first's.

    Raises:
        LengthsDiffer: two values of other shapes (list lengths, keys, types) or other flags.
    """
    weights = [
        math.prod((length - other) / (at - other) for j, other in enumerate(lengths) if j != i)
        for i, at in enumerate(lengths)
    ]
    return _fit(values, weights)


def _fit(values: list, weights: list[float]):
    first = values[0]
    if all(v is first for v in values) or all(type(v) is type(first) and v == first for v in values):
        return first
    if any(type(v) is not type(first) for v in values):
        raise LengthsDiffer(f"{type(first).__name__} against {', '.join(type(v).__name__ for v in values[1:])}")
    if isinstance(first, bool):
        raise LengthsDiffer(f"a flag differs: {values}")
    if isinstance(first, (int, float)):
        value = sum(w * v for w, v in zip(weights, values))
        return round(value) if isinstance(first, int) else value
    if isinstance(first, str):
        return first
    if isinstance(first, (list, tuple)):
        if any(len(v) != len(first) for v in values):
            raise LengthsDiffer(f"lists of {[len(v) for v in values]} items")
        return type(first)(_fit(list(items), weights) for items in zip(*values))
    if isinstance(first, dict):
        if any(v.keys() != first.keys() for v in values):
            raise LengthsDiffer("dictionaries with other keys")
        return {key: _fit([v[key] for v in values], weights) for key in first}
    if dataclasses.is_dataclass(first):
        changes = {
            f.name: _fit([getattr(v, f.name) for v in values], weights) for f in dataclasses.fields(first) if f.init
        }
        return replace(first, **changes)
    raise LengthsDiffer(f"{type(first).__name__} values differ")


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
            model = fit_at([self.records[n].model for n in near], near, length)
            self._fitted[length] = replace(self.records[self.given], model=model)
        return self._fitted[length]

    def add(self, length: int, record) -> None:
        """A record traced at another length (what later answers fit through)."""
        self.records[length] = record
        self._fitted.clear()


def longest_sequence(fits: Callable[[int], bool], *, context_length: int | None) -> int:
    """The longest multiple of ``SEQ_LEN_STEP`` tokens, up to ``context_length``, at which ``fits(length)``
    (what fits at one length fits at a shorter one): a bisection; 0 where not even ``SEQ_LEN_STEP`` tokens fit."""
    top = (context_length or LONGEST_SEARCHED) // SEQ_LEN_STEP
    if top < 1 or not fits(SEQ_LEN_STEP):
        return 0
    if fits(top * SEQ_LEN_STEP):
        return top * SEQ_LEN_STEP
    low, high = 1, top  # low fits, high does not
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle * SEQ_LEN_STEP):
            low = middle
        else:
            high = middle
    return low * SEQ_LEN_STEP
