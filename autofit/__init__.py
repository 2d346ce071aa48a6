"""autofit: fit PyTorch training into a memory budget.

The Python API (each name is imported on first use):

- ``autofit.probe(spec, micro_batch_size=..., ...)``: measure one configuration.
- ``autofit.plan(model, example_batch, budget="16GB", batch_size=256)``: search and verify a plan
  (the keywords are ``autofit.PlanRequest``'s fields).
- ``autofit.fit(model, budget="16GB", train_data=..., ...)``: plan, then train.
- ``autofit.apply_plan(model, plan)``: the plan's strategies for your own loop.
- ``autofit.Loss(fn, count_items=...)``, ``autofit.count_labels(shift=...)``: what a loss
  averages over (tokens), so micro-batches are weighted exactly (``autofit.model_io``).

A ``UserError`` from ``fit``, ``plan``, ``apply_plan`` (and the ``AppliedPlan`` it returns), ``probe`` and
``load_plan`` names the keywords their caller passes (``overwrite=True``), not the command line's flags
(``autofit.keywords``).
"""
from __future__ import annotations

import importlib

from autofit.version import __version__ as __version__  # re-exported

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

_SPEAKS_PYTHON = ("fit", "plan", "apply_plan", "probe", "load_plan")
"""Entry points shared with the command line's code, whose messages are written in its flags: offered here through
``keywords.python_api`` (the functions themselves stay as the command line calls them)."""


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'autofit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SPEAKS_PYTHON:
        from autofit.keywords import python_api

        value = python_api(value)
        globals()[name] = value  # one wrapper: autofit.fit is autofit.fit
    return value


__all__ = sorted(_EXPORTS)
