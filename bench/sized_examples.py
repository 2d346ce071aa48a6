"""The examples' model files at other sizes, as ModelSpecs the bench scripts share.

Each model file keeps its sizes in module constants (``D_MODEL``, ``SEQ_LEN``,
...); a bench loads its own copy of the file, sets them, and builds the spec
the way ``autofit.spec`` builds one for a model file (its loss, or the model's
own, and what that loss averages over).

    spec = example_spec("tiny_transformer.py", build=lambda m: m.TinyTransformer("sdpa"), D_MODEL=512, N_LAYERS=6)
"""
from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from torch import nn

from autofit.model_io import Loss
from autofit.spec import ModelSpec, default_optimizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
_copies = itertools.count()


def example_module(file: str, **sizes) -> ModuleType:
    """A fresh copy of ``examples/<file>`` with the module constants in ``sizes`` set (each must exist)."""
    spec = importlib.util.spec_from_file_location(f"bench_example_{Path(file).stem}_{next(_copies)}", EXAMPLES / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, value in sizes.items():
        if not hasattr(module, name):
            raise AttributeError(f"examples/{file} has no size {name}")
        setattr(module, name, value)
    return module


def example_spec(file: str, *, build: Callable[[ModuleType], nn.Module] | None = None, **sizes) -> ModelSpec:
    """The ModelSpec of ``examples/<file>`` at ``sizes``; ``build(module)`` builds the model instead of ``build_model()``."""
    module = example_module(file, **sizes)
    described = " ".join(f"{name.lower()}={value}" for name, value in sizes.items())
    return ModelSpec(
        source=f"examples/{file}" + (f" ({described})" if described else ""),
        build_model=(lambda: build(module)) if build else module.build_model,
        example_batch=module.example_batch,
        loss_fn=Loss(getattr(module, "loss_fn", None), count_items=getattr(module, "count_items", None)),
        build_optimizer=getattr(module, "build_optimizer", None) or default_optimizer,
    )
