"""A memory trace's segments: the stretches between block events, and the peak of any checkpoint set over them.

A segment knows which blocks' saved activations are alive in it (their
forward ended, their backward has not begun), so checkpointing or offloading
them frees their bytes there (``peak_of``). The traces (``traces``) and the
levers' record of them (``levers``) both cut a run's marks into segments here.
"""
from __future__ import annotations

from dataclasses import dataclass

# Micro-steps of the traced run: one optimizer step of 2 micro-batches, its optimizer
# state made beforehand (as the probe makes it). The first micro-step is what a step
# without accumulation looks like (optimizer state alive, no gradients yet); the second
# is what every later micro-step of an accumulating step looks like (gradients alive).
FIRST_MICRO, LATER_MICRO = 0, 1


@dataclass(kw_only=True, slots=True)
class Segment:
    """A stretch of the trace between two block events."""

    peak_bytes: int
    """Highest live bytes inside the segment."""
    dropped: list[int]
    """Indices of the blocks whose forward has ended and whose backward has not begun: checkpointing them frees bytes here."""
    phase: str
    """"first" (first micro-step of an optimizer step), "later" (a micro-step with gradients alive), "optimizer"."""
    recomputes: int | None = None
    """Set for the stretch where a checkpointed block recomputes its forward: it exists only when that block is checkpointed."""
    selective: bool = False
    """With ``recomputes``: the stretch is that block's selective recomputation (it exists only when the block is
    checkpointed selectively); else its full one."""


def peak_of(
    segments: list[Segment], drops: list[float], checkpoint, *, selective_drops: list[float] | None = None, selective=frozenset(),
    offload=frozenset(),
) -> float:
    """The model's peak bytes with ``checkpoint`` blocks checkpointed fully and ``selective`` ones selectively.

    Args:
        segments: the segments at one micro-batch size (``MemoryCosts.at``).
        drops: bytes each block's full checkpointing frees.
        checkpoint: indices of the fully checkpointed blocks.
        selective_drops: bytes each block's selective checkpointing frees (needed when ``selective`` is not empty).
        selective: indices of the selectively checkpointed blocks.
        offload: indices in ``checkpoint`` whose ``drops`` are what offloading them frees (no recomputation).
    """
    def freed(block: int) -> float:
        if block in checkpoint:
            return drops[block]
        return selective_drops[block] if block in selective else 0.0

    return max(
        (
            s.peak_bytes - sum(freed(b) for b in s.dropped)
            for s in segments
            if s.recomputes is None or s.recomputes in (selective if s.selective else set(checkpoint) - set(offload))
        ),
        default=0.0,
    )


def apart_from_step(segments: list[Segment]) -> tuple[list[Segment], int]:
    """Forward and backward's segments, and the optimizer step's peak (0 where the segments hold no step): a rank
    under FSDP2 holds each differently (it steps its shards only)."""
    backward = [segment for segment in segments if segment.phase != "optimizer"]
    return backward, max((segment.peak_bytes for segment in segments if segment.phase == "optimizer"), default=0)


def plain_segments(marks: list[tuple], peaks: list[int], drop_bytes: list[int]) -> tuple[list[Segment], bool]:
    """The plain trace's segments, and whether their dropped blocks are always a prefix."""
    segments = [segment for segment, _, _ in labelled_segments(marks, peaks, len(drop_bytes))]
    prefix_shaped = all(s.dropped == list(range(len(s.dropped))) for s in segments)
    return segments, prefix_shaped


def recompute_segments(marks: list[tuple], peaks: list[int], drop_bytes: list[int], *, selective: bool) -> list[Segment]:
    """From an all-checkpointed (or all-selective) trace: the stretch after each block's backward begins (its recompute).

    That trace had every block before it dropped (in its mode, ``drop_bytes``);
    the segment's bytes are stated as if none were (adding their drops back),
    like every other segment, and it counts only when its block is
    checkpointed in that mode.
    """
    found = []
    for segment, opener, _ in labelled_segments(marks, peaks, len(drop_bytes)):
        if opener[0] == "bwd_start" and segment.phase in ("first", "later"):
            segment.peak_bytes += sum(drop_bytes[b] for b in segment.dropped)
            segment.recomputes = opener[1]
            segment.selective = selective
            found.append(segment)
    return found


def labelled_segments(marks: list[tuple], peaks: list[int], num_blocks: int):
    """Yield (segment, the mark that opened it, its position i) for the traced micro-steps and optimizer step.

    Segment i lies between marks[i-1] and marks[i]; it belongs to the micro-step
    (or optimizer step) that the last "micro"/"optimizer" mark before it opened.
    A block is dropped in it when its forward ended before and its backward
    begins after.
    """
    fwd_end: dict[tuple[int, int], int] = {}
    bwd_start: dict[tuple[int, int], int] = {}
    for position, mark in enumerate(marks):
        if mark[0] == "fwd_end":
            fwd_end.setdefault((mark[2], mark[1]), position)
        elif mark[0] == "bwd_start":
            bwd_start[(mark[2], mark[1])] = position
    phase, micro = None, None
    for i in range(1, len(marks)):
        opener = marks[i - 1]
        if opener[0] == "micro":
            micro = opener[1]
            phase = {FIRST_MICRO: "first", LATER_MICRO: "later"}.get(micro)
        elif opener[0] == "optimizer":
            phase = "optimizer" if micro == LATER_MICRO else None
        elif opener[0] == "optimizer_end":
            phase = None
        if phase is None:
            continue
        # The stretch from the end of backward to where the next micro-step begins holds all
        # gradients and the next micro-batch's copy: it belongs to the accumulating regime.
        segment_phase = "later" if marks[i] == ("micro", LATER_MICRO) else phase
        active = []
        if phase != "optimizer":
            for block in range(num_blocks):
                end, start = fwd_end.get((micro, block)), bwd_start.get((micro, block))
                if end is not None and end <= i - 1 and (start is None or start >= i):
                    active.append(block)
        yield Segment(peak_bytes=peaks[i], dropped=active, phase=segment_phase), opener, i
