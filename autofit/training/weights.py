"""Training checkpoints (last.pt / best.pt): weights plus what is needed to rebuild the model.

A checkpoint is a dict saved with ``torch.save``:
    {"format": "autofit-checkpoint", "version": 1,
     "model_source": {"source": path, "torchvision:NAME", "timm:NAME" or "hf:DIR", "input_shape": "3x32x32",
                      "num_classes": 10, and for hf: "task", "seq_len"},
     "fingerprint": model_fingerprint(model), "classes": [names] or None,
     "model_state": state_dict, "plan": Plan.to_dict(),
     "training": {...}   # optimizer/scaler/scheduler/RNG/data position, for --resume}
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import torch
from torch import nn

from autofit.atomic import write_atomic
from autofit.errors import UserError
from autofit.spec import ModelSpec, model_fingerprint, spec_from_source_info

FORMAT = "autofit-checkpoint"
VERSION = 1


def save_checkpoint(path: str | Path, checkpoint: dict) -> Path:
    """Save atomically (``autofit.atomic.write_atomic``): an interrupt or a crash never leaves half a file.

    Raises:
        OSError: ENOSPC when a write fails, whichever layer reports it: torch.save's zip writer raises a
            RuntimeError of its own ("PytorchStreamWriter failed writing file", "unexpected pos") where the disk
            fills up under it.
    """
    try:
        return write_atomic(path, lambda file: torch.save({"format": FORMAT, "version": VERSION, **checkpoint}, file))
    except RuntimeError as error:
        if not any(sign in str(error) for sign in _WRITER_FAILURES):
            raise
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from error


_WRITER_FAILURES = ("PytorchStreamWriter failed", "inline_container", "unexpected pos")
"""What torch.save's zip writer says when a write to the file fails."""


def load_checkpoint(path: str | Path, *, mmap: bool = False) -> dict:
    """Load a checkpoint written by ``save_checkpoint``; ``mmap`` maps its tensors instead of reading them.

    Raises:
        UserError: the file is missing, unreadable, or not an autofit checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"weights file {str(path)!r} does not exist; train first with `autofit train --plan plan.json`")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as error:  # any unpickling failure means a corrupt or foreign file
        raise UserError(f"weights file {str(path)!r} cannot be read ({type(error).__name__}); is it a file written by `autofit train`?") from error
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise UserError(f"weights file {str(path)!r} is not an autofit checkpoint; use runs/NAME/best.pt or last.pt from `autofit train`")
    return checkpoint


def model_from_checkpoint(checkpoint: dict, *, where: str = "weights") -> tuple[nn.Module, ModelSpec]:
    """Rebuild the model named in the checkpoint and load its weights (on the CPU).

    Raises:
        UserError: the model source is gone, or the weights belong to another model.
    """
    source = checkpoint["model_source"]
    spec = spec_from_source_info(source)
    model = spec.build_model()
    if model_fingerprint(model) != checkpoint.get("fingerprint"):
        raise UserError(f"{where} were saved from another model than {source['source']!r} builds now (parameter names or shapes differ); use the model file they were trained with")
    model.load_state_dict(checkpoint["model_state"])
    return model, spec
