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


def default_workers(device_type: str, *, threads: int, world_size: int = 1) -> tuple[int, str]:
    """DataLoader workers when none were asked for, and the line that says why.

    On a GPU the step runs on the card: up to 4 workers, one core left to the
    training process. On the CPU the step's intra-op threads already use the
    cores, and a worker takes from them: the timm example on 2 cores trained
    at 0.81x its plan's speed with one worker, 0.91x with none (the digits CNN,
    decoding images: 0.88x and 0.94x). So there a worker gets only a core the
    threads leave free (shared among the processes of a run on several).
    """
    from autofit.measure.other_work import usable_cores

    cores = usable_cores()
    if device_type == "cuda":
        count = min(4, max(cores - 1, 0))
        return count, f"data: {count} DataLoader worker(s) (--workers sets it)"
    busy = threads * world_size  # several processes on one machine share its cores
    count = min(4, max(cores - busy, 0) // world_size)
    why = "the cores its threads leave free" if count else f"the step's {busy} thread(s) take the {cores} core(s)"
    return count, f"data: {count} DataLoader worker(s) beside the step, {why} (--workers sets it)"
