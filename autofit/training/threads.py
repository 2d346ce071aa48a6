"""The intra-op threads a run trains with: those its plan's speed was timed with.

On a CPU that other work keeps busy the planner times with fewer threads than
PyTorch's default (``autofit.planning.context.timing_threads``): a step on two
threads of a busy 2-core machine waits at every parallel region for the thread
the other work holds off its core, and ran 3-4 times slower than on one. The
plan's ``measured.threads`` says what was timed; training uses the same, so
that the speed the plan promised is the speed it trains at. If the machine is
busier at the start of training than it was while planning, the planner's rule
decided now gives fewer threads, and those are used (seen: a plan timed with 2
threads on a quiet machine trained at 0.12x its speed when other work started
in between). A plan without the field (an older autofit) uses the rule alone.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from autofit.plan_file import Plan


def threads_for(plan: Plan) -> tuple[int, str]:
    """The intra-op thread count to train ``plan`` with, and the line that says why ("" where nothing changes).

    Only a plan for one process on the CPU is changed: on a GPU the step does not run on these threads, and
    several processes each take their share of the cores.
    """
    current = torch.get_num_threads()
    if plan.device.type != "cpu" or plan.config.world_size != 1:
        return current, ""
    from autofit.planning.context import timing_threads  # the planner's rule, decided now

    timed = plan.measured.threads if plan.measured is not None else None
    now, note = timing_threads("cpu")
    if timed is None:
        count = now
        why = f"the plan does not say what it was timed with, so decided now: {note}" if note else (
            "the plan does not say what it was timed with, so decided now: the machine is not busy"
        )
    elif now < timed:
        count = now
        why = f"fewer than the {timed} the plan's speed was timed with: {note}"
    else:
        count = timed
        why = "as the plan's speed was timed"
    return count, f"threads: training with {count} intra-op thread(s), {why} (PyTorch's default here: {current})"


@contextmanager
def plan_threads(plan: Plan, *, say: Callable[[str], None]) -> Iterator[int]:
    """Train inside with ``threads_for(plan)``'s count, its line said first; PyTorch's setting is put back after.

    Yields:
        The thread count in use.
    """
    from autofit.planning.context import intra_op_threads

    count, line = threads_for(plan)
    if line:
        say(line)
    with intra_op_threads(count):
        yield count
