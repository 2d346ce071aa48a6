"""PlanRequest: what a user asks the planner for, spelled once for autofit.plan, make_plan, the CLI and fit."""
import dataclasses

import pytest
import torch
from torch import nn

import autofit
from autofit.errors import UserError
from autofit.planning.request import PlanRequest, plan_request


def test_a_request_is_frozen_and_holds_its_precisions_as_a_tuple():
    request = PlanRequest(budget="1MB", batch_size=8, precisions=["fp32"])
    assert request.precisions == ("fp32",) and hash(request) == hash(dataclasses.replace(request))
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.budget = "2MB"


@pytest.mark.parametrize(("asks", "words"), [
    (dict(budget="1MB", batch_size=8, budgett="2MB"), "'budgett' is not something a plan can be asked for; give any of budget, batch_size"),
    (dict(batch_size=8), "a plan needs budget"),
])
def test_autofit_plan_refuses_what_is_not_a_request_in_one_line(asks, words):
    model = nn.Linear(4, 2)
    with pytest.raises(UserError, match=words) as error:
        autofit.plan(model, lambda n: (torch.randn(n, 4), torch.randint(0, 2, (n,))), **asks)
    assert "\n" not in str(error.value)
    assert plan_request(budget="1MB", batch_size=8) == PlanRequest(budget="1MB", batch_size=8)


def test_plan_keywords_are_the_request_s_fields_and_a_request_takes_them_over():
    """``PlanKeywords`` (what an editor completes for ``autofit.plan``) lists ``PlanRequest``'s fields with their types;
    a request given whole, with keywords beside it, is that request with those fields in place."""
    from autofit.planning.request import PlanKeywords

    fields = {field.name: field.type for field in dataclasses.fields(PlanRequest)}
    assert {name: getattr(kind, "__forward_arg__", kind) for name, kind in PlanKeywords.__annotations__.items()} == fields
    request = PlanRequest(budget="1MB", batch_size=8, simulate=True)
    assert plan_request(request, budget="2MB") == dataclasses.replace(request, budget="2MB")
    with pytest.raises(UserError, match="plan\\(\\)'s request must be an autofit.PlanRequest, got dict"):
        autofit.plan(nn.Linear(4, 2), lambda n: (torch.randn(n, 4), torch.randint(0, 2, (n,))), {"budget": "1MB"})
