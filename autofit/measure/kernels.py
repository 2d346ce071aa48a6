"""Whether a precision's kernels can run a model on this device at all.

Autocast sends each op to the kernel of its precision, and a device may have
none for some op and precision: on this project's CPU oneDNN refuses an fp16
LSTM ("could not create a primitive descriptor for the LSTM forward
propagation primitive"), while bf16 and fp32 run it. Such a precision is left
out of a plan with one line saying why, and a probe of it stops with one line;
any other error is the model's own and is raised as it is.
"""
from __future__ import annotations

import torch

from strategies import MASTER_WEIGHTS, PURE_BF16
from autofit.apply import apply_config
from autofit.config import TrainingConfig
from autofit.model_io import call_model
from autofit.spec import ModelSpec
from autofit.step import to_device


def precision_failures(spec: ModelSpec, *, precisions: list[str], device: str) -> dict[str, str]:
    """Run one training-mode forward of two samples in each precision; say which ones an op has no kernel for.

    Forward only: the check must stay cheap where a precision is merely slow
    (fp16 autocast's backward of a ResNet-50 took 45 s for one sample on this
    CPU, its forward 0.2 s). Two samples: BatchNorm refuses one at a 1x1 map.
    A precision fails when an op raises RuntimeError in it and fp32 (the
    reference, not checked itself) runs the same forward; any other failure
    is the model's own, left to the step that meets it.

    Returns:
        Precision -> why it cannot run (the op's error, first sentence), for each precision that cannot.
    """
    # bf16 weights (bf16-master, bf16-pure) run bf16 autocast's kernels: checked as bf16, on a model they would cast.
    as_bf16 = [p for p in precisions if p in (MASTER_WEIGHTS, PURE_BF16)]
    checked = list(dict.fromkeys("bf16" if p in as_bf16 else p for p in precisions if p != "fp32"))
    if not checked:
        return {}
    torch.manual_seed(0)
    model = spec.build_model().to(device)
    model.train()
    inputs = to_device(spec.example_batch(2)[0], device)
    failures: dict[str, str] = {}
    for precision in checked:
        error = _forward_error(model, inputs, precision=precision, device=device)
        if error is not None:
            failures[precision] = _first_line(error)
    if failures and _forward_error(model, inputs, precision="fp32", device=device) is not None:
        return {}  # fp32 fails too: not a kernel of the precision
    failures.update({p: failures["bf16"] for p in as_bf16 if "bf16" in failures})
    return {p: why for p, why in failures.items() if p in precisions}


def precision_failure(spec: ModelSpec, *, precision: str, device: str) -> str | None:
    """Why ``precision`` cannot run the model on ``device`` (an op without a kernel for it), or None when it can."""
    return precision_failures(spec, precisions=[precision], device=device).get(precision)


def _forward_error(model: torch.nn.Module, inputs, *, precision: str, device: str) -> RuntimeError | None:
    """The RuntimeError one forward raises in ``precision``, or None (it ran, or failed otherwise)."""
    config = TrainingConfig(global_batch_size=1, micro_batch_size=1, precision=precision)
    applied = apply_config(model, config, device=device, use_scaler=False)
    try:
        with applied.forward_context():  # with gradients on: some kernels exist for inference only
            call_model(applied.model, inputs)
    except torch.OutOfMemoryError:
        return None  # memory, not a kernel: the planner's probes deal with it
    except RuntimeError as error:  # an op with no kernel for this precision raises RuntimeError
        return error
    except Exception:  # the model's own check (a ValueError): not a kernel, left to the step that meets it
        return None
    return None


def _first_line(error: BaseException) -> str:
    """The error's first sentence (oneDNN's goes on about a diagnostic variable)."""
    line = (str(error).strip().splitlines() or [type(error).__name__])[0].split(". ")[0].rstrip(".")
    return line if len(line) <= 160 else line[:157] + "..."
