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
from strategies.frozen_nf4 import is_nf4

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
        full = disk_full(error, path)
        if full is None:
            raise
        raise full from error


def disk_full(error: BaseException, path: str | Path) -> OSError | None:
    """The OSError ENOSPC (or EDQUOT) that ``error`` stands for, whichever layer raised it; None for any other error.

    torch.save's zip writer says it as a RuntimeError of its own; torch.distributed.checkpoint as a
    CheckpointException holding each failed rank's error; safetensors (``save_pretrained``) as a SafetensorError
    carrying the OS's words.
    """
    if isinstance(error, OSError):
        return error if error.errno in (errno.ENOSPC, errno.EDQUOT) else None
    if isinstance(error, RuntimeError) and any(sign in str(error) for sign in _WRITER_FAILURES):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    for code in (errno.ENOSPC, errno.EDQUOT):
        if type(error).__name__ == "SafetensorError" and os.strerror(code) in str(error):
            return OSError(code, os.strerror(code), str(path))
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            found = disk_full(failure[0] if isinstance(failure, tuple) else failure, path)
            if found is not None:
                return found
    return None


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
        raise UserError(
            f"{where} were saved from another model than {source['source']!r} builds now (parameter names or shapes differ); "
            "use the model file they were trained with"
        )
    model.load_state_dict(dense_state(checkpoint["model_state"]))
    return model, spec


def dense_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with frozen weights a QLoRA run held in NF4 (``strategies.frozen_nf4``) as the dense weights they
    stand for: what the run computed with, loadable into the model as it is built (evaluated, exported, or started
    from). A resumed run loads its checkpoint into the NF4 weights themselves."""
    return {name: dense(tensor) for name, tensor in state.items()}


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or the dense weight an NF4 tensor stands for (``strategies.frozen_nf4``)."""
    return tensor.get_original_weight() if is_nf4(tensor) else tensor


# ---- the weights a run starts from ----------------------------------------------------------------

def initial_model(spec: ModelSpec, *, weights=None, from_config: bool = False) -> tuple[nn.Module, str]:
    """The model training starts from, and where its weights came from (for the header and the log).

    Args:
        spec: the model.
        weights: a state dict, or a path to one (``state_dict_from``); it replaces the model's initialisation.
        from_config: an ``hf:`` directory's pretrained weights are left out (random init from its config).

    Returns:
        (model on the CPU, "pretrained from DIR" / "from PATH" / "random init from config.json" / "").

    Raises:
        UserError: the weights cannot be read or do not match the model (one line naming the file and the mismatch).
    """
    if weights is not None:
        where = "init_from" if isinstance(weights, dict) else str(weights)
        state = weights if isinstance(weights, dict) else state_dict_from(weights)
        if spec.build_base is not None and not any(".lora_" in name for name in state):
            # The base model's weights (not a LoRA run's): loaded into the base, then the adapters added over them.
            from autofit.adapters import lora_model, parse_lora

            lora = spec.source_options["lora"]
            base = load_without_copy(spec.build_base, state, where=where)
            return lora_model(base, parse_lora(lora)), f"from {where}, frozen; LoRA adapters ({lora}) trained"
        return load_without_copy(spec.build_model, state, where=where), f"from {where}"
    if spec.build_pretrained is not None and not from_config:
        return spec.build_pretrained(), spec.weights_note
    note = spec.weights_note if spec.build_pretrained is None else "random init (--from-config)"
    return spec.build_model(), note


def state_dict_from(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict in ``path``: an autofit checkpoint (its weights), a ``torch.save``'d state dict (.pt, .bin),
    a .safetensors file, or a ``save_pretrained`` directory (one file or shards and their index). Tensors are
    mapped from the file, not read into memory.

    Raises:
        UserError: no such file, or one that holds no state dict.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        from autofit.library_models import WEIGHT_FILES

        found = next((path / name for name in WEIGHT_FILES if (path / name).is_file()), None)
        if found is None:
            raise UserError(f"--weights {str(path)!r} holds none of {', '.join(WEIGHT_FILES)}; give a weights file or a save_pretrained directory")
        path = found
    if not path.is_file():
        raise UserError(
            f"--weights {str(path)!r} does not exist; give a state dict (.pt, .bin, .safetensors), an autofit last.pt/best.pt, "
            "or a save_pretrained directory"
        )
    if path.name.endswith(".index.json"):
        import json

        shards = sorted(set(json.loads(path.read_text()).get("weight_map", {}).values()))
        state = {}
        for shard in shards:
            state.update(_read_state_file(path.parent / shard))
        return state
    return _read_state_file(path)


def _read_state_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as error:
            raise UserError(f"--weights {str(path)!r} is not a readable safetensors file ({type(error).__name__}: {str(error)[:120]})") from error
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as error:  # any unpickling failure means a corrupt or foreign file
        raise UserError(
            f"--weights {str(path)!r} cannot be read by torch.load ({type(error).__name__}); give a state dict, "
            "a .safetensors file or an autofit checkpoint"
        ) from error
    if isinstance(loaded, dict) and loaded.get("format") == FORMAT:
        loaded = loaded.get("model_state")
    elif isinstance(loaded, dict) and not _is_state(loaded):
        loaded = next((loaded[key] for key in ("state_dict", "model_state_dict", "model") if _is_state(loaded.get(key))), loaded)
    if not _is_state(loaded):
        raise UserError(f"--weights {str(path)!r} holds no state dict (names -> tensors); save one with torch.save(model.state_dict(), PATH)")
    return dense_state(loaded)


def _is_state(value) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())


def load_without_copy(build_model, state: dict[str, torch.Tensor], *, where: str) -> nn.Module:
    """``build_model()`` with its parameters on the meta device, then ``state`` assigned to them
    (``load_state_dict(assign=True)``): the weights are never in memory twice. Buffers are built as usual (a
    non-persistent one is not in a state dict); tied parameters stay tied; tensors saved in another dtype take
    the model's.

    Raises:
        UserError: keys missing or unexpected, or shapes that differ: one line naming ``where`` and the mismatch.
    """
    with _parameters_on_meta():
        model = build_model()
    aliases = _tied_parameters(model)
    state = _checked(model, state, aliases=aliases, where=where)
    model.load_state_dict(state, assign=True)
    for first, others in aliases.items():
        tied = model.get_parameter(first)
        for name in others:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, tied)
    return model


def load_into(model: nn.Module, state: dict[str, torch.Tensor], *, where: str) -> None:
    """Copy ``state`` into a model that exists already (``autofit.fit``'s ``init_from``), checked as
    ``load_without_copy`` checks it."""
    model.load_state_dict(_checked(model, state, aliases=_tied_parameters(model), where=where))


def _checked(model: nn.Module, state: dict[str, torch.Tensor], *, aliases: dict[str, list[str]], where: str) -> dict:
    """``state`` with tied names filled in and the model's dtypes, after checking its names and shapes.

    Raises:
        UserError: keys missing or unexpected, or shapes that differ (one line).
    """
    expected = model.state_dict()
    state = dict(state)
    for first, others in aliases.items():  # a tied tensor saved once (save_pretrained drops the duplicates)
        for name in [first, *others]:
            if name not in state:
                saved = next((state[n] for n in [first, *others] if n in state), None)
                if saved is not None:
                    state[name] = saved
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    wrong = [key for key in expected if key in state and tuple(state[key].shape) != tuple(expected[key].shape)]
    if missing or unexpected:
        parts = [f"{len(missing)} missing (e.g. {', '.join(missing[:3])})" if missing else "",
                 f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})" if unexpected else ""]
        raise UserError(f"the weights in {where} do not match the model's names: {'; '.join(p for p in parts if p)}; "
                        "give the weights saved from this model")
    if wrong:
        key = wrong[0]
        raise UserError(f"the weights in {where} do not match the model: {key} is {tuple(state[key].shape)} there but "
                        f"{tuple(expected[key].shape)} in the model ({len(wrong)} such); give the weights saved from this model")
    return {key: value.to(expected[key].dtype) if value.dtype != expected[key].dtype else value for key, value in state.items()}


def _tied_parameters(model: nn.Module) -> dict[str, list[str]]:
    """First name -> the other names of each parameter registered under several names."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return {group[0]: group[1:] for group in names.values() if len(group) > 1}


class _parameters_on_meta:
    """Parameters registered inside go to the meta device (no storage, no initialisation arithmetic); buffers
    stay where they are made, so those a state dict lacks (non-persistent ones) keep their computed values."""

    def __enter__(self):
        self.register = register = nn.Module.register_parameter

        def on_meta(module: nn.Module, name: str, parameter) -> None:
            register(module, name, parameter)
            if parameter is not None and parameter.device.type != "meta":  # an already meta one is a tie: keep it
                kind = type(parameter)
                module._parameters[name] = kind(parameter.to("meta"), requires_grad=parameter.requires_grad)

        nn.Module.register_parameter = on_meta
        return self

    def __exit__(self, *exc) -> None:
        nn.Module.register_parameter = self.register
