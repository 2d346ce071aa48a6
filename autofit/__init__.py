"""autofit: fit PyTorch training into a memory budget.

The Python API (each name is imported on first use):

- ``autofit.probe(spec, micro_batch_size=..., ...)``: measure one configuration.
- ``autofit.plan(model, example_batch, budget="16GB", batch_size=256)``: search and verify a plan
  (the keywords are ``autofit.PlanRequest``'s fields).
- ``autofit.fit(model, budget="16GB", train_data=..., ...)``: plan, then train.
- ``autofit.apply_plan(model, plan)``: the plan's strategies for your own loop.
- ``autofit.Loss(fn, count_items=...)``, ``autofit.count_labels(shift=...)``: what a loss
  averages over (tokens), so micro-batches are weighted exactly (``autofit.model_io``).
"""
from __future__ import annotations

import importlib

from autofit.version import __version__

_EXPORTS = {
    "probe": "autofit.measure.probe",
    "load_spec": "autofit.spec",
    "spec_from_model": "autofit.spec",
    "Plan": "autofit.plan_file",
    "TrainingConfig": "autofit.config",
    "load_plan": "autofit.plan_file",
    "save_plan": "autofit.plan_file",
    "parse_budget": "autofit.units",
    "UserError": "autofit.errors",
    "plan": "autofit.planning.planner",
    "PlanRequest": "autofit.planning.request",
    "fit": "autofit.api",
    "apply_plan": "autofit.apply",
    "Loss": "autofit.model_io",
    "count_labels": "autofit.model_io",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'autofit' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
