"""Checkpoint modes per block by exact knapsack.

For one precision and micro-batch size, how to checkpoint each block (not at
all, selectively or fully), or offload its activations, is a covering
knapsack: drop enough bytes at every point of the step for the peak to fit,
at the least added time. Each block offers its modes with the bytes they
free and the seconds they cost; the constraints are the memory model's
segments (``memory.traces.Segment``). In the usual case (blocks run forward
in order and backward in reverse) every segment's droppable blocks are a
prefix of the block list, and a dynamic programme over blocks with
Pareto-pruned states (bytes dropped so far, seconds spent) solves it exactly
for any number of blocks; other shapes are enumerated while small, else
solved greedily. ``search.cheapest_for`` poses the problem from the cost model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autofit.planning.memory.segments import Segment, peak_of
from autofit.planning.policy import POLICY

FULL, SELECTIVE, OFFLOAD = "full", "selective", "offload"
"""A block's modes (None: none of them): checkpointed fully or selectively, or its activations offloaded."""


@dataclass(kw_only=True, slots=True)
class CheckpointChoice:
    blocks: frozenset[int]
    """Blocks checkpointed fully."""
    peak_bytes: float
    recompute_seconds: float
    selective: frozenset[int] = frozenset()
    """Blocks checkpointed selectively."""
    offload: frozenset[int] = frozenset()
    """Blocks whose activations are offloaded."""
    offload_seconds: float = 0.0
    """What offloading them costs per optimizer step (in ``recompute_seconds`` too)."""


@dataclass(frozen=True, slots=True)
class _Option:
    mode: str | None
    drop: float
    seconds: float


def cheapest_checkpoint(
    segments: list[Segment],
    drops: list[float],
    seconds: list[float],
    *,
    limit_bytes: float,
    selective_drops: list[float] | None = None,
    selective_seconds: list[float] | None = None,
    offload_drops: list[float] | None = None,
    offload_seconds: list[float] | None = None,
    checkpointing: bool = True,
) -> CheckpointChoice | None:
    """Each block's checkpoint mode (none, selective, full, offload) with the least added time whose peak is at most
    ``limit_bytes``.

    Args:
        segments: the memory model's segments at this precision and micro-batch size.
        drops: bytes each block's full checkpointing frees.
        seconds: recompute seconds each block's full checkpointing costs per optimizer step.
        limit_bytes: the peak allowed.
        selective_drops, selective_seconds: the same for selective checkpointing; None (either) leaves it out.
        offload_drops, offload_seconds: the same for activation offload; None (either) leaves it out.
        checkpointing: False leaves full and selective checkpointing out (segments of plain training only).

    Returns:
        The choice, or None when even checkpointing every block does not fit.
    """
    n = len(drops)
    options = _options(
        drops, seconds, selective_drops=selective_drops, selective_seconds=selective_seconds, offload_drops=offload_drops,
        offload_seconds=offload_seconds, checkpointing=checkpointing,
    )
    if _prefix_shaped(segments, n):
        modes = _prefix_knapsack(segments, options, limit_bytes=limit_bytes)
    elif math.prod(len(o) for o in options) <= 2**POLICY.enumerate_max_choices_log2:
        modes = _enumerate(segments, options, limit_bytes=limit_bytes)
    else:
        modes = _greedy(segments, options, limit_bytes=limit_bytes)
    if modes is None:
        return None
    full = frozenset(b for b, mode in enumerate(modes) if mode == FULL)
    selective = frozenset(b for b, mode in enumerate(modes) if mode == SELECTIVE)
    offloaded = frozenset(b for b, mode in enumerate(modes) if mode == OFFLOAD)
    return CheckpointChoice(
        blocks=full, selective=selective, offload=offloaded, peak_bytes=_peak(segments, options, modes),
        recompute_seconds=sum(_chosen(options, modes, b).seconds for b in range(n)),
        offload_seconds=sum(_chosen(options, modes, b).seconds for b in offloaded),
    )


def _options(
    drops, seconds, *, selective_drops=None, selective_seconds=None, offload_drops=None, offload_seconds=None,
    checkpointing: bool = True,
) -> list[list[_Option]]:
    """Per block, its modes with the bytes they free and the seconds they cost: none, full, and selective and
    offload where known (full and selective only with ``checkpointing``)."""
    options = [[_Option(None, 0.0, 0.0)] + ([_Option(FULL, drops[b], seconds[b])] if checkpointing else []) for b in range(len(drops))]
    for mode, mode_drops, mode_seconds in ((SELECTIVE, selective_drops, selective_seconds), (OFFLOAD, offload_drops, offload_seconds)):
        if mode == SELECTIVE and not checkpointing:
            continue
        if mode_drops is not None and mode_seconds is not None:
            for b, block_options in enumerate(options):
                block_options.append(_Option(mode, mode_drops[b], mode_seconds[b]))
    return options


def _chosen(options: list[list[_Option]], modes, block: int) -> _Option:
    return next(o for o in options[block] if o.mode == modes[block])


def _peak(segments: list[Segment], options: list[list[_Option]], modes) -> float:
    """``peak_of`` for a mode per block (an offloaded block frees its drop where it is dropped, and recomputes nothing)."""
    chosen = [_chosen(options, modes, b).drop for b in range(len(options))]
    return peak_of(
        segments, chosen, {b for b, mode in enumerate(modes) if mode in (FULL, OFFLOAD)},
        selective_drops=chosen, selective={b for b, mode in enumerate(modes) if mode == SELECTIVE},
        offload={b for b, mode in enumerate(modes) if mode == OFFLOAD},
    )


def _prefix_shaped(segments: list[Segment], n: int) -> bool:
    for s in segments:
        expected = list(range(s.recomputes if s.recomputes is not None else len(s.dropped)))
        if s.dropped != expected:
            return False
    return True


def _prefix_knapsack(segments, options: list[list[_Option]], *, limit_bytes: float) -> tuple | None:
    """Exact: blocks in forward order; states (bytes dropped so far, seconds, modes), Pareto-pruned.

    Segment constraints: a segment whose droppable blocks are 0..j-1 needs the
    modes chosen for them to drop at least (its bytes - limit). A block's
    recompute segment in a mode exists only when it takes that mode, so it is
    checked when the block takes it, against what the blocks before it drop.
    """
    n = len(options)
    need = [-np.inf] * (n + 1)
    recompute = [{FULL: -np.inf, SELECTIVE: -np.inf, OFFLOAD: -np.inf} for _ in range(n)]
    for s in segments:
        if s.recomputes is None:
            need[len(s.dropped)] = max(need[len(s.dropped)], s.peak_bytes - limit_bytes)
        else:
            mode = SELECTIVE if s.selective else FULL
            recompute[s.recomputes][mode] = max(recompute[s.recomputes][mode], s.peak_bytes - limit_bytes)
    if need[0] > 0:
        return None
    states: list[tuple[float, float, tuple]] = [(0.0, 0.0, ())]
    for block in range(n):
        grown = []
        for dropped, cost, modes in states:
            for option in options[block]:
                if option.mode is None or recompute[block][option.mode] <= dropped:
                    grown.append((dropped + option.drop, cost + option.seconds, (*modes, option.mode)))
        grown = [state for state in grown if state[0] >= need[block + 1]]
        if not grown:
            return None
        # Keep a state only if no other drops at least as much for no more time.
        grown.sort(key=lambda state: (-state[0], state[1]))
        states, best_cost = [], np.inf
        for state in grown:
            if state[1] < best_cost:
                states.append(state)
                best_cost = state[1]
    return min(states, key=lambda state: (state[1], -state[0]))[2]


def _enumerate(segments, options: list[list[_Option]], *, limit_bytes: float) -> tuple | None:
    """Exact for any shape: every choice of a mode per block, vectorised (at most 2 ** ``POLICY.enumerate_max_choices_log2`` of them)."""
    n = len(options)
    counts = [len(o) for o in options]
    total = math.prod(counts)
    codes = np.arange(total, dtype=np.int64)
    picks = np.empty((total, n), dtype=np.int64)  # (choices, blocks): each block's option index
    for b in range(n):
        picks[:, b] = codes % counts[b]
        codes = codes // counts[b]
    drop = np.stack([np.asarray([o.drop for o in options[b]])[picks[:, b]] for b in range(n)], axis=1) if n else np.zeros((1, 0))
    cost = sum((np.asarray([o.seconds for o in options[b]])[picks[:, b]] for b in range(n)), np.zeros(total))
    peak = np.full(total, -np.inf)
    for s in segments:
        value = s.peak_bytes - drop[:, s.dropped].sum(axis=1)
        if s.recomputes is not None:
            mode = SELECTIVE if s.selective else FULL
            index = next((i for i, o in enumerate(options[s.recomputes]) if o.mode == mode), None)
            value = np.where(picks[:, s.recomputes] == index, value, -np.inf) if index is not None else np.full(total, -np.inf)
        peak = np.maximum(peak, value)
    cost = np.where(peak <= limit_bytes, cost, np.inf)
    best = int(np.argmin(cost))
    if not np.isfinite(cost[best]):
        return None
    return tuple(options[b][picks[best, b]].mode for b in range(n))


def _greedy(segments, options: list[list[_Option]], *, limit_bytes: float) -> tuple | None:
    """Many blocks of unusual shape: take the change of mode that drops the most bytes per second until it fits,
    then give back, most expensive first, what is not needed."""
    n = len(options)
    current = [options[b][0] for b in range(n)]  # not checkpointed

    def peak() -> float:
        return _peak(segments, options, tuple(o.mode for o in current))

    while peak() > limit_bytes:
        moves = [
            ((o.drop - current[b].drop) / max(o.seconds - current[b].seconds, 1e-12), b, o)
            for b in range(n) for o in options[b] if o.drop > current[b].drop
        ]
        if not moves:
            return None
        _, block, option = max(moves, key=lambda move: move[0])
        current[block] = option
    for block in sorted(range(n), key=lambda b: -current[b].seconds):
        taken = current[block]
        for option in sorted(options[block], key=lambda o: o.seconds):
            if option.seconds >= taken.seconds:
                break
            current[block] = option
            if peak() <= limit_bytes:
                break
            current[block] = taken
    return tuple(o.mode for o in current)
