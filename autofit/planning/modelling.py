"""Steps 1 and 2 of planning: the cost model's memory half (simulated traces) and speed half (timings or FLOPs).

Memory: two simulated traces per precision (no arithmetic), at the smallest
micro-batch the model trains with and at the global batch, give every
configuration's peak (``memory_model``). Speed: real timings on the device at
a few micro-batch sizes per precision (``cost_model``); with ``simulate``,
FLOPs instead. A stored study can hold both, and a rerun then measures neither.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autofit.errors import UserError
from autofit.planning.context import PlanContext
from autofit.planning.cost_model import CostModel, PrecisionCosts, SpeedCosts, flop_speed_costs, memory_costs, time_precisions
from autofit.planning.memory_model import MemoryTrace, trace_memory


@dataclass(frozen=True, kw_only=True)
class Costs:
    """The run's cost model and the micro-batch sizes it covers (largest first)."""

    model: CostModel
    micro_batch_sizes: list[int]
    resumed: bool = False
    """The cost model, speeds included, came from a stored study."""

    @property
    def host_sample_bytes(self) -> int:
        """Bytes of one sample of the host's copy of the global batch."""
        return next(iter(self.model.precisions.values())).memory.high.host_sample_bytes


def stored_or_traced(context: PlanContext) -> Costs:
    """The cost model of a stored study with the same model, device, batch and precisions; else the memory traced."""
    stored = context.study.load("cost_model")
    if stored is None:
        return traced(context)
    model = CostModel.from_dict(stored)
    smallest = model.precisions[context.precisions[0]].memory.low.micro_batch_size
    context.log("cost model loaded from the stored study")
    return Costs(model=model, micro_batch_sizes=micro_batch_sizes(context.global_batch_size, smallest=smallest), resumed=True)


def traced(context: PlanContext) -> Costs:
    """The memory model: each precision traced at the smallest runnable micro-batch and at the global batch.

    Its speeds are placeholders until ``add_speeds``.
    """
    G = context.global_batch_size
    smallest, low_trace = smallest_runnable(context)
    model = CostModel(blocks=low_trace.blocks, global_batch_size=G, device_type=context.device, estimated=context.simulate)
    model.output_shape = low_trace.output_shape
    context.log(f"memory: tracing {len(context.precisions)} precision(s) at micro-batch {smallest} and {G} (simulated)")
    for precision in context.precisions:
        reuse = low_trace if precision == context.precisions[0] else None
        memory = memory_costs(context.sim_spec, precision=precision, low=smallest, high=G, device_type=context.device, low_trace=reuse)
        empty = SpeedCosts(sizes=[1], step_seconds=[1.0], forward_seconds=[1.0], block_seconds=[[]], optimizer_seconds=0.0)
        model.precisions[precision] = PrecisionCosts(precision=precision, memory=memory, speed=empty)
    return Costs(model=model, micro_batch_sizes=micro_batch_sizes(G, smallest=smallest))


def smallest_runnable(context: PlanContext) -> tuple[int, MemoryTrace]:
    """The smallest micro-batch the model trains with (BatchNorm refuses 1 sample per channel), and its trace."""
    errors = []
    for size in micro_batch_sizes(context.global_batch_size, smallest=1)[::-1]:
        try:
            trace = trace_memory(context.sim_spec, micro_batch_size=size, precision=context.precisions[0], device_type=context.device)
        except Exception as error:  # the user's model refused this batch size
            errors.append(f"micro-batch {size}: {type(error).__name__}: {error}")
            continue
        if errors:
            context.log(f"the model does not train below micro-batch {size} ({errors[0]})")
        return size, trace
    raise UserError(f"the model fails to train even at micro-batch {context.global_batch_size}: {errors[-1]}; fix the model file or the batch size")


def add_speeds(context: PlanContext, costs: Costs) -> dict[str, str]:
    """Fill the cost model's speeds, and keep the model in the study.

    Returns:
        Precision -> a note on its speed (e.g. not timed past the smallest size: far slower than the fastest).
    """
    sizes = timing_sizes(costs.micro_batch_sizes)
    if context.simulate:
        context.log(f"speed: estimating from FLOPs at micro-batch {', '.join(map(str, sizes))}")
        speeds = flop_speed_costs(
            context.sim_spec, precisions=context.precisions, sizes=sizes, device_type=context.device, device_name=context.info.name
        )
    else:
        context.log(f"speed: timing {', '.join(context.precisions)} at micro-batch {', '.join(map(str, sizes))} on {context.device}")
        speeds = time_precisions(context.spec, precisions=context.precisions, sizes=sizes, device=context.device)
    notes = {}
    for precision, speed in speeds.items():
        costs.model.precisions[precision].speed = speed
        if speed.note:
            notes[precision] = speed.note
    context.study.save("cost_model", costs.model.to_dict())
    return notes


def micro_batch_sizes(global_batch_size: int, *, smallest: int) -> list[int]:
    """Micro-batch sizes searched, largest first: the smallest size for each k in 1, 2, 3, 4, 6, 8, 12, ...

    For a given number of micro-steps k, ceil(G / k) is the smallest micro-batch
    (least memory) with that many steps, so no other size is worth searching.
    A size whose last micro-batch (the remainder) would be below ``smallest``
    is left out: BatchNorm, for one, refuses a batch of one.
    """
    steps = {1}
    power = 1
    while power <= global_batch_size:
        steps.update({power, 3 * power // 2 if power > 1 else 1})
        power *= 2
    steps.add(global_batch_size)
    sizes = {math.ceil(global_batch_size / k) for k in steps if k <= global_batch_size}
    sizes.add(smallest)
    # The last micro-batch holds the remainder: it too must be a size the model trains with.
    return sorted((s for s in sizes if s >= smallest and not 0 < global_batch_size % s < smallest), reverse=True)


def timing_sizes(sizes: list[int]) -> list[int]:
    """A few sizes to time, spread geometrically (about x4 apart) from the largest to the smallest."""
    chosen = [sizes[0]]
    for size in sizes[1:]:
        if size * 4 <= chosen[-1] * 1.01:
            chosen.append(size)
    if chosen[-1] != sizes[-1]:
        chosen.append(sizes[-1])
    return sorted(chosen)
