"""autofit: fit PyTorch training into a memory budget.

The Python API (each name is imported on first use):

- ``autofit.probe(spec, micro_batch_size=..., ...)``: measure one configuration.
- ``autofit.plan(model, example_batch, budget="16GB", batch_size=256)``: search and verify a plan
  (the keywords are ``autofit.PlanRequest``'s fields; ``plan(model, example_batch, request)`` takes one whole).
- ``autofit.fit(model, budget="16GB", train_data=..., ...)``: plan, then train (the keywords are
  ``autofit.FitSettings``' fields; ``fit(model, settings)`` takes them as one record).
- ``autofit.apply_plan(model, plan)``: the plan's strategies for your own loop.
- ``autofit.Loss(fn, count_items=...)``, ``autofit.count_labels(shift=...)``: what a loss
  averages over (tokens), so micro-batches are weighted exactly (``autofit.model_io``).

A ``UserError`` from ``fit``, ``plan``, ``apply_plan`` (and the ``AppliedPlan`` it returns), ``probe`` and
``load_plan`` names the keywords their caller passes (``overwrite=True``), not the command line's flags
(``autofit.keywords``).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

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
    "FitSettings": "autofit.fit_settings",
    "apply_plan": "autofit.apply",
    "Loss": "autofit.model_io",
    "count_labels": "autofit.model_io",
}

if TYPE_CHECKING:  # what an editor and a type checker see; at run time ``__getattr__`` imports each on first use
    from autofit.api import fit as fit
    from autofit.apply import apply_plan as apply_plan
    from autofit.config import TrainingConfig as TrainingConfig
    from autofit.errors import UserError as UserError
    from autofit.fit_settings import FitSettings as FitSettings
    from autofit.measure.probe import probe as probe
    from autofit.model_io import Loss as Loss
    from autofit.model_io import count_labels as count_labels
    from autofit.plan_file import Plan as Plan
    from autofit.plan_file import load_plan as load_plan
    from autofit.plan_file import save_plan as save_plan
    from autofit.planning.planner import plan as plan
    from autofit.planning.request import PlanRequest as PlanRequest
    from autofit.spec import load_spec as load_spec
    from autofit.spec import spec_from_model as spec_from_model
    from autofit.units import parse_budget as parse_budget

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
