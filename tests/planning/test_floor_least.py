"""The floor is the least measured configuration among those check_floor measures, whatever the memory model
predicted (DeepLabV3's stated floor was a configuration measured above another that fits)."""
import pytest
import autofit.planning.planner as planner
from autofit.planning.request import PlanRequest
from autofit.planning.verify.floor import InfeasibleBudget, check_floor
from tests.planning.test_planner import uneven_spec


class Swapped:
    """A memory model that predicts every block checkpointed as it would none and the other way round: the
    floor's two options ordered wrongly, each predicted at the other's peak."""

    def __init__(self, memory, blocks: frozenset[int]) -> None:
        self.memory, self.blocks = memory, blocks

    def peak_bytes(self, micro_batch_size, *, checkpoint, **kwargs) -> float:
        return self.memory.peak_bytes(micro_batch_size, checkpoint=frozenset() if checkpoint else self.blocks, **kwargs)


def _mispredicting(context, costs, measurements):
    memory_for_floor = type(costs).memory_for_floor
    blocks = frozenset(range(len(costs.model.blocks)))
    type(costs).memory_for_floor = lambda self: {p: Swapped(m, blocks) for p, m in memory_for_floor(self).items()}
    try:
        return check_floor(context, costs, measurements)
    finally:
        type(costs).memory_for_floor = memory_for_floor


def _floor(request: PlanRequest):
    with pytest.raises(InfeasibleBudget) as error:
        planner.make_plan(uneven_spec(), request)
    return error.value


def test_floor_is_the_least_measured_when_the_prediction_orders_it_wrong(monkeypatch):
    request = PlanRequest(budget=1000, batch_size=4, precisions=("fp32",), simulate=True, cache=False)
    right = _floor(request)
    monkeypatch.setattr(planner, "check_floor", _mispredicting)
    wrong = _floor(request)
    assert wrong.floor_bytes == right.floor_bytes
    assert wrong.floor.config == right.floor.config
