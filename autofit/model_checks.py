"""What a model file hands autofit, checked where it is used: a mistake in the file is one line naming it, not a traceback.

``autofit.spec`` wraps a model file's functions: ``build_model()`` must return
an ``nn.Module`` (an error raised inside it is reported with the file's line),
``example_batch(n)`` must return ``(inputs, targets)`` of ``n`` samples, and
without a ``loss_fn`` the forward must return a tensor of logits.
``check_model_runs`` runs the model once on ``example_batch(2)`` on the CPU
before a command measures it, so inputs the model cannot take are found
before any search or probe.
"""
from __future__ import annotations

import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from torch import nn

from autofit.errors import UserError
from autofit.model_io import Samples, batch_sizes, call_model, per_sample


class CheckedBuild:
    """A model file's ``build_model``: the model it returns, or a UserError naming what went wrong."""

    def __init__(self, build_model: Callable[[], nn.Module], *, source: str) -> None:
        self.build_model, self.source = build_model, source

    def __call__(self) -> nn.Module:
        try:
            model = self.build_model()
        except UserError:
            raise
        except SystemExit as error:  # an exit in the user's code would end autofit without a word
            raise UserError(f"model file {self.source!r}: build_model() called sys.exit({error.code!r}); return the model instead") from None
        except Exception as error:  # the user's code: any error is theirs to fix
            raise UserError(f"model file {self.source!r}: build_model() raised {_describe(error, self.source)}; fix it there") from error
        if not isinstance(model, nn.Module):
            raise UserError(
                f"model file {self.source!r}: build_model() returned {type(model).__name__}, not a torch.nn.Module; return the model itself"
            )
        return model


class CheckedOptimizer:
    """A model file's ``build_optimizer``: the optimizer it returns for the parameters, or a UserError naming what went
    wrong (where it is first called: in ``probe``, ``plan`` or ``train``)."""

    def __init__(self, build_optimizer: Callable, *, source: str) -> None:
        self.build_optimizer, self.source = build_optimizer, source
        self.__wrapped__ = build_optimizer  # its signature says whether it takes named_parameters (``spec.wants_names``)

    def __call__(self, params):
        try:
            return self.build_optimizer(params)
        except UserError:
            raise
        except SystemExit as error:
            raise UserError(
                f"model file {self.source!r}: build_optimizer(params) called sys.exit({error.code!r}); return the optimizer instead"
            ) from None
        except Exception as error:
            raise UserError(f"model file {self.source!r}: build_optimizer(params) raised {_describe(error, self.source)}; fix it there") from error


class CheckedExampleBatch:
    """A model file's ``example_batch``: ``(inputs, targets)`` of ``batch_size`` samples, or a UserError saying what is wrong.

    Args:
        per_sample: the file defines ``collate``: lists in its batches hold one entry per sample (``model_io.per_sample``).
        owner: who gave it, for the messages; default "model file SOURCE" ("" for a caller of the Python API, whose
            ``example_batch`` argument is named alone).
    """

    def __init__(self, example_batch: Callable[[int], tuple], *, source: str, per_sample: bool = False, owner: str | None = None) -> None:
        self.example_batch, self.source, self.per_sample = example_batch, source, per_sample
        self.owner = f"model file {source!r}: " if owner is None else owner

    def __call__(self, batch_size: int) -> tuple:
        try:
            batch = self.example_batch(batch_size)
            if self.per_sample:
                batch = per_sample(batch)
        except UserError:
            raise
        except SystemExit as error:
            raise UserError(
                f"{self.owner}example_batch({batch_size}) called sys.exit({error.code!r}); return the batch instead"
            ) from None
        except Exception as error:
            raise UserError(
                f"{self.owner}example_batch({batch_size}) raised {_describe(error, self.source)}; fix it there"
            ) from error
        check_batch(batch, batch_size=batch_size, where=f"{self.owner}example_batch({batch_size})")
        return batch


class CheckedCollate:
    """A ``collate(samples) -> (inputs, targets)``: the batch its datasets' samples make, with lists one entry per
    sample (``model_io.per_sample``); a UserError where it raises or returns another number of samples.

    Args:
        owner: whose function it is, for messages ("model file 'det.py'", "fit()").
        source: the model file, whose line an error names ("" for a function passed to ``fit``).
    """

    def __init__(self, collate: Callable[[list], tuple], *, owner: str, source: str = "") -> None:
        self.collate, self.owner, self.source = collate, owner, source

    def __call__(self, samples: list) -> tuple:
        where = f"{self.owner}: collate() of {len(samples)} sample(s)"
        try:
            batch = per_sample(self.collate(samples))
        except UserError:
            raise
        except Exception as error:  # the user's code: any error is theirs to fix
            raise UserError(f"{where} raised {_describe(error, self.source)}; fix it there") from error
        check_batch(batch, batch_size=len(samples), where=where)
        return batch


def check_batch(batch, *, batch_size: int, where: str) -> None:
    """Refuse anything but ``(inputs, targets)`` whose tensors all hold ``batch_size`` samples (their first dimension).

    Raises:
        UserError: naming ``where``, what came back and what is expected.
    """
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        got = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) else type(batch).__name__
        raise UserError(f"{where} returned {got}; return a pair (inputs, targets), e.g. (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))")
    for role, part in zip(("inputs", "targets"), batch):
        if role == "targets" and part is None:
            continue  # the labels are in the inputs (a model that computes its own loss)
        tensors = _tensors(part)
        if not tensors:
            raise UserError(f"{where} returned {role} of type {type(part).__name__}, which hold no tensor; return torch tensors")
        sizes = sorted(set(batch_sizes(part)))
        if sizes != [batch_size]:
            lists = _holds_lists(part)
            raise UserError(
                f"{where} returned {role} of {' and '.join(map(str, sizes)) or 'no'} sample(s) (first dimension), not {batch_size}; "
                + ("if a list holds one entry per sample (torchvision detection's images and targets), define "
                   "collate(samples) -> (inputs, targets) in the model file" if lists else "return as many samples as asked for")
            )


def check_model_runs(
    spec, *, build: Callable[[Callable[[], nn.Module]], nn.Module] | None = None,
    environment: Callable[[], AbstractContextManager] = nullcontext,
) -> None:
    """Build a model file's model and run its forward and loss on ``example_batch(2)`` on the CPU (no gradients).

    Only model files are checked (their ``build_model`` is a ``CheckedBuild``):
    library models (``torchvision:NAME``) take what their spec makes.

    Args:
        build: how the model is built from ``spec.build_model`` (default: called); the simulated meter's
            ``build_model`` builds it of fake tensors (``measure.meters.check_model_runs_simulated``).
        environment: what the check runs inside (the simulated meter's fake mode); default nothing.

    Raises:
        UserError: build_model or example_batch fail their checks, or the
            forward or the loss fails on the example batch.
    """
    if not isinstance(spec.build_model, CheckedBuild):
        return
    with environment():
        model = build(spec.build_model) if build is not None else spec.build_model()
        check_trainable(model)
        inputs, targets = spec.example_batch(2)
        try:
            with torch.no_grad():
                loss = spec.loss_fn(call_model(model, inputs), targets)
        except UserError:
            raise
        except Exception as error:
            raise UserError(
                f"model file {spec.source!r}: the forward or the loss failed on example_batch(2): {_describe(error, spec.source)}; "
                "make example_batch return inputs the model takes and targets its loss takes"
            ) from error
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise UserError(
            f"model file {spec.source!r}: loss_fn returned {type(loss).__name__}"
            f"{' of shape ' + str(tuple(loss.shape)) if isinstance(loss, torch.Tensor) else ''}; return one number (a 0-dim tensor)"
        )


def check_trainable(model: nn.Module) -> None:
    """Refuse a model none of whose parameters trains: an optimizer over none cannot be built, and nothing would fit.

    Raises:
        UserError: no parameter has ``requires_grad``.
    """
    parameters = list(model.parameters())
    if not any(p.requires_grad for p in parameters):
        raise UserError(
            f"the model has no parameters that train ({len(parameters)} parameter tensor(s), none with requires_grad): "
            "nothing to fit; give a model with trainable parameters"
        )


def _holds_lists(part) -> bool:
    """Whether a batch's inputs or targets hold a list or tuple not marked ``Samples`` (one level in, or themselves)."""
    values = part.values() if isinstance(part, dict) else part if isinstance(part, (tuple, list)) else ()
    return isinstance(part, list) or any(isinstance(value, (tuple, list)) and not isinstance(value, Samples) for value in values)


def _tensors(part) -> list[torch.Tensor]:
    if isinstance(part, torch.Tensor):
        return [part]
    if isinstance(part, dict):
        part = list(part.values())
    if isinstance(part, (tuple, list)):
        return [t for item in part for t in _tensors(item)]
    return []


def _describe(error: BaseException, source: str) -> str:
    """``TypeName: first line of the message (file.py, line N)``, the line being the last one in ``source``'s file."""
    message = (str(error).strip().splitlines() or [""])[0][:300]
    path = Path(source).resolve()
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if Path(frame.filename).resolve() == path]
    where = f" ({path.name}, line {frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}: {message}{where}"


def batch_bytes(batch) -> int:
    """Bytes of every tensor in a batch (inputs and targets)."""
    return sum(t.numel() * t.element_size() for t in _tensors(list(batch)))
