"""The training data checked as the example batch is, before step 1: a batch the model cannot take is one line.

``model_checks.check_model_runs`` runs the model on ``example_batch(2)`` before anything is measured; the data a
run trains on may still differ from it (a dataset whose samples are ``(x, y)`` for a model of two inputs, a flag
collated into a tensor). ``check_data_batches`` collates the first two samples of the training set (and of the
validation set) as the loop will, and runs the applied model's forward and loss on them before step 1: nothing
is saved yet, and a folder ``--overwrite`` cleared is given back (``loop.train``).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from autofit.apply import AppliedPlan
from autofit.errors import UserError, is_out_of_memory, user_frame
from autofit.model_checks import check_batch
from autofit.model_io import as_loss, call_model
from autofit.step import to_device
from autofit.training.data import TrainData, collate_pairs
from autofit.training.images import Unreadable

SAMPLES = 2
"""Samples collated for the check, as ``example_batch(2)`` is."""
LOOKED_AT = 16
"""Samples read at most to find that many readable ones (an image folder may hold files that fail to decode)."""


def check_data_batches(applied: AppliedPlan, data: TrainData, *, loss_fn: Callable) -> None:
    """Collate the first samples of ``data.train`` (and ``data.val``) and run the forward (and the default loss) on
    them as a step does (on its device, in its precision; eagerly: a compiled model is not compiled for this batch's shapes).

    The model runs without gradients, its buffers (BatchNorm's statistics) and the random state put back after, so
    the run that follows is the one that would have run without the check.

    Raises:
        UserError: the samples do not collate, the batch is not ``(inputs, targets)``, or the model or the loss
            fails on it: naming the samples' structure and the hook that fixes it.
    """
    if applied.config.sharding not in ("none", "ddp"):
        # FSDP2 leaves the root's parameters gathered after a forward no backward follows, and the optimizer, built
        # next, would hold those; the ranks take the same data a one-process run of it checks.
        return
    for name, dataset in (("training", data.train), ("validation", data.val)):
        if dataset is not None:
            _check_one(applied, dataset, name=name, collate=data.collate, loss_fn=as_loss(loss_fn), source=data.source)


def _check_one(applied: AppliedPlan, dataset, *, name: str, collate, loss_fn, source: str) -> None:
    samples = []
    for index in range(min(len(dataset), LOOKED_AT)):
        sample = dataset[index]
        if not isinstance(sample, Unreadable):
            samples.append(sample)
        if len(samples) == SAMPLES:
            break
    if not samples:
        return  # nothing readable up front: the loop reports unreadable samples as it meets them
    form = structure(samples[0])
    hook = (
        "make each sample (inputs, target) as example_batch returns a batch (inputs a tuple for a model of several "
        "inputs, a dict for keyword inputs), or define collate(samples) -> (inputs, targets) in the model file"
    )
    where = f"{source}: the {name} data's first {len(samples)} samples (each {form})"
    try:
        batch = (collate or collate_pairs)(samples)
    except UserError:
        raise
    except Exception as error:
        raise UserError(f"{where} do not make a batch: {_raised(error)}; {hook}") from error
    check_batch(batch, batch_size=len(samples), where=f"{where}, collated,")
    inputs, targets = to_device(batch[0], applied.device), to_device(batch[1], applied.device)
    buffers = [(b, b.detach().clone()) for b in applied.model.buffers()]
    rng_devices = [] if applied.device.type == "cpu" else [applied.device]
    try:
        with torch.random.fork_rng(devices=rng_devices), torch.no_grad(), torch.compiler.set_stance("force_eager"):
            with applied.forward_context():
                output = call_model(applied.model, inputs)
                if loss_fn.fn is None:
                    # The default loss (the model's own, or cross-entropy of its logits) is checked as the output's
                    # form; a loss_fn of your own is left to the step, where an error in it names its own line.
                    loss_fn(output, targets)
    except UserError:
        raise
    except Exception as error:
        if is_out_of_memory(error):  # not the data's form: the loop's recovery meets it in the step, as ever
            return
        raise UserError(
            f"{where} collated into inputs {structure(inputs)} and targets {structure(targets)}, which the model or its "
            f"loss cannot take: {_raised(error)}; {hook}"
        ) from error
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)


def _raised(error: BaseException) -> str:
    """``TypeName: first line (file.py, line N)``, the line the innermost of the user's own code."""
    message = (str(error).strip().splitlines() or [""])[0][:300]
    frame = user_frame(error)
    where = f" ({Path(frame.filename).name}, line {frame.lineno}, in {frame.name})" if frame else ""
    return f"{type(error).__name__}: {message}{where}"


def structure(tree) -> str:
    """A sample's or batch's form in a few words: ``(tensor[8], tensor[] int64)``, ``{input_ids: tensor[2, 16] int64,
    return_loss: True}``; float32 is not named."""
    if isinstance(tree, torch.Tensor):
        dtype = "" if tree.dtype == torch.float32 else f" {str(tree.dtype).removeprefix('torch.')}"
        return f"tensor{list(tree.shape)}{dtype}"
    if isinstance(tree, Mapping):
        return "{" + ", ".join(f"{key}: {structure(value)}" for key, value in tree.items()) + "}"
    if isinstance(tree, (tuple, list)):
        inner = ", ".join(structure(value) for value in tree[:4]) + (", ..." if len(tree) > 4 else "")
        return f"({inner})" if isinstance(tree, tuple) else f"[{inner}]"
    if tree is None or isinstance(tree, (bool, int, float)):
        return repr(tree)
    return type(tree).__name__
