"""Costs from the cache: a half precision traced in full without its recomputations (the earlier plan's floor was
well under its budget) cannot lend the floor of a tighter budget the checkpointed peak it never traced."""
import dataclasses

import pytest
import torch

from autofit.measure.probe import probe
from autofit.planning.planner import make_plan
from autofit.planning.request import PlanRequest
from autofit.spec import ModelSpec, default_optimizer
from tests.helpers.models import BatchNormCNN

pytestmark = pytest.mark.slow  # the whole module plans or trains real models (tens of seconds each)


def cnn_spec() -> ModelSpec:
    return ModelSpec(
        source="tests.helpers.models.BatchNormCNN", build_model=BatchNormCNN,
        example_batch=lambda n: (torch.randn(n, 3, 16, 16), torch.randint(0, 10, (n,))),
        loss_fn=torch.nn.functional.cross_entropy, build_optimizer=default_optimizer,
    )


def test_a_tight_budget_after_a_roomy_one_plans_as_from_scratch(one_thread, tmp_path, monkeypatch):
    """It used to be a KeyError: 'fp16' traceback (bf16 and fp16 share traces, and the floor took fp16's)."""
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    spec = cnn_spec()
    plain = probe(spec, micro_batch_size=8, simulate=True, steps=1).peak_bytes
    roomy = make_plan(spec, PlanRequest(budget=int(plain * 1.25), batch_size=8, simulate=True))
    assert roomy.config.checkpoint == () and roomy.config.micro_batch_size == 8  # bf16 and fp16 traced, no recompute
    tight = PlanRequest(budget=int(plain * 0.15), batch_size=8, simulate=True)  # below fp32's floor
    cached, fresh = make_plan(spec, tight), make_plan(spec, dataclasses.replace(tight, cache=False))
    assert cached.config == fresh.config and cached.config.precision != "fp32"
